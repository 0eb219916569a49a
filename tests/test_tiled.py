"""Row-invariant matmuls (`kvjax.model.tiled`): the values of a plain matmul, and each row's
bits independent of how many rows share the call and where the row sits among them."""

from __future__ import annotations

from functools import partial

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.model.tiled import model_shapes, plain_matmul, row_classes, tiled_matmul

BENCH_LIKE = [(512, 1408), (1408, 512), (512, 128)]  # configs/bench.toml's MLP and k/v
TOL = 5e-4  # max |tiled - float64| measured 4.6e-5 on values up to 96 ([3, 37, 512] @ [512, 8, 64])


@pytest.mark.parametrize("tile", [8, 16])
def test_tiled_matmul_computes_the_product(tile):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 37, 512)).astype(np.float32)  # [B, T, D]
    w = rng.standard_normal((512, 8, 64)).astype(np.float32)  # a DenseGeneral kernel [D, N, H]
    out = np.asarray(tiled_matmul(jnp.asarray(x), jnp.asarray(w), tile))
    assert out.shape == (3, 37, 8, 64)
    ref = np.einsum("btd,dnh->btnh", x.astype(np.float64), w.astype(np.float64))
    np.testing.assert_allclose(out, ref, rtol=0, atol=TOL)


@pytest.mark.parametrize("tile", [8, 16])
@pytest.mark.parametrize(("d", "f"), BENCH_LIKE)
def test_a_row_has_the_same_bits_at_any_row_count_and_place(tile, d, f):
    assert row_classes(partial(tiled_matmul, tile=tile), d, f) == []
    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.standard_normal((d, f)).astype(np.float32))
    row = rng.standard_normal((1, d)).astype(np.float32)
    alone = np.asarray(tiled_matmul(jnp.asarray(row), w, tile))[0]
    for rows, place in [(5, 4), (tile, 0), (tile + 1, tile), (3 * tile + 2, 17)]:
        x = rng.standard_normal((rows, d)).astype(np.float32)  # other tokens around it
        x[place] = row[0]
        np.testing.assert_array_equal(np.asarray(tiled_matmul(jnp.asarray(x), w, tile))[place],
                                      alone)


def test_the_probe_finds_a_row_count_dependence():
    """A matmul whose arithmetic depends on the row count is caught at those counts (on
    this backend the plain matmul is such a one too, for some shapes: `kvjax bench tiles`)."""
    def split_above_8(x, w):  # sums the input width in two halves when more than 8 rows
        if x.shape[0] <= 8:
            return x @ w
        h = x.shape[1] // 2
        return x[:, :h] @ w[:h] + x[:, h:] @ w[h:]

    assert {16, 32, 33, 48, 64, 128, 256} <= set(row_classes(split_above_8, 256, 384))
    assert isinstance(row_classes(plain_matmul, 64, 96), list)


def test_model_shapes_names_every_token_matmul():
    from helpers import small_model

    shapes = model_shapes(small_model())
    assert set(shapes) == {"q", "k/v", "o", "mlp up", "mlp down", "head"}
    assert all(d > 0 and f > 0 for d, f in shapes.values())
