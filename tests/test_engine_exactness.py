"""Prefix cache on == prefix cache off, bitwise, on every workload shape."""

from __future__ import annotations

import dataclasses

import pytest
from engine_helpers import (
    CACHE,
    CONFIG,
    assert_matches_forward,
    assert_same,
    engine,
    params,
    with_cache,
)

from kvjax import Request, SamplingConfig
from kvjax.lab import workloads

V = CONFIG.vocab_size


@pytest.fixture(scope="module")
def p():
    return params()


def _on_off(p, requests, **kw):
    on = engine(p, prefix_cache=True, **kw)
    off = engine(p, prefix_cache=False, **kw)
    return on.generate(requests), off.generate(requests), on


def test_shared_system_prompt(p):
    requests = workloads.shared_system_prompt(6, prefix_len=37, suffix_len=9, vocab=V,
                                              max_new_tokens=9, seed=1, return_logits=True)
    on, off, eng = _on_off(p, requests)
    assert_same(on, off)
    assert_matches_forward(p, requests, on)
    assert sum(r.stats["reused_tokens"] for r in on) >= 5 * 36
    assert eng.metrics()["request_hit_rate"] >= 5 / 6


def test_few_shot(p):
    requests = workloads.few_shot(5, num_examples=4, example_len=7, query_len=6, vocab=V,
                                  max_new_tokens=6, seed=2, return_logits=True)
    on, off, _ = _on_off(p, requests)
    assert_same(on, off)
    assert_matches_forward(p, requests, on)
    assert on[-1].stats["reused_tokens"] == 28


def test_divergence_in_the_middle_of_a_page(p):
    requests = workloads.mid_page_divergence(4, prefix_len=22, total_len=35, vocab=V,
                                             max_new_tokens=7, seed=3, return_logits=True)
    on, off, _ = _on_off(p, requests)
    assert_same(on, off)
    assert [r.stats["reused_tokens"] for r in on] == [0, 20, 20, 20]
    assert [r.stats["miss_cause"] for r in on] == ["cold"] + ["divergence"] * 3
    assert [r.stats["miss_position"] for r in on[1:]] == [22, 22, 22]


