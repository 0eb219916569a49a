"""`kvjax bench kv_format` (kvjax.bench.kv_format) on a small model: float32 pages are the
reference (agreement 1, no error), second turns equal a cache-off engine's bitwise under
each format, int8 pages move logits and the NLL and store 4 x head_dim / (head_dim + 4)
times the tokens per byte, and the teacher-forced NLL is the full-sequence reference's."""

from __future__ import annotations

import numpy as np
from helpers import random_tokens, sharp_params, small_model

import kvjax
from kvjax.bench.kv_format import Case, measure

CONFIG = small_model(max_seq_len=256)


def test_each_format_is_measured_against_float32_pages():
    params = sharp_params(CONFIG, seed=2)
    prompts = random_tokens(5, [20, 37, 9], CONFIG.vocab_size)
    case = Case(params, CONFIG, prompts, lambda prompt, answer: prompt + answer + [3, 4, 5])
    f32, int8 = measure(case, ("float32", "int8"), new_tokens=8, slots=2,
                        context=CONFIG.max_seq_len, reps=1, decode_prompt=24, decode_tokens=4)
    assert (f32["agreement"], f32["forced_agreement"], f32["max_logit_error"],
            f32["nll_diff"]) == (1.0, 1.0, 0.0, 0.0)
    assert 0 < int8["forced_agreement"] <= 1
    for r in (f32, int8):
        assert r["turn2_same_as_cache_off"] and r["turn2_reused_tokens"] >= 16
        assert r["decode_s_per_token"] > 0
    assert int8["max_logit_error"] > 0 and int8["nll_diff"] != 0
    h = CONFIG.head_dim
    assert int8["tokens_per_byte_vs_f32"] == 4 * h / (h + 4)
    # the NLL read through float32 pages is the full-sequence forward's (fast numerics)
    nll = []
    for prompt, r in zip(prompts, _answers(params, prompts), strict=True):
        seq = prompt + r
        lg = np.asarray(kvjax.forward(params, CONFIG, [seq])[0], np.float64)
        lg = lg[len(prompt) - 1: len(seq) - 1]
        logp = lg - np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - lg.max(-1, keepdims=True)
        nll.extend(-logp[np.arange(len(r)), r])
    assert abs(float(np.mean(nll)) - f32["nll"]) < 1e-6  # measured 1.0e-7 (NLL 0.92)


def _answers(params, prompts):
    engine = kvjax.Engine(params, CONFIG, kvjax.EngineConfig(min_context=CONFIG.max_seq_len))
    return [r.tokens for r in engine.generate(
        [kvjax.Request(p, 8, ignore_eos=True) for p in prompts])]
