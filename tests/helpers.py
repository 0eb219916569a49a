"""Shared test helpers: small configs, sharp test weights, one tolerance helper, and a
teacher-forced cached run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache.allocator import PageAllocator
from kvjax.cache.paged import BatchInfo, init_cache
from kvjax.config import CacheConfig, ModelConfig
from kvjax.decode import steps
from kvjax.decode.batching import page_table, pages_for
from kvjax.model.attention import paged_attention_reference
from kvjax.model.plan import FAST
from kvjax.model.transformer import init_params

# the reference attention jitted, as the model's steps run it (one compile per shape, not one
# per operation): (q, cache, layer, batch, window, row_tile, ...), layer, window and
# row_tile static
attention_reference = jax.jit(paged_attention_reference, static_argnums=(2, 4, 5))


def tol(measured: float) -> float:
    """The max abs logit error allowed at a test site against the float32 full-sequence
    reference (or one device's logits): 10x the worst error measured at that site, on
    `sharp_params` models, so each site says what it measured (`tol(9.3e-6)`) and a
    regression of one order of magnitude fails. A wrong mask, position or page moves these
    logits by whole units (they spread over about LOGIT_STD)."""
    return 10 * measured


LOGIT_STD = 3.0  # a position's logits spread over a few units (random init: 0.11)
QK_SCALE = 2.0  # attention scores x4: far from uniform attention (random init: nearly uniform)


def sharp_params(config: ModelConfig, seed: int = 0) -> dict:
    """`init_params` with sharp attention and spread logits, for tests that compare outputs.

    Random init gives flat logits (small_model: std 0.11, mean top-2 gap 0.04) and nearly
    uniform attention (mean top weight 0.22), unlike a trained model. Here the query and key
    projections are scaled by QK_SCALE (mean top weight 0.64) and the final norm so that the
    logits' std is about LOGIT_STD (small_model: std 2.9, mean top-2 gap 1.3). The head's
    scale is taken from the weights (a tied embedding and an untied head start ~9x apart).
    Rounding errors grow with the logits: `tol` is measured on these models.
    """
    params = init_params(config, seed=seed)
    head = params["embed"]["embedding"] if config.tie_embeddings else params["lm_head"]["kernel"]
    # A logit is a head row dotted with the unit-RMS final hidden state: std ~ std(row) sqrt(D).
    head_scale = LOGIT_STD / (float(jnp.std(head)) * config.d_model**0.5)

    def scale(path, x):
        names = [p.key for p in path]
        if names[-2] in ("q", "k"):  # kernel and bias
            return x * QK_SCALE
        if names[-2] == "final_norm" and names[-1] == "scale":
            return x * head_scale
        return x

    return jax.tree_util.tree_map_with_path(scale, params)


def small_model(**kw) -> ModelConfig:
    base = dict(vocab_size=61, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64,
                max_seq_len=128)
    base.update(kw)
    return ModelConfig(**base)


def random_tokens(seed: int, lengths, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, vocab, size=n)] for n in lengths]


def prefill(params, config, cache_cfg, cache, tokens, pages, start=0, plan=FAST):
    """Prefills tokens[start:] of one sequence in fixed chunks; returns (logits [n, V], cache)
    (`params` stored as `plan` says)."""
    chunk = cache_cfg.prefill_chunk
    table = page_table([pages], 1, cache_cfg.block_pages)
    out = []
    for s in range(start, len(tokens), chunk):
        piece = tokens[s:s + chunk]
        padded = np.zeros((1, chunk), np.int32)
        padded[0, : len(piece)] = piece
        batch = BatchInfo(page_table=table, lengths=np.array([s], np.int32),
                          num_new=np.array([len(piece)], np.int32))
        logits, cache = steps.extend(params, config, cache, padded, batch, plan=plan)
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
    width = max(map(len, rows))  # one page-table width for every prefill: one compile
    for seq, n, row in zip(sequences, prompt_lens, rows, strict=True):
        padded = row + row[-1:] * (width - len(row))  # never read: past the sequence's end
        lg, cache = prefill(params, config, cache_cfg, cache, seq[:n], padded)
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


def fresh_prefill(params, config: ModelConfig, cache_cfg: CacheConfig, history: list[int],
                  plan=FAST):
    """A fresh cache holding `history` in pages 0, 1, ... (a prefill of it alone, under
    `plan`). The page table is always as wide as the longest sequence the model takes
    (pages past the history are never read), so every history compiles one prefill per
    model."""
    width = min(cache_cfg.num_pages, -(-config.max_seq_len // cache_cfg.page_size))
    _, cache = prefill(params, config, cache_cfg, init_cache(config, cache_cfg), history,
                       list(range(width)), plan=plan)
    return cache


def gather_sequence(cache, row: list[int], length: int) -> tuple[np.ndarray, np.ndarray]:
    """A sequence's K and V in logical order: [layers, kv_heads, length, head_dim]."""
    k = np.asarray(cache.k.astype(jnp.float32))[:, :, row].reshape(
        cache.k.shape[0], cache.k.shape[1], -1, cache.k.shape[-1])
    v = np.asarray(cache.v.astype(jnp.float32))[:, :, row].reshape(k.shape)
    return k[:, :, :length], v[:, :, :length]
