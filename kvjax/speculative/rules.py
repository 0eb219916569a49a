"""Speculative decoding: acceptance rules and the speedup model.

A drafter proposes γ tokens per sequence; the target scores all γ + 1 positions in one call;
the longest acceptable prefix is kept, then one token of the target's own.

- Greedy: keep drafted tokens while they equal the target's argmax, then the argmax.
- Sampling, exact (Leviathan et al. 2023; Chen et al. 2023): accept drafted x with
  probability min(1, p(x) / q(x)); at the first rejection draw from norm(max(0, p − q));
  when all γ are accepted draw the bonus token from p at position γ. The emitted tokens are
  then distributed exactly as the target's own samples. A deterministic proposal (the
  n-gram drafter) is q = one-hot(x): accept with probability p(x), else draw from p with x
  removed.

Legend: B batch, G γ (drafted tokens), V vocab. Device code (pure JAX).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ACCEPT_TAG = 0x5EC  # separates the acceptance draws from the token draws of a position


def predicted_speedup(alpha: float, gamma: int, c: float, verify_slope: float = 0.0) -> float:
    """Expected tokens per unit of target-step time: (1 − α^(γ+1)) / ((1 − α)(γc + 1)).

    α is the expected acceptance rate E[min(p, q)], c the draft/target step cost ratio.
    `verify_slope` s extends the textbook model (which prices a verify of γ + 1 tokens as
    one target step) with a verify that costs 1 + s·γ steps, as measured on hardware where
    a step is not purely bandwidth-bound (`kvjax.speculative.cost`).
    """
    tokens = gamma + 1 if alpha >= 1.0 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return tokens / (gamma * c + 1 + verify_slope * gamma)


def _leading(accept: jax.Array) -> jax.Array:
    """int32[B]: how many leading entries of bool[B, G] are True."""
    return jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)


def greedy_accept(draft: jax.Array, target: jax.Array,
                  num_draft: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(accepted int32[B], next token int32[B]).

    Args:
      draft: int32[B, G]; target: the target's logits float32[B, G + 1, V] (position i
      scores the token after draft[:, :i]) or their argmax int32[B, G + 1];
      num_draft: int32[B] real drafted tokens per row (<= G).
    """
    best = (target if target.ndim == 2
            else jnp.argmax(target, axis=-1).astype(jnp.int32))  # [B, G + 1]
    g = draft.shape[1]
    real = jnp.arange(g)[None, :] < num_draft[:, None]
    accepted = _leading((draft == best[:, :g]) & real)
    return accepted, jnp.take_along_axis(best, accepted[:, None], axis=1)[:, 0]


