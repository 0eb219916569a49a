"""Row-invariant matmuls (`kvjax.model.tiled`): the values of a plain matmul, and each row's
bits independent of how many rows share the product, where the row sits among them, and
which block size (inside the probed class) computes it."""

from __future__ import annotations

from functools import partial

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import small_model

from kvjax.model.tiled import (
    invariant_block,
    invariant_matmul,
    model_shapes,
    row_classes,
)

BENCH_LIKE = [(512, 1408), (1408, 512), (576, 192)]  # bench MLP up/down, SmolLM2 k/v
TOL = 5e-4  # max |invariant - float64| measured 4.6e-5 on values up to 96


@pytest.mark.parametrize("block", [2, 8, 32])
def test_invariant_matmul_computes_the_product(block):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 37, 512)).astype(np.float32)  # [B, T, D]: 111 rows
    w = rng.standard_normal((512, 8, 64)).astype(np.float32)  # a DenseGeneral kernel [D, N, H]
    ref = np.einsum("btd,dnh->btnh", x.astype(np.float64), w.astype(np.float64))
    for rows in (x, x[:1, :1]):  # blocks in a loop, and a single row padded to two
        out = np.asarray(invariant_matmul(jnp.asarray(rows), jnp.asarray(w), block))
        assert out.shape == (*rows.shape[:2], 8, 64)
        np.testing.assert_allclose(out, ref[: rows.shape[0], : rows.shape[1]], rtol=0, atol=TOL)


@pytest.mark.parametrize(("d", "f"), BENCH_LIKE)
def test_a_row_has_the_same_bits_at_any_row_count_place_and_block(d, f):
    block = invariant_block(d, f)
    assert block >= 32  # the class {2..32} held for every shape measured here
    assert row_classes(partial(invariant_matmul, block=block), d, f) == []
    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.standard_normal((d, f)).astype(np.float32))
    row = rng.standard_normal((1, d)).astype(np.float32)
    alone = np.asarray(invariant_matmul(jnp.asarray(row), w, block))[0]
    for rows, place in [(2, 1), (5, 4), (block, 0), (block + 1, block), (3 * block + 2, 17)]:
        x = rng.standard_normal((rows, d)).astype(np.float32)  # other tokens around it
        x[place] = row[0]
        for b in sorted({2, 8, block}):  # any block inside the class: a speed knob only
            out = np.asarray(invariant_matmul(jnp.asarray(x), w, b))
            np.testing.assert_array_equal(out[place], alone)


def test_the_probes_find_a_row_count_dependence():
    """Products whose arithmetic depends on the row count are caught at those counts and
    shrink the block (on this backend the plain product is such a one too: `kvjax bench
    tiles`)."""
    def split_above(rows: int):
        def matmul(x, w):  # sums the input width in two halves above `rows` rows
            if x.shape[0] <= rows:
                return x @ w
            h = x.shape[1] // 2
            return x[:, :h] @ w[:h] + x[:, h:] @ w[h:]
        return matmul

    assert {16, 32, 33, 48, 64, 128, 256} <= set(row_classes(split_above(8), 256, 384))
    assert invariant_block(256, 384) >= 32
    with pytest.MonkeyPatch.context() as m:
        m.setattr("kvjax.model.tiled.plain_matmul", split_above(8))
        assert invariant_block(256, 384) == 8
        m.setattr("kvjax.model.tiled.plain_matmul", split_above(2))
        assert invariant_block(256, 384) == 2


def test_model_shapes_names_every_token_matmul():
    shapes = model_shapes(small_model())
    assert set(shapes) == {"q", "k/v", "o", "mlp up", "mlp down", "head"}
    assert all(d > 0 and f > 0 for d, f in shapes.values())
