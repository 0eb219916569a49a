"""Greedy-only programs: when no row samples, the device loops take the argmax and compile
no sampler (`kvjax.decode.sampling.any_sampled`, a static flag of `decode_loop` and
`spec_loop`); they emit the sampling programs' tokens with their logits bitwise."""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import CACHE, CONFIG, CONTEXT, SLOTS, assert_same, params
from helpers import random_tokens, small_model

import kvjax
from kvjax import Engine, EngineConfig
from kvjax.config import SpecConfig
from kvjax.decode import steps
from kvjax.decode.state import decode_state
from kvjax.engine.requests import Request
from kvjax.model.layout import store
from kvjax.model.plan import FAST, INVARIANT
from kvjax.speculative import plugin

PROMPTS = random_tokens(4, [5, 9, 14], CONFIG.vocab_size)
DRAFT = small_model(num_layers=1, d_model=16, num_heads=2, num_kv_heads=1, d_ff=32,
                    max_seq_len=256, tie_embeddings=False)


@pytest.fixture(scope="module")
def p():
    return params(1)


def _force_sampling(monkeypatch, module) -> None:
    monkeypatch.setattr(module, "any_sampled", lambda temperature: True)


@pytest.mark.parametrize("plan", [FAST, INVARIANT], ids=["fast", "invariant"])
def test_generate_greedy_program_equals_the_sampling_program(p, plan, monkeypatch):
    stored = store(p, plan)
    run = lambda: kvjax.generate(stored, CONFIG, PROMPTS, 9, cache=CACHE,  # noqa: E731
                                 return_logits=True, plan=plan)
    greedy = run()
    _force_sampling(monkeypatch, steps)
    sampling = run()
    assert greedy.tokens == sampling.tokens
    for a, b in zip(greedy.logits, sampling.logits, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_speculative_greedy_program_equals_the_sampling_program(p, drafter, monkeypatch):
    """Tokens, logits bitwise, and the same drafts accepted (the model drafter's greedy
    draws are its argmax in both programs)."""
    spec = SpecConfig(drafter=drafter, gamma=3)
    draft = (kvjax.init_params(DRAFT, seed=5), DRAFT) if drafter == "model" else None
    requests = [Request(tokens=t * 3, max_new_tokens=12, return_logits=True) for t in PROMPTS]

    def run():
        ec = EngineConfig(cache=CACHE, max_slots=SLOTS, decode_steps=4, min_context=CONTEXT)
        return Engine(p, CONFIG, ec, draft=draft, spec=spec).generate(requests)

    greedy = run()
    _force_sampling(monkeypatch, plugin)
    sampling = run()
    assert_same(greedy, sampling)
    for a, b in zip(greedy, sampling, strict=True):
        assert a.stats["spec"] == b.stats["spec"]
    assert sum(r.stats["spec"]["accepted"] for r in greedy) > 0


def test_only_the_sampling_program_holds_the_sampler(p):
    state = decode_state(np.zeros((2, 4), np.int32), np.zeros(2, np.int32),
                         np.ones(2, np.int32), np.full(2, 3, np.int32),
                         np.zeros((2, 2), np.uint32))
    cache = kvjax.init_cache(CONFIG, CACHE)
    text = {sampled: steps.decode_loop.lower(p, CONFIG, cache, state, 4, sampled=sampled)
            .as_text() for sampled in (True, False)}
    assert "threefry" in text[True] and "stablehlo.sort" in text[True]
    assert "threefry" not in text[False] and "stablehlo.sort" not in text[False]
