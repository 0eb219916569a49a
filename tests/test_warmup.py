"""`Engine.warmup()`: after it, a chat of any prompt length within the context compiles
nothing (no step traced, no program lowered), speculative engines' included (a chain's one
program for every γ, an n-gram tree's one for every width), and the warm-up itself changes no page,
statistic or bit."""

from __future__ import annotations

import contextlib

import jax
import pytest
from eagle_helpers import markov, trained_head
from engine_helpers import CACHE, CONFIG, SLOTS, assert_same, engine, params
from helpers import small_model

import kvjax
from kvjax.config import SpecConfig
from kvjax.decode import steps
from kvjax.decode.generate import warmup
from kvjax.engine import warmup as engine_warmup
from kvjax.engine.runner import decode_context
from kvjax.engine.warmup import prefill_widths

_LOWERED: list[str] = []
_COUNTING: list[bool] = []


def _on_duration(event: str, duration: float, **_) -> None:
    if _COUNTING and event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
        _LOWERED.append(event)


jax.monitoring.register_event_duration_secs_listener(_on_duration)


@contextlib.contextmanager
def no_compiles():
    """Asserts that the block lowers no program and traces no step."""
    traces = steps.trace_counts()
    _LOWERED.clear()
    _COUNTING.append(True)
    try:
        yield
    finally:
        _COUNTING.pop()
    assert steps.trace_counts() == traces, "a step was traced after the warm-up"
    assert not _LOWERED, f"{len(_LOWERED)} programs lowered after the warm-up"


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + salt) % (CONFIG.vocab_size - 1) + 1 for i in range(n)]


def chat(e, lengths=(5, 40, 69, 130)) -> list:
    """One request at a time, greedy then sampled, each prompt length; then a turn that
    continues the first conversation (its prefix comes from the trie)."""
    results = []
    for n in lengths:
        results += e.generate([kvjax.Request(tokens=prompt(n), max_new_tokens=9)])
        results += e.generate([kvjax.Request(
            tokens=prompt(n, 3), max_new_tokens=6,
            sampling=kvjax.SamplingConfig(temperature=0.9, top_k=20, seed=n))])
    first = prompt(lengths[0]) + results[0].tokens + prompt(23, 5)
    return results + e.generate([kvjax.Request(tokens=first, max_new_tokens=7)])


@pytest.mark.parametrize("numerics", ["invariant", "fast"])
def test_a_chat_compiles_nothing_after_warmup(numerics):
    e = engine(params(), numerics=numerics, min_context=None)
    report = e.warmup(threads=2)  # two compile threads, whatever the CPU
    assert report.programs
    counts = report.counts()
    widths = prefill_widths(e.runner, 1)
    assert counts["extend"] == len(widths)
    assert counts["decode_loop"] == 2  # greedy and sampled
    assert "warm-up:" in str(report)
    with no_compiles():
        results = chat(e)
    assert all(r.status == "finished" for r in results)


DRAFT = small_model(num_layers=1, d_model=16, num_heads=2, num_kv_heads=1, d_ff=32,
                    max_seq_len=256, tie_embeddings=False)


@pytest.mark.parametrize(("spec", "programs"), [
    (SpecConfig(drafter="model", gamma=4, adaptive=True), {"spec_loop": 2}),
    (SpecConfig(drafter="ngram", gamma=3), {"spec_loop": 2}),
    (SpecConfig(drafter="ngram", gamma=3, tree_nodes=8, adaptive=True), {"tree_loop": 2})],
    ids=["model-adaptive", "ngram", "ngram-tree-adaptive"])
def test_a_speculative_chat_compiles_nothing_after_warmup(spec, programs):
    """Greedy and sampled: a chain's one program (adaptive γ: every γ <= 4), an adaptive
    tree's one program for widths 2, 4 and 8; an adaptive engine's costs are measured by
    the warm-up."""
    draft = (kvjax.init_params(DRAFT, seed=5), DRAFT) if spec.drafter == "model" else None
    e = kvjax.Engine(params(), CONFIG, kvjax.EngineConfig(cache=CACHE, max_slots=SLOTS,
                                                          decode_steps=4),
                     draft=draft, spec=spec)
    report = e.warmup()
    assert {k: v for k, v in report.counts().items() if k in programs} == programs
    with no_compiles():
        results = chat(e)
    assert all(r.status == "finished" for r in results)
    assert e.metrics()["spec"]["target_calls"] > 0


