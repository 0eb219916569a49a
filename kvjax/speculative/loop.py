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

import flax.struct
import jax
import jax.numpy as jnp

from kvjax.cache.paged import BatchInfo, model_positions
from kvjax.config import ModelConfig
from kvjax.decode import steps
from kvjax.decode.aot import concrete, program
from kvjax.decode.sampling import DRAFT_TAG, greedy, probabilities, sample
from kvjax.decode.state import DecodeState
from kvjax.model.plan import FAST, NumericsPlan
from kvjax.model.transformer import Cache, Transformer
from kvjax.sharding.rules import maybe_constrain_cache, maybe_replicated
from kvjax.speculative.ngram_device import ngram_propose
from kvjax.speculative.rules import greedy_accept, sampling_accept


@flax.struct.dataclass
class DraftState:
    """The draft model's rows beside a `DecodeState` (the model drafter only)."""

    page_table: jax.Array  # int32[B, P'] the draft's pages
    lengths: jax.Array  # int32[B] tokens the draft has cached
    prev: jax.Array  # int32[B] the token at lengths - 1 of the target, when the draft lags


@flax.struct.dataclass
class RowStats:
    """Per-row counters of a speculative call (`kvjax.speculative.stats.SpecStats.add_row`)."""

    verifications: jax.Array  # int32[B] target calls that verified the row
    drafted: jax.Array  # int32[B]
    accepted: jax.Array  # int32[B]
    emitted: jax.Array  # int32[B]
    alpha_sum: jax.Array  # float32[B] sum of E[min(p, q)] over tested positions
    alpha_count: jax.Array  # int32[B] tested positions
    drafted_by_position: jax.Array  # int32[B, G]
    accepted_by_position: jax.Array  # int32[B, G]


@flax.struct.dataclass
class SpecLoopResult:
    """What a speculative call returns besides the caches."""

    tokens: jax.Array  # int32[B, S] (-1 past the end)
    logits: jax.Array | None  # float32[B, S, V] the target logits of each token
    lengths: jax.Array  # int32[B] tokens the target has cached
    draft_lengths: jax.Array | None  # int32[B] the draft's cached tokens (model drafter)
    prev: jax.Array | None  # int32[B] the draft's token to feed first (model drafter)
    rounds: jax.Array  # int32 target calls
    stats: RowStats


@flax.struct.dataclass
class _Carry:
    """The speculative loop's state between rounds."""

    round: jax.Array  # int32
    count: jax.Array  # int32[B] tokens emitted
    done: jax.Array  # bool[B]
    cache: Cache
    lengths: jax.Array  # int32[B]
    last: jax.Array  # int32[B]
    draft_cache: Cache
    draft: DraftState | None
    history: jax.Array | None  # int32[B, H] (the n-gram drafter)
    tokens: jax.Array  # int32[B, S]
    logits: jax.Array  # float32[B, S, V], or [0]
    stats: RowStats


