"""Speculative generation with a host drafter, exact verification and paged rollback.

Each round, per sequence: the drafter proposes up to γ tokens; the target scores the fed
token plus the drafts in one `extend` over the fixed prefill chunk shape; the acceptance
rule keeps the longest acceptable prefix and adds one target token; the cache length is
truncated to the kept history and pages past the new end go back to the allocator.

Verification uses the prefill chunk shape [1, prefill_chunk] per sequence, so every K/V
the target keeps is computed exactly as a fresh prefill of the accepted history computes
it: the rolled-back cache is bitwise what a fresh prefill writes (tested). A batched
[B, γ + 1] verify would be cheaper per round but differs in the last bits.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from kvjax.cache.paged import BatchInfo
from kvjax.config import CacheConfig, ModelConfig, SamplingConfig
from kvjax.runtime import steps
from kvjax.runtime.batching import page_table, pages_for
from kvjax.runtime.drafters import Drafter
from kvjax.runtime.generate import KVPool, _prefill, validate_prompts
from kvjax.runtime.requests import InvalidRequestError
from kvjax.runtime.sampling import adjusted_logits, sample, sequence_keys
from kvjax.runtime.speculative import greedy_accept, sampling_accept


@dataclasses.dataclass
class SpecStats:
    target_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    accepted_by_position: list[int] = dataclasses.field(default_factory=list)
    drafted_by_position: list[int] = dataclasses.field(default_factory=list)
    verify_s: float = 0.0
    draft_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target call (accepted drafts + the target's own token)."""
        return self.emitted / self.target_calls if self.target_calls else 0.0

    @property
    def wasted(self) -> int:
        """Drafted tokens the target scored and rejected."""
        return self.drafted - self.accepted

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "acceptance_rate": self.acceptance_rate,
                "mean_accepted_length": self.mean_accepted_length, "wasted": self.wasted}


@dataclasses.dataclass
class SpecResult:
    tokens: list[list[int]]
    stats: SpecStats
    pool: KVPool
    rows: list[list[int]]  # each sequence's pages at the end (before they are freed)
    lengths: list[int]  # each sequence's cached tokens at the end


_sample = jax.jit(sample)
_probs = jax.jit(lambda logits, t, k, p: jax.nn.softmax(adjusted_logits(logits, t, k, p), -1))
_greedy = jax.jit(greedy_accept)
_exact = jax.jit(sampling_accept)


def speculative_generate(params, config: ModelConfig, prompts, max_new_tokens: int,
                         drafter: Drafter, gamma: int,
                         sampling: SamplingConfig | None = None,
                         cache: CacheConfig | None = None,
                         keep_pages: bool = False) -> SpecResult:
    """Generates like `kvjax.generate`, drafting γ tokens per target call.

    Greedy (temperature 0) output is token for token the target's greedy output; sampled
    output follows the target's distribution exactly. `keep_pages` leaves the pages
    allocated in the returned pool (to inspect the cache); otherwise they are freed.
    """
    sampling = sampling or SamplingConfig()
    prompts = validate_prompts(config, prompts, max_new_tokens)
    cache = cache or CacheConfig(page_size=16, num_pages=sum(
        pages_for(len(p) + max_new_tokens + gamma + 1, 16) for p in prompts))
    if not 1 <= gamma < cache.prefill_chunk:
        raise InvalidRequestError(f"gamma={gamma} must be in [1, prefill_chunk="
                                  f"{cache.prefill_chunk})")
    pool = KVPool(config, cache)
    ps = cache.page_size
    rows = [pool.allocator.allocate(pages_for(len(p), ps)) for p in prompts]
    stats = SpecStats(accepted_by_position=[0] * gamma, drafted_by_position=[0] * gamma)
    n = len(prompts)
    keys = np.asarray(sequence_keys(sampling.seed, n))
    t, k, p_ = (np.full(1, sampling.temperature, np.float32), np.full(1, sampling.top_k, np.int32),
                np.full(1, sampling.top_p, np.float32))
    histories, lengths, outs = [list(x) for x in prompts], [len(x) for x in prompts], []
    for i, (prompt, row) in enumerate(zip(prompts, rows, strict=True)):
        logits = _prefill(params, config, pool, prompt, row)[None]
        first = int(_sample(logits, keys[i:i + 1], np.array([len(prompt)], np.int32), t, k, p_)[0])
        outs.append([first])
    while True:
        active = [i for i in range(n) if len(outs[i]) < max_new_tokens]
        if not active:
            break
        t0 = time.perf_counter()
        proposals = drafter.propose([histories[i] + outs[i] for i in active], gamma,
                                    seq_ids=active)
        stats.draft_s += time.perf_counter() - t0
        for i, (draft, q) in zip(active, proposals, strict=True):
            draft = list(draft)[: min(gamma, max_new_tokens - len(outs[i]) - 1)]
            emitted = _verify_one(params, config, pool, rows[i], lengths[i], outs[i][-1], draft,
                                  q, keys[i], sampling, stats, gamma)
            lengths[i] += len(emitted)  # the fed token and the accepted drafts are now cached
            outs[i] += emitted[: max_new_tokens - len(outs[i])]
            _truncate(pool, rows[i], lengths[i], ps)
    for i in range(n):
        if hasattr(drafter, "release"):
            drafter.release(i)
    result = SpecResult(tokens=outs, stats=stats, pool=pool, rows=rows, lengths=lengths)
    if not keep_pages:
        for row in rows:
            pool.allocator.free(row)
    return result


