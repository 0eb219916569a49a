"""The decoder-only Transformer (Flax Linen). The cache goes in and comes back out.

Legend: B batch, T new tokens, N query heads, K kv heads, H head dim, D model width, V vocab.

`Transformer(config)(tokens, positions)` is the full-sequence reference (no cache).
`Transformer(config)(tokens, positions, cache, batch)` extends a paged (or dense baseline)
cache by the new tokens and returns their logits and the new cache.
"""

from __future__ import annotations

import functools
from functools import partial
from typing import TYPE_CHECKING

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import kivi
from kvjax.cache.dense import DenseKVCache, dense_write_kv
from kvjax.cache.paged import BatchInfo, PagedKVCache, write_kv
from kvjax.config import ModelConfig
from kvjax.errors import NonCausalCacheError
from kvjax.model.attention import dense_attention, full_attention, paged_attention_reference
from kvjax.model.kernels import (
    AttentionKernel,
    paged_decode_attention,
    sharded_paged_decode_attention,
)
from kvjax.model.layers import EMBED_INIT, MLP, StackedLinear, apply_rope, make_norm, row_dot
from kvjax.model.lora import add_lora, stack_adapters
from kvjax.model.plan import FAST, NumericsPlan

if TYPE_CHECKING:  # annotations only: the sharding layer sits above the model
    from kvjax.sharding.rules import StepShardings

Cache = PagedKVCache | DenseKVCache | None
Groups = tuple[tuple[int, int], ...]  # a packed step's groups: (sequences, tokens each)


def _write(cache: PagedKVCache, layer: int, k: jax.Array, v: jax.Array, batch: BatchInfo
           ) -> tuple[PagedKVCache, kivi.Fresh | None]:
    """The new tokens' K/V into the cache; int4_kivi pages also return what the queries see
    of their own pages (`kvjax.cache.kivi`)."""
    if cache.open_k is not None:
        return kivi.write(cache, layer, k, v, batch)
    return write_kv(cache, layer, k, v, batch), None


