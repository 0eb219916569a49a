"""Greedy, temperature, top-k and top-p sampling with explicit per-sequence keys.

The token that will sit at position p of sequence b is drawn with
`fold_in(sequence_key[b], p)`, so the same seed gives the same tokens however the work is
split into calls or batched.

Legend: B batch, V vocab.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.config import SamplingConfig
from kvjax.decode.aot import Program
from kvjax.model.tiled import row_softmax

DRAFT_TAG = 0xD4AF  # a draft model's sampling keys: fold_in(sequence key, DRAFT_TAG)
TOP_K_SELECT = 256  # top-k up to this many without top-p: a partial selection, no sort


def sequence_keys(seed: int, num_sequences: int) -> jax.Array:
    """uint32[B, 2]: one raw PRNG key per sequence, `fold_in(PRNGKey(seed), index)`."""
    base = jax.random.PRNGKey(seed)
    return jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.arange(num_sequences))


def sampling_rows(samplings: Sequence[SamplingConfig | None], rows: int | None = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(temperature float32[B], top_k int32[B], top_p float32[B]): one row per entry of
    `samplings` (None: greedy), padded with greedy rows to `rows` (a step may mix
    settings). The one builder of sampling arrays."""
    rows = len(samplings) if rows is None else rows
    greedy = SamplingConfig(temperature=0.0)
    picked = [s or greedy for s in samplings] + [greedy] * (rows - len(samplings))
    return (np.array([s.temperature for s in picked], np.float32),
            np.array([s.top_k for s in picked], np.int32),
            np.array([s.top_p for s in picked], np.float32))


def sampling_arrays(sampling: SamplingConfig, batch: int) -> dict[str, np.ndarray]:
    """`sampling_rows` of one setting for `batch` rows, by name."""
    return dict(zip(("temperature", "top_k", "top_p"),
                    sampling_rows([sampling] * batch), strict=True))


def adjusted_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                    top_p: jax.Array) -> jax.Array:
    """Logits after temperature, top-k and top-p: filtered-out tokens are -inf.

    Args:
      logits: float32[B, V]; temperature, top_p: float32[B]; top_k: int32[B] (0 is off).
    Ties at a cut-off are all kept. top_p >= 1 keeps every token (top-k aside). Below 1,
    a token is kept while the mass ranked before it is < top_p, decided as "the mass from
    it to the end of the ranking exceeds (1 - top_p) of the total": that tail is a sum of
    the smallest terms first, exact to float32 rounding of its own size, whereas a running
    sum from the top reaches 1.0 before the tail does and cuts tokens that belong in.
    """
    vocab = logits.shape[-1]
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]

    def filtered():
        ranked = -jnp.sort(-scaled, axis=-1)  # [B, V] descending
        k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
        kth = jnp.take_along_axis(ranked, (k - 1)[:, None], axis=-1)  # [B, 1]
        ranked = jnp.where(ranked >= kth, ranked, -jnp.inf)
        weights = jnp.exp(ranked - ranked[:, :1])  # [B, V] unnormalised, 0 past top-k
        tail = jnp.flip(jnp.cumsum(jnp.flip(weights, -1), axis=-1), -1)  # mass from i on
        inside = tail > ((1.0 - top_p) * tail[:, 0])[:, None]
        keep = jnp.where(top_p >= 1.0, vocab, jnp.maximum(jnp.sum(inside, axis=-1), 1))
        cutoff = jnp.maximum(jnp.take_along_axis(ranked, (keep - 1)[:, None], axis=-1), kth)
        return jnp.where(scaled >= cutoff, scaled, -jnp.inf)

    def top_k_only():  # the k-th largest from a partial selection: the sort's own values
        best = jax.lax.top_k(scaled, min(vocab, TOP_K_SELECT))[0]  # [B, C] descending
        kth = jnp.take_along_axis(best, (jnp.clip(top_k, 1, best.shape[1]) - 1)[:, None], -1)
        return jnp.where((top_k <= 0)[:, None] | (scaled >= kth), scaled, -jnp.inf)

    # The sort is most of a sampled step's cost on a large vocabulary: without top-k and
    # top-p in any row every token stays (the cut-off is the smallest logit), and without
    # top-p the cut-off is the k-th largest logit, which a partial selection finds (the
    # same value, so the same bits either way).
    no_p = jnp.all(top_p >= 1.0)
    branch = jnp.where(no_p & jnp.all(top_k <= 0), 0,
                       jnp.where(no_p & jnp.all(top_k <= TOP_K_SELECT), 1, 2))
    return jax.lax.switch(branch, [lambda: scaled, top_k_only, filtered])


def probabilities(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                  top_p: jax.Array) -> jax.Array:
    """The distributions sampling draws from: softmax of `adjusted_logits`.

    Args:
      logits: float32[B, ..., V]; temperature, top_p: float32[B]; top_k: int32[B] (one
      setting per row b, shared by its inner positions).
    """
    shape = logits.shape
    inner = int(np.prod(shape[1:-1], dtype=np.int64))
    rep = lambda x: jnp.repeat(x, inner)  # noqa: E731
    adjusted = adjusted_logits(logits.reshape(-1, shape[-1]), rep(temperature), rep(top_k),
                               rep(top_p))
    return row_softmax(adjusted).reshape(shape)


# For host loops (a drafter's distributions, a tree's acceptance): one compiled program per
# shape, where calling `probabilities` outside a jit compiles and dispatches each operation.
jitted_probabilities = jax.jit(probabilities)


def greedy(logits: jax.Array) -> jax.Array:
    """int32[...]: the argmax of logits float32[..., V] (a temperature 0 row's token)."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def any_sampled(temperature) -> bool:
    """Whether any row of a host array float32[B] of temperatures samples. The device loops
    take it as a static flag: without sampled rows they take `greedy` and compile no
    sampler (threefry and the top-k/top-p sort are most of a small model's loop program),
    with the same tokens. (A device array is read back to the host first.)"""
    return bool(np.any(np.asarray(temperature) > 0))


def sample(logits: jax.Array, keys: jax.Array, positions: jax.Array, temperature: jax.Array,
           top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Samples int32[B] tokens; temperature 0 rows are greedy (argmax).

    Args:
      logits: float32[B, V]; keys: uint32[B, 2] sequence keys; positions: int32[B], the
      position each sampled token will occupy.
    """
    argmax = greedy(logits)

    def stochastic() -> jax.Array:
        step_keys = jax.vmap(jax.random.fold_in)(keys, positions)
        filtered = adjusted_logits(logits, temperature, top_k, top_p)
        drawn = jax.vmap(jax.random.categorical)(step_keys, filtered).astype(jnp.int32)
        return jnp.where(temperature > 0, drawn, argmax)

    return jax.lax.cond(jnp.all(temperature == 0), lambda: argmax, stochastic)


_sample = Program(sample, "sample")
_greedy = Program(greedy, "greedy")


def sample_jit(logits, keys, positions, temperature, top_k, top_p) -> jax.Array:
    """The one jitted sampler the host calls (first tokens): `sample`, or `greedy` when no
    row of the host array `temperature` samples (`any_sampled`)."""
    if not any_sampled(temperature):
        return _greedy(logits)
    return _sample(logits, keys, positions, temperature, top_k, top_p)