def eagle_engine(tmp_path_factory, adaptive: bool = False) -> kvjax.Engine:
    """An engine drafting with the tests' trained EAGLE head (its target's weights)."""
    spec = SpecConfig(drafter="eagle", gamma=3, tree_nodes=8, branches=3, adaptive=adaptive,
                      verify_costs=((2, 1.0), (4, 1.02), (8, 1.04)) if adaptive else None)
    return kvjax.Engine(kvjax.init_params(CONFIG, seed=1), CONFIG,
                        kvjax.EngineConfig(cache=CACHE, max_slots=SLOTS, decode_steps=4),
                        draft=trained_head(tmp_path_factory)["head"], spec=spec)


@pytest.mark.parametrize("adaptive", [False, True], ids=["eagle", "eagle-adaptive"])
def test_an_eagle_chat_compiles_nothing_after_warmup(tmp_path_factory, adaptive):
    """An EAGLE head's trees, a program per width (8; adaptive: 2, 4 and 8), greedy and
    sampled, and the head's prefill at every prefill width."""
    e = eagle_engine(tmp_path_factory, adaptive)
    counts = e.warmup().counts()
    assert counts["tree_loop"] == 2 * (3 if adaptive else 1)
    assert counts["head_prefill"] == counts["extend"] == len(prefill_widths(e.runner, 1))
    with no_compiles():
        results = chat(e)
    assert all(r.status == "finished" for r in results)
    assert e.metrics()["spec"]["accepted"] > 0


def test_warmup_leaves_the_eagle_head_s_pages_as_they_were(tmp_path_factory):
    """A warm-up between two turns (the second continues the first: its head pairs come
    from the head's cached pages) changes no token, logit or drafting statistic: the
    compile-only tree call hands back the head's cache it was given."""
    text = [int(t) for t in markov(1, 49, CONFIG.vocab_size, 7)[0]]  # the head's data
    first = kvjax.Request(tokens=text[:40], max_new_tokens=12, return_logits=True)
    engines = [eagle_engine(tmp_path_factory) for _ in range(2)]
    answers = [e.generate([first]) for e in engines]
    engines[0].warmup()
    turn = kvjax.Request(tokens=text[:40] + answers[0][0].tokens + text[40:],
                         max_new_tokens=12, return_logits=True)
    got, want = (e.generate([turn]) for e in engines)
    assert_same(got, want)
    assert engines[0].metrics()["spec"] == engines[1].metrics()["spec"]
    assert engines[0].metrics()["spec"]["accepted"] > 0


@pytest.mark.parametrize("sampling", [None, kvjax.SamplingConfig(temperature=0.8, seed=3)])
def test_generate_compiles_nothing_after_its_warmup(sampling):
    p = params()
    report = warmup(p, CONFIG, CACHE, max_new_tokens=8, sampling=sampling)
    assert report.counts() == {"extend": 1, "greedy" if sampling is None else "sample": 1,
                               "decode_loop": 1}
    with no_compiles():
        for n in (5, 40, 130):
            out = kvjax.generate(p, CONFIG, [prompt(n)], 8, sampling=sampling, cache=CACHE)
            assert len(out.tokens[0]) == 8


def test_warmup_changes_no_page_statistic_or_bit():
    p = params()
    e = engine(p)
    pages, metrics = e.pool.stats(), e.metrics()
    e.warmup(rows=(1, 2))
    assert e.pool.stats() == pages
    assert e.metrics() == metrics
    requests = [kvjax.Request(tokens=prompt(n), max_new_tokens=8, return_logits=True)
                for n in (9, 33)]
    assert_same(e.generate(requests), engine(p).generate(requests))


