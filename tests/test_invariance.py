"""Invariant numerics (the engine's default): a request's float32 logits and tokens are
bitwise those it gets alone, whatever else the engine does: the batch around it and
`max_slots`, the prefill chunk, `decode_steps`, the schedule, the prefix cache (pages written
by prefill, by decode or by a verification), preemption, the page size at one attention
block, and how prefill calls interleave with decode calls. Greedy and sampled requests
share each run. (Speculative vs plain: tests/test_engine_spec.py; the row-invariant pieces:
test_tiled.py and test_invariant_attention.py.)"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import itertools

import numpy as np
import pytest
from engine_helpers import CACHE, CONFIG, CONTEXT, assert_same, params, with_cache
from helpers import random_tokens
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvjax import ConfigError, Engine, EngineConfig, Request, SamplingConfig
from kvjax.decode import prefill, steps
from kvjax.engine import runner
from kvjax.engine.numerics_policy import NumericsPolicy
from kvjax.engine.rounds import Rounds
from kvjax.engine.runner import StepRunner

LENGTHS = [3, 9, 14, 22, 17, 6, 30, 11]  # 8 prompts, most crossing 4-token pages
SAMPLED = SamplingConfig(temperature=0.8, top_p=0.9, top_k=20)


def requests(lengths=LENGTHS, new=10, seed=11) -> list[Request]:
    """Odd-indexed requests sample (each with its own seed), even ones are greedy."""
    return [Request(tokens=t, max_new_tokens=new, return_logits=True,
                    sampling=dataclasses.replace(SAMPLED, seed=i) if i % 2 else SamplingConfig())
            for i, t in enumerate(random_tokens(seed, lengths, CONFIG.vocab_size))]


def engine(p, cache=CACHE, **kw) -> Engine:
    """An engine whose page tables cover the model's context (one table width for every
    length, as the engine tests': each knob compiles one width); the `alone` reference's
    tables grow with its sequences instead, so every comparison with it also shows that a
    table's width changes no bit."""
    kw.setdefault("max_slots", 8)
    kw.setdefault("decode_steps", 4)
    kw.setdefault("min_context", CONTEXT)
    return Engine(p, CONFIG, EngineConfig(cache=cache, **kw))


@pytest.fixture(scope="module")
def p():
    return params()


@pytest.fixture(scope="module")
def alone(p):
    """Each request on its own, one slot, no prefix cache, page tables as wide as its
    sequence needs (powers of two)."""
    e = engine(p, max_slots=1, prefix_cache=False, min_context=0)
    return [e.generate([r])[0] for r in requests()]


@pytest.mark.parametrize("knobs", [
    dict(max_slots=8), dict(max_slots=2), dict(max_slots=16),
    dict(cache=with_cache(prefill_chunk=8)), dict(cache=with_cache(prefill_chunk=32)),
    dict(decode_steps=1), dict(decode_steps=16), dict(schedule="lpm"),
    dict(prefix_cache=False), dict(prefill_calls_per_round=0), dict(packed_prefill=True),
    dict(packed_prefill=True, max_slots=2)], ids=str)
def test_a_request_gets_the_same_bits_whatever_the_knobs(p, alone, knobs):
    assert_same(engine(p, **knobs).generate(requests()), alone)


