"""Shared test helpers: small configs, one tolerance helper, and a teacher-forced cached run."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kvjax.cache.allocator import PageAllocator
from kvjax.cache.paged import BatchInfo, init_cache
from kvjax.config import CacheConfig, ModelConfig
from kvjax.runtime import steps
from kvjax.runtime.batching import page_table, pages_for


def tol(dtype) -> float:
    """Max abs logit error allowed against the float32 full-sequence reference."""
    return {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2e-2}[jnp.dtype(dtype)]


def small_model(**kw) -> ModelConfig:
    base = dict(vocab_size=61, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64,
                max_seq_len=128)
    base.update(kw)
    return ModelConfig(**base)


def random_tokens(seed: int, lengths, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, vocab, size=n)] for n in lengths]


def prefill(params, config, cache_cfg, cache, tokens, pages, start=0):
    """Prefills tokens[start:] of one sequence in fixed chunks; returns (logits [n, V], cache)."""
    chunk = cache_cfg.prefill_chunk
    table = page_table([pages], 1, cache_cfg.block_pages)
    out = []
    for s in range(start, len(tokens), chunk):
        piece = tokens[s:s + chunk]
        padded = np.zeros((1, chunk), np.int32)
        padded[0, : len(piece)] = piece
        batch = BatchInfo(page_table=table, lengths=np.array([s], np.int32),
                          num_new=np.array([len(piece)], np.int32))
        logits, cache = steps.extend(params, config, cache, padded, batch)
        out.append(np.asarray(logits[0, : len(piece)]))
    return np.concatenate(out), cache


def cached_logits(params, config: ModelConfig, cache_cfg: CacheConfig, sequences, prompt_lens,
                  shuffle_seed: int | None = None):
    """Prefills each prompt, then decodes the rest of each sequence one token per step in a
    batch (teacher forcing). Returns (per-sequence logits [len, V], cache, page rows)."""
    cache = init_cache(config, cache_cfg)
    alloc = PageAllocator(cache_cfg.num_pages)
    rows = [alloc.allocate(pages_for(len(s), cache_cfg.page_size)) for s in sequences]
    if shuffle_seed is not None:
        perm = np.random.default_rng(shuffle_seed).permutation(cache_cfg.num_pages)
        rows = [[int(perm[p]) for p in r] for r in rows]
    logits = []
    for seq, n, row in zip(sequences, prompt_lens, rows, strict=True):
        lg, cache = prefill(params, config, cache_cfg, cache, seq[:n], row)
        logits.append([lg])
    table = page_table(rows, len(sequences), cache_cfg.block_pages)
    lengths = np.array(prompt_lens, np.int32)
    total = np.array([len(s) for s in sequences], np.int32)
    while np.any(lengths < total):
        active = lengths < total
        tokens = np.array([[s[l] if a else 0] for s, l, a in zip(sequences, lengths, active,
                                                                 strict=True)], np.int32)
        batch = BatchInfo(page_table=table, lengths=lengths,
                          num_new=active.astype(np.int32))
        lg, cache = steps.extend(params, config, cache, tokens, batch)
        lg = np.asarray(lg[:, 0])
        for i in np.flatnonzero(active):
            logits[i].append(lg[i:i + 1])
        lengths = lengths + active
    return [np.concatenate(x) for x in logits], cache, rows


def gather_sequence(cache, row: list[int], length: int) -> tuple[np.ndarray, np.ndarray]:
    """A sequence's K and V in logical order: [layers, kv_heads, length, head_dim]."""
    k = np.asarray(cache.k.astype(jnp.float32))[:, :, row].reshape(
        cache.k.shape[0], cache.k.shape[1], -1, cache.k.shape[-1])
    v = np.asarray(cache.v.astype(jnp.float32))[:, :, row].reshape(k.shape)
    return k[:, :, :length], v[:, :, :length]
