"""An EAGLE-style draft head (Li et al., 2024): the target drafts for itself from its own
features. Device code: pure JAX.

The target's feature f_j is its final norm's output at position j (what its output head
reads: `Transformer(features=True)`). The head reads f_j beside the embedding of the token
that follows, x_{j+1}, mixes them (`fc`: [f_j, e(x_{j+1})] 2D -> D) and runs one decoder
layer of the target's architecture over that sequence (its own KV cache, positions as the
target's), predicting f_{j+1}; the target's own output head turns a prediction into the
next token's logits. The target's embedding and head are read, never trained: the head's
parameters are the fc and the layer only.

The head drafts from a draft vocabulary (EAGLE-3's reduced vocabulary): the `vocab` ids
its training text uses most, so its output head is those rows of the target's (a product
of D x |vocab| instead of D x V per drafted token: SmolLM2's 49,152 ids make the full head
costlier than the head's layer). The target verifies over its full vocabulary, so what the
draft vocabulary leaves out costs acceptance, never exactness.

Drafting past the known features feeds the head its own predictions: a drafted token t at
position j + 1 enters as [f̂_{j+1}, e(t)].
"""

from __future__ import annotations

import dataclasses
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from kvjax.cache.paged import BatchInfo, PagedKVCache, model_positions
from kvjax.config import ModelConfig
from kvjax.model.layers import row_dot, row_log_softmax
from kvjax.model.layout import unstored
from kvjax.model.plan import FAST, NumericsPlan
from kvjax.model.transformer import Block, head_logits, output_weights

FEATURE_WEIGHT = 1.0  # EAGLE's loss: smooth L1 on the features ...
TOKEN_WEIGHT = 0.1  # ... plus 0.1 x cross-entropy to the target's next-token distribution
LOSS_WEIGHTS = (FEATURE_WEIGHT, TOKEN_WEIGHT)  # `head_loss`'s default (feature, token)


def head_config(target: ModelConfig) -> ModelConfig:
    """The head's decoder layer: one layer of the target's kind, full attention."""
    return dataclasses.replace(target, num_layers=1,
                               layer_types=("full",) if target.layer_types else ())


class EagleHead(nn.Module):
    """[f_j, e(x_{j+1})] -> f̂_{j+1} (module docstring). `config` is the head's
    (`head_config(target)`)."""

    config: ModelConfig
    plan: NumericsPlan = FAST

    @nn.compact
    def __call__(self, features: jax.Array, embeddings: jax.Array, positions: jax.Array,
                 cache: PagedKVCache | None = None, batch: BatchInfo | None = None
                 ) -> tuple[jax.Array, PagedKVCache | None]:
        """features, embeddings [B, T, D], positions int32[B, T] -> ([B, T, D], cache)."""
        # the plan's product (its row block, or kvjax's CPU kernel): XLA's own choice gives a
        # row other bits at another row count (a catch-up of 4 pairs vs a prefill of 64)
        x = nn.Dense(self.config.d_model, dtype=self.config.dtype,
                     dot_general=row_dot(self.plan, "eagle fc"), name="fc")(
            jnp.concatenate([features, embeddings.astype(features.dtype)], axis=-1))
        return Block(self.config, 0, plan=self.plan, name="layer_0")(
            x, positions, cache, batch, None)


