"""Recorded conversations replayed on an engine as a chat client would (`replay`).

Each conversation's user turns are sent in order, each as one request rendered with the
model's chat template from the conversation so far. Two ways to fill the history:

- "chat": the model's own answers (up to `max_new_tokens` tokens, ending at the model's
  end of turn) go into the history, as a chat client would send them back;
- "trace": the recorded answers are teacher-forced into the history: the prompts have the
  recorded conversation's lengths and no long generation is needed.

A conversation's first turn arrives at its arrival time (all at once, or `poisson_arrivals`
at a rate); each next turn is sent as soon as the previous answer is finished (a closed
loop per conversation). Idle time before the next arrival is skipped, not waited. A turn
the engine refuses (a prompt past the model's length, say) or fails ends its conversation.
A replay may restart half way: once a number of turns have finished it sends no more until
the running ones finish, then goes on with a new engine (a new process's, on the same disk
tier, say): the conversations continue where they were.

For every turn the replay records what the engine reused beside the ideal: the tokens of the
longest run of full pages, at the start of the prompt, that some earlier request of the
replay wrote (its prompt, or its prompt and answer once finished), short of the prompt's
last token (which is always computed): what an unbounded cache with exact reuse could have
served. Host code: the engine does the device work.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable, Sequence

import numpy as np

from kvjax.engine.requests import InvalidRequestError, Request

MODES = ("chat", "trace")


@dataclasses.dataclass
class ReplayTurn:
    """One request of a replay and what came of it."""

    conversation: int
    turn: int  # 1-based
    prompt_ids: list[int]
    ideal_reused: int  # prompt tokens an unbounded exact cache could have reused
    arrival_s: float  # when it was sent, on the replay's clock (idle gaps skipped)
    finished_s: float = 0.0
    tokens: list[int] = dataclasses.field(default_factory=list)
    logits_digest: str = ""  # sha256 of the answer's float32 logits (with return_logits)
    stats: dict = dataclasses.field(default_factory=dict)
    status: str = "running"
    error: str | None = None
    after_restart: bool = False  # sent to the engine a restart brought in

    def row(self) -> dict:
        s = self.stats
        return {"conversation": self.conversation, "turn": self.turn,
                "prompt_tokens": len(self.prompt_ids), "ideal_reused": self.ideal_reused,
                "reused_tokens": s.get("reused_tokens", 0), "miss_cause": s.get("miss_cause"),
                "ttft_s": s.get("ttft_s", 0.0), "e2e_s": self.finished_s - self.arrival_s,
                "new_tokens": len(self.tokens), "status": self.status}


def poisson_arrivals(n: int, rate: float | None, seed: int = 0) -> list[float]:
    """`n` arrival times in seconds: a Poisson process of `rate` per second (exponential
    gaps, the first after one gap), or all at 0 when `rate` is None."""
    if rate is None:
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    return np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, n)).tolist()


class WrittenPages:
    """The full pages earlier requests wrote, as chained digests of their token prefixes:
    `reusable(tokens)` is the longest run of them `tokens` starts with, in tokens."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self._seen: set[bytes] = set()

    def _digests(self, tokens: Sequence[int]):
        h, ps = b"", self.page_size
        for end in range(ps, len(tokens) + 1, ps):
            h = hashlib.blake2b(h + np.asarray(tokens[end - ps:end], np.int64).tobytes(),
                                digest_size=16).digest()
            yield h

    def add(self, tokens: Sequence[int]) -> None:
        self._seen.update(self._digests(tokens))

    def reusable(self, tokens: Sequence[int]) -> int:
        n = 0
        for h in self._digests(tokens):
            if h not in self._seen:
                break
            n += self.page_size
        return n