def test_a_context_floor_changes_no_bit_and_compiles_one_table_width(p, alone, monkeypatch):
    """`min_context` covering the model's context: every prefill and decode call's page table
    is that wide (64 pages of 4 tokens), so a growing sequence compiles no new width, and
    every request gets its alone bits (the widths that grow with a sequence: the `alone`
    reference, and test_compiles_stay_bounded)."""
    widths = set()

    def spy(table_of):
        def page_table(*args, **kwargs):
            table = table_of(*args, **kwargs)
            widths.add(table.shape[1])
            return table
        return page_table

    monkeypatch.setattr(runner, "page_table", spy(runner.page_table))
    monkeypatch.setattr(prefill, "page_table", spy(prefill.page_table))
    assert_same(engine(p, min_context=CONFIG.max_seq_len).generate(requests()), alone)
    assert widths == {CONFIG.max_seq_len // CACHE.page_size}


def test_row_blocks_keep_the_promise_without_transposed_kernels(p):
    """Kernels in Flax's layout (`transposed_kernels=False`): the products the probe cannot
    run as one product (here q, o and the down projection) run in 32-row blocks, and a
    request still gets its alone bits across slots, chunks and decode steps (other bits
    than the transposed layout's: another config, another cache identity)."""
    solo = engine(p, max_slots=1, prefix_cache=False, transposed_kernels=False)
    assert solo.plan.transposed == () and solo.plan.block("q") == 32
    alone = [solo.generate([r])[0] for r in requests()]
    for knobs in (dict(max_slots=8), dict(cache=with_cache(prefill_chunk=32), decode_steps=16)):
        assert_same(engine(p, transposed_kernels=False, **knobs).generate(requests()), alone)


def test_pages_written_by_decode_serve_later_requests_bitwise(p, alone):
    """A warm second pass reuses every full page of each request's prompt (and, with a
    longer prompt, of its answer): logits as alone."""
    e = engine(p)
    assert_same(e.generate(requests()), alone)
    assert_same(e.generate(requests()), alone)
    extended = [Request(tokens=r.tokens + a.tokens, max_new_tokens=6, return_logits=True)
                for r, a in zip(requests(), alone, strict=True)]
    warm = e.generate(extended)
    cold = engine(p, prefix_cache=False).generate(extended)
    assert_same(warm, cold)
    for r, res in zip(extended, warm, strict=True):  # the answer's last token is not cached
        assert res.stats["reused_tokens"] == (len(r.tokens) - 1) // CACHE.page_size \
            * CACHE.page_size


def test_multi_turn_reuses_every_full_page_of_the_conversation(p):
    """Turn k's prompt is turn k-1's prompt + answer + a user message: it reuses every full
    page of what is cached (all but the answer's last token), and its logits equal a
    cache-off engine's, turn after turn."""
    on, off = engine(p), engine(p, prefix_cache=False)
    system, *users = random_tokens(5, [30, 9, 7, 12], CONFIG.vocab_size)
    history, cached = list(system), 0
    for user in [[], *users]:
        history += user
        request = Request(tokens=history, max_new_tokens=19, return_logits=True)
        warm, cold = on.generate([request]), off.generate([request])
        assert_same(warm, cold)
        assert warm[0].stats["reused_tokens"] == cached // CACHE.page_size * CACHE.page_size
        history += warm[0].tokens
        cached = len(history) - 1
    assert cached > 100  # four turns of 19 new tokens each, over 4-token pages


def test_preemption_and_recompute_change_no_bit(p, alone):
    """A cache too small for every request at once: requests are preempted, recomputed
    (reusing the pages their first run cached) and still get their alone bits."""
    tight = with_cache(num_pages=24)
    e = engine(p, cache=tight)
    assert_same(e.generate(requests()), alone)
    assert e.metrics()["preemptions"] > 0
    assert e.allocator.num_free == tight.num_pages - e.trie.num_nodes  # nothing leaked


@pytest.mark.parametrize("prefix_cache", [True, False], ids=["cache_on", "cache_off"])
def test_a_preempted_request_resumes_from_the_answer_it_had_cached(p, monkeypatch,
                                                                   prefix_cache):
    """Long answers in a tight cache: running requests are preempted after some of their
    answer. With `preemption="resume"` (the default) their next admission prefills prompt +
    answer so far (teacher-forced): every answer token after the first is decoded exactly
    once, and with the prefix cache the resume reuses the answer pages the preemption
    cached (less than a page recomputed). `"recompute"` decodes the answers again. Both
    give the alone bits."""
    decoded = []
    decode = StepRunner.decode

    def counting(self, live, budgets, *args, **kw):
        decoded.append(sum(budgets[s.slot] for s in live))
        return decode(self, live, budgets, *args, **kw)

    monkeypatch.setattr(StepRunner, "decode", counting)
    reqs = requests([9, 22, 17, 30], new=32)
    # the youngest (preempted first) has a tenant's salt and its own position base
    reqs[-1] = dataclasses.replace(reqs[-1], tenant="acme", position_base=7)
    solo = engine(p, max_slots=1, prefix_cache=False)
    alone_long = [solo.generate([r])[0] for r in reqs]
    answers = sum(len(r.tokens) - 1 for r in alone_long)  # 124
    work = {}
    for mode in ("resume", "recompute"):
        e = engine(p, cache=with_cache(num_pages=22), max_slots=4, prefix_cache=prefix_cache,
                   preemption=mode)
        lost = _count_evicted_while_preempted(e, monkeypatch)
        decoded.clear()
        got = e.generate(reqs)
        assert_same(got, alone_long)
        m = e.metrics()
        assert m["preemptions"] > 0 and got[-1].stats["preemptions"] > 0
        assert e.allocator.num_free == e.cache_config.num_pages - e.trie.num_nodes
        work[mode] = sum(decoded), m["resumed_tokens"]
        if mode == "resume" and prefix_cache:
            # every resume recomputes under a page, plus the pages of its context that
            # were evicted while it waited
            resumed = [(r, g.stats) for r, g in zip(reqs, got, strict=True)
                       if g.stats["resumed_tokens"] > 0]
            assert any(not lost[tuple(r.tokens)] for r, _ in resumed)
            for r, s in resumed:
                pages = s["preemptions"] + lost[tuple(r.tokens)]
                assert s["recomputed_tokens"] < CACHE.page_size * pages, s
    assert work["resume"][0] == answers < work["recompute"][0]  # 124 < 188 / 192
    assert work["resume"][1] > 0 == work["recompute"][1]  # 56 / 60 answer tokens prefilled
    with pytest.raises(ConfigError, match="preemption"):
        EngineConfig(preemption="swap")


def _count_evicted_while_preempted(e: Engine, monkeypatch) -> collections.Counter:
    """Pages of a preempted request's context evicted while it waits, by its prompt."""
    lost = collections.Counter()
    remove = e.trie._remove

    def counting(node):
        history, n = [], node
        while n.parent is not None:
            history, n = list(n.tokens) + history, n.parent
        for req in e.scheduler.waiting:
            if req.stats.preemptions and req.context.tokens[:len(history)] == history:
                lost[tuple(req.tokens)] += 1
        remove(node)

    monkeypatch.setattr(e.trie, "_remove", counting)
    return lost


def test_page_size_at_one_attention_block(p):
    """Pages of 4 and of 16 tokens, the same 16-token attention block: the same bits."""
    four = with_cache(page_size=4, attn_block=16, num_pages=96)
    sixteen = with_cache(page_size=16, attn_block=16, num_pages=24)
    assert_same(engine(p, cache=four).generate(requests()),
                engine(p, cache=sixteen).generate(requests()))


def test_fast_numerics_do_change_with_the_batch(p, alone):
    """What invariance fixes, seen on this backend: under numerics="fast" on XLA's products
    and attention the same requests get other bits in a batch of 8 than alone (the logits
    still agree to ~1e-5). kvjax's CPU kernel gives every row its own bits whatever the
    mode."""
    alone_fast = [engine(p, max_slots=1, numerics="fast", cpu_kernel="off").generate([r])[0]
                  for r in requests()]
    batched = engine(p, numerics="fast", cpu_kernel="off").generate(requests())
    diff = max(np.abs(np.asarray(a.logits) - np.asarray(b.logits)).max()
               for a, b in zip(alone_fast, batched, strict=True))
    assert 0 < diff < 1e-4  # measured 8.1e-6


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(0, 3), min_size=8, max_size=8), st.sampled_from([2, 8]),
       st.sampled_from([1, 4]), st.booleans())
