"""Kernels stored transposed and fused (`kvjax.model.layout`): the canonical tree comes back
bit for bit, a step refuses parameters stored otherwise than its plan says, the transposed
view folds into its product in every compiled step (no copy of a weight is made, inside the
decode loop too), and the values match the plain layout's."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import sharp_params, small_model

from kvjax.cache.paged import BatchInfo, init_cache
from kvjax.config import CacheConfig, ConfigError
from kvjax.decode import steps
from kvjax.decode.batching import page_table
from kvjax.decode.state import decode_state
from kvjax.model import layout
from kvjax.model.layout import KERNELS, SCOPE, Stored, canonical, store, unstored
from kvjax.model.plan import FAST, NumericsPlan

CACHE = CacheConfig(page_size=4, num_pages=16, prefill_chunk=8, attn_block=8)
EVERY = ("q", "k/v", "o", "mlp up", "mlp down", "head")
FUSED = ("qkv", "o", "mlp up", "mlp down", "head")


def model(**kw):
    """The head untied so that it has a kernel of its own."""
    return small_model(**{"tie_embeddings": False, **kw})


def every(fused: bool = False, **kw) -> NumericsPlan:
    """Every kernel stored transposed."""
    products = FUSED if fused else EVERY
    return NumericsPlan(**{"mode": "invariant", "fused": fused, "transposed": products,
                           "row_blocks": tuple((name, 0) for name in products), **kw})


def test_store_moves_every_named_kernel_and_unstored_restores_it_bitwise():
    config, plan = model(), every()
    params = sharp_params(config)
    held = store(params, plan)
    assert isinstance(held, Stored)
    layer = held.tree["layer_0"]
    assert layer["attn"]["q"]["kernel"].shape == (4, 8, 32)  # [N, H, D] from [D, N, H]
    assert layer["attn"]["o"]["kernel"].shape == (32, 4, 8)  # [D, N, H] from [N, H, D]
    assert layer["mlp"]["down"]["kernel"].shape == (32, 64)  # [D, F] from [F, D]
    assert held.tree["lm_head"]["kernel"].shape == (61, 32)  # [V, D] from [D, V]
    assert layer["attn_norm"]["scale"] is params["layer_0"]["attn_norm"]["scale"]
    back = jax.jit(lambda p: unstored(p, plan))(held)
    jax.tree_util.tree_map(np.testing.assert_array_equal, back, params)
    jax.tree_util.tree_map(np.testing.assert_array_equal, canonical(held, config), params)
    assert store(params, FAST) is params


@pytest.mark.parametrize("kw", [{}, {"qkv_bias": True, "mlp_bias": True}, {"mlp": "gelu"}],
                         ids=["swiglu", "biases", "gelu"])
def test_fused_kernels_are_concatenated_once_and_come_back_bitwise(kw):
    """q/k/v [D, N, H] + [D, K, H] x 2 -> qkv [D, N + 2K, H] and gate/up [D, F] x 2 ->
    [D, 2F] (biases likewise; an ungated MLP keeps its up kernel), stored transposed;
    `canonical` gives back the separate kernels bit for bit."""
    config = model(**kw)
    params = sharp_params(config)
    held = store(params, every(fused=True))
    attn, mlp = held.tree["layer_0"]["attn"], held.tree["layer_0"]["mlp"]
    assert set(attn) == {"qkv", "o"}
    assert attn["qkv"]["kernel"].shape == (8, 8, 32)  # [N + 2K, H, D]
    np.testing.assert_array_equal(attn["qkv"]["kernel"][4:6],  # k's heads, transposed
                                  np.moveaxis(params["layer_0"]["attn"]["k"]["kernel"], 0, -1))
    if config.mlp == "gelu":
        assert set(mlp) == {"up", "down"}
    else:
        assert set(mlp) == {"gate_up", "down"}
        assert mlp["gate_up"]["kernel"].shape == (128, 32)  # [2F, D]
    if config.qkv_bias:
        assert attn["qkv"]["bias"].shape == (8, 8)
        np.testing.assert_array_equal(attn["qkv"]["bias"][6:],
                                      params["layer_0"]["attn"]["v"]["bias"])
        np.testing.assert_array_equal(mlp["gate_up"]["bias"][64:],
                                      params["layer_0"]["mlp"]["up"]["bias"])
    jax.tree_util.tree_map(np.testing.assert_array_equal, canonical(held, config), params)


def test_a_step_refuses_parameters_stored_otherwise_than_its_plan_says():
    plan = every()
    params = sharp_params(model())
    with pytest.raises(ValueError, match="stores .* transposed but the parameters hold"):
        unstored(params, plan)
    with pytest.raises(ValueError, match="layout.store"):
        unstored(store(params, dataclasses.replace(plan, transposed=("q",))), plan)
    fused = every(fused=True)
    with pytest.raises(ValueError, match="and fused but the parameters hold"):
        unstored(store(params, plan), fused)
    with pytest.raises(ValueError, match="hold .* fused"):
        unstored(store(params, fused), plan)
    with pytest.raises(ConfigError, match="fused"):
        every(fused=True, transposed=("q",), row_blocks=(("q", 0),))
    with pytest.raises(ConfigError, match="fused"):
        every(transposed=("qkv",), row_blocks=(("qkv", 0),))
    with pytest.raises(ConfigError, match="row block 0"):
        NumericsPlan("invariant", transposed=("q",))
    with pytest.raises(ConfigError, match="tied head"):
        NumericsPlan("invariant", row_blocks=(("head", 0),), transposed=("head",)).check(
            small_model())


def compiled_steps(config, plan, params) -> list[str]:
    """Optimised HLO of a prefill call and of the on-device decode loop."""
    cache = init_cache(config, CACHE)
    table = page_table([[0, 1, 2, 3]], 1, CACHE.block_pages)
    batch = BatchInfo(page_table=table, lengths=np.zeros(1, np.int32),
                      num_new=np.full(1, 8, np.int32))
    extend = steps.extend.lower(params, config, cache, np.zeros((1, 8), np.int32), batch,
                                plan=plan)
    state = decode_state(table, [8], [0], [4], np.zeros((1, 2)))
    loop = steps.decode_loop.lower(params, config, cache, state, max_steps=4, plan=plan)
    return [extend.compile().as_text(), loop.compile().as_text()]


def views_left(text: str) -> list[str]:
    """The instructions of compiled HLO `text` named by the views' scope (`unstored`), less
    bitcasts (free)."""
    return [line.strip() for line in text.splitlines()
            if f"/{SCOPE}/" in line and " bitcast(" not in line]


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
def test_the_transposed_view_folds_into_its_product_in_every_step(fused):
    """No instruction of the views survives compilation: the products read the stored
    arrays. (Computing the views outside the decode loop's body, where they cannot fold,
    leaves copies named by the scope: seen failing that way.) Fused kernels are one product
    each: a layer's step runs 2 input-side dots instead of 5 (q, k, v, gate, up) and
    concatenates no weight."""
    config, plan = model(), every(fused=fused)
    params = store(sharp_params(config), plan)
    for text in compiled_steps(config, plan, params):
        left = views_left(text)
        assert left == [], left[:3]
        projections = re.compile(r"/(attn/(q|k|v|qkv)|mlp/(gate|up|gate_up))/dot_general")
        dots = [line for line in text.splitlines()
                if " dot(" in line and projections.search(line)]
        per_layer = 2 if fused else 5  # qkv and gate_up, or q, k, v, gate and up
        assert len(dots) == config.num_layers * per_layer, dots
        kernels = ("f32[8,8,32]", "f32[32,8,8]", "f32[128,32]", "f32[32,128]")  # fused
        assert not [line for line in text.splitlines() if " concatenate(" in line
                    and any(shape in line for shape in kernels)]


def test_a_view_that_cannot_fold_is_seen_in_every_step(monkeypatch):
    """Positive control of the test above (in the prefill step the folded views leave no
    line named by the scope at all, so finding none proves nothing by itself): the same
    view taken as one transpose of the stored 3-D arrays, which XLA copies before the
    product (`layout.from_stored`), leaves instructions that `views_left` finds in both
    steps (measured: 24 lines in each)."""
    def moved(kernel, inputs):  # [outputs..., inputs...] -> [inputs..., outputs...]
        n = kernel.ndim
        return jnp.moveaxis(kernel, tuple(range(n - inputs, n)), tuple(range(inputs)))

    config, plan = model(), every()
    params = store(sharp_params(config), plan)
    q = params.tree["layer_0"]["attn"]["q"]["kernel"]
    np.testing.assert_array_equal(moved(q, 1), layout.from_stored(q, 1))  # the same view
    monkeypatch.setattr(layout, "from_stored", moved)
    jax.clear_caches()  # the steps trace again with the swapped view
    try:
        texts = compiled_steps(config, plan, params)
    finally:
        monkeypatch.undo()
        jax.clear_caches()  # and no other test runs it
    assert len(texts) == 2
    for text in texts:
        left = views_left(text)
        assert any(" transpose(" in line or " copy(" in line for line in left), left[:3]


def test_stored_kernels_give_the_plain_layouts_values():
    """The same prefill logits as the plain parameters under fast numerics, within float32
    rounding of a different summation order (measured 4.8e-6; tolerance 5e-5)."""
    config = model()
    params = sharp_params(config)
    tokens = np.arange(8, dtype=np.int32)[None] % config.vocab_size
    batch = BatchInfo(page_table=page_table([[0, 1, 2, 3]], 1, CACHE.block_pages),
                      lengths=np.zeros(1, np.int32), num_new=np.full(1, 8, np.int32))
    out = {}
    for name, plan in [("stored", every()), ("fused", every(fused=True)), ("plain", FAST)]:
        out[name], _ = steps.extend(store(params, plan), config, init_cache(config, CACHE),
                                    tokens, batch, plan=plan)
    for name in ("stored", "fused"):
        np.testing.assert_allclose(np.asarray(out[name]), np.asarray(out["plain"]),
                                   rtol=0, atol=5e-5)
    # and an EAGLE head's fusion, packed for the CPU kernel (tests/test_eagle_rows.py)
    assert set(KERNELS) == set(EVERY) | set(FUSED) | {"eagle fc"}


@pytest.mark.parametrize("cpu_kernel", ["off", "auto"])
def test_the_engine_shows_the_weights_as_loaded(cpu_kernel, monkeypatch):
    from kvjax import Engine, EngineConfig
    from kvjax.cpu.product import kernel
    from kvjax.model import tiled

    config = small_model()
    params = sharp_params(config)
    if cpu_kernel == "off":  # products held only stored transposed (as on some CPUs)
        monkeypatch.setattr(tiled, "_whole", lambda shape, contract, rows, backend,
                            stored=False: stored)
    engine = Engine(params, config, EngineConfig(cpu_kernel=cpu_kernel))
    if cpu_kernel == "off":
        assert engine.plan.transposed
    else:  # kvjax's CPU kernel reads them packed
        assert engine.model.params.packed == kernel().available
    assert engine.plan.fused
    assert isinstance(engine.model.params, Stored)
    jax.tree_util.tree_map(np.testing.assert_array_equal, engine.params, params)
