"""Hugging Face `config.json` <-> `ModelConfig`, per family: what each option means to kvjax.

Supported families: Llama (RoPE scaling: linear, dynamic, llama3, yarn), Mistral (sliding
window), Qwen2 (QKV bias, per-layer windows), Qwen3 (q/k norms), Phi-3 (fused projections),
Gemma 2 (soft-capping, alternating windows, sandwich norms, tanh-GELU gate, scaled
embeddings), Gemma 3 text (local and global RoPE bases, q/k norms) and GPT-2 (learned
positions, LayerNorm, tanh-GELU). Anything else, or an option kvjax does not implement, is a
clear error naming it: a checkpoint is never loaded into a model that would compute
something else.

The contract is the table `OPTIONS`: for each family, every `config.json` option that bears
on what the model computes, the default `transformers` (5.x) gives it when the key is
missing, and whether kvjax maps it onto `ModelConfig`, ignores it (it changes nothing at
inference), or implements only some values (any other is refused). `_resolve` checks it;
`_window` adds the one rule that spans options (Qwen2's per-layer windows). `hf_config` is
the way back: the family that expresses a `ModelConfig` and its `config.json`.
"""

from __future__ import annotations

from typing import Any

from kvjax.config import ConfigError, ModelConfig
from kvjax.io.hf_rope import kind_of, per_layer_type, theta_of
from kvjax.io.hf_rope import scaling as rope_scaling
from kvjax.io.hf_rope import unsupported as rope_unsupported

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")
GEMMA = ("gemma2", "gemma3_text")
FAMILIES = (*LLAMA_LIKE, "gpt2")


class CheckpointError(ValueError):
    """An unsupported architecture or option, a missing or misshapen tensor."""


MAPPED = "mapped"  # any value ModelConfig accepts; mapped onto its fields in config_from_hf
NO_EFFECT = "no effect"  # changes nothing at inference: dropout, init, token ids, caching


def _ignored(*options: str) -> dict[str, tuple[Any, str]]:
    return dict.fromkeys(options, (None, NO_EFFECT))


def _shape(vocab, hidden, ff, layers, heads, kv, positions, head_dim=None):
    """The size options of a family and the defaults transformers gives them."""
    return {"vocab_size": (vocab, MAPPED), "hidden_size": (hidden, MAPPED),
            "intermediate_size": (ff, MAPPED), "num_hidden_layers": (layers, MAPPED),
            "num_attention_heads": (heads, MAPPED),
            "num_key_value_heads": (kv, MAPPED),  # None / null: num_attention_heads
            "head_dim": (head_dim, MAPPED),  # None: hidden_size // num_attention_heads
            "max_position_embeddings": (positions, MAPPED)}


