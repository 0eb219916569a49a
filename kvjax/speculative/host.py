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
from kvjax.cache.pool import KVPool
from kvjax.config import CacheConfig, ModelConfig, SamplingConfig
from kvjax.decode import steps
from kvjax.decode.batching import bucket, page_table, pages_for
from kvjax.decode.generate import prefill_prompts
from kvjax.decode.prompts import validate_prompts
from kvjax.decode.sampling import probabilities, sample_jit, sampling_rows, sequence_keys
from kvjax.errors import InvalidRequestError
from kvjax.speculative.drafters import Drafter
from kvjax.speculative.gamma import GammaPolicy
from kvjax.speculative.rules import greedy_accept, sampling_accept
from kvjax.speculative.stats import SpecStats


@dataclasses.dataclass
class SpecResult:
    tokens: list[list[int]]
    stats: SpecStats
    pool: KVPool
    rows: list[list[int]]  # each sequence's pages at the end (before they are freed)
    lengths: list[int]  # each sequence's cached tokens at the end


_probs = jax.jit(probabilities)
_greedy = jax.jit(greedy_accept)
_exact = jax.jit(sampling_accept)


def speculative_generate(params, config: ModelConfig, prompts, max_new_tokens: int,
                         drafter: Drafter, gamma: int,
                         sampling: SamplingConfig | None = None,
                         cache: CacheConfig | None = None,
                         keep_pages: bool = False, batched_verify: bool = False,
                         adaptive: bool = False) -> SpecResult:
    """Generates like `kvjax.generate`, drafting γ tokens per target call.

    Greedy (temperature 0) output is token for token the target's greedy output; sampled
    output follows the target's distribution exactly. `keep_pages` leaves the pages
    allocated in the returned pool (to inspect the cache); otherwise they are freed.
    `batched_verify` scores every sequence in one [slots, γ + 1] call: faster, but the kept
    K/V then match a fresh prefill within float tolerance, not bitwise. `adaptive` picks
    each round's γ (up to `gamma`) with the engine's policy (`kvjax.speculative.gamma`):
    from the running acceptance by position and the measured cost ratio.
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
    rows = [pool.allocate(pages_for(len(p), ps)) for p in prompts]
    stats = SpecStats.empty(gamma)
    policy = GammaPolicy(gamma)
    n = len(prompts)
    slots = bucket(n)
    keys = np.asarray(sequence_keys(sampling.seed, n))
    histories, lengths, outs = [list(x) for x in prompts], [len(x) for x in prompts], []
    for i, (prompt, row) in enumerate(zip(prompts, rows, strict=True)):
        logits = prefill_prompts(params, config, pool, [prompt], [row])
        first = int(sample_jit(logits, keys[i:i + 1], np.array([len(prompt)], np.int32),
                               *sampling_rows([sampling]))[0])
        outs.append([first])
    while True:
        active = [i for i in range(n) if len(outs[i]) < max_new_tokens]
        if not active:
            break
        round_gamma = policy.choose(stats.cost_ratio) if adaptive else gamma
        stats.gamma_history.append(round_gamma)
        seen = SpecStats.empty(gamma)
        t0 = time.perf_counter()
        proposals = drafter.propose([histories[i] + outs[i] for i in active], round_gamma,
                                    seq_ids=active)
        stats.draft_s += time.perf_counter() - t0
        seqs = [(rows[i], lengths[i], outs[i][-1],
                 list(draft)[: min(round_gamma, max_new_tokens - len(outs[i]) - 1)], q,
                 keys[i])
                for i, (draft, q) in zip(active, proposals, strict=True)]
        if batched_verify:  # one [slots, γ + 1] call for every active sequence
            emitted = _verify(params, config, pool, seqs, sampling, seen, gamma, slots,
                              gamma + 1)
        else:  # exact: each sequence in the prefill chunk shape
            emitted = [_verify(params, config, pool, [seq], sampling, seen, gamma, 1,
                               cache.prefill_chunk)[0] for seq in seqs]
        policy.observe(round_gamma, seen.alpha_sum, seen.alpha_count, seen.drafted_by_position,
                       seen.accepted_by_position)
        stats.merge(seen)
        for i, tokens in zip(active, emitted, strict=True):
            lengths[i] += len(tokens)  # the fed token and the accepted drafts are now cached
            outs[i] += tokens[: max_new_tokens - len(outs[i])]
            pool.truncate(rows[i], lengths[i])
    for i in range(n):
        if hasattr(drafter, "release"):
            drafter.release(i)
    result = SpecResult(tokens=outs, stats=stats, pool=pool, rows=rows, lengths=lengths)
    if not keep_pages:
        for row in rows:
            pool.release(row)
    return result


def _verify(params, config, pool: KVPool, seqs: list[tuple], sampling: SamplingConfig,
            stats: SpecStats, gamma: int, rows_out: int, width: int) -> list[list[int]]:
    """One target call over [last] + draft for each of `seqs`; returns the emitted tokens.

    `seqs` holds (row, length, last, draft, q, key) per sequence; the call has the shape
    [rows_out, width] (padded rows verify nothing).
    """
    cc = pool.cache_config
    tokens = np.zeros((rows_out, width), np.int32)
    lengths = np.zeros(rows_out, np.int32)
    num_new = np.zeros(rows_out, np.int32)
    drafts = np.zeros((rows_out, gamma), np.int32)
    num_draft = np.zeros(rows_out, np.int32)
    keys = np.zeros((rows_out, 2), np.uint32)
    q_full = np.zeros((rows_out, gamma, config.vocab_size), np.float32)
    page_rows = []
    for j, (row, length, last, draft, q, key) in enumerate(seqs):
        g = len(draft)
        need = pages_for(length + 1 + g, cc.page_size) - len(row)
        if need > 0:
            row += pool.allocate(need)
        page_rows.append(row)
        tokens[j, : 1 + g] = [last, *draft]
        lengths[j], num_new[j], num_draft[j], keys[j] = length, 1 + g, g, key
        drafts[j, :g] = draft
        if q is None:  # a deterministic proposal is one-hot
            q_full[j, np.arange(g), draft] = 1.0
        else:
            q_full[j, :g] = np.asarray(q)[:g]
    page_rows += [[]] * (rows_out - len(seqs))
    batch = BatchInfo(page_table=page_table(page_rows, rows_out, cc.block_pages),
                      lengths=lengths, num_new=num_new)
    t0 = time.perf_counter()
    logits = pool.run(lambda cache: steps.extend(params, config, cache, tokens, batch))
    logits = logits[:, : gamma + 1]  # [rows, γ + 1, V]
    if sampling.temperature == 0:
        accepted, nxt = _greedy(drafts, logits, num_draft)
        alpha_terms = (np.asarray(jax.numpy.argmax(logits[:, :gamma], -1)) == drafts)
    else:
        p = _probs(logits, *sampling_rows([sampling] * rows_out))
        accepted, nxt = _exact(drafts, q_full, p, num_draft, keys, lengths + 1)
        alpha_terms = np.asarray(np.minimum(np.asarray(p)[:, :gamma], q_full).sum(-1))
    accepted, nxt = np.asarray(accepted), np.asarray(nxt)
    stats.verify_s += time.perf_counter() - t0
    stats.target_calls += 1
    out = []
    for j, (_, _, _, draft, _, _) in enumerate(seqs):
        a = int(accepted[j])
        stats.record(len(draft), a, alpha_terms[j])
        out.append([*draft[:a], int(nxt[j])])
    return out