def test_multi_turn_chat(p):
    kw = dict(num_conversations=3, turns=4, system_len=13, user_len=5, vocab=V,
              max_new_tokens=6, seed=4, return_logits=True)
    on_engine, off_engine = engine(p, prefix_cache=True), engine(p, prefix_cache=False)
    on = workloads.run_multi_turn(on_engine, **kw)
    off = workloads.run_multi_turn(off_engine, **kw)
    for a, b in zip(on, off, strict=True):
        assert a.history == b.history
        assert_same(a.results, b.results)
    # From turn 2 on, a turn reuses every full page of the previous turn's prompt and
    # answer (decode-written pages enter the trie; the answer's last token is not cached).
    for conv in on:
        cached = [r.stats["prompt_tokens"] + len(r.tokens) - 1 for r in conv.results]
        reused = [r.stats["reused_tokens"] for r in conv.results]
        assert reused[1:] == [n // 4 * 4 for n in cached[:-1]]


def test_fast_numerics_cache_on_equals_off_on_one_device(p):
    """Under `numerics="fast"` on one device only prefill-written pages enter the trie (a
    decode-written page's bits depend on its batch), so cache on == cache off still holds
    bitwise: from turn 2 on a turn reuses the full pages of the previous turn's prompt, none
    of its answer."""
    kw = dict(num_conversations=2, turns=3, system_len=5, user_len=3, vocab=V,
              max_new_tokens=5, seed=4, return_logits=True)
    on_engine = engine(p, prefix_cache=True, numerics="fast")
    on = workloads.run_multi_turn(on_engine, **kw)
    off = workloads.run_multi_turn(engine(p, prefix_cache=False, numerics="fast"), **kw)
    for a, b in zip(on, off, strict=True):
        assert a.history == b.history
        assert_same(a.results, b.results)
    for conv in on:
        prompts = [r.stats["prompt_tokens"] for r in conv.results]
        reused = [r.stats["reused_tokens"] for r in conv.results]
        assert reused[1:] == [n // 4 * 4 for n in prompts[:-1]]


@pytest.mark.parametrize("copy", [False, True], ids=["pages", "partial_copy"])
def test_eviction_under_memory_pressure(p, copy):
    requests = workloads.shared_system_prompt(4, prefix_len=21, suffix_len=11, vocab=V,
                                              max_new_tokens=5, seed=5, return_logits=True)
    requests += workloads.few_shot(4, num_examples=3, example_len=6, query_len=5, vocab=V,
                                   max_new_tokens=5, seed=6, return_logits=True)
    small = with_cache(num_pages=24)
    on, off, eng = _on_off(p, requests, cache=small, max_slots=2, partial_page_copy=copy)
    assert_same(on, off)
    assert eng.metrics()["evictions"] > 0
    assert_matches_forward(p, requests, on)


@pytest.mark.parametrize("copy", [False, True], ids=["pages", "partial_copy"])
def test_preemption_recomputes_exactly(p, copy):
    """Pages for only part of the running requests' growth: younger ones are preempted and
    recomputed, and every output is bitwise what an unconstrained engine produces."""
    requests = workloads.shared_system_prompt(4, prefix_len=9, suffix_len=6, vocab=V,
                                              max_new_tokens=40, seed=7, return_logits=True)
    tight = engine(p, cache=with_cache(num_pages=30), partial_page_copy=copy)
    roomy = engine(p, prefix_cache=False)
    got = tight.generate(requests)
    assert tight.metrics()["preemptions"] > 0
    assert any(r.stats["preemptions"] for r in got)
    assert tight.metrics()["recomputed_tokens"] > 0
    assert_same(got, roomy.generate(requests))
    assert_same(got, engine(p, cache=with_cache(num_pages=30), prefix_cache=False)
                .generate(requests))


@pytest.mark.parametrize("copy", [False, True], ids=["pages", "partial_copy"])
def test_n_samples_share_the_prompt_and_copy_on_write(p, copy):
    sampling = SamplingConfig(temperature=1.0, top_k=0, top_p=1.0, seed=3)
    requests = [Request(list(range(1, 15)), 8, sampling=sampling, n=3, return_logits=True),
                Request(list(range(1, 15)) + [5, 6], 8, sampling=sampling, n=2,
                        return_logits=True)]
    on, off, eng = _on_off(p, requests, partial_page_copy=copy)
    assert_same(on, off)
    assert len(on[0].tokens) == 3
    assert len({tuple(t) for t in on[0].tokens}) > 1  # the samples differ
    assert eng.metrics()["cow_copies"] >= 2  # the shared partial prompt page, per writer
    assert_matches_forward(p, requests, on)


def test_partial_page_copy_gives_the_same_outputs_and_more_reuse(p):
    requests = workloads.mid_page_divergence(4, prefix_len=22, total_len=35, vocab=V,
                                             max_new_tokens=5, seed=8, return_logits=True)
    plain = engine(p)
    copying = engine(p, partial_page_copy=True)
    a, b = plain.generate(requests), copying.generate(requests)
    assert_same(a, b)
    assert [r.stats["reused_tokens"] for r in a] == [0, 20, 20, 20]
    assert [r.stats["reused_tokens"] for r in b] == [0, 22, 22, 22]
    assert copying.metrics()["partial_copies"] == 3


def test_schedules_give_the_same_outputs(p):
    requests = workloads.shared_system_prompt(3, prefix_len=17, suffix_len=4, vocab=V,
                                              max_new_tokens=5, seed=9, return_logits=True)
    requests += workloads.few_shot(3, num_examples=2, example_len=9, query_len=3, vocab=V,
                                   max_new_tokens=5, seed=10, return_logits=True)
    fcfs = engine(p, max_slots=1).generate(requests)
    lpm = engine(p, max_slots=1, schedule="lpm").generate(requests)
    assert_same(fcfs, lpm)


def test_streamed_tokens_equal_the_results(p):
    requests = workloads.shared_system_prompt(3, prefix_len=10, suffix_len=3, vocab=V,
                                              max_new_tokens=11, seed=11)
    eng = engine(p)
    ids = [eng.submit(r) for r in requests]
    streamed = {i: [] for i in ids}
    finished = set()
    only_first = [e.tokens for e in eng.stream(ids[0])]
    assert ids[0] not in eng.rounds.live
    streamed[ids[0]] = [t for tokens in only_first for t in tokens]
    finished.add(ids[0])
    for event in eng.stream():
        streamed[event.request_id] += event.tokens
        if event.finished:
            finished.add(event.request_id)
    results = eng.run()
    assert finished == set(ids)
    assert all(streamed[i] == results[i].tokens for i in ids)
    assert all(len(results[i].tokens) == 11 for i in ids)


def test_stop_token_and_cancellation_return_every_page(p):
    """A stopped or cancelled request returns every page; a sample cancelled while it
    decodes leaves its answer's full pages in the trie, and a request for prompt + answer
    reuses them (and gets a cache-off engine's bits)."""
    eng = engine(p)
    free = eng.generate([Request(list(range(3, 12)), 12)])[0].tokens
    stop = free[4]
    got = eng.generate([Request(list(range(3, 12)), 12, stop_token=stop)])[0].tokens
    assert got == free[: free.index(stop) + 1]
    prompt = list(range(20, 40))  # 5 full pages
    rid = eng.submit(Request(prompt, 30))
    other = eng.submit(Request(list(range(5, 9)), 4))
    eng.step()  # both prompts prefilled, then a decode call
    assert not eng.rounds.live[rid].prefilling
    eng.cancel(rid)
    results = eng.run()
    assert results[rid].status == "cancelled"
    assert len(results[other].tokens) == 4
    held = set(eng.trie.pages())
    assert eng.allocator.num_free + len(held) == CACHE.num_pages
    assert all(eng.allocator.refcount(page) == 1 for page in held)
    answer = results[rid].tokens
    assert len(answer) == 5  # the prefill's token and one call's 4
    follow = Request(prompt + answer, 3, return_logits=True)
    (again,) = eng.generate([follow])
    # 20 prompt + 4 cached answer tokens (the last one is never cached): 6 full pages
    assert again.stats["reused_tokens"] == 24
    assert_same([again], engine(p, prefix_cache=False).generate([follow]))


def test_position_base_shifts_positions_exactly(p):
    request = Request(list(range(7, 30)), 6, position_base=17, return_logits=True)
    on, off, _ = _on_off(p, [request, dataclasses.replace(request)])
    assert_same(on, off)
    assert on[1].stats["reused_tokens"] == 20
    assert_matches_forward(p, [request], on[:1])
