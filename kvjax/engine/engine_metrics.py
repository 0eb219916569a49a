"""The engine's aggregates as one typed, read-only object (host code, plain Python).

`Engine.metrics()` returns an `EngineMetrics`: named fields, and a read-only mapping of the
keys it has always had (`m["token_reuse_rate"]`, `dict(m)`, `m.as_dict()` for JSON).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping

_SPEC_ONLY = ("draft_prefill_s", "draft_reused_tokens", "spec")


@dataclasses.dataclass(frozen=True, eq=False)  # eq: as a mapping (Mapping.__eq__)
class EngineMetrics(Mapping):
    """Aggregates over every finished or cancelled request, and the pool's state now."""

    requests: int  # admitted requests finished or cancelled
    request_hit_rate: float  # of them, those that reused any token
    token_reuse_rate: float  # reused / prompt tokens
    page_reuse_rate: float  # reused / full prompt pages
    prompt_tokens: int
    reused_tokens: int
    computed_tokens: int
    recomputed_tokens: int  # computed again after preemptions
    resumed_tokens: int  # answer tokens resumes took back
    misses_by_cause: dict  # the operator's view: every tenant's pages (kvjax.engine.stats)
    namespace_misses_by_field: dict
    errors: int
    evictions: int
    cow_copies: int
    partial_copies: int
    preemptions: int
    resident_pages: int  # pages the prefix cache holds now
    resident_bytes: int
    free_pages: int
    unbounded_request_hit_rate: float  # what an unbounded cache would have reached
    unbounded_token_reuse_rate: float
    mean_ttft_s: float
    prefill_s: float
    decode_s: float
    host_s: float
    draft_prefill_s: float | None = None  # with speculative decoding only
    draft_reused_tokens: int | None = None
    spec: dict | None = None  # the speculative totals (kvjax.speculative.plugin)
    # with host/disk tiers: reused tokens by tier, and each tier's state and counters
    # (kvjax.cache.tiers.Tiers.stats)
    tiers: dict | None = None

    def _keys(self) -> list[str]:
        names = [f.name for f in dataclasses.fields(self)]
        if self.tiers is None:
            names.remove("tiers")
        return names if self.spec is not None else [n for n in names if n not in _SPEC_ONLY]

    def __getitem__(self, key: str):
        if key not in self._keys():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    def as_dict(self) -> dict:
        """Plain data, ready for JSON (the keys of the mapping)."""
        return dict(self)


def tier_metrics(log: list[dict], tiers: dict | None) -> dict | None:
    """Reused tokens by the tier they came from (device: cached there all along) beside
    the tiers' own figures; None without tiers."""
    if tiers is None:
        return None
    restored = {"host": 0, "disk": 0}
    for s in log:
        for tier, n in (s.get("restored_tokens") or {}).items():
            restored[tier] += n
    reused = sum(s["reused_tokens"] for s in log)
    return {"reused_tokens": {"device": reused - sum(restored.values()), **restored}, **tiers}
