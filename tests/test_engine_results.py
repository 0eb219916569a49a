"""Results and streams of the engine: nothing is lost between calls, and a request that is
preempted and recomputed tells exactly what it returns (checked against what it streamed)."""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import CONFIG, SLOTS, assert_same, engine, params, with_cache
from helpers import small_model

import kvjax
from kvjax import Engine, EngineConfig, Request, SamplingConfig, workloads
from kvjax.config import SpecConfig
from kvjax.runtime.engine import Engine as EngineClass

V = CONFIG.vocab_size
A, B = list(range(2, 21)), list(range(30, 41))
HOT = SamplingConfig(temperature=1.0, seed=5)


@pytest.fixture(scope="module")
def p():
    return params()


def test_generate_keeps_the_results_of_other_requests(p):
    eng = engine(p)
    alone = engine(p).generate([Request(A, 9), Request(B, 3)])
    rid = eng.submit(Request(A, 9))
    (mine,) = eng.generate([Request(B, 3)])
    assert mine.tokens == alone[1].tokens
    for _ in eng.stream():
        pass
    assert eng.result(rid).tokens == alone[0].tokens
    with pytest.raises(KeyError, match="already collected"):
        eng.result(rid)
    with pytest.raises(KeyError, match="no request 99"):
        eng.result(99)
    waiting = eng.submit(Request(A, 9))
    with pytest.raises(KeyError, match=r"not finished \(waiting\)"):
        eng.result(waiting)
    eng.step()
    with pytest.raises(KeyError, match=r"not finished \(running\)"):
        eng.result(waiting)
    # A stream of one request, then generate: the streamed one's result is kept.
    streamed = [e.tokens for e in eng.stream(waiting)]
    other = eng.generate([Request(B, 2)])
    assert sum(streamed, ()) != () and other[0].tokens == alone[1].tokens[:2]
    assert eng.result(waiting).tokens == alone[0].tokens
    # run() collects what is left, and only that.
    late = eng.submit(Request(B, 3))
    eng.generate([Request(A, 2)])
    assert list(eng.run()) == [late]
    assert eng.run() == {}


def _tight(p, **kw) -> Engine:
    return engine(p, cache=with_cache(num_pages=30), **kw)


def _sampled_workload():
    return workloads.shared_system_prompt(4, prefix_len=9, suffix_len=6, vocab=V,
                                          max_new_tokens=40, seed=7, return_logits=True,
                                          sampling=HOT)


def test_preempted_sampled_requests_stream_and_return_what_they_would_unpreempted(p):
    requests = _sampled_workload()
    tight = _tight(p)
    ids = [tight.submit(r) for r in requests]
    streamed = {i: [] for i in ids}
    for event in tight.stream():
        streamed[event.request_id] += event.tokens
    results = tight.run()
    assert tight.metrics()["preemptions"] > 0 and tight.metrics()["errors"] == 0
    roomy = engine(p, prefix_cache=False).generate(requests)
    assert_same([results[i] for i in ids], roomy)
    assert [streamed[i] for i in ids] == [r.tokens for r in roomy]


def test_a_recomputation_that_contradicts_the_stream_is_an_error(p, monkeypatch):
    """Break determinism on purpose: a preempted request gets another sampling key, so its
    recomputed tokens differ from what it streamed. The engine ends that request with
    status "error" (its result holds the streamed tokens), keeps serving the others
    exactly, and leaks no page."""
    preempt = EngineClass._preempt

    def preempt_and_rekey(self, req):
        preempt(self, req)
        for seq in req.seqs:
            seq.key = seq.key ^ np.uint32(1)

    monkeypatch.setattr(EngineClass, "_preempt", preempt_and_rekey)
    requests = _sampled_workload()
    tight = _tight(p)
    ids = [tight.submit(r) for r in requests]
    streamed, ends = {i: [] for i in ids}, {}
    for event in tight.stream():
        streamed[event.request_id] += event.tokens
        if event.finished:
            ends[event.request_id] = event.error
    results = tight.run()
    failed = [i for i in ids if results[i].status == "error"]
    assert failed and tight.metrics()["errors"] == len(failed)
    reference = engine(p, prefix_cache=False).generate(requests)
    for i, ref in zip(ids, reference, strict=True):
        assert results[i].tokens == streamed[i]
        if i in failed:
            assert "recomputed after a preemption" in results[i].error == ends[i]
            assert results[i].logits is None
            assert len(streamed[i]) < len(ref.tokens)
        else:
            assert_same([results[i]], [ref])
    m = tight.metrics()
    assert m["free_pages"] == 30 - m["resident_pages"]
    assert tight.generate([Request(A, 5)])[0].tokens == \
        engine(p).generate([Request(A, 5)])[0].tokens


DRAFT = small_model(num_layers=1, d_model=16, num_heads=2, num_kv_heads=1, d_ff=32,
                    max_seq_len=256, tie_embeddings=False)


def test_preemption_resets_the_speculative_stats_of_a_request(p):
    """Per-request speculative counters describe the tokens returned: every token after
    the prefill's first was emitted by exactly one verification round, so emitted equals
    len(tokens) - 1, also for requests preempted (and recomputed) midway."""
    requests = _sampled_workload()
    cache = with_cache(num_pages=30)
    ec = EngineConfig(cache=cache, max_slots=SLOTS, decode_steps=4)
    spec = Engine(p, CONFIG, ec, draft=(kvjax.init_params(DRAFT, seed=5), DRAFT),
                  spec=SpecConfig(gamma=3))
    results = spec.generate(requests)
    assert spec.metrics()["preemptions"] > 0
    assert any(r.stats["preemptions"] for r in results)
    for r in results:
        assert r.stats["spec"]["emitted"] == len(r.tokens) - 1
        assert r.stats["spec"]["accepted"] <= r.stats["spec"]["drafted"]