def test_random_arrivals_give_every_request_its_alone_bits(p, alone, arrivals, slots, steps_,
                                                           packed):
    """Requests arrive over the first rounds (request i before round `arrivals[i]`), with a
    random batch size, decode length and prefill (packed steps or calls) while others
    decode: each gets the logits it gets alone."""
    e = engine(p, max_slots=slots, decode_steps=steps_, packed_prefill=packed)
    ids = {}
    for round_ in range(4):
        for i, r in enumerate(requests()):
            if arrivals[i] == round_:
                ids[i] = e.submit(r)
        e.step()
    while e.num_running or e.num_waiting:
        e.step()
    assert_same([e.result(ids[i]) for i in range(len(LENGTHS))], alone)


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _compile_key(step: str, bound: inspect.BoundArguments) -> tuple:
    """What docs/numerics.md says a step compiles once per: its shapes and static switches."""
    a = bound.arguments
    table = a["batch"].page_table if step == "extend" else a["state"].page_table
    offsets = (a["batch"] if step == "extend" else a["state"]).position_offset
    fill = a.get("fill")
    return (step, a["tokens"].shape if step == "extend" else a["max_steps"], table.shape,
            offsets is None, a.get("lora") is None, a.get("last_only", a.get("return_logits")),
            a.get("sampled"), None if fill is None else (fill.tokens.shape, fill.page_table.shape))