# option: (the default transformers gives a missing key, what kvjax implements), where what
# kvjax implements is MAPPED, NO_EFFECT, a tuple of the only values it implements, or a
# function naming why a value is not implemented (None: implemented).
_LLAMA_LIKE = {
    "rms_norm_eps": (1e-6, MAPPED),
    "tie_word_embeddings": (False, MAPPED),
    "rope_theta": (10000.0, MAPPED),  # rope_parameters["rope_theta"] wins when both are set
    # checked by kvjax.io.hf_rope; a dict per layer type only where the family has layer
    # types (_rope)
    "rope_parameters": (None, rope_unsupported),
    "rope_scaling": (None, rope_unsupported),  # the 4.x name; replaces rope_parameters
    "partial_rotary_factor": (None, (None, 1.0)),
    "hidden_act": ("silu", ("silu", "swish")),  # SwiGLU: both names are SiLU
    "quantization_config": (None, (None,)),  # quantized weights (GPTQ, AWQ, ...): not read
    **_ignored("attention_dropout", "initializer_range", "use_cache", "pad_token_id",
               "bos_token_id", "eos_token_id", "dtype", "torch_dtype"),
}
_QWEN_WINDOWS = {
    # Layers at index >= max_window_layers slide when use_sliding_window; layer_types,
    # when given, says it per layer (_layers).
    "use_sliding_window": (False, MAPPED), "sliding_window": (4096, MAPPED),
    "max_window_layers": (28, MAPPED), "layer_types": (None, MAPPED),
}
_GEMMA = _LLAMA_LIKE | {
    "hidden_act": (None, NO_EFFECT),  # unread: hidden_activation is the MLP's
    "hidden_activation": ("gelu_pytorch_tanh", ("gelu_pytorch_tanh",)),  # tanh-GELU gate
    "attention_bias": (False, MAPPED),  # q, k, v and o biases
    "query_pre_attn_scalar": (256, MAPPED),  # scores scaled by its -1/2 power
    "sliding_window": (4096, MAPPED), "layer_types": (None, MAPPED),
    "use_bidirectional_attention": (None, (None, False)),  # an encoder's attention
    "tie_word_embeddings": (True, MAPPED),
    **_ignored("cache_implementation"),
}
OPTIONS: dict[str, dict[str, tuple[Any, Any]]] = {
    "llama": _LLAMA_LIKE | _shape(32000, 4096, 11008, 32, 32, None, 2048) | {
        "attention_bias": (False, MAPPED),  # qkv_bias and o_bias together
        "mlp_bias": (False, MAPPED),
        "pretraining_tp": (1, NO_EFFECT),  # 4.x sliced the matmuls and summed: same math
    },
    "mistral": _LLAMA_LIKE | _shape(32000, 4096, 14336, 32, 32, 8, 131072) | {
        "sliding_window": (4096, MAPPED),  # every layer; null: full attention
        "layer_types": (None, MAPPED),  # unread by transformers' Mistral: must agree (_layers)
        **_ignored("attention_bias", "mlp_bias"),  # Mistral has no biases; unread
    },
    "qwen2": _LLAMA_LIKE | _shape(151936, 4096, 22016, 32, 32, 32, 32768) | _QWEN_WINDOWS | {
        **_ignored("attention_bias", "mlp_bias"),  # always q/k/v biases only; unread
    },
    "qwen3": _LLAMA_LIKE | _shape(151936, 4096, 22016, 32, 32, 32, 32768, 128) | _QWEN_WINDOWS
    | {"attention_bias": (False, MAPPED)},  # q, k, v and o biases; q/k norms always
    "phi3": _LLAMA_LIKE | _shape(32064, 3072, 8192, 32, 32, None, 4096) | {
        "rms_norm_eps": (1e-5, MAPPED),
        "sliding_window": (None, MAPPED),  # every layer; null: full attention
        "original_max_position_embeddings": (4096, NO_EFFECT),  # read by longrope only
        **_ignored("resid_pdrop", "embd_pdrop"),
    },
    "gemma2": _GEMMA | _shape(256000, 2304, 9216, 26, 8, 4, 8192, 256) | {
        "final_logit_softcapping": (30.0, MAPPED), "attn_logit_softcapping": (50.0, MAPPED),
    },
    "gemma3_text": _GEMMA | _shape(262208, 2304, 9216, 26, 8, 4, 131072, 256) | {
        "final_logit_softcapping": (None, MAPPED), "attn_logit_softcapping": (None, MAPPED),
        "rope_theta": (1_000_000.0, MAPPED),  # the full layers'
        "rope_local_base_freq": (10_000.0, MAPPED),  # the sliding layers' (4.x name)
        "sliding_window_pattern": (6, MAPPED),  # every 6th layer full (4.x; layer_types wins)
        "use_bidirectional_attention": (False, (None, False)),
    },
    "gpt2": {
        "vocab_size": (50257, MAPPED), "n_positions": (1024, MAPPED), "n_embd": (768, MAPPED),
        "n_layer": (12, MAPPED), "n_head": (12, MAPPED),
        "n_inner": (None, MAPPED),  # None: 4 * n_embd
        "layer_norm_epsilon": (1e-5, MAPPED), "tie_word_embeddings": (True, MAPPED),
        "activation_function": ("gelu_new", ("gelu_new", "gelu_pytorch_tanh")),  # tanh GELU
        "scale_attn_weights": (True, (True,)),  # False: scores not scaled by 1/sqrt(head_dim)
        "scale_attn_by_inverse_layer_idx": (False, (False,)),  # True: also / (layer + 1)
        "reorder_and_upcast_attn": (False, (False,)),  # mixed-precision score order
        "add_cross_attention": (False, (False,)),  # encoder-decoder use; kvjax has no encoder
        "pruned_heads": ({}, ({}, None)),  # 4.x: heads cut out of c_attn
        "quantization_config": (None, (None,)),
        **_ignored("resid_pdrop", "embd_pdrop", "attn_pdrop", "initializer_range",
                   "summary_type", "summary_use_proj", "summary_activation",
                   "summary_proj_to_labels", "summary_first_dropout", "n_ctx", "use_cache",
                   "pad_token_id", "bos_token_id", "eos_token_id", "dtype", "torch_dtype"),
    },
}
# transformers' other names for GPT-2 options (its `attribute_map`).
ALIASES = {"gpt2": {"hidden_size": "n_embd", "max_position_embeddings": "n_positions",
                    "num_attention_heads": "n_head", "num_hidden_layers": "n_layer"}}


