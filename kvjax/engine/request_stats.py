"""What a request is told about its own run, as typed fields (host code, plain Python).

A result carries them as a plain dict (`RequestStats.as_dict`), easy to dump as JSON, with
the keys results have always had.
"""

from __future__ import annotations

import dataclasses

from kvjax.speculative.stats import SpecStats

# The admission's figures, in the order a result lists them.
ADMISSION_KEYS = ("prompt_tokens", "reused_tokens", "computed_tokens", "reused_pages",
                  "copied_tokens", "miss_cause", "miss_position", "miss_fields", "prefill_s",
                  "unbounded_reused_tokens", "preemptions", "recomputed_tokens",
                  "resumed_tokens", "ttft_s")


@dataclasses.dataclass
class RequestStats:
    """A request's statistics. The admission's figures are set once, when its prompt is
    first fully prefilled (`admitted`; `kvjax.engine.stats.record_admission`); a later
    admission (after a preemption) adds what it computed again or took back."""

    admitted: bool = False
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens whose K/V came from the cache
    computed_tokens: int = 0
    reused_pages: int = 0
    copied_tokens: int = 0  # reused by copying part of a page
    miss_cause: str | None = None  # why the next block was not reused (kvjax.cache.trie)
    miss_position: int | None = None  # divergence / partial_page: the first differing token
    miss_fields: list[str] = dataclasses.field(default_factory=list)  # namespace misses
    prefill_s: float = 0.0
    unbounded_reused_tokens: int = 0  # what an unbounded cache would have reused
    preemptions: int = 0
    recomputed_tokens: int = 0  # computed again after a preemption
    resumed_tokens: int = 0  # answer tokens a resume took back instead of decoding them
    ttft_s: float = 0.0
    draft_reused_tokens: int | None = None  # with a draft model: the draft pool's reuse
    # with host/disk tiers: of the reused tokens, those restored from each tier
    restored_tokens: dict[str, int] | None = None
    spec: SpecStats | None = None  # with speculative decoding: this request's rounds

    def as_dict(self) -> dict:
        """The result's stats as plain data: the admission's figures once admitted (before,
        only `preemptions`, if any), then `draft_reused_tokens`, `restored_tokens` and `spec`
        where present."""
        if self.admitted:
            out = {key: getattr(self, key) for key in ADMISSION_KEYS}
            out["miss_fields"] = list(self.miss_fields)
        else:
            out = {"preemptions": self.preemptions} if self.preemptions else {}
        if self.draft_reused_tokens is not None:
            out["draft_reused_tokens"] = self.draft_reused_tokens
        if self.restored_tokens is not None:
            out["restored_tokens"] = dict(self.restored_tokens)
        if self.spec is not None:
            out["spec"] = self.spec.as_dict(timings=False)
        return out
