"""Frozen configuration dataclasses (TOML and `--set a.b=c` overrides: kvjax.config_files).

Every config is a frozen (hashable) dataclass, a static argument of jitted functions;
variants are made with `dataclasses.replace`. Each error of validation names its key.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, ClassVar


class ConfigError(ValueError):
    """A config key is unknown, has the wrong type, or has an invalid value."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}")

    def under(self, section: str) -> ConfigError:
        return ConfigError(f"{section}.{self.key}", str(self).split(": ", 1)[1])


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


def _choice(value: Any, key: str, choices: tuple[str, ...]) -> None:
    _require(value in choices, key, f"{value!r} is not one of {', '.join(map(repr, choices))}")


# the RoPE scalings ModelConfig.rope_scaling names and the numbers each needs
ROPE_SCALING = {
    "linear": ("factor",),
    # plain RoPE up to original_max_position_embeddings, where transformers' NTK update starts
    "dynamic": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
             "beta_slow", "truncate"),
}

@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer; every block is chosen here."""

    vocab_size: int = 256
    num_layers: int = 2
    d_model: int = 64
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: int | None = None  # defaults to d_model // num_heads
    d_ff: int = 256
    max_seq_len: int = 512
    norm: str = "rms"  # "rms" | "layer"
    norm_eps: float = 1e-5
    position: str = "rope"  # "rope" | "learned"
    rope_theta: float = 10000.0
    mlp: str = "swiglu"  # "swiglu" | "gelu"
    qkv_bias: bool = False
    o_bias: bool = False  # bias on the attention output projection
    mlp_bias: bool = False  # biases on the MLP projections
    sliding_window: int | None = None  # a query sees itself and the window - 1 keys before it
    # per layer, "full" or "sliding" (with `sliding_window`); (): every layer has the window
    layer_types: tuple[str, ...] = ()
    # RoPE scaling of the full layers, (name, value) pairs: ("rope_type", "linear" | "llama3"
    # | "yarn" | "dynamic") and its numbers (ROPE_SCALING, layers.rope_frequencies); (): none
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    local_rope_theta: float | None = None  # RoPE base of the sliding layers (None: rope_theta)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    query_scale: float | None = None  # scores' scale (None: 1/sqrt(head_dim))
    attn_softcap: float | None = None  # scores become cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # logits likewise
    sandwich_norms: bool = False  # a norm after attention and after the MLP too (Gemma 2/3)
    embed_scale: bool = False  # embeddings times sqrt(d_model) in the model dtype (Gemma)
    tie_embeddings: bool = True
    causal: bool = True
    dtype: str = "float32"  # parameter and activation dtype

    # fields moved to the numerics plan (`kvjax.model.plan`) -> where a config file sets them
    MOVED: ClassVar[dict[str, str]] = {
        "numerics": "engine.numerics (the engine's NumericsPlan.mode)",
        "row_block": "engine.row_block (NumericsPlan.row_block)",
        "row_blocks": "kvjax.model.plan.NumericsPlan.row_blocks (the engine's probe)",
        "transposed": "engine.transposed_kernels (NumericsPlan.transposed)",
        "fused": "engine.fused_projections (NumericsPlan.fused)"}

    def __post_init__(self):
        for key in ("vocab_size", "num_layers", "d_model", "num_heads", "num_kv_heads", "d_ff",
                    "max_seq_len"):
            _require(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")
        _require(self.num_heads % self.num_kv_heads == 0, "num_kv_heads",
                 f"{self.num_kv_heads} must divide num_heads ({self.num_heads})")
        if self.head_dim is None:
            _require(self.d_model % self.num_heads == 0, "head_dim",
                     f"not set and d_model ({self.d_model}) is not divisible by num_heads "
                     f"({self.num_heads})")
            object.__setattr__(self, "head_dim", self.d_model // self.num_heads)
        _require(self.head_dim >= 1, "head_dim", f"must be >= 1, got {self.head_dim}")
        _require(self.position != "rope" or self.head_dim % 2 == 0, "head_dim",
                 f"RoPE needs an even head_dim, got {self.head_dim}")
        _choice(self.norm, "norm", ("rms", "layer"))
        _choice(self.position, "position", ("rope", "learned"))
        _choice(self.mlp, "mlp", ("swiglu", "geglu", "gelu"))
        _choice(self.dtype, "dtype", ("float32", "bfloat16"))
        _require(self.norm_eps > 0, "norm_eps", f"must be > 0, got {self.norm_eps}")
        _require(self.rope_theta > 0, "rope_theta", f"must be > 0, got {self.rope_theta}")
        _require(self.sliding_window is None or self.sliding_window >= 1, "sliding_window",
                 f"must be None or >= 1, got {self.sliding_window}")
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.layer_types:
            _require(len(self.layer_types) == self.num_layers, "layer_types",
                     f"{len(self.layer_types)} given for {self.num_layers} layers")
            for kind in self.layer_types:
                _choice(kind, "layer_types", ("full", "sliding"))
            _require("sliding" not in self.layer_types or self.sliding_window is not None,
                     "layer_types", "sliding layers need a sliding_window")
        object.__setattr__(self, "rope_scaling", tuple(tuple(p) for p in self.rope_scaling))
        if self.rope_scaling:
            scaling = dict(self.rope_scaling)
            _choice(scaling.get("rope_type"), "rope_scaling", tuple(ROPE_SCALING))
            missing = [k for k in ROPE_SCALING[scaling["rope_type"]] if k not in scaling]
            _require(not missing, "rope_scaling", f"{scaling['rope_type']} needs {missing}")
            _require(scaling["rope_type"] != "dynamic" or self.max_seq_len <= scaling[
                "original_max_position_embeddings"], "max_seq_len",
                f"{self.max_seq_len} is past where dynamic RoPE starts rescaling "
                f"({scaling.get('original_max_position_embeddings')})")
        for key in ("local_rope_theta", "query_scale", "attn_softcap", "final_softcap"):
            value = getattr(self, key)
            _require(value is None or value > 0, key, f"must be None or > 0, got {value}")

    def window(self, layer: int) -> int | None:
        """The attention window of `layer` (None: full attention)."""
        full = bool(self.layer_types) and self.layer_types[layer] == "full"
        return None if full else self.sliding_window

    def rope(self, layer: int) -> tuple[float, tuple[tuple[str, Any], ...]]:
        """(theta, scaling) of `layer`'s RoPE: sliding layers of a model with a
        `local_rope_theta` use it, unscaled."""
        if self.local_rope_theta is not None and self.window(layer) is not None:
            return self.local_rope_theta, ()
        return self.rope_theta, self.rope_scaling

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Every layer's window."""
        return tuple(self.window(i) for i in range(self.num_layers))

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 for MHA, num_heads for MQA)."""
        return self.num_heads // self.num_kv_heads


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: `num_pages` pages of `page_size` token slots each.

    `prefill_chunk` is the one padded chunk length every prefill call uses (a multiple of the
    page size); `attn_block` is the number of cached tokens attention reduces over at a time
    (whole pages). Both are fixed per cache so that a token's arithmetic never depends on
    where its chunk started or how long the cached prefix was.
    """

    page_size: int = 16
    num_pages: int = 256
    # float32 | bfloat16 | int8 | float8_e4m3fn (kvjax.cache.paged) | int4_kivi (cache.kivi)
    dtype: str = "float32"
    prefill_chunk: int = 64
    attn_block: int = 64
    # tiers for evicted full pages, each at most its bytes (0: none; kvjax.cache.tiers)
    host_bytes: int = 0
    disk_dir: str | None = None
    disk_bytes: int = 0

    def __post_init__(self):
        for key, low in (("page_size", 1), ("num_pages", 1), ("prefill_chunk", 1),
                         ("attn_block", 1), ("host_bytes", 0), ("disk_bytes", 0)):
            _require(getattr(self, key) >= low, key, f"must be >= {low}, got {getattr(self, key)}")
        _require((self.disk_dir is None) == (not self.disk_bytes), "disk_bytes", "needs disk_dir")
        _choice(self.dtype, "dtype", ("float32", "bfloat16", "int8", "float8_e4m3fn", "int4_kivi"))
        _require(self.prefill_chunk % self.page_size == 0, "prefill_chunk",
                 f"{self.prefill_chunk} is not a multiple of page_size ({self.page_size})")
        _require(self.attn_block % self.page_size == 0 or self.attn_block < self.page_size,
                 "attn_block", f"{self.attn_block}: not a multiple of page_size {self.page_size}")

    @property
    def block_pages(self) -> int:
        """Pages per attention block."""
        return max(1, self.attn_block // self.page_size)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Sampling after the logits; temperature 0 is greedy. top_k 0 and top_p 1 are off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        _require(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        _require(self.top_k >= 0, "top_k", f"must be >= 0, got {self.top_k}")
        _require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The serving engine: cache pool, batch slots, prefix reuse and scheduling policies."""

    cache: CacheConfig = CacheConfig()
    max_slots: int = 8  # decode batch rows (a request with n samples takes n)
    prefix_cache: bool = True
    partial_page_copy: bool = False  # copy the matching slots of a partly matching page
    eviction: str = "lru"  # a name in kvjax.cache.trie.EVICTION_POLICIES: lru, lfu, fifo
    schedule: str = "fcfs"  # "fcfs" | "lpm" (longest prefix match first)
    decode_steps: int = 16  # on-device decode steps between scheduling rounds
    # prefill calls (one chunk of each prompt being prefilled) a round may run while other
    # sequences decode; 0: prefill every admitted prompt to the end first
    prefill_calls_per_round: int = 1
    # invariant numerics, no speculation: the decode call prefills the prompts with more than
    # one call left in its steps (each step takes every such prompt's next ceil(prefill_chunk
    # / decode_steps) tokens, at least 16). Off by default: one prefill call per round
    # measured as good or better for latency, prefill time and TTFT (docs/benchmarks.md)
    packed_prefill: bool = False
    # after a preemption: "resume" prefills prompt + cached answer (one sample, invariant
    preemption: str = "resume"  # numerics; others recompute); "recompute" decodes it again
    poison_freed: bool = False  # debug: fill freed pages with NaN on device
    evicted_record: int = 65536  # evicted blocks remembered to attribute capacity misses
    mesh: str | None = None  # None: one device; "data=D,model=M" (or a jax.sharding.Mesh)
    attention: str = "auto"  # decode kernel: auto | reference | pallas_gpu | pallas_tpu
    attention_interpret: bool = False  # run a Pallas kernel in interpret mode (CPU tests)
    # the model's and the draft's numerics (`kvjax.model.plan.NumericsPlan`): "invariant": a
    # request's bits depend on its own history alone; "fast" shares prefill-written pages only
    numerics: str = "invariant"
    # invariant numerics: kernels stored transposed where one product of any row count then
    # replaces 32-row blocks (kvjax.model.layout; the costs: docs/numerics.md)
    transposed_kernels: bool = True
    row_block: int = 32  # invariant numerics: the largest row block the probe tries
    # q/k/v as one product, gate/up as one (NumericsPlan.fused; not on a mesh)
    fused_projections: bool = True
    # "auto": products and attention by kvjax's CPU kernel (kvjax.cpu) where it runs (a CPU
    # backend, a C++ compiler, no mesh; `Engine.products` says), else XLA's; "products": those
    cpu_kernel: str = "auto"
    # under both CPU kernels, layers alike and no adapters: one loop over them (same bits)
    layer_loop: bool = True
    # tokens every page table covers at least. None: the whole context, one shape from start-up
    # (`runner.decode_context`); 0: grown in powers of two. No bit changes (docs/engine.md)
    min_context: int | None = None

    def __post_init__(self):
        _require((self.min_context or 0) >= 0, "min_context",
                 f"must be >= 0 or None, got {self.min_context}")
        for key in ("max_slots", "decode_steps", "evicted_record"):
            _require(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")
        _require(self.row_block >= 2, "row_block", f"must be >= 2, got {self.row_block}")
        _require(self.prefill_calls_per_round >= 0, "prefill_calls_per_round",
                 f"must be >= 0, got {self.prefill_calls_per_round}")
        _choice(self.schedule, "schedule", ("fcfs", "lpm"))
        _choice(self.numerics, "numerics", ("fast", "invariant"))
        _choice(self.cpu_kernel, "cpu_kernel", ("off", "products", "auto"))
        _choice(self.preemption, "preemption", ("resume", "recompute"))
        _choice(self.attention, "attention", ("auto", "reference", "pallas_gpu", "pallas_tpu"))
        if isinstance(self.mesh, str):
            parse_mesh(self.mesh)


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: which drafter, how many tokens it drafts per target call."""

    drafter: str = "model"  # "model" | "ngram" | "eagle" (an EAGLE-style head's trees)
    gamma: int = 4  # drafts a round: a chain's length, a tree's depth
    adaptive: bool = False  # each call's gamma (<= gamma), or tree width (<= tree_nodes)
    ngram_max: int = 3
    cost_ratio: float | None = None  # c for adaptive gamma; None: measured by the engine
    verify_slope: float | None = None  # extra verify cost per drafted token; None: measured
    tree_nodes: int | None = None  # tree nodes (greedy and sampled rows). None: chains
    branches: int = 4  # an n-gram tree's continuations; an EAGLE tree's offers per level
    rerank: bool = False  # EAGLE trees: EAGLE-2's cut of every level's offers to the best
    # adaptive trees: (node count, v(w) + h(w): kvjax.speculative.cost) pairs; None: measured
    verify_costs: tuple[tuple[int, float], ...] | None = None

    def __post_init__(self):
        _choice(self.drafter, "drafter", ("model", "ngram", "eagle"))
        for key, value in (("cost_ratio", self.cost_ratio), ("verify_slope", self.verify_slope)):
            _require(value is None or value >= 0, key, f"must be >= 0, got {value}")
        _require(1 <= self.gamma <= 32, "gamma", f"must be in [1, 32], got {self.gamma}")
        for key in ("ngram_max", "branches"):
            _require(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")
        _require((self.tree_nodes is None and self.drafter != "eagle") or (
                 self.drafter != "model" and self.gamma < (self.tree_nodes or 0) <= 33),
                 "tree_nodes", f"{self.tree_nodes}: n-gram or EAGLE trees (drafter 'ngram' "
                 "or 'eagle', which drafts trees only) of gamma + 1 to 33 nodes")
        _require(not self.rerank or (self.drafter == "eagle" and not self.adaptive), "rerank",
                 "for EAGLE trees of a fixed size (a cut tree is no prefix of a wider one)")
        if (costs := self.verify_costs) is not None:  # hashable, whatever lists gave them
            costs = tuple((int(n), float(c)) for n, c in costs)
            object.__setattr__(self, "verify_costs", costs)
            _require(self.tree_nodes is not None and self.adaptive and bool(costs) and all(
                n >= 1 and c > 0 for n, c in costs), "verify_costs", f"{costs}: (node count "
                ">= 1, cost > 0) pairs, for adaptive trees (adaptive, tree_nodes)")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """`kvjax train`: AdamW with linear warmup + cosine decay on the stdlib corpus."""

    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 256
    learning_rate: float = 3e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # the cosine decays to learning_rate * min_lr_ratio
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 8
    checkpoint_every: int = 100
    out_dir: str = "checkpoints/run"
    seed: int = 0
    validation_fraction: float = 0.05
    max_files: int | None = None  # use only the first N stdlib files (tests)
    time_limit_s: float | None = None  # checkpoint and stop after this much training time

    def __post_init__(self):
        for key in ("steps", "batch_size", "seq_len", "eval_every", "eval_batches",
                    "checkpoint_every"):
            _require(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")
        _require(self.learning_rate > 0, "learning_rate", "must be > 0")
        _require(0 <= self.warmup_steps < self.steps, "warmup_steps", "must be in [0, steps)")
        _require(0 < self.validation_fraction < 1, "validation_fraction", "must be in (0, 1)")


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
    """What `scripts/quickstart` and `kvjax generate` run."""

    prompts: tuple[str, ...] = ("Hello, kvjax!",)
    max_new_tokens: int = 32
    stop_token: int | None = None
    seed: int = 0  # parameter initialisation seed

    def __post_init__(self):
        _require(self.max_new_tokens >= 1, "max_new_tokens",
                 f"must be >= 1, got {self.max_new_tokens}")
        _require(len(self.prompts) >= 1, "prompts", "needs at least one prompt")


@dataclasses.dataclass(frozen=True)
class Config:
    """A whole TOML file: one table per section. It has one cache config: `[cache]` is the
    engine's cache too (`engine.cache` follows it)."""

    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    sampling: SamplingConfig = SamplingConfig()
    generate: GenerateConfig = GenerateConfig()
    engine: EngineConfig = EngineConfig()
    train: TrainConfig = TrainConfig()
    spec: SpecConfig = SpecConfig()

    def __post_init__(self):
        if self.engine.cache == self.cache:
            return
        if self.engine.cache == CacheConfig():  # the engine's left at its default
            object.__setattr__(self, "engine", dataclasses.replace(self.engine, cache=self.cache))
        elif self.cache == CacheConfig():
            object.__setattr__(self, "cache", self.engine.cache)
        else:
            raise ConfigError("engine.cache", "differs from cache: a config has one cache "
                              "config (set the cache section)")


MESH_AXES = ("data", "model")


def parse_mesh(spec: str | dict[str, int]) -> dict[str, int]:
    """`"data=2,model=4"` (or a dict) -> {"data": 2, "model": 4}; a missing axis is 1."""
    if isinstance(spec, dict):
        sizes = dict(spec)
    else:
        sizes = {}
        for part in filter(None, (p.strip() for p in str(spec).split(","))):
            match = re.fullmatch(r"(\w+)\s*=\s*(\d+)", part)
            if match is None:
                raise ConfigError("mesh", f"{spec!r}: expected 'data=D,model=M', got {part!r}")
            if match[1] in sizes:
                raise ConfigError("mesh", f"{spec!r}: axis {match[1]!r} given twice")
            sizes[match[1]] = int(match[2])
    unknown = sorted(set(sizes) - set(MESH_AXES))
    if unknown:
        raise ConfigError("mesh", f"{spec!r}: unknown axis {unknown[0]!r} (axes: data, model)")
    for axis, size in sizes.items():
        if not isinstance(size, int) or size < 1:
            raise ConfigError("mesh", f"{spec!r}: {axis} must be an integer >= 1, got {size!r}")
    return {axis: sizes.get(axis, 1) for axis in MESH_AXES}