def test_compiles_stay_bounded(p, monkeypatch):
    """Every knob value of a cache shape compiles `extend` once per (rows, chunk width,
    page-table bucket, offsets, adapters) and `decode_loop` once per (rows, decode steps,
    bucket, logits or not, sampled or greedy-only), each within the sets docs/numerics.md
    states (rows and buckets powers of two; widths the chunk or min(chunk, 16) times a
    power of two); a second pass over every knob compiles nothing."""
    calls = []  # (max_slots, compile key) of every step call
    for name in ("extend", "decode_loop"):
        step = getattr(steps, name)
        sig = inspect.signature(step)

        def spy(*a, _step=step, _name=name, _sig=sig, **k):
            calls.append((slots, _compile_key(_name, _sig.bind(*a, **k))))
            return _step(*a, **k)

        step.clear_cache()
        monkeypatch.setattr(steps, name, spy)

    def run():
        nonlocal slots
        for knobs in (dict(max_slots=8), dict(max_slots=2), dict(decode_steps=1)):
            slots = knobs.get("max_slots", 8)
            engine(p, min_context=0, **knobs).generate(requests())

    slots = 0
    before = steps.trace_counts()
    run()
    first = steps.trace_counts()
    keys = {key for _, key in calls}
    for step in ("extend", "decode_loop"):
        assert first[step] - before.get(step, 0) == sum(k[0] == step for k in keys), step
    blocks = 2 * CACHE.block_pages
    for max_slots, (step, width, table, *_) in calls:
        rows, bucket = table
        assert bucket % blocks == 0 and _is_power_of_two(bucket // blocks)
        if step == "extend":
            chunk = CACHE.prefill_chunk
            assert _is_power_of_two(rows) and rows <= max_slots
            assert width[1] == chunk or (
                width[1] % min(chunk, 16) == 0 and _is_power_of_two(width[1] // min(chunk, 16))
                and width[1] <= chunk * max_slots // rows)
        else:
            assert rows == max_slots or (_is_power_of_two(rows) and 2 <= rows < max_slots)
    run()
    assert steps.trace_counts() == first


def test_idle_slots_cost_nothing(p, alone, monkeypatch):
    """A decode call runs its live samples alone, in the next power of two of rows (at least
    two) below the slots: a lone request in an 8-slot engine decodes in 2 rows; three in 4
    rows, then in two rows once one finishes; five in every slot's row, then in fewer; their
    bits are their alone bits. Under fast numerics, where a row's bits may depend on the
    call's shape, every slot stays a row."""
    rows = []
    decode_loop = steps.decode_loop
    monkeypatch.setattr(steps, "decode_loop",
                        lambda *a, **k: rows.append(a[3].lengths.shape[0]) or decode_loop(*a, **k))
    assert_same(engine(p).generate(requests()[:1]), alone[:1])
    assert set(rows) == {2}
    rows.clear()
    three = requests()[:3]
    three[0] = dataclasses.replace(three[0], max_new_tokens=3)  # slot 0 finishes first
    got = engine(p).generate(three)
    assert got[0].tokens == alone[0].tokens[:3]
    np.testing.assert_array_equal(got[0].logits, alone[0].logits[:3])
    assert_same(got[1:], alone[1:3])  # slots 1 and 2, then in rows 0 and 1
    assert rows[0] == 4 and rows[-1] == 2 and set(rows) == {2, 4}
    rows.clear()
    five = [dataclasses.replace(r, max_new_tokens=n)
            for r, n in zip(requests()[:5], [10, 10, 10, 10, 4], strict=True)]
    for got, ref, r in zip(engine(p).generate(five), alone, five, strict=False):
        assert got.tokens == ref.tokens[:r.max_new_tokens]
        np.testing.assert_array_equal(got.logits, ref.logits[:r.max_new_tokens])
    assert set(rows) == {2, 4, 8}, rows  # 4 live while one still prefills, 5, then fewer
    rows.clear()
    engine(p, numerics="fast").generate(requests()[:1])
    assert set(rows) == {8}


def _long_prompt_arrives(p, cache, a_new=30, b_len=60, b_new=6, **knobs):
    """A short request decodes; a long one arrives after the first round."""
    e = engine(p, cache=cache, max_slots=4, decode_steps=2, **knobs)
    a_req, b_req = (Request(tokens=t, max_new_tokens=n, return_logits=True) for t, n in
                    zip(random_tokens(21, [5, b_len], CONFIG.vocab_size), [a_new, b_new],
                        strict=True))
    a = e.submit(a_req)
    e.step()
    b = e.submit(b_req)
    return e, a, b, a_req, b_req


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "calls"])
def test_a_long_prompt_is_prefilled_while_others_decode(p, monkeypatch, packed):
    """The 52-token prompt while the short request decodes: packed, inside the decode
    calls' steps (8 tokens, the chunk, beside each of the 2 decode steps; its last 4
    tokens too, though one call would finish them: a packed prompt stays packed, so no
    prefill call at all: 4 rounds), else one 8-token prefill call per round (7 rounds).
    The short one gets tokens every round (it is not stalled for the prompt), and both get
    their alone bits."""
    from kvjax.engine.runner import StepRunner

    calls = []
    prefill_call = StepRunner.prefill_call
    monkeypatch.setattr(StepRunner, "prefill_call",
                        lambda self, *a, **k: calls.append(1) or prefill_call(self, *a, **k))
    e, a, b, a_req, b_req = _long_prompt_arrives(p, with_cache(prefill_chunk=8), b_len=52,
                                                 packed_prefill=packed)
    calls.clear()  # a's own prefill
    rounds_before_b = 0
    while not e.rounds.live[b].seqs[0].generated:
        events = e.step()
        assert any(ev.request_id == a for ev in events)  # a decodes every round
        rounds_before_b += 1
    assert rounds_before_b == (4 if packed else 7)  # 16 or 8 of its tokens per round
    assert len(calls) == (0 if packed else 7)
    done = e.run()
    alone = engine(p, max_slots=1, prefix_cache=False)
    assert_same([done[a], done[b]], alone.generate([a_req]) + alone.generate([b_req]))


def test_a_prompt_one_call_finishes_takes_a_call_while_others_decode(p, monkeypatch):
    """A prompt that arrives with at most one chunk to prefill (here 6 tokens, chunk 8)
    takes one prefill call before the next decode call instead of packed steps (which
    gather its cached pages at every step); its first token comes after that round, and
    both requests get their alone bits."""
    from kvjax.engine.runner import StepRunner

    calls, packed = [], []
    prefill_call, packed_fill = StepRunner.prefill_call, StepRunner.packed_fill
    monkeypatch.setattr(StepRunner, "prefill_call",
                        lambda self, rows, *a, **k: calls.append(len(rows))
                        or prefill_call(self, rows, *a, **k))
    monkeypatch.setattr(StepRunner, "packed_fill", lambda self, rows, *a: packed.extend(
        rows) or packed_fill(self, rows, *a))
    e, a, b, a_req, b_req = _long_prompt_arrives(p, with_cache(prefill_chunk=8), b_len=6,
                                                 packed_prefill=True)
    calls.clear()  # a's own prefill
    e.step()
    assert calls == [1] and packed == [] and e.rounds.live[b].seqs[0].generated
    done = e.run()
    alone = engine(p, max_slots=1, prefix_cache=False)
    assert_same([done[a], done[b]], alone.generate([a_req]) + alone.generate([b_req]))


@pytest.mark.parametrize("packed", [False, True], ids=["calls", "packed"])
def test_preempting_or_cancelling_a_prompt_being_prefilled_loses_nothing(p, monkeypatch,
                                                                         packed):
    """The decoding request outgrows a tight cache while the long prompt is half
    prefilled (in prefill calls, or in packed steps): the younger one is preempted (its
    pages back, the full ones it wrote into the trie), recomputed later with its alone
    bits and the stats of its first attempt; a cancelled half-prefilled prompt returns
    every page, and the pages it wrote serve its next run, bitwise."""
    dropped = []
    drop = Rounds._drop_prefill
    monkeypatch.setattr(Rounds, "_drop_prefill",
                        lambda self, req: dropped.append(req.id) or drop(self, req))
    tight = with_cache(prefill_chunk=8, num_pages=24)
    e, a, b, a_req, b_req = _long_prompt_arrives(p, tight, a_new=40, b_len=80, b_new=8,
                                                 packed_prefill=packed)
    done = e.run()
    assert dropped == [b] and done[b].stats["preemptions"] == 1
    # its stats describe its first attempt (a cold cache: its own dropped chunks are not
    # reuse) and count the dropped attempt's seconds (before: 40 / 52 tokens "reused" and
    # the requests' prefill_s 0.68x / 0.001x the engine's)
    stats = done[b].stats
    assert (stats["reused_tokens"], stats["computed_tokens"], stats["miss_cause"]) == \
        (0, 80, "cold")
    assert done[a].stats["prefill_s"] + stats["prefill_s"] == \
        pytest.approx(e.metrics()["prefill_s"], rel=1e-9)
    alone = engine(p, max_slots=1, prefix_cache=False)
    assert_same([done[a], done[b]], alone.generate([a_req]) + alone.generate([b_req]))
    assert e.allocator.num_free == tight.num_pages - e.trie.num_nodes
    e, a, b, _, b_req = _long_prompt_arrives(p, with_cache(prefill_chunk=8),
                                             packed_prefill=packed)
    e.step()
    assert e.rounds.prefilling[0].packed == packed
    written = e.rounds.prefilling[0].row.start
    assert e.rounds.live[b].prefilling and written >= 8
    e.cancel(b)
    assert e.run()[b].status == "cancelled"
    assert e.allocator.num_free == CACHE.num_pages - e.trie.num_nodes
    again = e.generate([b_req])  # the chunks written before the cancel are cached, exact
    assert again[0].stats["reused_tokens"] >= written // CACHE.page_size * CACHE.page_size
    assert_same(again, alone.generate([b_req]))


def test_generate_prefills_prompts_together_with_their_alone_bits(p):
    """`generate` under invariant numerics (the engine's forms, kernels stored so) prefills
    the prompts in shared calls: every prompt's tokens and logits are bitwise its own
    run's; the fast layout's values agree within float32 rounding (measured 5e-6)."""
    from kvjax import generate
    from kvjax.engine.engine import numerics_plans
    from kvjax.model.layout import store

    plan, problems = numerics_plans([CONFIG], EngineConfig(cache=CACHE), 0)
    assert problems == [] and plan.invariant
    stored = store(p, plan)
    prompts = random_tokens(5, [3, 17, 9, 30], CONFIG.vocab_size)
    cache = with_cache(num_pages=64)
    together = generate(stored, CONFIG, prompts, 6, cache=cache, return_logits=True,
                        plan=plan)
    for i, prompt in enumerate(prompts):
        alone = generate(stored, CONFIG, [prompt], 6, cache=cache, return_logits=True,
                         plan=plan)
        assert alone.tokens[0] == together.tokens[i]
        np.testing.assert_array_equal(alone.logits[0], together.logits[i])
    fast = generate(p, CONFIG, prompts, 6, cache=cache, return_logits=True)
    for a, b in zip(fast.logits, together.logits, strict=True):
        np.testing.assert_allclose(a[:1], b[:1], rtol=0, atol=5e-5)


def test_per_request_prefill_seconds_add_up_to_the_engines(p):
    """Prompts sharing a prefill call are each charged their share of it: the requests'
    `prefill_s` add up to the engine's (they were each charged the whole call). A prompt
    prefilled inside decode calls (packed) is charged its tokens' share of each call,
    which moves from the engine's decode_s to its prefill_s."""
    e = engine(p)
    results = e.generate(requests())
    total = e.metrics()["prefill_s"]
    assert total > 0
    assert sum(r.stats["prefill_s"] for r in results) == pytest.approx(total, rel=1e-9)
    e, a, b, *_ = _long_prompt_arrives(p, with_cache(prefill_chunk=8), packed_prefill=True)
    before = e.metrics()["prefill_s"]  # a's own prefill call
    done = e.run()
    packed = done[b].stats["prefill_s"]
    assert 0 < packed == pytest.approx(e.metrics()["prefill_s"] - before, rel=1e-9)
    assert done[a].stats["prefill_s"] + packed == pytest.approx(e.metrics()["prefill_s"])


def test_a_prompt_prefilled_while_nothing_decodes_takes_wider_calls(p, alone, monkeypatch):
    """Nothing decoding: a lone 30-token prompt takes one call of 2 x 16 tokens instead of
    two 16-token calls (max_slots 8, chunk 16: up to 8 x 16, but no wider than its tokens
    need), a lone 70-token prompt one 128-token call, two prompts of 3 and 9 tokens one
    16-token call each, and they keep their alone bits (computed in 16-token calls)."""
    from kvjax.decode import aot
    from kvjax.engine.runner import StepRunner

    widths = []  # of the calls run (not those a first round compiles ahead)
    prefill = StepRunner.target_prefill

    def spy(self, rows, width, **kw):
        if not aot.active():
            widths.append(width)
        return prefill(self, rows, width, **kw)

    monkeypatch.setattr(StepRunner, "target_prefill", spy)
    e = engine(p)
    assert_same(e.generate([requests()[6]]), [alone[6]])
    assert widths == [32]
    widths.clear()
    long = Request(tokens=random_tokens(5, [70], CONFIG.vocab_size)[0], max_new_tokens=2,
                   return_logits=True)
    got = e.generate([long])[0]
    assert widths == [128]
    ref = engine(p, prefix_cache=False, max_slots=1).generate([long])[0]
    np.testing.assert_array_equal(got.logits, ref.logits)
    widths.clear()
    assert_same(e.generate(requests()[:2]), alone[:2])
    assert widths == [16]


def test_the_numerics_policy_allows_each_freedom_only_when_invariant():
    """Every freedom the engine takes from invariant numerics (shared and widened prefill
    calls, decode-written pages in the trie, live-row decode calls, packed steps, resumed
    preemptions) is granted by the one policy, and only with invariant numerics on one
    device where the start-up probe passed."""
    freedoms = [name for name in vars(NumericsPolicy)
                if not name.startswith("_") and callable(getattr(NumericsPolicy, name))
                and name != "for_engine"]
    assert len(freedoms) == 6
    for numerics, on_mesh, probe_ok in itertools.product(("fast", "invariant"), (False, True),
                                                         (False, True)):
        policy = NumericsPolicy.for_engine(numerics, on_mesh, probe_ok)
        want = numerics == "invariant" and not on_mesh and probe_ok
        assert policy.invariant == want
        assert [getattr(policy, name)() for name in freedoms] == [want] * 6
