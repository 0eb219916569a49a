"""Replaying recorded conversations on an engine (`kvjax.lab.replay`): the model's own answers
(or the recorded ones) go into the history, every turn reuses every full page the earlier
turns wrote, the outputs are the cache-off engine's, arrivals and failed turns. On the
engine tests' shared small model, with a toy chat template over its 61-token vocabulary."""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import CACHE, CONFIG, engine, params, with_cache

from kvjax.data import Conversation
from kvjax.decode.batching import pages_for
from kvjax.lab.replay import WrittenPages, poisson_arrivals, replay

V = CONFIG.vocab_size
BOS, USER, ASSISTANT, END = 1, 2, 3, 4  # the toy template's special ids


def encode(text: str) -> list[int]:
    """Characters from `decode` back to their ids; others onto the ordinary ids."""
    return [ord(c) - 0x100 if ord(c) >= 0x100 else 5 + ord(c) % (V - 5) for c in text]


def decode(ids: list[int]) -> str:
    return "".join(chr(0x100 + t) for t in ids)


def render(messages: list[dict]) -> list[int]:
    ids = [BOS]
    for m in messages:
        ids += [USER if m["role"] == "user" else ASSISTANT, *encode(m["content"]), END]
    return ids + [ASSISTANT]  # the generation prompt


def conversation(i: int, first: str = "") -> Conversation:
    return Conversation(f"c{i}", (
        ("user", first or f"hello there {i}, how are you?"), ("assistant", f"recorded {i}"),
        ("user", "tell me more"), ("assistant", "more, recorded"), ("user", "and then?")))


CONVERSATIONS = [conversation(i) for i in range(3)]


@pytest.fixture(scope="module")
def p():
    return params()


@pytest.fixture(scope="module")
def chat(p):
    """A chat replay on an unbounded cache (every turn's answer in the history)."""
    return replay(engine(p), CONVERSATIONS, render, decode=decode, max_new_tokens=6,
                  return_logits=True)


def test_a_chat_replay_puts_the_models_answers_in_the_history(chat):
    assert [(t.conversation, t.turn) for t in chat if t.conversation == 1] == \
        [(1, 1), (1, 2), (1, 3)]
    assert len(chat) == 9 and all(t.status == "finished" for t in chat)
    for t in chat:
        if t.turn > 1:
            before = next(b for b in chat if (b.conversation, b.turn) ==
                          (t.conversation, t.turn - 1))
            start = before.prompt_ids + before.tokens  # its answer, as the model gave it
            assert t.prompt_ids[: len(start)] == start and t.prompt_ids[len(start)] == END


def test_every_turn_reuses_every_page_the_earlier_turns_wrote(chat):
    """Unbounded cache: reused == ideal for every turn; a later turn's ideal holds every full
    page of the previous turn's prompt and answer but its last token; the first turns share
    the template's and the question's common start. (Seen failing: with the answers' pages
    left out of the ideal, reused > ideal on every later turn.)"""
    ps = CACHE.page_size
    for t in chat:
        assert t.stats["reused_tokens"] == t.ideal_reused, t.row()
        if t.turn > 1:
            before = next(b for b in chat if (b.conversation, b.turn) ==
                          (t.conversation, t.turn - 1))
            written = len(before.prompt_ids) + len(before.tokens) - 1
            assert t.ideal_reused >= written // ps * ps
    first = [t for t in chat if t.turn == 1]
    assert first[0].ideal_reused == 0 and all(t.ideal_reused > 0 for t in first[1:])
    assert sum(t.ideal_reused for t in chat) > sum(len(t.prompt_ids) for t in chat) / 2


def test_a_replay_gives_the_cache_off_outputs_bitwise(p, chat):
    off = replay(engine(p, prefix_cache=False), CONVERSATIONS, render, decode=decode,
                 max_new_tokens=6, return_logits=True)
    key = lambda t: (t.conversation, t.turn)  # noqa: E731
    for a, b in zip(sorted(chat, key=key), sorted(off, key=key), strict=True):
        assert (a.prompt_ids, a.tokens, a.logits_digest) == (b.prompt_ids, b.tokens,
                                                              b.logits_digest)
        assert a.logits_digest and b.stats["reused_tokens"] == 0


def test_on_step_runs_after_every_engine_step(p):
    """`on_step` runs after each engine step, the pool mid-replay: with the cache off the
    pages in use then are the running turns' (the ShareGPT experiment's "peak" allowance
    samples them). The three first turns run together."""
    eng = engine(p, prefix_cache=False)
    steps, used = [], []
    step = eng.step
    eng.step = lambda: steps.append(1) or step()
    turns = replay(eng, CONVERSATIONS, render, decode=decode, max_new_tokens=6,
                   on_step=lambda: used.append(CACHE.num_pages - eng.kv.stats()["free_pages"]))
    assert len(used) == len(steps) >= 3
    first = [t for t in turns if t.turn == 1]
    assert max(used) >= sum(pages_for(len(t.prompt_ids), CACHE.page_size) for t in first)
    assert used[-1] == 0  # every turn finished: nothing held


