"""`generate()`: validate, allocate pages, prefill in fixed chunks, decode on device, free.

Under an invariant numerics plan (`plan=kvjax.model.plan.NumericsPlan("invariant")`) the
prompts are prefilled together. The parameters must be stored as the plan says
(`kvjax.model.layout.store(params, plan)`: kernels stored transposed, q/k/v and gate/up
fused); the engine's start-up choice of plan is `kvjax.engine.plans.numerics_plans`.

The pages come from a `KVPool` (`kvjax.cache.pool.PagePool`, the engine's pool class).

Host code: builds numpy batch descriptions and calls the jitted steps in `steps.py`.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache.paged import bytes_per_page, cache_bytes
from kvjax.cache.pool import KVPool
from kvjax.config import CacheConfig, ModelConfig, SamplingConfig
from kvjax.decode import aot, compile_cache, steps
from kvjax.decode.aot import Warmup
from kvjax.decode.batching import bucket, page_table, pages_for
from kvjax.decode.prefill import PrefillRow, prefill, prefill_rows
from kvjax.decode.prompts import validate_prompts
from kvjax.decode.sampling import sample_jit, sampling_rows, sequence_keys
from kvjax.decode.state import decode_state
from kvjax.errors import InvalidRequestError
from kvjax.model.plan import FAST, NumericsPlan


@dataclasses.dataclass
class GenerateResult:
    tokens: list[list[int]]  # per prompt, the generated ids only
    logits: list[np.ndarray] | None  # per prompt, float32[num_generated, vocab]
    stats: dict


def context_pages(config: ModelConfig, pool: KVPool) -> int:
    """The page-table width of every call of `generate` over `pool`: the most pages a
    sequence can hold (the model's context, at most the pool's), so that a prompt's length
    changes no program."""
    cc = pool.cache_config
    return pages_for(min(config.max_seq_len, cc.num_pages * cc.page_size), cc.page_size)


def prefill_prompts(params, config: ModelConfig, pool: KVPool, prompts: list[list[int]],
                    rows: list[list[int]], plan: NumericsPlan = FAST) -> jax.Array:
    """Prefills the prompts into their pages; returns their last tokens' logits [n, V].

    Under an invariant plan all prompts share each chunk call (a token's bits do not
    depend on the rows around it); under fast numerics one prompt per call, in the cache's
    one chunk shape, so that a prompt's bits do not depend on the others."""
    width = context_pages(config, pool)
    if plan.invariant:
        rows = [PrefillRow(p, r) for p, r in zip(prompts, rows, strict=True)]
        return jnp.stack(pool.run(lambda cache: prefill_rows(
            params, config, cache, pool.cache_config, rows, plan=plan, min_pages=width)))
    return jnp.stack([pool.run(lambda cache, prompt=prompt, pages=pages: prefill(
        params, config, cache, pool.cache_config, prompt, pages, plan=plan, min_pages=width))
        for prompt, pages in zip(prompts, rows, strict=True)])


def generate(params, config: ModelConfig, prompts, max_new_tokens: int,
             sampling: SamplingConfig | None = None,
             cache: CacheConfig | KVPool | None = None, return_logits: bool = False,
             stop_token: int | None = None, plan: NumericsPlan = FAST) -> GenerateResult:
    """Generates up to `max_new_tokens` tokens for each token-id prompt.

    `cache` is a CacheConfig (a pool is built for this call), a KVPool (reused; its pages
    are returned when the call ends), or None (a pool sized to fit). `plan`: how the
    arithmetic runs (`params` stored as it says). Bad input raises InvalidRequestError (or
    NonCausalCacheError) before any page is allocated.
    """
    prompts = validate_prompts(config, prompts, max_new_tokens)
    plan.check(config)
    compile_cache.enable()
    sampling = sampling or SamplingConfig()
    if cache is None:  # a power of two of pages: a few pool shapes, each its programs
        page_size = CacheConfig().page_size
        need = sum(pages_for(len(p) + max_new_tokens, page_size) for p in prompts)
        cache = CacheConfig(page_size=page_size, num_pages=bucket(need))
    if (cache.cache_config if isinstance(cache, KVPool) else cache).dtype == "int4_kivi":
        raise NotImplementedError("generate() does not name int4_kivi pages' open pages: "
                                  "serve them with the Engine")
    pool = cache if isinstance(cache, KVPool) else KVPool(config, cache)
    if pool.model_config != config:
        raise InvalidRequestError("the KVPool was built for another model config")
    cache_cfg = pool.cache_config
    needs = [pages_for(len(p) + max_new_tokens, cache_cfg.page_size) for p in prompts]
    if sum(needs) > pool.num_free:
        raise InvalidRequestError(
            f"the prompts need {sum(needs)} pages of {cache_cfg.page_size} tokens for prompt + "
            f"max_new_tokens, but only {pool.num_free} of {cache_cfg.num_pages} "
            f"pages are free")
    if stop_token is not None and not 0 <= stop_token < config.vocab_size:
        raise InvalidRequestError(f"stop_token {stop_token} is outside the vocabulary")

    rows = [pool.allocate(n) for n in needs]
    try:
        return _run(params, config, plan, pool, prompts, rows, max_new_tokens, sampling,
                    return_logits, stop_token)
    finally:
        for row in rows:
            pool.release(row)