def _resolve(family: str, hf: dict) -> dict[str, Any]:
    """Every option of `OPTIONS[family]`: its value in `hf`, or the default; refuses values
    kvjax does not implement."""
    hf = dict(hf)
    for alias, name in ALIASES.get(family, {}).items():
        if alias in hf:
            if name in hf and hf[name] != hf[alias]:
                raise CheckpointError(f"{family} {name}={hf[name]!r} disagrees with its alias "
                                      f"{alias}={hf[alias]!r}")
            hf[name] = hf[alias]
    values = {}
    for name, (default, implemented) in OPTIONS[family].items():
        value = values[name] = hf.get(name, default)
        if implemented in (MAPPED, NO_EFFECT):
            continue
        if isinstance(implemented, tuple):
            why = None if value in implemented else f"kvjax implements only {implemented}"
        else:
            why = implemented(value)
        if why:
            raise CheckpointError(f"{family} {name}={value!r} is not supported: {why}")
    return values


def _default_types(family: str, v: dict) -> list[str]:
    """transformers' layer types when config.json names none."""
    n = v["num_hidden_layers"]
    if family == "gemma2":  # sliding first, then alternating
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    if family == "gemma3_text":
        every = v["sliding_window_pattern"]
        return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    window = v["sliding_window"] if v["use_sliding_window"] else None
    return ["sliding_attention" if window is not None and i >= v["max_window_layers"]
            else "full_attention" for i in range(n)]


def _layers(family: str, v: dict) -> tuple[int | None, tuple[str, ...]]:
    """(sliding_window, layer_types) of ModelConfig: the window each layer has in
    transformers."""
    if family == "llama":
        return None, ()
    if family in ("mistral", "phi3"):
        window = v["sliding_window"]
        implied = ["full_attention" if window is None else "sliding_attention"] * \
            v["num_hidden_layers"]
        if v.get("layer_types") is not None and list(v["layer_types"]) != implied:
            raise CheckpointError(f"{family} layer_types={v['layer_types']!r} is not "
                                  f"supported: transformers ignores it and gives every layer "
                                  f"sliding_window={window!r}")
        return window, ()
    types = list(v["layer_types"] or _default_types(family, v))
    if len(types) != v["num_hidden_layers"] or \
            not set(types) <= {"full_attention", "sliding_attention"}:
        raise CheckpointError(f"{family} layer_types={types!r} is not supported: "
                              f"{v['num_hidden_layers']} of full_attention or "
                              f"sliding_attention expected")
    window = v["sliding_window"]
    if family in ("qwen2", "qwen3") and not v["use_sliding_window"]:
        window = None
    if "sliding_attention" in types and window is None:
        raise CheckpointError(f"{family} layer_types={types!r} is not supported: sliding "
                              f"layers without a window")
    if "sliding_attention" not in types:
        return None, ()
    if "full_attention" not in types:
        return window, ()
    return window, tuple("sliding" if t == "sliding_attention" else "full" for t in types)


