"""Hugging Face `config.json` <-> `ModelConfig`, per family: what each option means to kvjax.

Supported families: Llama, Mistral (sliding window), Qwen2 (QKV bias) and GPT-2 (learned
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

LLAMA_LIKE = ("llama", "mistral", "qwen2")
FAMILIES = (*LLAMA_LIKE, "gpt2")


class CheckpointError(ValueError):
    """An unsupported architecture or option, a missing or misshapen tensor."""


def _plain_rope(rope: dict | None) -> str | None:
    """Why a `rope_parameters` / `rope_scaling` dict is not plain RoPE (None: it is)."""
    if not rope:
        return None
    if not isinstance(rope, dict):
        return "not a dict"
    if any(isinstance(v, dict) for v in rope.values()):
        return "RoPE parameters per layer type are not implemented"
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        return f"rope scaling {kind!r} is not implemented (only plain RoPE)"
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        return "partial rotary embeddings are not implemented (RoPE rotates the whole head)"
    return None


MAPPED = "mapped"  # any value ModelConfig accepts; mapped onto its fields in config_from_hf
NO_EFFECT = "no effect"  # changes nothing at inference: dropout, init, token ids, caching


def _ignored(*options: str) -> dict[str, tuple[Any, str]]:
    return dict.fromkeys(options, (None, NO_EFFECT))


# option: (the default transformers gives a missing key, what kvjax implements), where what
# kvjax implements is MAPPED, NO_EFFECT, a tuple of the only values it implements, or a
# function naming why a value is not implemented (None: implemented).
_LLAMA_LIKE = {
    "head_dim": (None, MAPPED),  # None: hidden_size // num_attention_heads
    "rms_norm_eps": (1e-6, MAPPED),
    "tie_word_embeddings": (False, MAPPED),
    "rope_theta": (10000.0, MAPPED),  # rope_parameters["rope_theta"] wins when both are set
    "rope_parameters": (None, _plain_rope),
    "rope_scaling": (None, _plain_rope),  # the 4.x name; replaces rope_parameters when set
    "partial_rotary_factor": (None, (None, 1.0)),
    "hidden_act": ("silu", ("silu", "swish")),  # SwiGLU: both names are SiLU
    "quantization_config": (None, (None,)),  # quantized weights (GPTQ, AWQ, ...): not read
    **_ignored("attention_dropout", "initializer_range", "use_cache", "pad_token_id",
               "bos_token_id", "eos_token_id", "dtype", "torch_dtype"),
}
OPTIONS: dict[str, dict[str, tuple[Any, Any]]] = {
    "llama": _LLAMA_LIKE | {
        "vocab_size": (32000, MAPPED), "hidden_size": (4096, MAPPED),
        "intermediate_size": (11008, MAPPED), "num_hidden_layers": (32, MAPPED),
        "num_attention_heads": (32, MAPPED),
        "num_key_value_heads": (None, MAPPED),  # None: num_attention_heads
        "max_position_embeddings": (2048, MAPPED),
        "attention_bias": (False, MAPPED),  # qkv_bias and o_bias together
        "mlp_bias": (False, MAPPED),
        "pretraining_tp": (1, NO_EFFECT),  # 4.x sliced the matmuls and summed: same math
    },
    "mistral": _LLAMA_LIKE | {
        "vocab_size": (32000, MAPPED), "hidden_size": (4096, MAPPED),
        "intermediate_size": (14336, MAPPED), "num_hidden_layers": (32, MAPPED),
        "num_attention_heads": (32, MAPPED),
        "num_key_value_heads": (8, MAPPED),  # null: num_attention_heads
        "max_position_embeddings": (131072, MAPPED),
        "sliding_window": (4096, MAPPED),  # every layer; null: full attention
        "layer_types": (None, MAPPED),  # unread by transformers' Mistral: must agree (_window)
        **_ignored("attention_bias", "mlp_bias"),  # Mistral has no biases; unread
    },
    "qwen2": _LLAMA_LIKE | {
        "vocab_size": (151936, MAPPED), "hidden_size": (4096, MAPPED),
        "intermediate_size": (22016, MAPPED), "num_hidden_layers": (32, MAPPED),
        "num_attention_heads": (32, MAPPED),
        "num_key_value_heads": (32, MAPPED),  # null: num_attention_heads
        "max_position_embeddings": (32768, MAPPED),
        # Layers at index >= max_window_layers slide when use_sliding_window; layer_types,
        # when given, says it per layer. kvjax: one window for all layers (_window).
        "use_sliding_window": (False, MAPPED), "sliding_window": (4096, MAPPED),
        "max_window_layers": (28, MAPPED), "layer_types": (None, MAPPED),
        **_ignored("attention_bias", "mlp_bias"),  # always q/k/v biases only; unread
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


def _window(family: str, v: dict) -> int | None:
    """The attention window every layer has in transformers (None: full attention)."""
    if family == "llama":
        return None
    n = v["num_hidden_layers"]
    if family == "mistral":
        window = v["sliding_window"]
        implied = ["full_attention" if window is None else "sliding_attention"] * n
        if v["layer_types"] is not None and list(v["layer_types"]) != implied:
            raise CheckpointError(f"mistral layer_types={v['layer_types']!r} is not supported: "
                                  f"transformers' Mistral ignores it and gives every layer "
                                  f"sliding_window={window!r}")
        return window
    window = v["sliding_window"] if v["use_sliding_window"] else None
    types = v["layer_types"] or [
        "sliding_attention" if window is not None and i >= v["max_window_layers"]
        else "full_attention" for i in range(n)]
    if len(types) != n or not set(types) <= {"full_attention", "sliding_attention"}:
        raise CheckpointError(f"qwen2 layer_types={types!r} is not supported: "
                              f"{n} of full_attention or sliding_attention expected")
    if "sliding_attention" in types and window is None:
        raise CheckpointError(f"qwen2 layer_types={types!r} is not supported: sliding layers "
                              f"without a window (use_sliding_window={v['use_sliding_window']})")
    if len(set(types)) > 1:
        raise CheckpointError(
            f"qwen2 layer_types={types!r} (use_sliding_window={v['use_sliding_window']}, "
            f"max_window_layers={v['max_window_layers']}) is not supported: kvjax gives every "
            f"layer the same attention window")
    return window if types[0] == "sliding_attention" else None


def _rope_theta(v: dict) -> float:
    theta = (v["rope_scaling"] or v["rope_parameters"] or {}).get("rope_theta", v["rope_theta"])
    if not isinstance(theta, (int, float)):
        raise CheckpointError(f"rope_theta={theta!r} is not a number")
    return float(theta)


def config_from_hf(hf: dict) -> ModelConfig:
    """Maps a Hugging Face `config.json` dict to a ModelConfig, refusing what kvjax lacks."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise CheckpointError(f"unsupported architecture model_type={family!r} "
                              f"(supported: {', '.join(FAMILIES)})")
    v = _resolve(family, hf)
    try:
        if family == "gpt2":
            d = v["n_embd"]
            return ModelConfig(
                vocab_size=v["vocab_size"], num_layers=v["n_layer"], d_model=d,
                num_heads=v["n_head"], num_kv_heads=v["n_head"], d_ff=v["n_inner"] or 4 * d,
                max_seq_len=v["n_positions"], norm="layer", norm_eps=v["layer_norm_epsilon"],
                position="learned", mlp="gelu", qkv_bias=True, o_bias=True, mlp_bias=True,
                tie_embeddings=bool(v["tie_word_embeddings"]))
        heads = v["num_attention_heads"]
        llama_bias = family == "llama" and bool(v["attention_bias"])
        return ModelConfig(
            vocab_size=v["vocab_size"], num_layers=v["num_hidden_layers"],
            d_model=v["hidden_size"], num_heads=heads,
            num_kv_heads=v["num_key_value_heads"] or heads,
            head_dim=v["head_dim"] or v["hidden_size"] // heads,
            d_ff=v["intermediate_size"], max_seq_len=v["max_position_embeddings"],
            norm="rms", norm_eps=v["rms_norm_eps"], position="rope", rope_theta=_rope_theta(v),
            mlp="swiglu", qkv_bias=family == "qwen2" or llama_bias, o_bias=llama_bias,
            mlp_bias=family == "llama" and bool(v["mlp_bias"]),
            sliding_window=_window(family, v), tie_embeddings=bool(v["tie_word_embeddings"]))
    except ConfigError as e:
        raise CheckpointError(f"{family} config.json is not a valid kvjax model: {e}") from e


def family_of(c: ModelConfig) -> str:
    """The Hugging Face family that expresses `c` (CheckpointError: none does)."""
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