def emitted(out: jax.Array, available: jax.Array, left: jax.Array, stops: jax.Array,
            active: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """What a round emits of `out` int32[B, W] (its first `available[b]` tokens are the
    round's): (count int32[B], bool[B, W] the emitted slots, bool[B] stopped): at most
    `left[b]` (the budget), up to and including the first of a row's `stops` [B, K]; none
    for rows not `active`. The chain and tree loops' one rule."""
    cols = jnp.arange(out.shape[1])[None, :]
    n = jnp.minimum(available, left)
    is_stop = jnp.any(out[:, :, None] == stops[:, None, :], axis=2) & (cols < n[:, None])
    first_stop = jnp.min(jnp.where(is_stop, cols, out.shape[1]), axis=1)
    n = jnp.where(active, jnp.minimum(n, first_stop + 1), 0)
    keep = cols < n[:, None]
    return n, keep, jnp.any(is_stop & keep, axis=1)


def _draft_model(params, config, plan, cache, draft: DraftState, state: DecodeState, lengths,
                 last, active, gamma, gamma_max: int, sharding=None, sampled=True):
    """γ (traced, <= gamma_max) draft-model steps. Returns (drafts [B, G], q [B, G, V],
    cache, draft lengths); the columns past γ stay 0."""
    model = Transformer(config, sharding, plan=plan)
    variables = partial(steps.model_variables, params, None, plan)  # called in the loop
    table, draft_lengths, prev, offset = draft.page_table, draft.lengths, draft.prev, \
        state.position_offset
    keys, (temperature, top_k, top_p) = state.keys, state.knobs
    lag = (draft_lengths < lengths) & active
    num_new = jnp.where(active, 1 + lag, 0).astype(jnp.int32)
    fed = jnp.where(lag[:, None], jnp.stack([prev, last], 1),
                    jnp.stack([last, jnp.zeros_like(last)], 1))  # [B, 2]
    batch = BatchInfo(table, draft_lengths, num_new, offset)
    logits, cache = model.apply(variables(), fed, model_positions(batch, 2), cache, batch, None,
                                jnp.maximum(num_new - 1, 0))
    draft_lengths = draft_lengths + num_new
    base = 0 if offset is None else offset
    draft_keys = (jax.vmap(lambda k: jax.random.fold_in(k, DRAFT_TAG))(keys) if sampled
                  else None)
    vocab = config.vocab_size
    drafts = jnp.zeros((last.shape[0], gamma_max), jnp.int32)
    q = jnp.zeros((last.shape[0], gamma_max, vocab), jnp.float32)

    all_greedy = jnp.all(temperature == 0)

    def draw(i, logits, drafts, q):
        if not sampled:  # every row greedy: q is the draft's one-hot
            tok = greedy(logits)
            return drafts.at[:, i].set(tok), q.at[:, i].set(jax.nn.one_hot(tok, vocab))
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
    # round costs no more (docs/speculative.md has the measurement). Its bound is traced:
    # one program drafts every γ <= gamma_max, each round only γ steps.
    cache, draft_lengths, drafts, q = jax.lax.fori_loop(
        1, gamma, body, (cache, draft_lengths, drafts, q))
    return drafts, q, maybe_constrain_cache(sharding, cache, draft=True), draft_lengths


def verify_widths(gamma_max: int, widths: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The verify widths of a `spec_loop` program, checked: by default γ + 1 for γ = 1, 2,
    4, 8, ... and gamma_max (a width is a model's copy in the program, so every γ's would
    multiply its compile time; a γ between them verifies at the next width up); given ones
    sorted, the largest gamma_max + 1 (it holds every γ)."""
    if gamma_max < 1:
        raise ValueError(f"gamma_max must be >= 1, got {gamma_max}")
    if widths is None:
        powers = [1 << i for i in range(gamma_max.bit_length())]
        return tuple(sorted({g + 1 for g in [*powers, gamma_max] if g <= gamma_max}))
    widths = tuple(sorted(set(widths)))
    if widths[0] < 2 or widths[-1] != gamma_max + 1:
        raise ValueError(f"verify widths must be in [2, gamma_max + 1 = {gamma_max + 1}] "
                         f"and include gamma_max + 1, got {widths}")
    return widths


def one_of(index: jax.Array, branches: list, cache):
    """`branches[index](cache)` -> (outputs, cache), the cache updated in place: as
    `jax.lax.switch` would, but each branch in a while loop of at most one trip, since XLA
    copies a cache that a conditional's branches update (every round, the whole pool) and
    carries a while loop's in place. The outputs' shapes are the branches' (the same)."""
    if len(branches) == 1:
        return branches[0](cache)
    shapes = jax.eval_shape(branches[-1], cache)[0]
    out = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
    for i, branch in enumerate(branches):
        def body(carry, branch=branch):
            return (jnp.bool_(True), *branch(carry[2]))

        _, out, cache = jax.lax.while_loop(lambda c, i=i: ~c[0] & (index == i), body,
                                           (jnp.bool_(False), out, cache))
    return out, cache


def _check_gamma(*_, gamma, gamma_max: int, widths=None, **__) -> None:
    """A call's γ must lie in [1, gamma_max] (traced, the program could not refuse it)."""
    verify_widths(gamma_max, widths)
    value = concrete(gamma)
    if value is not None and not 1 <= value <= gamma_max:
        raise ValueError(f"gamma must be in [1, gamma_max = {gamma_max}], got {value}")


@program("spec_loop", {1: "cache", 2: "draft_cache"},
         static_argnames=("config", "draft_config", "drafter", "gamma_max", "widths",
                          "max_out", "ngram_max", "return_logits", "sharding", "plan",
                          "draft_plan", "sampled"),
         donate_argnames=("cache", "draft_cache"), check=_check_gamma)
def spec_loop(params, config: ModelConfig, cache, state: DecodeState, *, drafter: str,
              gamma, gamma_max: int, max_out: int, widths: tuple[int, ...] | None = None,
              draft_params=None,
              draft_config: ModelConfig | None = None, draft_cache=None,
              draft: DraftState | None = None, history=None, ngram_max: int = 3,
              return_logits: bool = False, lora=None, sharding=None,
              plan: NumericsPlan = FAST, draft_plan: NumericsPlan = FAST,
              sampled: bool = True):
    """Emits up to `state.budget[b]` tokens per row by speculative rounds on device.

    One program serves every γ in [1, gamma_max]: `gamma` is traced (an int or int32
    scalar), `gamma_max` and `widths` are static. Each round drafts up to γ tokens and
    verifies them at the smallest of `widths` (verify widths; default `verify_widths`'s)
    that holds γ + 1, chosen on device (`one_of`); columns past a row's drafts are fed
    but not written. A γ whose γ + 1 is a width gets the tokens, logits, K/V and
    statistics of a program compiled for that γ alone, bitwise; a γ between widths
    verifies padded, which changes no bit under invariant numerics only
    (tests/test_spec_programs.py). A concrete γ outside [1, gamma_max] is refused before
    the call (ValueError); pass a Python int (a non-weak int32 is another program).

    Donates `cache` and `draft_cache`. `drafter` is "model" (draft_params, draft_config,
    draft_cache and `draft`, its rows) or "ngram" (history int32[B, H]: each row's tokens
    including `state.last`, H >= lengths + budget + 1). `state`, `lora`, `sharding` and
    `plan` (the draft's: `draft_plan`) and `sampled` (False: no row samples, no sampler
    compiled) as in `steps.decode_loop`; rows with budget 0 do nothing.

    Returns (SpecLoopResult, the cache, the draft cache): the result's logits only with
    `return_logits`, its draft only with the model drafter.
    """
    b = state.last.shape[0]
    vocab = config.vocab_size
    widths = verify_widths(gamma_max, widths)
    g1 = gamma_max + 1
    rows = jnp.arange(b)
    cols = jnp.arange(g1)[None, :]
    model = Transformer(config, sharding, plan=plan)
    variables = partial(steps.model_variables, params, lora, plan)  # called in the loop
    base = 0 if state.position_offset is None else state.position_offset
    temperature, top_k, top_p = state.knobs
    keys, budget, stops = state.keys, state.budget, state.stops
    all_greedy = jnp.all(temperature == 0)
    zeros_b = jnp.zeros((b,), jnp.int32)
    zeros_g = jnp.zeros((b, gamma_max), jnp.int32)
    carry = _Carry(
        round=jnp.int32(0), count=zeros_b, done=budget <= 0,
        cache=maybe_constrain_cache(sharding, cache), lengths=state.lengths, last=state.last,
        draft_cache=maybe_constrain_cache(sharding, draft_cache, draft=True), draft=draft,
        history=history, tokens=jnp.full((b, max_out), -1, jnp.int32),
        logits=jnp.zeros((b, max_out, vocab) if return_logits else (0,), jnp.float32),
        stats=RowStats(verifications=zeros_b, drafted=zeros_b, accepted=zeros_b,
                       emitted=zeros_b, alpha_sum=jnp.zeros((b,), jnp.float32),
                       alpha_count=zeros_b, drafted_by_position=zeros_g,
                       accepted_by_position=zeros_g))

    def body(s: _Carry) -> _Carry:
        active = ~s.done
        lengths, last = s.lengths, s.last
        room = jnp.maximum(budget - s.count - 1, 0)  # drafts that could still be emitted
        draft_cache, draft_state, history = s.draft_cache, s.draft, s.history
        if drafter == "model":
            drafts, q, draft_cache, draft_len = _draft_model(
                draft_params, draft_config, draft_plan, draft_cache, draft_state, state,
                lengths, last, active, gamma, gamma_max, sharding, sampled)
            num_draft = jnp.where(active, jnp.minimum(gamma, room), 0)
        else:
            drafts, found = ngram_propose(history, lengths + 1, gamma_max, ngram_max)
            num_draft = jnp.where(active, jnp.minimum(jnp.minimum(found, gamma), room), 0)
            q = jax.nn.one_hot(drafts, vocab, dtype=jnp.float32)

        # Verify [last, d_1 .. d_γ] in one call; only real tokens are written.
        fed = jnp.concatenate([last[:, None], drafts], axis=1)  # [B, G + 1]
        batch = BatchInfo(state.page_table, lengths, jnp.where(active, 1 + num_draft, 0),
                          state.position_offset)

        def verify(width):  # the verify at `width` columns: its argmax [B, G + 1], padded,
            def run(cache):  # and its logits [B, G + 1, V] where a sampler or caller reads them
                logits, cache = model.apply(variables(), fed[:, :width],
                                            model_positions(batch, width), cache, batch,
                                            state.adapter_ids)  # [B, width, V]
                pad = ((0, 0), (0, g1 - width))
                full = jnp.pad(logits, (*pad, (0, 0))) if sampled or return_logits else None
                return (jnp.pad(greedy(logits), pad), full), cache
            return run

        pick = jnp.sum(jnp.asarray(widths) < gamma + 1)  # the smallest that holds γ + 1
        (best, logits), cache = one_of(pick, [verify(w) for w in widths], s.cache)
        cache = maybe_constrain_cache(sharding, cache)

        greedy_n, greedy_next = greedy_accept(drafts, best, num_draft)

        # Each branch returns (accepted, next token, E[min(p, q)] per drafted position [B, G]).
        def greedy_only():  # p and q are both one-hot: E[min(p, q)] is argmax == draft
            return greedy_n, greedy_next, (best[:, :gamma_max] == drafts).astype(jnp.float32)

        def mixed():
            p = probabilities(logits, temperature, top_k, top_p)
            n, nxt = sampling_accept(drafts, q, p, num_draft, keys, base + lengths + 1)
            pick = temperature == 0
            argmax_p = jax.nn.one_hot(best[:, :gamma_max], vocab)
            p_eff = jnp.where(pick[:, None, None], argmax_p, p[:, :gamma_max])
            return (jnp.where(pick, greedy_n, n), jnp.where(pick, greedy_next, nxt),
                    jnp.sum(jnp.minimum(p_eff, q), axis=-1))

        accepted, nxt, alpha_terms = (jax.lax.cond(all_greedy, greedy_only, mixed) if sampled
                                      else greedy_only())

        # Emit d_1 .. d_accepted then nxt, within the budget, up to the first stop token.
        out = jnp.where(cols < accepted[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), 0)
        out = jnp.where(cols == accepted[:, None], nxt[:, None], out)  # [B, G + 1]
        n_emit, keep, stopped = emitted(out, accepted + 1, budget - s.count, stops, active)
        at = jnp.where(keep, s.count[:, None] + cols, max_out)
        tokens = s.tokens.at[rows[:, None], at].set(out, mode="drop")
        out_logits = (s.logits.at[rows[:, None], at].set(logits, mode="drop")
                      if return_logits else s.logits)

        new_last = jnp.take_along_axis(out, jnp.maximum(n_emit - 1, 0)[:, None], 1)[:, 0]
        if drafter == "model":  # the draft keeps what it fed that is still on the history
            new_len = lengths + n_emit
            before_last = jnp.take_along_axis(fed, jnp.maximum(n_emit - 1, 0)[:, None], 1)[:, 0]
            draft_state = draft_state.replace(
                lengths=jnp.where(active, jnp.minimum(draft_len, new_len), draft_state.lengths),
                prev=jnp.where(active, before_last, draft_state.prev))
        else:
            hist_at = jnp.where(keep, lengths[:, None] + 1 + cols, history.shape[1])
            history = history.at[rows[:, None], hist_at].set(out, mode="drop")

        drafted = cols[:, :gamma_max] < num_draft[:, None]  # [B, G]
        tested = (cols[:, :gamma_max] <= accepted[:, None]) & drafted
        st = s.stats
        stats = RowStats(
            verifications=st.verifications + active, drafted=st.drafted + num_draft,
            accepted=st.accepted + jnp.minimum(accepted, num_draft),
            emitted=st.emitted + n_emit,
            alpha_sum=st.alpha_sum + jnp.sum(jnp.where(tested, alpha_terms, 0.0), axis=1),
            alpha_count=st.alpha_count + jnp.sum(tested, axis=1).astype(jnp.int32),
            drafted_by_position=st.drafted_by_position + drafted.astype(jnp.int32),
            accepted_by_position=st.accepted_by_position
            + (cols[:, :gamma_max] < accepted[:, None]).astype(jnp.int32))
        count = s.count + n_emit
        return _Carry(round=s.round + 1, count=count,
                      done=s.done | (count >= budget) | stopped, cache=cache,
                      lengths=lengths + n_emit, last=jnp.where(n_emit > 0, new_last, last),
                      draft_cache=draft_cache, draft=draft_state, history=history,
                      tokens=tokens, logits=out_logits, stats=stats)

    end = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, carry)
    result = SpecLoopResult(tokens=end.tokens, logits=end.logits if return_logits else None,
                            lengths=end.lengths,
                            draft_lengths=None if draft is None else end.draft.lengths,
                            prev=None if draft is None else end.draft.prev, rounds=end.round,
                            stats=end.stats)
    return (maybe_replicated(sharding, result), maybe_constrain_cache(sharding, end.cache),
            maybe_constrain_cache(sharding, end.draft_cache, draft=True))