def test_a_restart_goes_on_with_a_new_engine_from_the_disk_tier(p, chat, tmp_path):
    """`restart=(4, new_engine)`: once 4 turns have finished no turn is sent until the running
    ones finish (the three second turns run together: 6 finish on the first engine); the
    rest go to a new engine on the same disk folder (its device cache and host tier empty),
    which restores the conversations' pages from the files the first one wrote. Every turn
    is the unbroken replay's, bitwise."""
    disk = with_cache(CACHE, num_pages=24, disk_dir=str(tmp_path), disk_bytes=1 << 30)
    engines = [engine(p, disk)]

    def new_engine():
        engines.append(engine(p, disk))
        return engines[-1]

    turns = replay(engines[0], CONVERSATIONS, render, decode=decode, max_new_tokens=6,
                   return_logits=True, restart=(4, new_engine))
    assert len(engines) == 2
    before = [t for t in turns if not t.after_restart]
    assert len(before) == 6 and all(t.status == "finished" for t in turns)
    assert max(t.finished_s for t in before) <= min(t.arrival_s for t in turns
                                                     if t.after_restart)
    key = lambda t: (t.conversation, t.turn)  # noqa: E731
    for a, b in zip(sorted(turns, key=key), sorted(chat, key=key), strict=True):
        assert (a.prompt_ids, a.tokens, a.logits_digest) == (b.prompt_ids, b.tokens,
                                                              b.logits_digest)
    restored = [t.stats["restored_tokens"].get("disk", 0) for t in turns if t.after_restart]
    assert sum(restored) > 0 and engines[1].metrics()["tiers"]["disk"]["restored_pages"] > 0


def test_a_trace_replay_teacher_forces_the_recorded_answers(p):
    turns = replay(engine(p), CONVERSATIONS[:2], render, mode="trace", max_new_tokens=1)
    for t in turns:
        c = CONVERSATIONS[t.conversation]
        history = list(c.messages[: 2 * t.turn - 1])  # user turns and recorded answers
        assert t.prompt_ids == render(history) and len(t.tokens) == 1
        assert t.stats["reused_tokens"] == t.ideal_reused


def _exponential_fit(gaps: np.ndarray, rate: float) -> tuple[float, float]:
    """(the gaps' coefficient of variation, 1 for exponential gaps; the Kolmogorov-Smirnov
    distance of their distribution from the exponential of `rate`)."""
    s, n = np.sort(gaps), len(gaps)
    cdf, i = 1 - np.exp(-rate * s), np.arange(1, n + 1)
    return float(s.std() / s.mean()), float(max((i / n - cdf).max(), (cdf - (i - 1) / n).max()))


def test_arrivals_are_a_seeded_poisson_process_and_idle_gaps_are_skipped(p):
    a = poisson_arrivals(2000, rate=4.0, seed=3)
    assert a == poisson_arrivals(2000, rate=4.0, seed=3) and np.all(np.diff(a) > 0)
    assert abs(np.mean(np.diff(a)) - 0.25) < 0.02  # measured 0.247
    # exponential gaps, not just their mean: CV measured 1.012; KS distance 0.0165 under
    # the 1 % critical value 1.63 / sqrt(2000) = 0.036. Evenly spaced arrivals (the same
    # mean) fail both: CV 0, distance 0.63
    limit = 1.63 / np.sqrt(2000)
    cv, distance = _exponential_fit(np.diff([0.0, *a]), 4.0)
    assert abs(cv - 1) < 0.1 and distance < limit
    cv, distance = _exponential_fit(np.full(2000, 0.25), 4.0)
    assert abs(cv - 1) > 0.1 and distance > limit
    assert poisson_arrivals(3, None) == [0.0] * 3
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(3, 0.0)
    turns = replay(engine(p), CONVERSATIONS[:2], render, decode=decode, max_new_tokens=2,
                   arrivals=[0.0, 600.0])
    late = [t for t in turns if t.conversation == 1]
    assert late[0].arrival_s >= 600.0 and late[0].arrival_s < 600.0 + 60  # not waited
    assert all(t.turn == 3 or t.conversation == 1 for t in turns[-3:])


def test_a_refused_turn_ends_its_conversation_and_the_others_go_on(p):
    long = Conversation("long", (("user", "hi"), ("assistant", "x"), ("user", "y" * 300)))
    turns = replay(engine(p), [long, CONVERSATIONS[0]], render, decode=decode,
                   max_new_tokens=3)
    failed = [t for t in turns if t.status != "finished"]
    assert [(t.conversation, t.turn) for t in failed] == [(0, 2)]
    assert "max_seq_len" in failed[0].error or "longer" in failed[0].error
    assert [t.turn for t in turns if t.conversation == 1] == [1, 2, 3]


def test_bad_replay_arguments_are_refused(p):
    eng = engine(p, cache=with_cache())
    with pytest.raises(ValueError, match="mode"):
        replay(eng, CONVERSATIONS, render, mode="live", decode=decode)
    with pytest.raises(ValueError, match="pass decode"):
        replay(eng, CONVERSATIONS, render)
    with pytest.raises(ValueError, match="2 arrival times for 3"):
        replay(eng, CONVERSATIONS, render, decode=decode, arrivals=[0.0, 1.0])


def test_written_pages_count_the_longest_run_of_full_pages():
    pages = WrittenPages(4)
    pages.add(list(range(10)))  # two full pages and a partial one
    assert pages.reusable(list(range(10))) == 8
    assert pages.reusable([0, 1, 2, 3, 9, 9, 9, 9]) == 4
    assert pages.reusable([1, 1, 2, 3, 4, 5, 6, 7]) == 0
    assert pages.reusable(list(range(3))) == 0