def _truncate(pool: KVPool, row: list[int], length: int, page_size: int) -> None:
    """Rollback: pages wholly past the kept history return to the allocator."""
    keep = pages_for(length, page_size)
    if len(row) > keep:
        pool.allocator.free(row[keep:])
        del row[keep:]


def _verify_one(params, config, pool: KVPool, row: list[int], length: int, last: int,
                draft: list[int], q, key, sampling: SamplingConfig, stats: SpecStats,
                gamma: int) -> list[int]:
    """One target call over [last] + draft; returns the emitted tokens (>= 1)."""
    cc = pool.cache_config
    g = len(draft)
    need = pages_for(length + 1 + g, cc.page_size) - len(row)
    if need > 0:
        row += pool.allocator.allocate(need)
    tokens = np.zeros((1, cc.prefill_chunk), np.int32)
    tokens[0, : 1 + g] = [last, *draft]
    batch = BatchInfo(page_table=page_table([row], 1, cc.block_pages),
                      lengths=np.array([length], np.int32), num_new=np.array([1 + g], np.int32))
    t0 = time.perf_counter()
    logits, pool.cache = steps.extend(params, config, pool.cache, tokens, batch)
    logits = logits[:, : gamma + 1]  # [1, γ + 1, V] (positions past 1 + g unused)
    padded = np.zeros((1, gamma), np.int32)
    padded[0, :g] = draft
    num = np.array([g], np.int32)
    if sampling.temperature == 0:
        accepted, nxt = _greedy(padded, logits, num)
    else:
        knobs = (np.full(gamma + 1, sampling.temperature, np.float32),
                 np.full(gamma + 1, sampling.top_k, np.int32),
                 np.full(gamma + 1, sampling.top_p, np.float32))
        p = _probs(logits[0], *knobs)[None]  # [1, γ + 1, V]
        q_full = np.zeros((1, gamma, config.vocab_size), np.float32)
        if q is None:  # deterministic proposal: one-hot
            q_full[0, np.arange(g), draft] = 1.0
        else:
            q_full[0, :g] = np.asarray(q)[:g]
        accepted, nxt = _exact(padded, q_full, p, num, key[None],
                               np.array([length + 1], np.int32))
    a, nxt = int(accepted[0]), int(nxt[0])
    stats.verify_s += time.perf_counter() - t0
    stats.target_calls += 1
    stats.drafted += g
    stats.accepted += a
    stats.emitted += a + 1
    for j in range(g):
        stats.drafted_by_position[j] += 1
        stats.accepted_by_position[j] += j < a
    return [*draft[:a], nxt]