class Attention(nn.Module):
    config: ModelConfig
    layer: int  # the layer the config describes (any one under the layer loop: all alike)
    sharding: StepShardings | None = None
    kernel: AttentionKernel | None = None  # None: the reference for every step
    plan: NumericsPlan = FAST
    stack: int = 0  # > 0: the layer loop's stacked parameters, layer `index`'s used

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array, cache: Cache,
                 batch: BatchInfo | tuple[BatchInfo, ...] | None, adapter_ids: jax.Array | None,
                 groups: Groups | None = None, index: jax.Array | None = None
                 ) -> tuple[jax.Array, Cache]:
        cfg, plan = self.config, self.plan
        lora_block = plan.block("lora") if plan.invariant else None
        at = self.layer if index is None else index  # the cache's layer written and read

        def project(heads: int, name: str, product: str) -> jax.Array:
            # [B, T, D] -> [B, T, heads, H]
            if self.stack:
                return StackedLinear((heads, cfg.head_dim), 1, self.stack, cfg.qkv_bias,
                                     cfg.dtype, name=name)(x, index)
            return nn.DenseGeneral((heads, cfg.head_dim), use_bias=cfg.qkv_bias,
                                   dtype=cfg.dtype, dot_general=row_dot(plan, product),
                                   name=name)(x)

        n, kv = cfg.num_heads, cfg.num_kv_heads
        if plan.fused:  # one product, its heads split after (kvjax.model.layout.fuse)
            q, k, v = jnp.split(project(n + 2 * kv, "qkv", "qkv"), [n, n + kv], axis=2)
        else:
            q, k, v = project(n, "q", "q"), project(kv, "k", "k/v"), project(kv, "v", "k/v")
        q, k, v = (add_lora(self, name, x, y, adapter_ids, block=lora_block)
                   for name, y in (("q", q), ("k", k), ("v", v)))
        if cfg.qk_norm:  # per head, over H
            q = make_norm(cfg, "q_norm", self.stack)(q, index)
            k = make_norm(cfg, "k_norm", self.stack)(k, index)
        if cfg.position == "rope":
            theta, scaling = cfg.rope(self.layer)
            q = apply_rope(q, positions, theta, scaling)
            k = apply_rope(k, positions, theta, scaling)
        window, score = cfg.window(self.layer), self.score_math
        with jax.named_scope("attention"):
            if cache is None:
                out = full_attention(q, k, v, positions, cfg.causal, window, **score)
            elif groups is not None:
                out, cache = self.packed(q, k, v, cache, batch, groups, at)
            elif isinstance(cache, PagedKVCache):
                cache, fresh = _write(cache, at, k, v, batch)
                out = self.paged(q, cache, batch, fresh, at)
            else:
                cache = dense_write_kv(cache, self.layer, k, v, batch)
                out = dense_attention(q, cache, self.layer, batch, window, **score)
        if self.stack:
            y = StackedLinear((cfg.d_model,), 2, self.stack, cfg.o_bias, cfg.dtype,
                              name="o")(out, index)
        else:
            y = nn.DenseGeneral(cfg.d_model, axis=(-2, -1), use_bias=cfg.o_bias,
                                dtype=cfg.dtype, dot_general=row_dot(plan, "o"), name="o")(out)
        return add_lora(self, "o", out, y, adapter_ids, in_dims=2, block=lora_block), cache

    @property
    def score_math(self) -> dict:
        """The attention functions' `scale` and `softcap` arguments for this model."""
        return {"scale": self.config.query_scale, "softcap": self.config.attn_softcap}

    def packed(self, q: jax.Array, k: jax.Array, v: jax.Array, cache: PagedKVCache,
               batches: tuple[BatchInfo, ...], groups: Groups, at) -> tuple[jax.Array, Cache]:
        """A packed step's attention: q, k, v [R, 1, heads, H] hold the rows of every group
        (`groups`: (B, T) each, in order); each group writes its K/V and attends over the
        paged cache as a call of its own would. The groups' sequences own disjoint pages."""
        if not isinstance(cache, PagedKVCache):
            raise TypeError("a packed step needs the paged cache")
        bounds = np.cumsum([0] + [b * t for b, t in groups])

        def part(a: jax.Array, i: int) -> jax.Array:  # group i's [b, t, heads, H]
            return a[bounds[i]: bounds[i + 1], 0].reshape(*groups[i], *a.shape[2:])

        # every write before any read: with a read between two writes XLA copies the
        # whole cache, which made a packed step several times slower
        fresh = []
        for i, info in enumerate(batches):
            cache, f = _write(cache, at, part(k, i), part(v, i), info)
            fresh.append(f)
        outs = [self.paged(part(q, i), cache, info, f, at).reshape(-1, 1, *q.shape[2:])
                for i, (info, f) in enumerate(zip(batches, fresh, strict=True))]
        return jnp.concatenate(outs), cache

    def paged(self, q: jax.Array, cache: PagedKVCache, batch: BatchInfo,
              fresh: kivi.Fresh | None, at) -> jax.Array:
        """[B, T, N, H] attention over the paged cache: a decode step (T == 1) by the kernel
        if one is chosen (under shard_map on a mesh), everything else by the reference;
        invariant numerics and int4_kivi pages (`fresh`) always by the reference; under
        `plan.cpu_attention` every step by kvjax's CPU kernel (`kvjax.cpu.attention`)."""
        kernel, window, plan = self.kernel, self.config.window(self.layer), self.plan
        if plan.cpu_attention and fresh is None:
            from kvjax.cpu.attention import paged_attention

            return paged_attention(q, cache, at, batch, window,
                                   self.config.query_scale).astype(q.dtype)
        if (kernel is None or kernel.backend == "reference" or q.shape[1] != 1 or plan.invariant
                or fresh is not None):
            return paged_attention_reference(q, cache, at, batch, window,
                                             plan.block("attention") if plan.invariant
                                             else None, fresh=fresh, **self.score_math)
        if self.sharding is None:
            return paged_decode_attention(q, cache, at, batch, kernel.backend,
                                          kernel.interpret, window=window, **self.score_math)
        return sharded_paged_decode_attention(
            q, cache, at, batch, kernel.backend, mesh=self.sharding.mesh,
            cache_spec=self.sharding.cache, interpret=kernel.interpret, window=window,
            **self.score_math)


class Block(nn.Module):
    config: ModelConfig
    layer: int
    sharding: StepShardings | None = None
    kernel: AttentionKernel | None = None
    plan: NumericsPlan = FAST
    stack: int = 0  # > 0: the layer loop's stacked parameters, layer `index`'s used

    @nn.compact
    def __call__(self, x, positions, cache, batch, adapter_ids, groups=None, index=None):
        cfg, stack = self.config, self.stack

        def norm(name, y):
            return make_norm(cfg, name, stack)(y, index)

        attn_out, cache = Attention(cfg, self.layer, self.sharding, self.kernel, self.plan,
                                    stack, name="attn")(
            norm("attn_norm", x), positions, cache, batch, adapter_ids, groups, index)
        if cfg.sandwich_norms:
            attn_out = norm("post_attn_norm", attn_out)
        x = x + attn_out
        mlp_out = MLP(cfg, self.plan, stack, name="mlp")(norm("mlp_norm", x), adapter_ids,
                                                          index)
        if cfg.sandwich_norms:
            mlp_out = norm("post_mlp_norm", mlp_out)
        return x + mlp_out, cache