def replay(engine, conversations, render: Callable[[list[dict]], list[int]], *,
           mode: str = "chat", max_new_tokens: int = 32, arrivals: Sequence[float] | None = None,
           decode: Callable[[list[int]], str] | None = None, return_logits: bool = False,
           max_turns: int | None = None,
           on_step: Callable[[], None] | None = None,
           restart: tuple[int, Callable[[], object]] | None = None) -> list[ReplayTurn]:
    """Replays `conversations` (`kvjax.data.Conversation`s) on `engine`; returns every turn
    in the order sent. `render`: chat messages -> prompt ids (the model's chat template);
    `decode`: ids -> text, for the answers a "chat" replay puts in the history;
    `return_logits`: keep a digest of each answer's logits (to compare two replays
    bitwise without holding [tokens, vocab] arrays); `max_turns`: user turns per
    conversation at most; `on_step`: called after each engine step (to sample the pool);
    `restart` (n, new_engine): after n turns have finished and the running ones with them,
    the replay goes on with `new_engine()` (the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    if mode == "chat" and decode is None:
        raise ValueError("a chat replay puts the model's answers in the history: pass decode")
    arrivals = [0.0] * len(conversations) if arrivals is None else list(arrivals)
    if len(arrivals) != len(conversations):
        raise ValueError(f"{len(arrivals)} arrival times for {len(conversations)} conversations")
    ps = engine.cache_config.page_size
    written = WrittenPages(ps)
    stops = set(engine.eos_tokens)
    users = [c.user_turns[:max_turns] for c in conversations]
    answers = [c.answers for c in conversations]
    history: list[list[dict]] = [[] for _ in conversations]
    # when each conversation's next turn is sent (None: in flight or done)
    ready: list[float | None] = [at if u else None for at, u in zip(arrivals, users, strict=True)]
    live: dict[int, ReplayTurn] = {}
    turns: list[ReplayTurn] = []
    finished = 0  # turns finished
    restarted = False  # a restart brought in the engine now in use
    start = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - start

    def send(i: int, now: float) -> None:
        k = sum(m["role"] == "user" for m in history[i])
        history[i].append({"role": "user", "content": users[i][k]})
        ids = render(history[i])
        ideal = min(written.reusable(ids), (len(ids) - 1) // ps * ps)  # one token computed
        turn = ReplayTurn(i, k + 1, ids, ideal, now, after_restart=restarted)
        turns.append(turn)
        ready[i] = None
        try:
            rid = engine.submit(Request(ids, max_new_tokens, return_logits=return_logits))
        except InvalidRequestError as e:  # too long for the model, say: ends its conversation
            turn.status, turn.error, turn.finished_s = "error", str(e), now
            return
        written.add(ids)
        live[rid] = turn

    def finish(request_id: int, now: float) -> None:
        nonlocal finished
        turn, result = live.pop(request_id), engine.result(request_id)
        finished += 1
        turn.finished_s, turn.tokens, turn.stats = now, list(result.tokens), result.stats
        turn.status, turn.error = result.status, result.error
        if return_logits and result.logits is not None:
            turn.logits_digest = hashlib.sha256(
                np.ascontiguousarray(result.logits, np.float32).tobytes()).hexdigest()
        written.add(turn.prompt_ids + turn.tokens[:-1])  # the last token is never cached
        i, k = turn.conversation, turn.turn
        if result.status != "finished" or k >= len(users[i]):
            return  # a failed turn ends its conversation
        if mode == "chat":
            ids = turn.tokens[:-1] if turn.tokens and turn.tokens[-1] in stops else turn.tokens
            answer = decode(ids)
        else:
            answer = answers[i][k - 1] if k - 1 < len(answers[i]) else ""
        history[i].append({"role": "assistant", "content": answer})
        ready[i] = now

    while live or any(r is not None for r in ready):
        now = clock()
        # the running turns finish before a restart
        hold = restart is not None and not restarted and finished >= restart[0]
        if hold and not live:
            engine, restarted, hold = restart[1](), True, False
        if not hold:
            for i, at in enumerate(ready):
                if at is not None and at <= now:
                    send(i, now)
        if not live:  # idle until the next arrival: skip the gap
            start -= min(r for r in ready if r is not None) - now
            continue
        for event in engine.step():
            if event.finished and event.request_id in live:
                finish(event.request_id, clock())
        if on_step is not None:
            on_step()
    return turns
