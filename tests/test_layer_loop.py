"""The layer loop (`NumericsPlan.layer_loop`): a model's layers run as one loop over stacked
parameters, one block's program for every layer, with the bits of the unrolled layers;
the engine chooses it where both CPU kernels run a model of layers alike, and not where
they differ or adapters are served."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from engine_helpers import CACHE, CONFIG, assert_same, engine, params
from helpers import sharp_params, small_model

import kvjax
from kvjax import Request
from kvjax.cache.paged import BatchInfo, init_cache
from kvjax.config import ConfigError
from kvjax.cpu.product import kernel
from kvjax.decode.steps import extend
from kvjax.model.layout import canonical, stack_layers, store, unstack_layers
from kvjax.model.plan import FAST, INVARIANT

needs_kernel = pytest.mark.skipif(not kernel().available, reason=kernel().describe())
PROMPTS = [[5, 9, 2, 44, 17, 3, 8, 30, 12, 1, 7, 7, 40, 2, 9, 11, 3, 50], [1, 2, 3]]


def _kernels(base, loop: bool):
    return dataclasses.replace(base, cpu_kernel=True, cpu_attention=True, fused=True,
                               layer_loop=loop)


@needs_kernel
@pytest.mark.parametrize("base", [FAST, INVARIANT], ids=["fast", "invariant"])
def test_the_loop_gives_the_unrolled_layers_bits(base):
    """Prefill (a 18-token prompt in chunks beside a short one) and decode with logits: the
    loop's tokens and logits equal the unrolled layers' bitwise, 4 layers of sharp weights."""
    config = small_model(num_layers=4, max_seq_len=128)
    p = sharp_params(config, seed=3)
    out = [kvjax.generate(store(p, _kernels(base, loop)), config, PROMPTS, 6,
                          return_logits=True, plan=_kernels(base, loop)) for loop in (False, True)]
    assert out[0].tokens == out[1].tokens
    for unrolled, looped in zip(out[0].logits, out[1].logits, strict=True):
        np.testing.assert_array_equal(looped, unrolled)


def _products_in_step(num_layers: int) -> int:
    """Stacked-kernel calls in the lowered decode step (`extend`, one token a row) of a
    default engine's plan on a model of `num_layers` layers (a loop's body holds one
    layer's)."""
    config = small_model(num_layers=num_layers, max_seq_len=128)
    eng = kvjax.Engine(sharp_params(config), config, kvjax.EngineConfig(cache=CACHE))
    assert eng.plan.layer_loop and "one loop" in eng.products
    cache = init_cache(config, CACHE)
    batch = BatchInfo(page_table=np.zeros((1, 4), np.int32), lengths=np.zeros(1, np.int32),
                      num_new=np.ones(1, np.int32))
    lowered = extend.fn.lower(eng.model.params, config, cache, np.ones((1, 1), np.int32),
                              batch, plan=eng.plan)
    return lowered.compile().as_text().count("custom_call_target=\"kvjax_product_stacked\"")


@needs_kernel
def test_the_engine_compiles_one_block_whatever_the_depth():
    """A default engine on a model of layers alike runs them as one loop: its decode
    step holds one block's products (qkv, o, gate/up, down: 4 stacked-kernel calls) for
    2 layers as for 6."""
    assert _products_in_step(2) == _products_in_step(6) == 4


@needs_kernel
def test_layers_that_differ_or_adapters_keep_the_unrolled_layers():
    """Layers with another window (a sliding/full mix) or served adapters: the engine
    unrolls them; a plan asking for the loop on such a model is refused by name."""
    mixed = small_model(num_layers=2, sliding_window=8, layer_types=("sliding", "full"))
    eng = kvjax.Engine(sharp_params(mixed), mixed, kvjax.EngineConfig(cache=CACHE))
    assert eng.plan.cpu_kernel and not eng.plan.layer_loop
    with pytest.raises(ConfigError, match="layer_loop"):
        _kernels(FAST, True).check(mixed)
    adapter = kvjax.init_adapter(CONFIG, rank=2, seed=1)
    served = engine(params(), adapters={"a": adapter})
    assert served.plan.cpu_kernel and not served.plan.layer_loop
    assert engine(params()).plan.layer_loop
    with pytest.raises(ConfigError, match="layer_loop"):
        dataclasses.replace(FAST, layer_loop=True)  # without the CPU kernels


@needs_kernel
def test_an_engine_with_the_loop_answers_as_one_without():
    """The same requests (greedy and sampled, logits) through a default engine (the loop)
    and one whose plan unrolls the layers: the same tokens and logits."""
    requests = [Request(tokens=PROMPTS[0], max_new_tokens=7, return_logits=True),
                Request(tokens=PROMPTS[1], max_new_tokens=5, return_logits=True,
                        sampling=kvjax.SamplingConfig(temperature=0.8, seed=4))]
    looped, unrolled = engine(params()), engine(params(), layer_loop=False)
    assert looped.plan.layer_loop and not unrolled.plan.layer_loop
    assert_same(looped.generate(requests), unrolled.generate(requests))


def test_stacked_layers_come_back_as_they_were():
    """`stack_layers` makes one [L, ...] tree of every layer; `unstack_layers` and
    `canonical` give the layers back exactly."""
    config = small_model(num_layers=3)
    p = kvjax.init_params(config, seed=2)
    stacked = stack_layers(p)
    assert "layer_0" not in stacked and stacked["layers"]["mlp"]["down"]["kernel"].shape[0] == 3
    for tree in (unstack_layers(stacked), canonical(store(p, _kernels(FAST, True)), config)):
        assert jax.tree.structure(tree) == jax.tree.structure(p)
        for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(p), strict=True):
            np.testing.assert_array_equal(a, b)
