"""Speculative decoding on device: draft, verify, accept and roll back inside one while_loop.

One round, for every active sequence at once:
  1. draft γ tokens: the draft model decodes γ steps on its own paged cache (its first step
     also feeds the one token it may lag behind), or the n-gram lookup reads the history;
  2. verify: the target extends its cache by [last, d_1 .. d_γ] in one [B, γ + 1] call;
  3. accept (greedy or exact sampling, per row) the longest acceptable prefix plus one
     token of the target's own; emit up to the row's budget, cut at its stop token;
  4. roll back: each cache's length drops to the kept history. The rejected tokens' K/V
     stay in pages past the length, where nothing reads them and the next round overwrites
     them; the host frees the pages wholly past the end after the call.

Cache state per sequence (host and device agree): the target holds `lengths` tokens and
`last` (the newest token) is not yet cached. The draft holds `draft_lengths` tokens, which
is `lengths` or, after a round that accepted all γ drafts, `lengths - 1` with `prev` (the
token at index `lengths - 1`) still to feed.

K/V the target keeps come from the [B, γ + 1] verify shape, not from the prefill chunk
shape, so they are never inserted in the prefix trie (the same rule as decode-written K/V).

Legend: B batch slots, G γ, V vocab, S tokens out per call, H history buffer width.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from kvjax.cache.paged import BatchInfo, model_positions
from kvjax.config import ModelConfig
from kvjax.decode import steps
from kvjax.decode.sampling import DRAFT_TAG, probabilities, sample
from kvjax.model.transformer import Transformer
from kvjax.sharding.rules import maybe_constrain_cache, maybe_replicated
from kvjax.speculative.ngram_device import ngram_propose
from kvjax.speculative.rules import greedy_accept, sampling_accept
from kvjax.speculative.stats import ROW_KEYS


def _draft_model(params, config, cache, table, draft_lengths, lengths, last, prev, active,
                 keys, offset, temperature, top_k, top_p, gamma, sharding=None):
    """γ draft-model steps. Returns (drafts [B, G], q [B, G, V], cache, draft_lengths)."""
    model = Transformer(config, sharding)
    variables = partial(steps.model_variables, params, None, config)  # called in the loop
    lag = (draft_lengths < lengths) & active
    num_new = jnp.where(active, 1 + lag, 0).astype(jnp.int32)
    fed = jnp.where(lag[:, None], jnp.stack([prev, last], 1),
                    jnp.stack([last, jnp.zeros_like(last)], 1))  # [B, 2]
    batch = BatchInfo(table, draft_lengths, num_new, offset)
    logits, cache = model.apply(variables(), fed, model_positions(batch, 2), cache, batch, None,
                                jnp.maximum(num_new - 1, 0))
    draft_lengths = draft_lengths + num_new
    base = 0 if offset is None else offset
    draft_keys = jax.vmap(lambda k: jax.random.fold_in(k, DRAFT_TAG))(keys)
    vocab = config.vocab_size
    drafts = jnp.zeros((last.shape[0], gamma), jnp.int32)
    q = jnp.zeros((last.shape[0], gamma, vocab), jnp.float32)

    all_greedy = jnp.all(temperature == 0)

    def draw(i, logits, drafts, q):
        tok = sample(logits, draft_keys, base + lengths + 1 + i, temperature, top_k, top_p)
        one_hot = jax.nn.one_hot(tok, vocab)

        def mixed():  # sampled rows drew from q: keep it for the acceptance rule
            probs = probabilities(logits, temperature, top_k, top_p)
            return jnp.where((temperature > 0)[:, None], probs, one_hot)

        dist = jax.lax.cond(all_greedy, lambda: one_hot, mixed)
        return drafts.at[:, i].set(tok), q.at[:, i].set(dist)

    drafts, q = draw(0, logits[:, 0], drafts, q)

    def body(i, carry):  # feeds d_i, drafts d_{i+1} (i: the loop's int32 index)
        cache, draft_lengths, drafts, q = carry
        on = active.astype(jnp.int32)
        batch = BatchInfo(table, draft_lengths, on, offset)
        fed = jax.lax.dynamic_slice_in_dim(drafts, i - 1, 1, axis=1)  # [B, 1]
        logits, cache = model.apply(variables(), fed, model_positions(batch, 1), cache, batch,
                                    None)
        drafts, q = draw(i, logits[:, 0], drafts, q)
        return cache, draft_lengths + on, drafts, q

    # A loop, not γ unrolled copies of the draft: XLA compiles the body once, so compile
    # time stays flat in γ, and a draft step is the same computation either way, so a
    # round costs no more (README "Speculative decoding" has the measurement).
    cache, draft_lengths, drafts, q = jax.lax.fori_loop(
        1, gamma, body, (cache, draft_lengths, drafts, q))
    return drafts, q, maybe_constrain_cache(sharding, cache, draft=True), draft_lengths


@partial(jax.jit, static_argnames=("config", "draft_config", "drafter", "gamma", "max_out",
                                   "ngram_max", "return_logits", "sharding"),
         donate_argnames=("cache", "draft_cache"))
def spec_loop(params, config: ModelConfig, cache, page_table, lengths, last, budget, keys,
              temperature, top_k, top_p, stop_token, *, drafter: str, gamma: int,
              max_out: int, draft_params=None, draft_config: ModelConfig | None = None,
              draft_cache=None, draft_page_table=None, draft_lengths=None, prev=None,
              history=None, ngram_max: int = 3, return_logits: bool = False,
              position_offset=None, lora=None, adapter_ids=None, sharding=None):
    """Emits up to `budget[b]` tokens per sequence by speculative rounds on device.

    Donates `cache` and `draft_cache`. `drafter` is "model" (draft_params, draft_config,
    draft_cache, draft_page_table int32[B, P'], draft_lengths, prev int32[B]) or "ngram"
    (history int32[B, H]: each row's tokens including `last`, H >= lengths + budget + 1).
    Arrays and `sharding` as in `steps.decode_loop`; rows with budget 0 do nothing.

    Returns a dict: tokens int32[B, S] (-1 past the end), logits float32[B, S, V] (the
    target logits each token was accepted or sampled from) or None, cache, lengths,
    draft_cache, draft_lengths, prev, rounds (target calls), and per-row int32/f32
    statistics: verifications, drafted, accepted, emitted, alpha_sum, alpha_count, plus
    drafted_by_position / accepted_by_position int32[B, G].
    """
    steps.note_trace("spec_loop")
    b = last.shape[0]
    vocab = config.vocab_size
    g1 = gamma + 1
    rows = jnp.arange(b)
    cols = jnp.arange(g1)[None, :]
    model = Transformer(config, sharding)
    variables = partial(steps.model_variables, params, lora, config)  # called in the loop
    base = 0 if position_offset is None else position_offset
    all_greedy = jnp.all(temperature == 0)
    zeros_b = jnp.zeros((b,), jnp.int32)
    stats = {key: (jnp.zeros((b,), jnp.float32) if key == "alpha_sum" else zeros_b)
             for key in ROW_KEYS}
    stats["drafted_by_position"] = jnp.zeros((b, gamma), jnp.int32)
    stats["accepted_by_position"] = jnp.zeros((b, gamma), jnp.int32)
    state = {
        "round": jnp.int32(0), "count": zeros_b, "done": budget <= 0,
        "cache": maybe_constrain_cache(sharding, cache), "lengths": lengths, "last": last,
        "draft_cache": maybe_constrain_cache(sharding, draft_cache, draft=True),
        "draft_lengths": draft_lengths, "prev": prev,
        "history": history,
        "tokens": jnp.full((b, max_out), -1, jnp.int32),
        "logits": jnp.zeros((b, max_out, vocab) if return_logits else (0,), jnp.float32),
        "stats": stats,
    }
    stops = stop_token if stop_token.ndim == 2 else stop_token[:, None]  # [B, K], -1: none

    def body(s):
        active = ~s["done"]
        lengths, last = s["lengths"], s["last"]
        room = jnp.maximum(budget - s["count"] - 1, 0)  # drafts that could still be emitted
        if drafter == "model":
            drafts, q, s["draft_cache"], draft_len = _draft_model(
                draft_params, draft_config, s["draft_cache"], draft_page_table,
                s["draft_lengths"], lengths, last, s["prev"], active, keys, position_offset,
                temperature, top_k, top_p, gamma, sharding)
            num_draft = jnp.where(active, jnp.minimum(gamma, room), 0)
        else:
            drafts, found = ngram_propose(s["history"], lengths + 1, gamma, ngram_max)
            num_draft = jnp.where(active, jnp.minimum(found, room), 0)
            q = jax.nn.one_hot(drafts, vocab, dtype=jnp.float32)

        # Verify [last, d_1 .. d_γ] in one call; only real tokens are written.
        fed = jnp.concatenate([last[:, None], drafts], axis=1)  # [B, G + 1]
        batch = BatchInfo(page_table, lengths, jnp.where(active, 1 + num_draft, 0),
                          position_offset)
        logits, s["cache"] = model.apply(variables(), fed, model_positions(batch, g1),
                                         s["cache"], batch, adapter_ids)  # [B, G + 1, V]
        s["cache"] = maybe_constrain_cache(sharding, s["cache"])

        greedy_n, greedy_next = greedy_accept(drafts, logits, num_draft)

        # Each branch returns (accepted, next token, E[min(p, q)] per drafted position [B, G]).
        def greedy_only():  # p and q are both one-hot: E[min(p, q)] is argmax == draft
            best = jnp.argmax(logits[:, :gamma], -1)
            return greedy_n, greedy_next, (best == drafts).astype(jnp.float32)

        def mixed():
            p = probabilities(logits, temperature, top_k, top_p)
            n, nxt = sampling_accept(drafts, q, p, num_draft, keys, base + lengths + 1)
            pick = temperature == 0
            argmax_p = jax.nn.one_hot(jnp.argmax(logits[:, :gamma], -1), vocab)
            p_eff = jnp.where(pick[:, None, None], argmax_p, p[:, :gamma])
            return (jnp.where(pick, greedy_n, n), jnp.where(pick, greedy_next, nxt),
                    jnp.sum(jnp.minimum(p_eff, q), axis=-1))

        accepted, nxt, alpha_terms = jax.lax.cond(all_greedy, greedy_only, mixed)

        # Emit d_1 .. d_accepted then nxt, within the budget, up to the first stop token.
        out = jnp.where(cols < accepted[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), 0)
        out = jnp.where(cols == accepted[:, None], nxt[:, None], out)  # [B, G + 1]
        n_emit = jnp.minimum(accepted + 1, budget - s["count"])
        is_stop = jnp.any(out[:, :, None] == stops[:, None, :], axis=2) & \
            (cols < n_emit[:, None])
        first_stop = jnp.min(jnp.where(is_stop, cols, g1), axis=1)
        n_emit = jnp.where(active, jnp.minimum(n_emit, first_stop + 1), 0)
        keep = cols < n_emit[:, None]
        at = jnp.where(keep, s["count"][:, None] + cols, max_out)
        s["tokens"] = s["tokens"].at[rows[:, None], at].set(out, mode="drop")
        if return_logits:
            s["logits"] = s["logits"].at[rows[:, None], at].set(logits, mode="drop")

        new_last = jnp.take_along_axis(out, jnp.maximum(n_emit - 1, 0)[:, None], 1)[:, 0]
        if drafter == "model":  # the draft keeps what it fed that is still on the history
            new_len = lengths + n_emit
            s["draft_lengths"] = jnp.where(active, jnp.minimum(draft_len, new_len),
                                           s["draft_lengths"])
            before_last = jnp.take_along_axis(fed, jnp.maximum(n_emit - 1, 0)[:, None], 1)[:, 0]
            s["prev"] = jnp.where(active, before_last, s["prev"])
        else:
            hist_at = jnp.where(keep, lengths[:, None] + 1 + cols, s["history"].shape[1])
            s["history"] = s["history"].at[rows[:, None], hist_at].set(out, mode="drop")

        tested = (cols[:, :gamma] <= accepted[:, None]) & (cols[:, :gamma] < num_draft[:, None])
        st = dict(s["stats"])
        st["verifications"] += active
        st["drafted"] += num_draft
        st["accepted"] += jnp.minimum(accepted, num_draft)
        st["emitted"] += n_emit
        st["alpha_sum"] += jnp.sum(jnp.where(tested, alpha_terms, 0.0), axis=1)
        st["alpha_count"] += jnp.sum(tested, axis=1).astype(jnp.int32)
        st["drafted_by_position"] += (cols[:, :gamma] < num_draft[:, None]).astype(jnp.int32)
        st["accepted_by_position"] += (cols[:, :gamma] < accepted[:, None]).astype(jnp.int32)
        s["stats"] = st
        s["lengths"] = lengths + n_emit
        s["last"] = jnp.where(n_emit > 0, new_last, last)
        s["count"] = s["count"] + n_emit
        stopped = jnp.any(is_stop & keep, axis=1)
        s["done"] = s["done"] | (s["count"] >= budget) | stopped
        s["round"] = s["round"] + 1
        return s

    state = jax.lax.while_loop(lambda s: ~jnp.all(s["done"]), body, state)
    result = {key: state[key] for key in ("tokens", "cache", "lengths", "draft_cache",
                                          "draft_lengths", "prev")}
    result["logits"] = state["logits"] if return_logits else None
    result["rounds"] = state["round"]
    result.update(state["stats"])
    host = {k: v for k, v in result.items() if k not in ("cache", "draft_cache")}
    result.update(maybe_replicated(sharding, host))
    result["cache"] = maybe_constrain_cache(sharding, result["cache"])
    result["draft_cache"] = maybe_constrain_cache(sharding, result["draft_cache"], draft=True)
    return result
