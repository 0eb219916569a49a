"""Results and streams of the engine: nothing is lost between calls, and a request that is
preempted and recomputed tells exactly what it returns (checked against what it streamed)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from engine_helpers import CONFIG, CONTEXT, SLOTS, assert_same, engine, params, with_cache
from helpers import small_model

import kvjax
from kvjax import Engine, EngineConfig, InvalidRequestError, Request, SamplingConfig
from kvjax.config import SpecConfig
from kvjax.engine.rounds import Rounds
from kvjax.lab import workloads

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


def _tokens(events, request_id, sample=0) -> list[int]:
    return [t for e in events if (e.request_id, e.sample) == (request_id, sample)
            for t in e.tokens]


def test_streams_lose_nothing_to_generate_or_an_early_stop(p):
    """Events of other requests are kept through generate(), and a caller that stops a
    stream early (here mid-step, where one step yields an event per sample) finds the
    rest in the next stream()."""
    eng = engine(p)
    a, b = eng.submit(Request(A, 9)), eng.submit(Request(B, 30, n=2, sampling=HOT))
    events = list(eng.stream(a))
    eng.generate([Request(A, 3)])
    it = eng.stream(b)
    events += [next(it)]
    it.close()
    events += list(eng.stream(b))
    result_a, result_b = eng.result(a), eng.result(b)
    assert _tokens(events, a) == result_a.tokens
    assert [_tokens(events, b, j) for j in range(2)] == result_b.tokens
    assert all(len(t) == 30 for t in result_b.tokens)


def test_generate_validates_every_request_before_queueing_any(p):
    eng = engine(p)
    with pytest.raises(InvalidRequestError, match="max_new_tokens must be an int"):
        eng.generate([Request(A, 4), Request(B, "8")])
    assert eng.num_waiting == 0 and eng.run() == {}
    for bad, message in ((Request(A, 4, n=2.0), "n must be an int"),
                         (Request(text=5), "text must be a str"),
                         (Request(A, 4, stop_token="x"), "stop_token must be an int or None"),
                         (Request(A, 4, tenant=7), "tenant must be a str or None"),
                         (Request(A, 4, sampling={"temperature": 1.0}),
                          "sampling must be a SamplingConfig")):
        with pytest.raises(InvalidRequestError, match=message):
            eng.submit(bad)
    assert eng.generate([Request(A, 4)])[0].tokens == engine(p).generate([Request(A, 4)])[0].tokens


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
    recomputed tokens differ from what it streamed (`preemption="recompute"`: a resumed
    request samples none of its streamed tokens again). The engine ends that request with
    status "error" (its result holds the streamed tokens), keeps serving the others
    exactly, and leaks no page."""
    preempt = Rounds._preempt

    def preempt_and_rekey(self, req):
        preempt(self, req)
        for seq in req.seqs:
            seq.key = seq.key ^ np.uint32(1)

    monkeypatch.setattr(Rounds, "_preempt", preempt_and_rekey)
    requests = _sampled_workload()
    tight = _tight(p, preemption="recompute")
    ids = [tight.submit(r) for r in requests]
    streamed, ends = {i: [] for i in ids}, {}
    for event in tight.stream():
        streamed[event.request_id] += event.tokens
        if event.finished:
            assert event.request_id not in ends  # one last event per sample
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


@pytest.mark.parametrize("preemption", ["resume", "recompute"])
def test_preemption_resets_the_speculative_stats_of_a_request(p, preemption):
    """Per-request speculative counters describe the tokens returned: every token after
    the prefill's first was emitted by exactly one verification round, so emitted equals
    len(tokens) - 1, also for requests preempted midway (resumed: the counters of the
    rounds before stay, and the resume's prefill gives the last streamed token back
    without a round; recomputed: they start over)."""
    requests = _sampled_workload()
    cache = with_cache(num_pages=30)
    ec = EngineConfig(cache=cache, max_slots=SLOTS, decode_steps=4, preemption=preemption,
                      min_context=CONTEXT)
    spec = Engine(p, CONFIG, ec, draft=(kvjax.init_params(DRAFT, seed=5), DRAFT),
                  spec=SpecConfig(gamma=3))
    results = spec.generate(requests)
    m = spec.metrics()
    assert m["preemptions"] > 0 and m["errors"] == 0
    assert (m["resumed_tokens"] > 0) == (preemption == "resume")
    roomy = Engine(p, CONFIG, dataclasses.replace(ec, cache=with_cache(num_pages=256)),
                   draft=(kvjax.init_params(DRAFT, seed=5), DRAFT), spec=SpecConfig(gamma=3))
    assert [r.tokens for r in results] == [r.tokens for r in roomy.generate(requests)]
    assert any(r.stats["preemptions"] for r in results)
    for r in results:
        assert r.stats["spec"]["emitted"] == len(r.tokens) - 1
        assert r.stats["spec"]["accepted"] <= r.stats["spec"]["drafted"]


