"""Jitted device steps: one `extend` computation serves prefill, decode and verify.

Prefill is `extend` on a padded chunk of `prefill_chunk` tokens for one sequence, decode is
`extend` on one token per sequence, verify is `extend` on k+1 tokens per sequence. Shapes
are bucketed on the host (chunk length, pages per sequence, batch slots) so the number of
compilations stays bounded; `trace_counts()` reports how many each step has had. The
decode loop can also prefill prompts in its steps (`Fill`: packed steps).

Legend: B batch slots, T new tokens, P pages per sequence, V vocab, S decode steps.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from kvjax.cache.paged import BatchInfo, model_positions
from kvjax.config import ModelConfig
from kvjax.decode.aot import program
from kvjax.decode.aot import trace_counts as trace_counts  # where callers look
from kvjax.decode.sampling import any_sampled, greedy, sample
from kvjax.decode.state import DecodeState
from kvjax.model.kernels import AttentionKernel
from kvjax.model.layout import unstored
from kvjax.model.plan import FAST, NumericsPlan
from kvjax.model.transformer import Cache, Transformer
from kvjax.sharding.rules import StepShardings, maybe_constrain_cache, maybe_replicated


def model_variables(params, lora: dict | None, plan: NumericsPlan) -> dict:
    """The variable collections for `Transformer.apply`: params (stored as `plan` says, in
    the layout the model takes: see `kvjax.model.layout`), and LoRA adapters if any."""
    params = unstored(params, plan)
    return {"params": params} if lora is None else {"params": params, "lora": lora}


@program("extend", {1: "cache"},
         static_argnames=("config", "last_only", "sharding", "plan", "features"),
         donate_argnames=("cache",))
def extend(params: dict, config: ModelConfig, cache: Cache, tokens: jax.Array,
           batch: BatchInfo, lora: dict | None = None, adapter_ids: jax.Array | None = None,
           last_only: bool = False, sharding: StepShardings | None = None,
           plan: NumericsPlan = FAST, features: bool = False) -> tuple[jax.Array, Cache]:
    """Appends `tokens` [B, T] to each sequence's cache; returns logits [B, T, V] and the cache.

    Donates `cache`. New token t of sequence b goes to cache slot `batch.lengths[b] + t` and
    attends to every cached slot up to and including its own. `lora` (stacked adapters, see
    `kvjax.model.lora`) and `adapter_ids` int32[B] select a LoRA adapter per sequence.
    `last_only` returns only each row's last real token's logits, [B, 1, V] (the cache
    contents are the same either way). `sharding` (see `kvjax.sharding`) pins the cache's
    sharding in and out and replicates the logits. `plan`: how the arithmetic runs
    (`kvjax.model.plan`; `params` stored as it says). `features`: (logits, the final norm's
    output [B, T, D]) in place of the logits (`Transformer`'s `features`).
    """
    positions = model_positions(batch, tokens.shape[1])
    logits_at = jnp.maximum(batch.num_new - 1, 0) if last_only else None
    cache = maybe_constrain_cache(sharding, cache)
    logits, cache = Transformer(config, sharding, plan=plan, features=features).apply(
        model_variables(params, lora, plan), tokens, positions, cache, batch, adapter_ids,
        logits_at)
    return maybe_replicated(sharding, logits), maybe_constrain_cache(sharding, cache)


@flax.struct.dataclass
class Fill:
    """Prompts prefilled inside a decode loop (packed steps): every step takes the next slice
    of up to F tokens of each prompt beside the decoding sequences' tokens, in one call.

    Legend: Bp prompts (padded rows have count 0), F tokens per step, P pages per prompt.
    """

    tokens: jax.Array  # int32[Bp, S, F]: prompt b's tokens for step s
    page_table: jax.Array  # int32[Bp, P]
    start: jax.Array  # int32[Bp]: tokens cached before the call
    count: jax.Array  # int32[Bp]: tokens this call prefills (at most S * F)
    position_offset: jax.Array  # int32[Bp]
    adapter_ids: jax.Array | None = None  # int32[Bp], with LoRA
    open_rows: jax.Array | None = None  # int32[Bp], int4_kivi pages (kvjax.cache.kivi)


def _fill_step(fill: Fill, step: jax.Array, batch: BatchInfo, last: jax.Array,
               adapter_ids: jax.Array | None):
    """One packed step's inputs: the decode rows' tokens `last` [B] and the prompts' slice
    for `step`, one token per row [R, 1]; their positions, adapters, the two groups' batch
    descriptions and shapes, and the head's rows (each decode row, each prompt's last token
    of the slice). Returns (tokens, positions, adapter_ids, batches, groups, logits_at,
    finishing bool[Bp]: the prompt's last token is in this slice)."""
    b, (bp, _, f) = last.shape[0], fill.tokens.shape
    left = fill.count - step * f  # [Bp] tokens still to prefill
    num_new = jnp.clip(left, 0, f)
    fbatch = BatchInfo(page_table=fill.page_table, lengths=fill.start + step * f,
                       num_new=num_new, position_offset=fill.position_offset,
                       open_rows=fill.open_rows)
    tokens = jnp.concatenate([last, fill.tokens[:, step].reshape(-1)])[:, None]
    positions = jnp.concatenate([model_positions(batch, 1)[:, 0],
                                 model_positions(fbatch, f).reshape(-1)])[:, None]
    ids = None if adapter_ids is None else jnp.concatenate(
        [adapter_ids, jnp.repeat(fill.adapter_ids, f)])
    at = jnp.concatenate([jnp.arange(b), b + jnp.arange(bp) * f + jnp.maximum(num_new - 1, 0)])
    finishing = (left > 0) & (left <= f)
    return tokens, positions, ids, (batch, fbatch), ((b, 1), (bp, f)), at, finishing


@flax.struct.dataclass
class DecodeResult:
    """What a decode call returns besides the cache."""

    tokens: jax.Array  # int32[B, S] (-1 past the end)
    logits: jax.Array | None  # float32[B, S, V] the logits each token was sampled from
    lengths: jax.Array  # int32[B] tokens cached after the call
    fill_logits: jax.Array | None = None  # float32[Bp, V] with `fill` (zeros: unfinished)


@flax.struct.dataclass
class _Carry:
    """The decode loop's state between steps."""

    step: jax.Array  # int32
    cache: Cache
    lengths: jax.Array  # int32[B]
    last: jax.Array  # int32[B]
    done: jax.Array  # bool[B]
    tokens: jax.Array  # int32[B, S]
    logits: jax.Array  # float32[B, S, V], or [0] without return_logits
    fill_logits: jax.Array  # float32[Bp, V], Bp = 0 without fill


@program("decode_loop", {1: "cache"},
         static_argnames=("config", "max_steps", "return_logits", "sharding", "kernel",
                          "plan", "sampled"),
         donate_argnames=("cache",))
def decode_loop(params: dict, config: ModelConfig, cache: Cache, state: DecodeState,
                max_steps: int, return_logits: bool = False, lora: dict | None = None,
                sharding: StepShardings | None = None, kernel: AttentionKernel | None = None,
                fill: Fill | None = None, plan: NumericsPlan = FAST, sampled: bool = True
                ) -> tuple[DecodeResult, Cache]:
    """Decodes up to `max_steps` tokens per sequence on device, sampling inside the loop.

    Donates `cache`. Row b feeds `state.last[b]` (not yet cached, at slot
    `state.lengths[b]`), then keeps sampling until it has produced `state.budget[b]` tokens
    or sampled one of its `state.stop_ids`. The loop ends as soon as every row is done (and
    `fill` is written). `lora` (stacked adapters) serves `state.adapter_ids`; `sharding`:
    see `extend`; `kernel`: the decode-attention kernel (None: the reference); `plan`: see
    `extend`; `sampled`: False when no row samples (every temperature 0): the loop takes
    the argmax and compiles no sampler, with the same tokens (`decode` decides it).

    `fill` (see `Fill`) prefills prompts in the same steps: each step is one packed call of
    the decode tokens and every prompt's next slice (`Transformer`'s `groups`). Under
    invariant numerics a token's bits do not depend on what shares its step, so the decode
    rows and the prompts' pages and logits are those of separate calls.

    Returns (DecodeResult, the cache): logits only with `return_logits`, fill_logits only
    with `fill`.
    """
    b = state.last.shape[0]
    vocab = config.vocab_size
    model = Transformer(config, sharding, kernel, plan)
    adapter_ids = state.adapter_ids

    def cond(c: _Carry):
        filling = False if fill is None else jnp.any(fill.count > c.step * fill.tokens.shape[2])
        return (c.step < max_steps) & (~jnp.all(c.done) | filling)

    def body(c: _Carry) -> _Carry:
        active = ~c.done
        batch = BatchInfo(page_table=state.page_table, lengths=c.lengths,
                          num_new=active.astype(jnp.int32),
                          position_offset=state.position_offset, open_rows=state.open_rows)
        # the variables inside the loop: a stored kernel's transposed view must sit beside
        # its product for XLA to fold it (hoisted, it would be copied into a plain layout)
        variables = model_variables(params, lora, plan)
        fill_logits = c.fill_logits
        if fill is None:
            logits, cache = model.apply(variables, c.last[:, None], model_positions(batch, 1),
                                        c.cache, batch, adapter_ids)
        else:
            tokens, positions, ids, batches, groups, at, finishing = _fill_step(
                fill, c.step, batch, c.last, adapter_ids)
            logits, cache = model.apply(variables, tokens, positions, c.cache, batches, ids,
                                        at, groups)
            fill_logits = jnp.where(finishing[:, None], logits[b:, 0], fill_logits)
            logits = logits[:b]
        logits = logits[:, 0]  # [B, V]
        offset = 0 if state.position_offset is None else state.position_offset
        nxt = (sample(logits, state.keys, offset + c.lengths + 1, *state.knobs) if sampled
               else greedy(logits))
        stopped = jnp.any(nxt[:, None] == state.stops, axis=1)
        return _Carry(
            step=c.step + 1, cache=maybe_constrain_cache(sharding, cache),
            lengths=c.lengths + active.astype(jnp.int32),
            last=jnp.where(active, nxt, c.last),
            done=c.done | (c.step + 1 >= state.budget) | stopped,
            tokens=c.tokens.at[:, c.step].set(jnp.where(active, nxt, -1)),
            logits=c.logits.at[:, c.step].set(logits) if return_logits else c.logits,
            fill_logits=fill_logits)

    bp = 0 if fill is None else fill.count.shape[0]
    out = jax.lax.while_loop(cond, body, _Carry(
        step=jnp.int32(0), cache=maybe_constrain_cache(sharding, cache),
        lengths=state.lengths, last=state.last, done=state.budget <= 0,
        tokens=jnp.full((b, max_steps), -1, jnp.int32),
        logits=jnp.zeros((b, max_steps, vocab) if return_logits else (0,), jnp.float32),
        fill_logits=jnp.zeros((bp, vocab), jnp.float32)))
    tokens, logits, lengths = maybe_replicated(sharding, (out.tokens, out.logits, out.lengths))
    result = DecodeResult(tokens=tokens, logits=logits if return_logits else None,
                          lengths=lengths, fill_logits=None if fill is None else out.fill_logits)
    return result, maybe_constrain_cache(sharding, out.cache)


def decode(holder, params: dict, config: ModelConfig, state: DecodeState, max_steps: int,
           **kwargs) -> DecodeResult:
    """The one decode driver: `decode_loop` over the cache `holder` keeps (a
    `kvjax.cache.pool.PagePool`, the engine's `KVCacheManager` or a
    `kvjax.cache.paged.CacheHolder`), which keeps the new cache. `kwargs`: decode_loop's
    (return_logits, lora, sharding, kernel, fill, plan). The engine's runner, `generate()`, the
    model drafter and the benchmarks decode through it; it compiles the sampler only when a
    row of `state` samples (`sampled`)."""
    kwargs.setdefault("sampled", any_sampled(state.temperature))
    return holder.run(lambda cache: decode_loop(params, config, cache, state, max_steps,
                                                **kwargs))
