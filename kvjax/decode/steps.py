"""Jitted device steps: one `extend` computation serves prefill, decode and verify.

Prefill is `extend` on a padded chunk of `prefill_chunk` tokens for one sequence, decode is
`extend` on one token per sequence, verify is `extend` on k+1 tokens per sequence. Shapes
are bucketed on the host (chunk length, pages per sequence, batch slots) so the number of
compilations stays bounded; `trace_counts()` reports how many each step has had.

Legend: B batch slots, T new tokens, P pages per sequence, V vocab, S decode steps.
"""

from __future__ import annotations

import collections
from functools import partial

import jax
import jax.numpy as jnp

from kvjax.cache.paged import BatchInfo, model_positions
from kvjax.config import ModelConfig
from kvjax.decode.sampling import sample
from kvjax.model.kernels import AttentionKernel
from kvjax.model.layout import unstored
from kvjax.model.transformer import Cache, Transformer
from kvjax.sharding.rules import StepShardings, maybe_constrain_cache, maybe_replicated

_TRACES: collections.Counter = collections.Counter()


def trace_counts() -> dict[str, int]:
    """How many times each jitted step has been traced (compiled) in this process."""
    return dict(_TRACES)


def note_trace(step: str) -> None:
    """Counts one trace of a jitted step (call it from inside the traced function)."""
    _TRACES[step] += 1


def model_variables(params, lora: dict | None, config: ModelConfig) -> dict:
    """The variable collections for `Transformer.apply`: params (in their canonical layout:
    see `kvjax.model.layout`), and LoRA adapters if any."""
    params = unstored(params, config.transposed)
    return {"params": params} if lora is None else {"params": params, "lora": lora}


@partial(jax.jit, static_argnames=("config", "last_only", "sharding"),
         donate_argnames=("cache",))
def extend(params: dict, config: ModelConfig, cache: Cache, tokens: jax.Array,
           batch: BatchInfo, lora: dict | None = None, adapter_ids: jax.Array | None = None,
           last_only: bool = False,
           sharding: StepShardings | None = None) -> tuple[jax.Array, Cache]:
    """Appends `tokens` [B, T] to each sequence's cache; returns logits [B, T, V] and the cache.

    Donates `cache`. New token t of sequence b goes to cache slot `batch.lengths[b] + t` and
    attends to every cached slot up to and including its own. `lora` (stacked adapters, see
    `kvjax.model.lora`) and `adapter_ids` int32[B] select a LoRA adapter per sequence.
    `last_only` returns only each row's last real token's logits, [B, 1, V] (the cache
    contents are the same either way). `sharding` (see `kvjax.sharding`) pins the cache's
    sharding in and out and replicates the logits.
    """
    note_trace("extend")
    positions = model_positions(batch, tokens.shape[1])
    logits_at = jnp.maximum(batch.num_new - 1, 0) if last_only else None
    cache = maybe_constrain_cache(sharding, cache)
    logits, cache = Transformer(config, sharding).apply(
        model_variables(params, lora, config), tokens, positions, cache, batch, adapter_ids,
        logits_at)
    return maybe_replicated(sharding, logits), maybe_constrain_cache(sharding, cache)


@partial(jax.jit,
         static_argnames=("config", "max_steps", "return_logits", "sharding", "kernel"),
         donate_argnames=("cache",))
def decode_loop(params: dict, config: ModelConfig, cache: Cache, page_table: jax.Array,
                lengths: jax.Array, last: jax.Array, budget: jax.Array, keys: jax.Array,
                temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                stop_token: jax.Array, max_steps: int, return_logits: bool = False,
                position_offset: jax.Array | None = None, lora: dict | None = None,
                adapter_ids: jax.Array | None = None, sharding: StepShardings | None = None,
                kernel: AttentionKernel | None = None):
    """Decodes up to `max_steps` tokens per sequence on device, sampling inside the loop.

    Donates `cache`. Sequence b feeds `last[b]` (not yet cached, at position `lengths[b]`),
    then keeps sampling until it has produced `budget[b]` tokens or sampled `stop_token[b]`
    (-1: none). The loop ends as soon as every sequence is done.

    Args:
      page_table: int32[B, P]; lengths, last, budget: int32[B]; keys: uint32[B, 2];
      temperature, top_p: float32[B]; top_k, stop_token: int32[B];
      position_offset, adapter_ids: int32[B] or None; sharding: see `extend`;
      kernel: the decode-attention kernel (None: the reference).
    Returns:
      tokens int32[B, S] (-1 past the end), logits float32[B, S, V] or None, the cache,
      and the final lengths int32[B].
    """
    note_trace("decode_loop")
    b = last.shape[0]
    vocab = config.vocab_size
    out_tokens = jnp.full((b, max_steps), -1, jnp.int32)
    out_logits = jnp.zeros((b, max_steps, vocab) if return_logits else (0,), jnp.float32)
    model = Transformer(config, sharding, kernel)

    def cond(state):  # state: (step, cache, lengths, last, done, out_tokens, out_logits)
        return (state[0] < max_steps) & ~jnp.all(state[4])

    def body(state):
        step, cache, lengths, last, done, out_tokens, out_logits = state
        active = ~done
        batch = BatchInfo(page_table=page_table, lengths=lengths,
                          num_new=active.astype(jnp.int32), position_offset=position_offset)
        positions = model_positions(batch, 1)
        # the variables inside the loop: a stored kernel's transposed view must sit beside
        # its product for XLA to fold it (hoisted, it would be copied into a plain layout)
        logits, cache = model.apply(model_variables(params, lora, config), last[:, None],
                                    positions, cache, batch, adapter_ids)
        cache = maybe_constrain_cache(sharding, cache)
        logits = logits[:, 0]  # [B, V]
        offset = 0 if position_offset is None else position_offset
        nxt = sample(logits, keys, offset + lengths + 1, temperature, top_k, top_p)
        out_tokens = out_tokens.at[:, step].set(jnp.where(active, nxt, -1))
        if return_logits:
            out_logits = out_logits.at[:, step].set(logits)
        lengths = lengths + active.astype(jnp.int32)
        done = done | (step + 1 >= budget) | (nxt == stop_token)
        return (step + 1, cache, lengths, jnp.where(active, nxt, last), done, out_tokens,
                out_logits)

    done = budget <= 0
    state = (jnp.int32(0), maybe_constrain_cache(sharding, cache), lengths, last, done,
             out_tokens, out_logits)
    _, cache, lengths, _, _, out_tokens, out_logits = jax.lax.while_loop(cond, body, state)
    out_tokens, out_logits, lengths = maybe_replicated(sharding, (out_tokens, out_logits, lengths))
    cache = maybe_constrain_cache(sharding, cache)
    return out_tokens, (out_logits if return_logits else None), cache, lengths