class Transformer(nn.Module):
    """Decoder-only transformer; every piece is chosen by `config`, and how its arithmetic
    runs by `plan` (`kvjax.model.plan`; fast by default).

    With `sharding` (a mesh, see `kvjax.sharding`) the hidden state's batch axis is split
    over the mesh's "data" axis; the weights' and cache's own shardings do the rest.
    `kernel` picks the decode-attention kernel (`kvjax.model.kernels`). `features`: return
    (logits, the final norm's output [B, T, D] at every token, `logits_at` or not) in place
    of the logits: the output head's input, what an EAGLE-style drafter reads
    (`kvjax.speculative.eagle`); the logits are the same computation either way.
    """

    config: ModelConfig
    sharding: StepShardings | None = None
    kernel: AttentionKernel | None = None
    plan: NumericsPlan = FAST
    features: bool = False

    @nn.compact
    def __call__(self, tokens: jax.Array, positions: jax.Array, cache: Cache = None,
                 batch: BatchInfo | tuple[BatchInfo, ...] | None = None,
                 adapter_ids: jax.Array | None = None, logits_at: jax.Array | None = None,
                 groups: Groups | None = None) -> tuple[jax.Array, Cache]:
        """tokens, positions: int32[B, T] -> (logits [B, T, V] float32, cache).

        With a "lora" collection applied, `adapter_ids` int32[B] picks each row's adapter.
        `logits_at` int32[B] computes the output head for that one token per row only
        (logits [B, 1, V]): a prefill needs just its last token's.

        A packed step (`groups`, one `batch` per group): tokens, positions and adapter_ids
        hold every group's tokens one per row, [R, 1] with R = sum of B * T, group after
        group, each group's [B, T] flattened; `logits_at` int32[K] picks the rows the head
        computes (logits [K, 1, V]). Every product and norm runs on the R rows together;
        each group writes and attends as a call of its own (`Attention.packed`).
        """
        cfg = self.config
        if cache is not None and not cfg.causal:
            raise NonCausalCacheError()
        embed = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=EMBED_INIT,
                         dtype=cfg.dtype, name="embed")
        x = embed(tokens)  # [B, T, D]
        if cfg.embed_scale:
            x = x * jnp.asarray(cfg.d_model**0.5, x.dtype)
        if self.sharding is not None:
            x = self.sharding.batch(x)
        if cfg.position == "learned":
            x = x + nn.Embed(cfg.max_seq_len, cfg.d_model, embedding_init=EMBED_INIT,
                             dtype=cfg.dtype, name="pos_embed")(positions)
        if self.plan.layer_loop:
            x, cache = self.layer_loop(x, positions, cache, batch, adapter_ids, groups)
        for layer in range(0 if self.plan.layer_loop else cfg.num_layers):
            x, cache = Block(cfg, layer, self.sharding, self.kernel, self.plan,
                             name=f"layer_{layer}")(
                x, positions, cache, batch, adapter_ids, groups)
        final_norm = make_norm(cfg, "final_norm")
        # features of every token, also where the head reads one per row (`logits_at`): the
        # norm is per token, and the head's rows are normed as they are without features
        features = final_norm(x) if self.features else None  # [B, T, D]
        if logits_at is not None and groups is not None:
            x = x[logits_at]  # [K, 1, D]
        elif logits_at is not None:
            x = jnp.take_along_axis(x, logits_at[:, None, None], axis=1)  # [B, 1, D]
        x = final_norm(x) if logits_at is not None or features is None else features
        dot = row_dot(self.plan, "head")
        if cfg.tie_embeddings:  # x [B, T, D] . embedding [V, D], one product: Flax's
            # `attend` transposes the embedding, and XLA CPU fuses that transpose into a
            # loop about twice as slow as the matrix-vector product
            logits = (dot or jax.lax.dot_general)(x, embed.embedding.astype(x.dtype),
                                                  (((2,), (1,)), ((), ())))
        else:
            logits = nn.Dense(cfg.vocab_size, use_bias=False, dtype=cfg.dtype,
                              dot_general=dot, name="lm_head")(x)
        logits = logits.astype(jnp.float32)
        if cfg.final_softcap is not None:
            logits = jnp.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return ((logits, features) if self.features else logits), cache

    def layer_loop(self, x, positions, cache, batch, adapter_ids, groups):
        """The layers as one loop (`NumericsPlan.layer_loop`): one block's program run for
        each layer on the stacked parameters (`kvjax.model.layout.stack_layers`), its
        kernels and cache read in place at the layer's index, so compile time does not grow
        with depth. Every operation is the unrolled layers': the same bits."""
        if "lora" in self.variables:
            raise ValueError("the layer loop does not apply LoRA adapters: a plan without "
                             "layer_loop serves them")
        cfg, layers = self.config, self.variables["params"]["layers"]
        block = Block(cfg, 0, self.sharding, self.kernel, self.plan, cfg.num_layers,
                      parent=None)

        def body(index, carry):
            x, cache = carry
            return block.apply({"params": layers}, x, positions, cache, batch, adapter_ids,
                               groups, index)

        return jax.lax.fori_loop(0, cfg.num_layers, body, (x, cache))


