"""The numerics plan: how a model's arithmetic runs, beside the `ModelConfig` that says
what the model is.

A `ModelConfig` is the architecture alone: two engines with the same config and weights
hold the same model. How its products run is the plan: the mode, each product's row block,
the kernels stored transposed and the projections fused. The engine chooses it at start-up
(`kvjax.engine.plans.numerics_plans` probes the running backend); every step takes it as
a static argument beside the config. Every field changes a token's bits, so the plan is
part of the cache identity (`kvjax.cache.identity.model_fingerprint`). Host code: no JAX.
"""

from __future__ import annotations

import dataclasses

from kvjax.config import ConfigError, ModelConfig

# the token-row products whose row blocks `NumericsPlan.row_blocks` sets ("lora": both
# products of every LoRA delta, `kvjax.model.lora.stacked_delta`; "eagle fc" and "eagle
# logits": an EAGLE head's feature fusion [f, e] 2D -> D and its draft vocabulary's logits,
# `kvjax.speculative.eagle.head_products`)
ROW_PRODUCTS = ("q", "k/v", "qkv", "o", "mlp up", "mlp down", "head", "eagle fc",
                "eagle logits", "lora", "attention")
# those whose kernels the steps may take stored transposed (`NumericsPlan.transposed`)
STORED_PRODUCTS = ("q", "k/v", "qkv", "o", "mlp up", "mlp down", "head")


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


@dataclasses.dataclass(frozen=True)
class NumericsPlan:
    """How the steps run a model's arithmetic (frozen: a static argument of every step)."""

    # "fast": XLA picks each product's kernel by shape, so a token's bits may change with the
    # batch or chunk around it; "invariant": every token-row product runs in row blocks of
    # 2..row_block rows, attention per query, norms and softmax by fixed-order sums, so a
    # token's bits depend on its own history alone (see kvjax.model.tiled)
    mode: str = "fast"
    row_block: int = 32
    # per product, the row block the engine's start-up probe chose ((name, block) pairs for
    # ROW_PRODUCTS; 0 = one product of any row count, which the probe found invariant up to
    # the engine's largest call); a product not named uses row_block
    row_blocks: tuple[tuple[str, int], ...] = ()
    # products whose kernels the steps take stored transposed, each one product of any row
    # count (block 0): see kvjax.model.layout
    transposed: tuple[str, ...] = ()
    # the steps take q, k and v as one product ("qkv") and a gated MLP's gate and up as one
    # ("mlp up"), on kernels concatenated once at load (`kvjax.model.layout.store`); the
    # parameter tree users hold, load and save keeps its separate kernels
    fused: bool = False
    # every product of ROW_PRODUCTS by kvjax's own CPU kernel (`kvjax.cpu.product`): one
    # call of any row count, each row's bits its own by construction (whatever the mode), and
    # a lone row at XLA's one-row speed instead of padded to two; its bits are not XLA's.
    # It reads the kernels as Flax stores them (nothing `transposed`); LoRA deltas, norms and
    # attention run as the mode says
    cpu_kernel: bool = False
    # paged attention by kvjax's CPU kernel (`kvjax.cpu.attention`): each query alone, its
    # keys read in place in ascending position, so its bits are its own whatever the mode
    # (not XLA's bits); float32 and bfloat16 pages, no soft cap (the engine chooses it
    # only there). int4_kivi steps keep XLA's attention
    cpu_attention: bool = False
    # the layers as one loop over stacked parameters (`Transformer.layer_loop`): one block's
    # program for every layer, so compile time does not grow with depth; the same bits (the
    # same operations). Needs both CPU kernels (they read a layer of the stack in place,
    # where XLA's products would copy it out) and layers alike (the same window and RoPE)
    layer_loop: bool = False

    def __post_init__(self):
        _require(self.mode in ("fast", "invariant"), "mode",
                 f"{self.mode!r} is not one of 'fast', 'invariant'")
        _require(self.row_block >= 2, "row_block", f"must be >= 2, got {self.row_block}")
        object.__setattr__(self, "row_blocks", tuple(tuple(p) for p in self.row_blocks))
        for name, block in self.row_blocks:
            _require(name in ROW_PRODUCTS, "row_blocks", f"{name!r} is not a row product")
            _require(block == 0 or block >= 2, "row_blocks",
                     f"{name}: a block is 0 or >= 2, got {block}")
        _require(not self.layer_loop or (self.cpu_kernel and self.cpu_attention),
                 "layer_loop", "the layer loop reads each layer's kernels and pages in "
                 "place by the CPU kernels: cpu_kernel and cpu_attention")
        object.__setattr__(self, "transposed", tuple(self.transposed))
        _require(not (self.cpu_kernel and self.transposed), "transposed",
                 "the CPU kernel reads the kernels as Flax stores them: nothing transposed")
        for name in self.transposed:
            _require(name in STORED_PRODUCTS, "transposed", f"{name!r} is not a stored product")
            _require(self.block(name) == 0, "transposed", f"{name}: a transposed kernel is "
                     f"one product of any row count (row block 0)")
            if name in ("q", "k/v", "qkv"):  # a fused model has "qkv", a plain one q and k/v
                _require((name == "qkv") == self.fused, "transposed",
                         f"{name} is not a product of a {'fused' if self.fused else 'plain'} "
                         f"model (a fused model has 'qkv' for q and k/v)")

    @property
    def invariant(self) -> bool:
        return self.mode == "invariant"

    def block(self, product: str) -> int:
        """The row block of one of ROW_PRODUCTS (see `row_blocks`)."""
        return dict(self.row_blocks).get(product, self.row_block)

    def separate(self) -> NumericsPlan:
        """This plan on the canonical parameter tree: separate q/k/v and gate/up kernels,
        the layers unrolled."""
        if not self.fused and not self.layer_loop:
            return self
        return dataclasses.replace(self, fused=False, layer_loop=False, transposed=tuple(
            p for p in self.transposed if p != "qkv"))

    def check(self, config: ModelConfig) -> NumericsPlan:
        """Itself, when it can run `config`; a ConfigError naming the field otherwise."""
        _require("head" not in self.transposed or not config.tie_embeddings, "transposed",
                 "a tied head is the embedding [V, D], stored transposed already")
        _require(not self.layer_loop or layers_alike(config), "layer_loop",
                 "the layer loop runs one block for every layer: layers with different "
                 "windows or RoPE need the unrolled layers")
        return self


def layers_alike(config: ModelConfig) -> bool:
    """Whether every layer of `config` has one window and one RoPE (the layer loop runs one
    block's program for all)."""
    return len({(config.window(i), config.rope(i)) for i in range(config.num_layers)}) == 1


FAST = NumericsPlan()
# nothing probed: products in row blocks of 32; attention in query tiles of 4, which every
# CPU measured keeps (AVX2 changes a row's bits from 8-row tiles at head_dim 8); the engine
# probes the running backend for larger ones (`kvjax.model.tiled.choose_blocks`)
INVARIANT = NumericsPlan("invariant", row_blocks=(("attention", 4),))

