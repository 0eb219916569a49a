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
from kvjax.decode import sampling, steps
from kvjax.decode.state import decode_state
from kvjax.engine.requests import Request
from kvjax.model.layout import store
from kvjax.model.plan import FAST, INVARIANT
from kvjax.speculative import plugin
from kvjax.speculative.loop import DraftState, spec_loop

PROMPTS = random_tokens(4, [5, 9, 14], CONFIG.vocab_size)
DRAFT = small_model(num_layers=1, d_model=16, num_heads=2, num_kv_heads=1, d_ff=32,
                    max_seq_len=256, tie_embeddings=False)


@pytest.fixture(scope="module")
def p():
    return params(1)


def _force_sampling(monkeypatch, module) -> None:
    """The sampling programs for greedy rows: in `module`'s loop and the first token's."""
    for m in (module, sampling):
        monkeypatch.setattr(m, "any_sampled", lambda temperature: True)


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


def test_only_the_sampling_programs_hold_the_sampler(p):
    """The greedy `decode_loop` and `spec_loop` (both drafters) lower without threefry or a
    sort; their sampling programs have both (the check can see them)."""
    rows = 2
    state = decode_state(np.zeros((rows, 4), np.int32), np.zeros(rows, np.int32),
                         np.ones(rows, np.int32), np.full(rows, 3, np.int32),
                         np.zeros((rows, 2), np.uint32))
    cache = kvjax.init_cache(CONFIG, CACHE)
    draft = kvjax.init_params(DRAFT, seed=5)
    programs = {
        "decode": lambda sampled: steps.decode_loop.lower(p, CONFIG, cache, state, 4,
                                                          sampled=sampled),
        "ngram": lambda sampled: spec_loop.lower(
            p, CONFIG, cache, state, drafter="ngram", gamma=2, gamma_max=2, max_out=4,
            history=np.zeros((rows, 64), np.int32), sampled=sampled),
        "model": lambda sampled: spec_loop.lower(
            p, CONFIG, cache, state, drafter="model", gamma=2, gamma_max=2, max_out=4,
            draft_params=draft,
            draft_config=DRAFT, draft_cache=kvjax.init_cache(DRAFT, CACHE),
            draft=DraftState(page_table=np.zeros((rows, 4), np.int32),
                             lengths=np.zeros(rows, np.int32), prev=np.zeros(rows, np.int32)),
            sampled=sampled)}
    for name, lower in programs.items():
        sampling_text, greedy_text = (lower(sampled).as_text() for sampled in (True, False))
        assert "threefry" in sampling_text and "stablehlo.sort" in sampling_text, name
        assert "threefry" not in greedy_text and "stablehlo.sort" not in greedy_text, name