def output_head(params: dict, config: ModelConfig, features: jax.Array) -> jax.Array:
    """Logits [..., V] (float32) of features [..., D] by the model's output head, the tied
    embedding or `lm_head`, then the final soft-cap: what `Transformer` computes after its
    final norm (canonical parameters; XLA's own product)."""
    return head_logits(config, features, output_weights(params, config))


def output_weights(params: dict, config: ModelConfig) -> jax.Array:
    """[V, D]: the output head's rows, the tied embedding or `lm_head` (canonical params)."""
    if config.tie_embeddings:
        return params["embed"]["embedding"]
    return params["lm_head"]["kernel"].T


def head_logits(config: ModelConfig, features: jax.Array, w: jax.Array,
                dot=None) -> jax.Array:
    """Logits [..., R] (float32) of features [..., D] by head rows w [R, D] (all of the
    output head's, or some: a draft vocabulary's), soft-capped as `config` says; `dot`: a
    plan's product (`kvjax.model.layers.row_dot`), XLA's own when None."""
    logits = (dot or jax.lax.dot_general)(features, w.astype(features.dtype),
                                          (((features.ndim - 1,), (1,)), ((), ())))
    logits = logits.astype(jnp.float32)
    if config.final_softcap is not None:
        logits = jnp.tanh(logits / config.final_softcap) * config.final_softcap
    return logits


def init_params(config: ModelConfig, seed: int = 0) -> dict:
    """Random parameters for `config` (float32), in the canonical tree (separate q/k/v and
    gate/up kernels: `kvjax.model.layout.store` fuses them for a fused plan)."""
    tokens = jnp.zeros((1, 1), jnp.int32)
    return Transformer(config).init(jax.random.PRNGKey(seed), tokens, tokens)["params"]


@functools.lru_cache(maxsize=8)
def param_shapes(config: ModelConfig):
    """The parameter tree of `config` as shapes only (`jax.eval_shape`: nothing allocated)."""
    return jax.eval_shape(lambda: init_params(config))


@partial(jax.jit, static_argnames=("config", "plan", "features"))
def _forward(params: dict, config: ModelConfig, tokens: jax.Array, positions: jax.Array,
             lora: dict | None, adapter_ids: jax.Array | None, plan: NumericsPlan,
             features: bool = False) -> jax.Array:
    variables = {"params": params} if lora is None else {"params": params, "lora": lora}
    out = Transformer(config, plan=plan.separate(), features=features).apply(
        variables, tokens, positions, None, None, adapter_ids)[0]  # the canonical tree
    return out[1] if features else out  # jit drops the unused head


def forward(params: dict, config: ModelConfig, tokens, adapter: dict | None = None,
            position_base: int = 0, plan: NumericsPlan = FAST,
            features: bool = False) -> jax.Array:
    """Full-sequence logits [B, T, V] with no cache: the reference every cached path meets.

    `adapter` is one LoRA adapter (`kvjax.init_adapter`); `position_base` is the position
    of the first token; `plan` how the arithmetic runs (on the canonical parameters).
    `features`: the final norm's output [B, T, D] instead (what the output head reads).
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    positions = position_base + jnp.arange(tokens.shape[1], dtype=jnp.int32)
    positions = jnp.broadcast_to(positions, tokens.shape)
    lora = ids = None
    if adapter is not None:
        lora = stack_adapters(config, [adapter])
        ids = jnp.ones(tokens.shape[0], jnp.int32)
    return _forward(params, config, tokens, positions, lora, ids, plan, features)
