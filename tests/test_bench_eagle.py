"""`kvjax bench eagle` (kvjax.bench.eagle) on the tests' small model with a random head:
every method's rows per category and over all, plain decoding's speedup 1, under
invariant numerics every answer checked bitwise (a one-bit difference raises)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
from engine_helpers import CACHE, CONFIG, params
from helpers import random_tokens

from kvjax.bench import eagle
from kvjax.cpu.product import kernel
from kvjax.model.plan import FAST, INVARIANT
from kvjax.speculative.eagle import init_head
from kvjax.speculative.eagle_file import HeadFile


def _setup():
    model = SimpleNamespace(params=params(), config=CONFIG, stop_tokens=(CONFIG.vocab_size - 1,))
    head = HeadFile(init_head(CONFIG, 3), np.arange(CONFIG.vocab_size, dtype=np.int32), "t",
                    "i", {})
    base = random_tokens(7, [6], CONFIG.vocab_size)[0]
    picked = [("copying", base * 4 + base[:2]),
              ("random", random_tokens(8, [11], CONFIG.vocab_size)[0])]
    return model, head, picked


# Under fast numerics a few methods, one per drafting path (host n-gram rounds, the head's
# host and device rounds, the size policy): the bench's fast rows come from the same code as
# its invariant ones, which run every method; each method's own exactness under fast
# numerics is tests/test_eagle.py's and test_tree_loop.py's.
FAST_METHODS = ("n-gram tree", "eagle tree", "eagle tree on device", "eagle tree 16 + policy")


@pytest.mark.parametrize("plan", [FAST, INVARIANT])
def test_every_method_answers_every_prompt(plan):
    """Under invariant numerics the head drafts on kvjax's CPU kernels (where they build), as
    `bench eagle` runs it: its stored parameters inside the device loop too."""
    if plan.invariant and not kernel().available:  # never on CI (KVJAX_REQUIRE_KERNEL)
        pytest.skip(f"the invariant case drafts on the CPU kernels: {kernel().describe()}")
    model, head, picked = _setup()
    head_plan = FAST
    if plan.invariant:
        head_plan = dataclasses.replace(FAST, cpu_kernel=True, cpu_attention=True)
    table = eagle.methods(model, head, {1: 1.0, 2: 1.1, 4: 1.3, 8: 2.0, 16: 4.0}, head_plan)
    if not plan.invariant:
        assert set(FAST_METHODS) <= set(table)
        table = {name: table[name] for name in FAST_METHODS}
    heads = [t[0]() for name, t in table.items() if "eagle" in name]
    assert all(getattr(d, "second", d).plan == head_plan for d in heads)  # union: its head
    rows = eagle.run(model, picked, 12, plan, CACHE, table)
    names = ["plain", *table]
    assert {(r["category"], r["method"]) for r in rows} == {
        (c, m) for c in ("copying", "random", "all") for m in names}
    for r in rows:
        assert r["answers"] == (2 if r["category"] == "all" else 1)
        # every call emits its accepted drafts and one token of its own (the prefill's
        # first token counts as a call): tokens per call is 1 + accepted / calls
        assert r["tokens"] == r["calls"] + r["accepted"] and r["seconds"] > 0
        assert r["tokens_per_call"] == r["tokens"] / r["calls"]
        if r["method"] == "plain":
            assert r["speedup"] == 1.0 and r["tokens_per_call"] == 1.0
    copying = {r["method"]: r for r in rows if r["category"] == "copying"}
    assert copying["n-gram tree"]["tokens_per_call"] > 1.0
    if plan.invariant:  # checked bitwise, or the bench would have raised
        assert all(r["same"] == r["answers"] for r in rows)


def test_the_methods_at_one_verify_cost_share_node_count_and_depth():
    """The "... 8 on device" methods (run when named): chains and the n-gram tree of 8 nodes
    and 7 drafts deep, on device; a chain is one branch (top-1)."""
    model, head, _ = _setup()
    table = eagle.methods(model, head, None, one_cost=True)
    named = {k: v for k, v in table.items() if k.endswith(" 8 on device")}
    assert set(named) == {"n-gram chain 8 on device", "n-gram tree 8 on device",
                          "eagle chain 8 on device"}
    assert not set(named) & set(eagle.methods(model, head, None))  # not run by default
    assert {(nodes, depth, device) for _, nodes, depth, _, device in named.values()} == {
        (8, 7, True)}
    reranked = {k: v for k, v in table.items() if "rerank" in k}
    assert not set(reranked) & set(eagle.methods(model, head, None))
    assert len(reranked) == 2
    for name, (make, nodes, depth, _, device) in reranked.items():
        d = make()  # wide enough for every candidate, which outnumber the tree's nodes
        assert d.rerank and device and d.width == 1 + d.top_k * depth > nodes, name
    drafters = {k: v[0]() for k, v in named.items()}
    assert drafters["n-gram chain 8 on device"].branches == 1
    assert drafters["n-gram tree 8 on device"].branches == 4
    assert drafters["eagle chain 8 on device"].top_k == 1


def test_an_answer_that_differs_from_plain_decoding_raises(monkeypatch):
    from kvjax.speculative import tree_host

    real = tree_host.tree_generate

    def one_bit_off(*a, **kw):
        out = real(*a, **kw)
        out.logits[0][-1, 0] = np.nextafter(out.logits[0][-1, 0], np.float32(np.inf))
        return out

    monkeypatch.setattr(eagle, "tree_generate", one_bit_off)
    model, head, picked = _setup()
    with pytest.raises(AssertionError, match="differs from plain decoding"):
        eagle.run(model, picked[:1], 4, INVARIANT, CACHE, eagle.methods(model, head, None))
