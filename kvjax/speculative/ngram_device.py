"""Prompt-lookup (n-gram) drafting on device: the same rule as `NGramDrafter`, in pure JAX.

For each sequence, find the most recent earlier occurrence of its history's last n tokens
(n from `max_ngram` down to 1) and propose up to γ tokens that followed it.

Legend: B batch, H history buffer width, G γ.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ngram_matches(history: jax.Array, hist_len: jax.Array, n: int) -> jax.Array:
    """bool[B, H]: where an earlier occurrence of each row's last n tokens starts, with at
    least one token after it before the row's last (history int32[B, H], hist_len [B])."""
    h = history.shape[1]
    idx = jnp.arange(h, dtype=jnp.int32)
    tail_at = jnp.clip(hist_len[:, None] - n + jnp.arange(n)[None, :], 0, h - 1)
    tail = jnp.take_along_axis(history, tail_at, axis=1)  # [B, n]
    match = (idx[None, :] + n < hist_len[:, None]) & (hist_len[:, None] > n)
    for i in range(n):
        shifted = jnp.pad(history[:, i:], ((0, 0), (0, i)), constant_values=-1)
        match &= shifted == tail[:, i:i + 1]
    return match


def ngram_propose(history: jax.Array, hist_len: jax.Array, gamma: int,
                  max_ngram: int) -> tuple[jax.Array, jax.Array]:
    """(drafts int32[B, G], num_draft int32[B]) from int32[B, H] histories.

    Row b's history is history[b, :hist_len[b]]; a row with no match drafts nothing.
    """
    b, h = history.shape
    idx = jnp.arange(h, dtype=jnp.int32)
    follow = jnp.full((b,), -1, jnp.int32)  # where the proposed continuation starts
    for n in range(max_ngram, 0, -1):
        match = ngram_matches(history, hist_len, n)
        start = jnp.max(jnp.where(match, idx[None, :], -1), axis=1)  # most recent, or -1
        follow = jnp.where((follow < 0) & (start >= 0), start + n, follow)
    found = follow >= 0
    num_draft = jnp.where(found, jnp.minimum(gamma, hist_len - follow), 0).astype(jnp.int32)
    at = jnp.clip(follow[:, None] + jnp.arange(gamma)[None, :], 0, h - 1)
    drafts = jnp.take_along_axis(history, at, axis=1)
    drafts = jnp.where(jnp.arange(gamma)[None, :] < num_draft[:, None], drafts, 0)
    return drafts.astype(jnp.int32), num_draft
