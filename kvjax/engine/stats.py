"""The engine's statistics: timers, what each request is told, and the aggregates.

A request's stats depend only on what its own namespace can see (`kvjax.cache.trie`);
the operator's view (misses that another tenant's private pages explain) is kept apart and
only ever aggregated (`metrics`). Host code: plain Python.
"""

from __future__ import annotations

import collections
import contextlib
import time

from kvjax.cache.trie import Match
from kvjax.engine.requests import Dropped, LiveRequest


class Timers(collections.Counter):
    """Seconds spent per phase (prefill_s, decode_s, host_s, draft_prefill_s)."""

    @contextlib.contextmanager
    def __call__(self, key: str):
        """Adds the time spent inside the `with` block to `key`."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self[key] += time.perf_counter() - t0


def record_dropped(req: LiveRequest, match: Match, reuse: int, start: int, copied: int,
                   unbounded_blocks: int, end: int, prefill_s: float) -> None:
    """Remembers a prefill that ended before its last chunk (a preemption) having computed
    tokens [start, end), for the admission that completes (`record_admission`): its seconds,
    the tokens it computed again, and, when no admission has completed yet, the first
    attempt's reuse figures (what the cache held when the request came)."""
    d = req.dropped
    d.prefill_s += prefill_s
    before = len(req.context.tokens) if req.stats.admitted else d.end
    d.recomputed += max(0, min(end, before) - start)
    d.end = max(end, d.end)
    if d.first is None:
        d.first = (match, reuse, start, copied, unbounded_blocks)


def record_admission(req: LiveRequest, match: Match, reuse: int, start: int, copied: int,
                     prefill_s: float, unbounded_blocks: int, page_size: int) -> None:
    """Sets a request's admission stats (what its namespace can see) and its operator miss.

    A request re-admitted after a preemption keeps its first admission's reuse figures and
    adds the tokens it computed again (`recomputed_tokens`), and the answer tokens a resume
    took back instead of decoding them again (`resumed_tokens`, summed over resumes; reused
    from the cache or prefilled). Prefills dropped before their last chunk count too
    (`record_dropped`): their seconds, the tokens they computed again, and the first one's
    reuse figures when it was the request's first admission.
    """
    n_tok = len(req.context.tokens)
    dropped, req.dropped = req.dropped, Dropped()
    prefill_s += dropped.prefill_s
    s = req.stats
    if s.admitted:
        s.recomputed_tokens += n_tok - start + dropped.recomputed
        s.resumed_tokens += n_tok - len(req.tokens)
        s.prefill_s += prefill_s
        return
    recomputed = dropped.recomputed + max(0, min(n_tok, dropped.end) - start)
    if dropped.first is not None:
        match, reuse, start, copied, unbounded_blocks = dropped.first
    cause, operator_cause = match.cause, match.operator_cause
    if reuse < len(match.nodes):
        cause = operator_cause = None  # all cached; the last page is recomputed for logits
    unbounded = min(unbounded_blocks, (n_tok - 1) // page_size) * page_size
    # `preemptions` (while its prompt was prefilled), `draft_reused_tokens` and `spec` stay
    s.admitted = True
    s.prompt_tokens, s.reused_tokens, s.computed_tokens = len(req.tokens), start, n_tok - start
    s.reused_pages, s.copied_tokens = reuse, copied
    s.miss_cause = cause
    s.miss_position = match.position if cause in ("divergence", "partial_page") else None
    s.miss_fields = list(match.fields) if cause == "namespace" else []
    s.prefill_s = prefill_s
    s.unbounded_reused_tokens = max(unbounded, start)
    s.recomputed_tokens, s.resumed_tokens = recomputed, 0
    s.ttft_s = time.perf_counter() - req.submitted
    req.operator_miss = (operator_cause,
                         tuple(match.operator_fields) if operator_cause == "namespace" else ())


def ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def aggregate(log: list[dict], operator_log: list[tuple[str | None, tuple[str, ...]]],
              page_size: int) -> dict:
    """The aggregates over finished or cancelled requests' stats (`log`, admitted ones)
    and their operator misses (cause, namespace fields)."""
    prompt = sum(s["prompt_tokens"] for s in log)
    reused = sum(s["reused_tokens"] for s in log)
    full_pages = sum((s["prompt_tokens"] - 1) // page_size for s in log)
    causes = collections.Counter(cause for cause, _ in operator_log if cause)
    fields = collections.Counter(f for cause, fs in operator_log
                                 if cause == "namespace" for f in fs)
    unbounded = sum(s["unbounded_reused_tokens"] for s in log)
    return {
        "requests": len(log),
        "request_hit_rate": ratio(sum(s["reused_tokens"] > 0 for s in log), len(log)),
        "token_reuse_rate": ratio(reused, prompt),
        "page_reuse_rate": ratio(sum(s["reused_pages"] for s in log), full_pages),
        "prompt_tokens": prompt,
        "reused_tokens": reused,
        "computed_tokens": prompt - reused,
        "recomputed_tokens": sum(s["recomputed_tokens"] for s in log),
        "resumed_tokens": sum(s["resumed_tokens"] for s in log),
        "misses_by_cause": dict(causes),  # the operator's view (see the module docstring)
        "namespace_misses_by_field": dict(fields),
        "unbounded_request_hit_rate": ratio(
            sum(s["unbounded_reused_tokens"] > 0 for s in log), len(log)),
        "unbounded_token_reuse_rate": ratio(unbounded, prompt),
        "mean_ttft_s": ratio(sum(s["ttft_s"] for s in log), len(log)),
    }