def sampling_accept(draft: jax.Array, q: jax.Array, p: jax.Array, num_draft: jax.Array,
                    keys: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Exact speculative sampling: (accepted int32[B], next token int32[B]).

    Args:
      draft: int32[B, G] drafted tokens; q: float32[B, G, V] the draft's distributions they
      were drawn from (one-hot rows for a deterministic drafter); p: float32[B, G + 1, V] the
      target's distributions (after the same temperature / top-k / top-p as q);
      num_draft: int32[B]; keys: uint32[B, 2] sequence keys; positions: int32[B] position
      of the first drafted token. The draw for position t uses fold_in(key, t), so the
      same seed gives the same tokens.
    """
    b, g = draft.shape
    t = positions[:, None] + jnp.arange(g + 1)[None, :]  # [B, G + 1]
    step_keys = jax.vmap(lambda k, ts: jax.vmap(lambda x: jax.random.fold_in(k, x))(ts))(
        keys, t)  # [B, G + 1, 2]
    accept_keys = jax.vmap(jax.vmap(lambda k: jax.random.fold_in(k, ACCEPT_TAG)))(step_keys)
    u = jax.vmap(jax.vmap(lambda k: jax.random.uniform(k)))(accept_keys[:, :g])  # [B, G]
    p_x = jnp.take_along_axis(p[:, :g], draft[..., None], axis=-1)[..., 0]
    q_x = jnp.take_along_axis(q, draft[..., None], axis=-1)[..., 0]
    ok = u * q_x < p_x  # u < min(1, p/q), without dividing by a tiny q
    accepted = _leading(ok & (jnp.arange(g)[None, :] < num_draft[:, None]))
    rows = jnp.arange(b)
    p_at = p[rows, accepted]  # [B, V]
    q_pad = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)  # no q after the last
    residual = jnp.maximum(p_at - q_pad[rows, accepted], 0.0)
    # All accepted (or nothing drafted at that position): the bonus comes from p itself.
    use_p = (accepted >= num_draft)[:, None] | (residual.sum(-1, keepdims=True) <= 0)
    dist = jnp.where(use_p, p_at, residual)
    logits = jnp.where(dist > 0, jnp.log(jnp.where(dist > 0, dist, 1.0)), -jnp.inf)
    token = jax.vmap(jax.random.categorical)(step_keys[rows, accepted], logits)
    return accepted, token.astype(jnp.int32)


def reject(r: jax.Array, tokens: jax.Array) -> jax.Array:
    """r float32[B, V] after each row's deterministic draft `tokens` int32[B] was rejected:
    norm(max(0, r - one_hot(x))) unnormalised, i.e. r with x's mass taken out."""
    return r.at[jnp.arange(r.shape[0]), tokens].set(0.0)


def tree_uniforms(keys: jax.Array, positions: jax.Array, depth: jax.Array) -> jax.Array:
    """float32[B, N]: the uniform that tests node i of row b's tree, from the row's key
    folded with the node's position (`positions[b]`: depth 1's; a node at depth d sits
    d - 1 later), `ACCEPT_TAG`, then i: siblings share a position, not a draw; no position is
    tested in two rounds (a round's tests reach no further than the token it emits)."""
    n = depth.shape[1]

    def row(key, first, d):
        def node(i, d_i):
            k = jax.random.fold_in(jax.random.fold_in(key, first + d_i - 1), ACCEPT_TAG)
            return jax.random.uniform(jax.random.fold_in(k, i))
        return jax.vmap(node)(jnp.arange(n), d)

    return jax.vmap(row)(keys, positions, depth)


def tree_sampling_accept(parents: jax.Array, tokens: jax.Array, nodes: jax.Array,
                         p: jax.Array, u: jax.Array, keys: jax.Array, positions: jax.Array,
                         depth: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Exact speculative sampling over each row's tree of deterministic drafts (SpecInfer's
    rule; the host's `kvjax.speculative.tree.sampled_path` with q None): (path int32[B, D + 1]
    (node 0 first; 0 past its end), its node count int32[B], the token after it int32[B]).

    At the path's last node its children are tested in index order: child x is accepted
    with probability r(x) / sum(r), r starting as the target's distribution there; a
    rejection takes x's mass out of r (`reject`); an accepted child continues the path, and
    when every child is rejected (or there is none) the next token is drawn from r. The
    emitted tokens are then distributed as the target's own samples (a sibling repeating
    a rejected token has r(x) = 0 and is never accepted). One pass over the nodes does it:
    a node's children come after it.

    Args:
      parents, tokens: int32[B, N] (node 0 the root); nodes: int32[B] real nodes per row;
      p: float32[B, N, V] the target's sampling distribution after each node; u: float32
      [B, N] `tree_uniforms`; keys: uint32[B, 2]; positions: int32[B] depth 1's position
      (the token after a path of k nodes is drawn with fold_in(key, positions + k - 1), as
      plain sampling draws the token at that position).
    """
    parents, tokens, p, u = (jnp.asarray(x) for x in (parents, tokens, p, u))
    b, n = parents.shape
    rows = jnp.arange(b)

    def test(i, carry):
        at, r, path, count = carry
        x = tokens[:, i]
        child = (parents[:, i] == at) & (i < nodes)
        ok = child & (u[:, i] * jnp.sum(r, axis=-1) < r[rows, x])
        r = jnp.where(ok[:, None], p[:, i], jnp.where((child & ~ok)[:, None], reject(r, x), r))
        path = path.at[rows, jnp.where(ok, count, depth + 1)].set(i, mode="drop")
        return jnp.where(ok, i, at), r, path, count + ok

    _, r, path, count = jax.lax.fori_loop(1, n, test, (
        jnp.zeros((b,), jnp.int32), p[:, 0], jnp.zeros((b, depth + 1), jnp.int32),
        jnp.ones((b,), jnp.int32)))
    step = jax.vmap(jax.random.fold_in)(keys, positions + count - 1)
    logits = jnp.where(r > 0, jnp.log(jnp.where(r > 0, r, 1.0)), -jnp.inf)
    return path, count, jax.vmap(jax.random.categorical)(step, logits).astype(jnp.int32)