def test_a_contradiction_found_while_decoding_ends_every_open_stream_once(p, monkeypatch):
    """n = 2 samples; after a preemption the second sample's recomputation is made to
    differ at index 3, with the stop token (so that sample is done in the very call that
    finds the contradiction). Every sample of every request gets exactly one finished
    event; the failed request's open samples get one naming the error; no page leaks."""
    emit = Rounds._emit
    stop = 0  # never sampled in this workload: the requests run long enough to be preempted

    def emit_diverging(self, req, events):
        seq = req.seqs[-1]
        if req.stats.preemptions and seq.checked <= 3 < min(len(seq.generated),
                                                                    len(seq.streamed)):
            seq.generated[3:] = [stop]
            seq.done = True
        return emit(self, req, events)

    monkeypatch.setattr(Rounds, "_emit", emit_diverging)
    requests = workloads.shared_system_prompt(3, prefix_len=9, suffix_len=6, vocab=V,
                                              max_new_tokens=30, seed=7, n=2, sampling=HOT,
                                              stop_token=stop)
    tight = _tight(p)
    ids = [tight.submit(r) for r in requests]
    events = list(tight.stream())
    results = tight.run()
    failed = [i for i in ids if results[i].status == "error"]
    assert failed and all("at index 3" in results[i].error for i in failed)
    for i in ids:
        for j in range(2):
            ends = [e for e in events if (e.request_id, e.sample) == (i, j) and e.finished]
            assert len(ends) == 1
            assert results[i].tokens[j] == _tokens(events, i, j)
            if i in failed and not ends[0].tokens:
                assert ends[0].error == results[i].error
    assert any(e.error for e in events if e.request_id in failed)
    m = tight.metrics()
    assert m["free_pages"] == 30 - m["resident_pages"]


@pytest.mark.parametrize("preemption", ["resume", "recompute"])
def test_cancelling_a_preempted_request_returns_what_it_streamed(p, preemption):
    """A request cancelled while it waits after a preemption returns what it streamed; a
    resumable one kept its answer's logits (the unpreempted run's, bitwise), a recomputed
    one has none left."""
    tight = _tight(p, preemption=preemption)
    requests = _sampled_workload()
    ids = [tight.submit(r) for r in requests]
    streamed = {i: [] for i in ids}
    victim = None
    while victim is None:
        for event in tight.step():
            streamed[event.request_id] += event.tokens
        waiting = [r for r in tight.rounds.live.values()
                   if r.stats.preemptions and r in tight.scheduler.waiting]
        victim = waiting[0].id if waiting else None
    tight.cancel(victim)
    result = tight.result(victim)
    assert result.status == "cancelled" and result.tokens == streamed[victim]
    assert len(result.tokens) > 1
    if preemption == "resume":
        ref = engine(p, prefix_cache=False).generate([requests[ids.index(victim)]])[0]
        np.testing.assert_array_equal(result.logits, ref.logits[:len(result.tokens)])
    else:
        assert result.logits is None
    tight.run()
    m = tight.metrics()
    assert m["free_pages"] == 30 - m["resident_pages"]


def _sharp(params) -> dict:
    """Random-init weights with the embedding (tied: also the output head) x 15: logits far
    from flat, so a draft that differs is often rejected and adaptive γ moves."""
    out = jax.tree_util.tree_map(lambda x: x, params)
    out["embed"]["embedding"] = out["embed"]["embedding"] * 15.0
    return out


@pytest.mark.parametrize("trees", [False, True], ids=["chain", "trees"])
def test_adaptive_sizes_recompute_what_they_streamed(p, trees):
    """Sampled speculative tokens depend on where rounds start and on the tree a round
    verifies, so a preempted request that is recomputed (`preemption="recompute"`; a
    resumed one decodes none of its streamed tokens again) decodes them again under the
    size each of its calls had: adaptive γ (4 -> 3 -> 2 here, with a draft half-way between
    the target and another model, α 0.41) or adaptive n-gram tree widths (2, 4 or 8 nodes).
    No recomputation contradicts its stream (without the replayed sizes, one of the 4
    preempted requests failed with chains, two of the 5 with trees)."""
    target = _sharp(kvjax.init_params(CONFIG, seed=1))
    ec = EngineConfig(cache=with_cache(num_pages=32 if trees else 40), max_slots=SLOTS,
                      decode_steps=4, min_context=CONTEXT, preemption="recompute")
    if trees:  # costs near one: the policy moves with what the calls accept
        spec = Engine(target, CONFIG, ec, spec=SpecConfig(
            drafter="ngram", gamma=3, tree_nodes=8, branches=4, adaptive=True,
            verify_costs=((2, 1.0), (4, 1.02), (8, 1.04))))
    else:
        other = _sharp(kvjax.init_params(CONFIG, seed=9))
        draft = jax.tree_util.tree_map(lambda a, b: 0.5 * a + 0.5 * b, target, other)
        spec = Engine(target, CONFIG, ec, draft=(draft, CONFIG), spec=SpecConfig(
            gamma=4, adaptive=True, cost_ratio=0.05, verify_slope=0.0))
    requests = _sampled_workload()
    ids = [spec.submit(r) for r in requests]
    events = list(spec.stream())
    results = spec.run()
    m = spec.metrics()
    assert m["preemptions"] > 0 and m["errors"] == 0
    assert len(m["spec"]["tree_widths"] if trees else set(m["spec"]["gamma_history"])) > 1
    assert m["spec"]["accepted"] > 0
    for i in ids:
        assert results[i].status == "finished"
        assert results[i].tokens == _tokens(events, i)
        assert results[i].stats["spec"]["emitted"] == len(results[i].tokens) - 1