def _rope(family: str, v: dict) -> dict[str, Any]:
    """ModelConfig's rope_theta, rope_scaling and local_rope_theta, as transformers reads
    them: Gemma 3 from a dict per layer type (transformers 5) or 4.x's rope_theta,
    rope_local_base_freq and rope_scaling (merged into the full layers')."""
    params, legacy = v["rope_parameters"] or {}, v["rope_scaling"] or {}
    per_type = per_layer_type(params)
    positions = v["max_position_embeddings"]
    try:
        if family != "gemma3_text":
            if per_type:
                raise ValueError(f"rope_parameters={params!r}: RoPE parameters per layer "
                                 f"type are Gemma 3's")
            rope = legacy or params  # 4.x: rope_scaling beside a top-level rope_theta
            if family == "phi3" and kind_of(rope) != "default":
                raise ValueError(f"rope type {kind_of(rope)!r}: transformers' Phi-3 takes "
                                 f"only plain RoPE and longrope")
            return {"rope_theta": theta_of(rope, theta_of(params, v["rope_theta"])),
                    "rope_scaling": rope_scaling(rope, positions, rope)}
        if params and not per_type:
            raise ValueError(f"rope_parameters={params!r}: Gemma 3 names its layer types "
                             f"(transformers ignores a flat dict)")
        full = {**params.get("full_attention", {}), **legacy}
        local = params.get("sliding_attention", {})
        if rope_scaling(local, positions, local):
            raise ValueError(f"rope_parameters={params!r}: scaled RoPE on the sliding layers")
        return {"rope_theta": theta_of(full, v["rope_theta"]),
                "rope_scaling": rope_scaling(full, positions, params or legacy),
                "local_rope_theta": theta_of(local, v["rope_local_base_freq"])}
    except ValueError as e:
        raise CheckpointError(f"{family} rope is not supported: {e}") from e


def _llama_like(family: str, v: dict) -> ModelConfig:
    heads = v["num_attention_heads"]
    window, types = _layers(family, v)
    bias = family in ("llama", "qwen3", *GEMMA) and bool(v["attention_bias"])
    fields = dict(
        vocab_size=v["vocab_size"], num_layers=v["num_hidden_layers"],
        d_model=v["hidden_size"], num_heads=heads, num_kv_heads=v["num_key_value_heads"] or heads,
        head_dim=v["head_dim"] or v["hidden_size"] // heads, d_ff=v["intermediate_size"],
        max_seq_len=v["max_position_embeddings"], norm="rms", norm_eps=v["rms_norm_eps"],
        position="rope", mlp="swiglu", qkv_bias=family == "qwen2" or bias, o_bias=bias,
        mlp_bias=family == "llama" and bool(v["mlp_bias"]), sliding_window=window,
        layer_types=types, qk_norm=family in ("qwen3", "gemma3_text"),
        tie_embeddings=bool(v["tie_word_embeddings"]), **_rope(family, v))
    if family in GEMMA:  # a query scale of 1/sqrt(head_dim) is the default (None)
        scalar = v["query_pre_attn_scalar"]
        fields |= dict(mlp="geglu", sandwich_norms=True, embed_scale=True,
                       query_scale=None if scalar == fields["head_dim"] else scalar ** -0.5,
                       attn_softcap=v["attn_logit_softcapping"],
                       final_softcap=v["final_logit_softcapping"])
    return ModelConfig(**fields)


