"""The engine on kvjax's CPU kernel (`EngineConfig(cpu_kernel="auto")`, the default:
products and attention) and on XLA's path ("off", and what "auto" falls back to): a
request's bits are the ones it gets alone across the engine's knobs on XLA's path (on the
kernel's: tests/test_invariance.py, which runs the default engine), the kernel's values are
XLA's path's to rounding, the kernel is part of the cache identity, and `Engine.products`
says which path runs (the kernels themselves: tests/test_cpu_kernel.py,
tests/test_cpu_attention.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from engine_helpers import CACHE, CONFIG, CONTEXT, assert_same, params, with_cache
from test_invariance import requests

from kvjax import Engine, EngineConfig, Request
from kvjax.cache.identity import model_fingerprint
from kvjax.cpu import product
from kvjax.cpu.product import Kernel, kernel
from kvjax.model.plan import INVARIANT

needs_kernel = pytest.mark.skipif(not kernel().available, reason=kernel().describe())


def engine(p, **kw) -> Engine:
    kw.setdefault("max_slots", 8)
    kw.setdefault("decode_steps", 4)
    kw.setdefault("min_context", CONTEXT)
    kw.setdefault("cpu_kernel", "auto")
    return Engine(p, CONFIG, EngineConfig(cache=kw.pop("cache", CACHE), **kw))


@pytest.fixture(scope="module")
def p():
    return params()


@pytest.fixture(scope="module")
def alone(p):
    e = engine(p, max_slots=1, prefix_cache=False, min_context=0)
    assert e.plan.cpu_kernel and e.plan.transposed == ()
    return [e.generate([r])[0] for r in requests()]


@pytest.fixture(scope="module")
def alone_xla(p):
    e = engine(p, max_slots=1, prefix_cache=False, min_context=0, cpu_kernel="off")
    assert not e.plan.cpu_kernel and not e.plan.cpu_attention
    return [e.generate([r])[0] for r in requests()]


@needs_kernel
def test_the_default_engine_runs_the_kernel_path(p):
    """tests/test_invariance.py's matrix runs the default engine: the kernel's path."""
    e = Engine(p, CONFIG, EngineConfig(cache=CACHE))
    assert e.plan.cpu_kernel and e.plan.cpu_attention


@pytest.mark.parametrize("knobs", [
    dict(max_slots=8), dict(max_slots=2), dict(cache=with_cache(prefill_chunk=8)),
    dict(decode_steps=1), dict(decode_steps=16), dict(packed_prefill=True)], ids=str)
def test_a_request_gets_its_alone_bits_on_xlas_path(p, alone_xla, knobs):
    """XLA's products and attention (`cpu_kernel="off"`, and "auto" where the kernel cannot
    run): the invariance matrix's knobs (the default engine's: tests/test_invariance.py)."""
    assert_same(engine(p, cpu_kernel="off", **knobs).generate(requests()), alone_xla)


@needs_kernel
def test_the_kernel_path_gives_xla_paths_values_to_rounding(p, alone):
    xla = Engine(p, CONFIG, EngineConfig(cache=CACHE, max_slots=1, prefix_cache=False,
                                         cpu_kernel="off"))
    assert not xla.plan.cpu_kernel
    for r, got in zip(requests(), alone, strict=True):
        want = xla.generate([dataclasses.replace(r, max_new_tokens=1)])[0]
        # the first token's logits (the same history on both paths; up to 8.4): measured
        # 1.2e-5 (products by the kernel, XLA's attention: 8.6e-6)
        np.testing.assert_allclose(got.logits[0], want.logits[0], atol=1e-4, rtol=0)
    greedy = [Request(tokens=r.tokens, max_new_tokens=10, return_logits=True)
              for r in requests()[::2]]
    assert [r.tokens for r in engine(p).generate(greedy)] == \
        [r.tokens for r in xla.generate(greedy)]


@needs_kernel
def test_the_kernel_is_part_of_the_cache_identity_and_of_the_startup_line(p):
    on, off = engine(p), Engine(p, CONFIG, EngineConfig(cache=CACHE, cpu_kernel="off"))
    assert on.plan.cpu_kernel and not off.plan.cpu_kernel
    assert on.plan.cpu_attention and not off.plan.cpu_attention
    assert on.products.startswith("kvjax CPU product kernel (")
    assert on.products.endswith("; attention by kvjax's CPU kernel; the layers as one loop "
                                "(one block's program for every layer)")
    assert off.products == "XLA's products (cpu_kernel='off')"
    plan = dataclasses.replace(INVARIANT, cpu_kernel=True)
    assert model_fingerprint(CONFIG, p, plan) != model_fingerprint(CONFIG, p, INVARIANT)
    request = requests()[0]
    assert on.namespace(request) != off.namespace(request)


@needs_kernel
def test_products_alone_or_pages_the_attention_kernel_cannot_read_keep_xlas_attention(p):
    products = engine(p, max_slots=2, cpu_kernel="products")
    assert products.plan.cpu_kernel and not products.plan.cpu_attention
    assert products.products.endswith("; XLA's attention (cpu_kernel='products')")
    int8 = engine(p, max_slots=2, cache=with_cache(dtype="int8"))
    assert int8.plan.cpu_kernel and not int8.plan.cpu_attention
    assert int8.products.endswith(
        "; XLA's attention (the CPU kernel does not read int8 pages)")
    plan = dataclasses.replace(INVARIANT, cpu_kernel=True)
    assert model_fingerprint(CONFIG, p, plan) != model_fingerprint(
        CONFIG, p, dataclasses.replace(plan, cpu_attention=True))
    # products on the kernel: a request's bits across batches as on the whole kernel path
    alone = engine(p, max_slots=1, cpu_kernel="products", prefix_cache=False, min_context=0)
    assert_same(products.generate(requests()[:3]),
                [alone.generate([r])[0] for r in requests()[:3]])


@needs_kernel
def test_bfloat16_pages_keep_a_requests_alone_bits_on_the_attention_kernel(p):
    cache = with_cache(dtype="bfloat16")
    alone = engine(p, max_slots=1, cache=cache, prefix_cache=False, min_context=0)
    assert alone.plan.cpu_attention
    assert_same(engine(p, cache=cache).generate(requests()),
                [alone.generate([r])[0] for r in requests()])


def test_without_the_kernel_auto_runs_xlas_products_with_the_same_bits_and_says_why(
        p, monkeypatch):
    off = Engine(p, CONFIG, EngineConfig(cache=CACHE, max_slots=4, cpu_kernel="off"))
    monkeypatch.setattr(product, "_KERNEL", Kernel(False, "no C++ compiler found"))
    auto = engine(p, max_slots=4, min_context=0)
    assert not auto.plan.cpu_kernel and auto.plan == off.plan
    assert auto.products == ("pure-JAX products (kvjax CPU kernel not in use: no C++ "
                             "compiler found)")
    assert_same(auto.generate(requests()), off.generate(requests()))