@pytest.mark.parametrize("batch", ["greedy", "sampled", "a batch"])
def test_a_first_round_compiles_its_programs_side_by_side(monkeypatch, batch):
    """An engine's first round compiles its programs (the prefill call it is about to
    make, the first tokens' sampler, the decode call of its samples, with logits where
    asked) on parallel
    compile-only threads before it runs (`kvjax.engine.warmup.ahead`): a lone request's
    round then traces nothing more (a batch's round compiles its own, as before), and
    answers are those of an engine without it."""
    sampling = kvjax.SamplingConfig(temperature=0.9, top_k=20, seed=4)
    requests = {"greedy": [kvjax.Request(tokens=prompt(37), max_new_tokens=9)],
                "sampled": [kvjax.Request(tokens=prompt(21, 2), max_new_tokens=7,
                                          sampling=sampling, return_logits=True)],
                "a batch": [kvjax.Request(tokens=prompt(21, 2), max_new_tokens=7,
                                          sampling=sampling),
                            kvjax.Request(tokens=prompt(50, 1), max_new_tokens=7, n=2,
                                          sampling=sampling)]}[batch]
    ahead, seen = engine_warmup.ahead, []

    def spy(*args):
        report = ahead(*args)
        seen.append(([p.name for p in report], steps.trace_counts()))
        return report

    monkeypatch.setattr(engine_warmup, "ahead", spy)
    got = engine(params(), numerics="invariant").generate(requests)
    names, traces = seen[0]
    assert len(seen) == 1
    if batch == "a batch":
        assert names == []
    else:
        assert sorted(set(names)) == ["decode_loop", "extend",
                                      "greedy" if batch == "greedy" else "sample"]
        assert steps.trace_counts() == traces  # the real calls found every program
    monkeypatch.setattr(engine_warmup, "ahead", lambda *args: [])
    want = engine(params(), numerics="invariant").generate(requests)
    assert [r.tokens for r in got] == [r.tokens for r in want]


def test_the_warmup_threads_compile_the_same_programs():
    """One compile thread or several: the same programs, reported in the tasks' order (the
    decode loops first, then the prefill widths from the widest, then the samplers)."""
    one = engine(params()).warmup(threads=1)
    two = engine(params()).warmup(threads=3)
    names = [p.name for p in one.programs]
    assert names == [p.name for p in two.programs]
    assert names[:2] == ["decode_loop"] * 2 and names[-2:] == ["greedy", "sample"]
    with pytest.raises(ValueError, match="threads"):
        engine(params()).warmup(threads=0)


def test_the_width_ladder_holds_every_call_width():
    e = engine(params())
    chunk = CACHE.prefill_chunk
    for rows in range(1, SLOTS + 1):
        widths = prefill_widths(e.runner, rows)
        assert chunk in widths
        got = {e.runner.call_width(rows, widen, longest)
               for widen in (False, True) for longest in range(1, 8 * chunk * SLOTS)}
        assert got == set(widths), (rows, got, widths)


def test_warmup_rows_are_checked():
    e = engine(params())
    for rows in ((0,), (SLOTS + 1,)):
        with pytest.raises(ValueError, match="warm-up rows"):
            e.warmup(rows=rows)


def test_the_decode_context_is_decided_at_start_up():
    ec = kvjax.EngineConfig(cache=CACHE)
    assert ec.min_context is None
    assert decode_context(ec, CONFIG.max_seq_len) == min(
        CONFIG.max_seq_len, CACHE.num_pages * CACHE.page_size)
    assert decode_context(ec, 1 << 20) == CACHE.num_pages * CACHE.page_size
    assert decode_context(kvjax.EngineConfig(cache=CACHE, min_context=0), 4096) == 0
    e = engine(params(), min_context=None)
    assert e.runner.context == CONFIG.max_seq_len
    with pytest.raises(kvjax.ConfigError, match="min_context"):
        kvjax.EngineConfig(min_context=-1)