def config_from_hf(hf: dict) -> ModelConfig:
    """Maps a Hugging Face `config.json` dict to a ModelConfig, refusing what kvjax lacks."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise CheckpointError(f"unsupported architecture model_type={family!r} "
                              f"(supported: {', '.join(FAMILIES)})")
    v = _resolve(family, hf)
    try:
        if family != "gpt2":
            return _llama_like(family, v)
        d = v["n_embd"]
        return ModelConfig(
            vocab_size=v["vocab_size"], num_layers=v["n_layer"], d_model=d,
            num_heads=v["n_head"], num_kv_heads=v["n_head"], d_ff=v["n_inner"] or 4 * d,
            max_seq_len=v["n_positions"], norm="layer", norm_eps=v["layer_norm_epsilon"],
            position="learned", mlp="gelu", qkv_bias=True, o_bias=True, mlp_bias=True,
            tie_embeddings=bool(v["tie_word_embeddings"]))
    except ConfigError as e:
        raise CheckpointError(f"{family} config.json is not a valid kvjax model: {e}") from e


def family_of(c: ModelConfig) -> str:
    """The Hugging Face family that expresses `c` (CheckpointError: none does)."""
    if c.layer_types or c.rope_scaling or c.local_rope_theta is not None or c.qk_norm \
            or c.query_scale is not None or c.attn_softcap is not None or c.final_softcap \
            is not None or c.sandwich_norms or c.embed_scale or c.mlp == "geglu":
        raise CheckpointError("export is implemented for llama, mistral, qwen2 and gpt2 "
                              "without RoPE scaling, per-layer windows, q/k norms or "
                              "Gemma's options")
    if (c.position == "learned" and c.norm == "layer" and c.mlp == "gelu" and c.qkv_bias
            and c.o_bias and c.mlp_bias and c.num_kv_heads == c.num_heads and c.tie_embeddings
            and c.head_dim * c.num_heads == c.d_model and c.sliding_window is None
            and c.causal):
        return "gpt2"
    if c.position != "rope" or c.norm != "rms" or c.mlp != "swiglu" or not c.causal:
        raise CheckpointError("no supported Hugging Face family expresses this config")
    if c.sliding_window is not None and not (c.qkv_bias or c.o_bias or c.mlp_bias):
        return "mistral"
    if c.qkv_bias and not c.o_bias and not c.mlp_bias:
        return "qwen2"
    if c.sliding_window is not None:
        raise CheckpointError("a sliding window needs no biases (mistral) or q/k/v biases only "
                              "(qwen2)")
    if c.qkv_bias != c.o_bias:
        raise CheckpointError("llama's attention_bias covers q, k, v and o together")
    return "llama"


def hf_config(config: ModelConfig) -> dict:
    """The `config.json` dict of the Hugging Face family that expresses `config`."""
    c, family = config, family_of(config)
    if family == "gpt2":
        return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                "vocab_size": c.vocab_size, "n_positions": c.max_seq_len, "n_embd": c.d_model,
                "n_layer": c.num_layers, "n_head": c.num_heads, "n_inner": c.d_ff,
                "activation_function": "gelu_new", "layer_norm_epsilon": c.norm_eps,
                "tie_word_embeddings": True}
    arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM"}[family]
    out = {"model_type": family, "architectures": [arch], "vocab_size": c.vocab_size,
           "hidden_size": c.d_model, "intermediate_size": c.d_ff,
           "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
           "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
           "max_position_embeddings": c.max_seq_len, "rms_norm_eps": c.norm_eps,
           "rope_theta": c.rope_theta, "hidden_act": "silu",
           "tie_word_embeddings": c.tie_embeddings}
    if family == "llama":
        out |= {"attention_bias": c.qkv_bias, "mlp_bias": c.mlp_bias}
    if family == "mistral":
        out["sliding_window"] = c.sliding_window
    if family == "qwen2":  # a window covers every layer: none is below max_window_layers
        out |= {"use_sliding_window": c.sliding_window is not None,
                "sliding_window": c.sliding_window, "max_window_layers": 0}
    return out