def warmup(params, config: ModelConfig, cache: CacheConfig | KVPool, max_new_tokens: int,
           prompts: int = 1, sampling: SamplingConfig | None = None,
           return_logits: bool = False, plan: NumericsPlan = FAST) -> Warmup:
    """Compiles (or loads from the compilation cache) the programs of `generate` calls of
    `prompts` prompts over `cache` (the same CacheConfig, or KVPool) with these
    `max_new_tokens`, `sampling` (greedy or not decides), `return_logits` and `plan`, so
    that such calls compile nothing whatever the prompts' lengths. Runs nothing; returns
    what it compiled (`print` it)."""
    compile_cache.enable()
    pool = cache if isinstance(cache, KVPool) else KVPool(config, cache)
    start = time.perf_counter()
    with aot.compiling() as programs:  # the host code of a call, its steps compiled
        _run(params, config, plan, pool, [[0]] * prompts, [[] for _ in range(prompts)],
             max_new_tokens, sampling or SamplingConfig(), return_logits, None)
    return Warmup(tuple(programs), time.perf_counter() - start)


def _run(params, config, plan, pool, prompts, rows, max_new_tokens, sampling, return_logits,
         stop_token) -> GenerateResult:
    n = len(prompts)
    slots = bucket(n)
    keys = np.zeros((slots, 2), np.uint32)
    keys[:n] = np.asarray(sequence_keys(sampling.seed, n))
    samplings = [sampling] * slots  # padded rows too (their budget is 0)
    lengths = np.zeros(slots, np.int32)
    lengths[:n] = [len(p) for p in prompts]

    t0 = time.perf_counter()
    first_logits = prefill_prompts(params, config, pool, prompts, rows, plan)
    first_logits = jnp.pad(first_logits, ((0, slots - n), (0, 0)))
    first = sample_jit(first_logits, keys, lengths, *sampling_rows(samplings, slots))
    first = np.asarray(first)
    t1 = time.perf_counter()

    budget = np.zeros(slots, np.int32)
    budget[:n] = max_new_tokens - 1
    if stop_token is not None:
        budget[:n] = np.where(first[:n] == stop_token, 0, budget[:n])
    out = np.full((slots, 0), -1, np.int32)
    logits = np.zeros((slots, 0, config.vocab_size), np.float32) if return_logits else None
    if budget.any():
        table = page_table(rows, slots, pool.cache_config.block_pages,
                           context_pages(config, pool))
        state = decode_state(table, lengths, first, budget, keys, samplings,
                             np.full(slots, -1 if stop_token is None else stop_token))
        res = steps.decode(pool, params, config, state, bucket(max_new_tokens - 1, 16),
                           return_logits=return_logits, plan=plan)
        out, logits = res.tokens, res.logits
        out = np.asarray(out)
    t2 = time.perf_counter()

    tokens, all_logits = [], [] if return_logits else None
    first_logits = np.asarray(first_logits)
    logits = None if logits is None else np.asarray(logits)
    for i in range(n):
        produced = int(np.sum(out[i] >= 0))
        tokens.append([int(first[i]), *(int(t) for t in out[i, :produced])])
        if return_logits:
            all_logits.append(np.concatenate([first_logits[i:i + 1], logits[i, :produced]]))
    generated = sum(len(t) for t in tokens)
    used_pages = sum(len(r) for r in rows)
    one_page = bytes_per_page(pool.cache)
    stats = {
        "prefill_s": t1 - t0,
        "decode_s": t2 - t1,
        "prompt_tokens": int(sum(len(p) for p in prompts)),
        "generated_tokens": generated,
        "decode_tokens_per_s": (generated - n) / max(t2 - t1, 1e-9),
        "pages_used": used_pages,
        "pages_total": pool.cache_config.num_pages,
        "kv_bytes_used": used_pages * one_page,
        "kv_bytes_total": cache_bytes(pool.cache),
    }
    return GenerateResult(tokens=tokens, logits=all_logits, stats=stats)