def embed(target_params: dict, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """The target's input embeddings [..., D] of `tokens` (canonical parameters)."""
    x = jnp.take(target_params["embed"]["embedding"], tokens, axis=0)
    if config.embed_scale:
        x = x * jnp.asarray(config.d_model**0.5, x.dtype)
    return x


def draft_head(target_params: dict, config: ModelConfig, vocab) -> jax.Array:
    """[|vocab|, D]: the rows of the target's output head for the draft vocabulary `vocab`
    int32[|vocab|]."""
    return jnp.take(output_weights(target_params, config), jnp.asarray(vocab), axis=0)


def head_products(config: ModelConfig, vocab: int) -> dict:
    """The head's token-row products beyond its layer's ({name: (weight shape, contracted
    weight axes)}, as `kvjax.model.tiled.choose_blocks` probes them) for the target
    `config` and a draft vocabulary of `vocab` ids: the fusion `fc` ([2D, D]) and the draft
    logits (the target's head rows [vocab, D])."""
    d = config.d_model
    return {"eagle fc": ((2 * d, d), (0,)), "eagle logits": ((vocab, d), (1,))}


def draft_log_probs(config: ModelConfig, pred: jax.Array, head: jax.Array,
                    plan: NumericsPlan = FAST) -> jax.Array:
    """Log-probabilities [..., R] (float32) over the draft vocabulary of predictions
    [..., D] (`head`: `draft_head` [R, D]): the plan's product, and a log-softmax whose sum
    runs in a fixed order (`row_log_softmax`), so a row's drafts do not depend on the rows
    beside it."""
    return row_log_softmax(head_logits(config, pred, head, row_dot(plan, "eagle logits")))


def init_head(config: ModelConfig, seed: int = 0) -> dict:
    """Random head parameters for the target `config` (float32)."""
    x = jnp.zeros((1, 1, config.d_model), jnp.float32)
    pos = jnp.zeros((1, 1), jnp.int32)
    return EagleHead(head_config(config)).init(jax.random.PRNGKey(seed), x, x, pos)["params"]


@partial(jax.jit, static_argnames=("config", "top_k", "plan"), donate_argnames=("cache",))
def head_extend(head_params: dict, target_params: dict, config: ModelConfig,
                cache: PagedKVCache, features: jax.Array, tokens: jax.Array,
                batch: BatchInfo, head: jax.Array, top_k: int, plan: NumericsPlan = FAST
                ) -> tuple[tuple[jax.Array, jax.Array, jax.Array], PagedKVCache]:
    """Appends [features, e(tokens)] ([B, T, D], int32[B, T]) to the head's paged cache
    (a pool of `head_config(config)`; `batch` as for `kvjax.decode.steps.extend`, trees
    included); returns ((the `top_k` best log-probabilities [B, T, top_k] of the next token
    over the draft vocabulary (`head`: `draft_head`), their columns int32[B, T, top_k],
    the predicted features [B, T, D]), cache): the host gets a few numbers per node, not a
    distribution. `config` is the target's; `head_params` are stored as `plan` takes them
    (`kvjax.model.layout.store`). Donates `cache`."""
    positions = model_positions(batch, tokens.shape[1])
    pred, cache = EagleHead(head_config(config), plan).apply(
        {"params": unstored(head_params, plan)}, features,
        embed(target_params, config, tokens), positions, cache, batch)
    best, columns = jax.lax.top_k(draft_log_probs(config, pred, head, plan), top_k)
    return (best, columns, pred), cache


def head_loss(head_params: dict, target_params: dict, config: ModelConfig,
              features: jax.Array, tokens: jax.Array, mask: jax.Array, vocab: jax.Array,
              noise: jax.Array | None = None,
              weights: tuple[float, float] = LOSS_WEIGHTS) -> tuple[jax.Array, dict]:
    """EAGLE's teacher-forced loss over windows of a recorded text.

    features [B, T + 1, D]: the target's f_0 .. f_T; tokens int32[B, T + 1]: x_0 .. x_T;
    mask [B, T + 1]: where the loss counts (position j + 1 is f_{j+1}'s, the prediction
    from [f_j, e(x_{j+1})]); `noise` [B, T, D] is added to the input features (EAGLE
    trains with uniform noise so drafting past its own predictions stays on course).
    The token term compares distributions over the draft vocabulary `vocab`. `weights` are
    (feature, token): EAGLE's (1, 0.1) by default; EAGLE-3 drops the feature term (0, 1), so
    the head is judged only by the tokens it drafts. Returns (loss, {"feature": smooth L1,
    "token": cross-entropy, "top1": how often the head's argmax over `vocab` is the
    target's}).
    """
    inputs = features[:, :-1] if noise is None else features[:, :-1] + noise
    positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32),
                                 inputs.shape[:2])
    pred, _ = EagleHead(head_config(config)).apply(
        {"params": head_params}, inputs, embed(target_params, config, tokens[:, 1:]),
        positions)
    want = jax.lax.stop_gradient(features[:, 1:])
    weight = mask[:, 1:].astype(jnp.float32)
    count = jnp.maximum(weight.sum(), 1.0)
    feature = (optax.huber_loss(pred, want).mean(-1) * weight).sum() / count
    head = draft_head(target_params, config, vocab)
    target_logits = jax.lax.stop_gradient(head_logits(config, want, head))
    logits = head_logits(config, pred, head)
    p = jax.nn.softmax(target_logits)
    token = (optax.softmax_cross_entropy(logits, p) * weight).sum() / count
    top1 = ((logits.argmax(-1) == target_logits.argmax(-1)) * weight).sum() / count
    loss = weights[0] * feature + weights[1] * token
    return loss, {"feature": feature, "token": token, "top1": top1}
