"""Hugging Face checkpoints: `config.json` + `*.safetensors` (sharded too) to kvjax, and back.

Supported families: Llama, Mistral (sliding window), Qwen2 (QKV bias) and GPT-2 (learned
positions, LayerNorm, tanh-GELU, fused QKV in Conv1D layout). Anything else, an option
kvjax does not implement, or a missing tensor is a clear error naming it: a checkpoint is
never loaded into a model that would compute something else.

The contract is the table `OPTIONS`: for each family, every `config.json` option that bears
on what the model computes, the default `transformers` (5.x) gives it when the key is
missing, and whether kvjax maps it onto `ModelConfig`, ignores it (it changes nothing at
inference), or implements only some values (any other is refused). `_resolve` checks it;
`_window` adds the one rule that spans options (Qwen2's per-layer windows).

Layouts: a Hugging Face `Linear` stores `weight [out, in]` (y = x W^T); GPT-2's `Conv1D`
stores `[in, out]` (y = x W). kvjax kernels are `[in, ...out]`: q/k/v `[D, heads, H]`,
o `[heads, H, D]`, MLP `[in, out]`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

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


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint folder (single file or sharded with an index)."""
    try:
        from safetensors.numpy import load_file
    except ImportError as e:  # pragma: no cover
        raise ImportError("reading safetensors needs the hf extra: pip install 'kvjax[hf]'") \
            from e
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    tensors: dict[str, np.ndarray] = {}
    for name in files:
        if not (path / name).exists():
            raise CheckpointError(f"shard {name} named in the index is missing from {path}")
        tensors.update(load_file(str(path / name)))
    return tensors


class _Tensors:
    """Looks tensors up by name (with or without a `model.`/`transformer.` prefix)."""

    def __init__(self, tensors: dict[str, np.ndarray], prefixes: tuple[str, ...]):
        self.tensors = tensors
        self.prefixes = prefixes

    def has(self, name: str) -> bool:
        return any(p + name in self.tensors for p in self.prefixes)

    def __call__(self, name: str) -> np.ndarray:
        for prefix in self.prefixes:
            if prefix + name in self.tensors:
                return np.asarray(self.tensors[prefix + name], np.float32)
        raise CheckpointError(f"missing tensor {self.prefixes[0]}{name}")


def _llama_params(t: _Tensors, c: ModelConfig) -> dict:
    d, h, n, k = c.d_model, c.head_dim, c.num_heads, c.num_kv_heads
    params = {"embed": {"embedding": t("embed_tokens.weight")},
              "final_norm": {"scale": t("norm.weight")}}
    for i in range(c.num_layers):
        p = f"layers.{i}."
        attn = {}
        for name, heads in (("q", n), ("k", k), ("v", k)):
            attn[name] = {"kernel": t(f"{p}self_attn.{name}_proj.weight").T.reshape(d, heads, h)}
            if c.qkv_bias:
                attn[name]["bias"] = t(f"{p}self_attn.{name}_proj.bias").reshape(heads, h)
        attn["o"] = {"kernel": t(f"{p}self_attn.o_proj.weight").T.reshape(n, h, d)}
        if c.o_bias:
            attn["o"]["bias"] = t(f"{p}self_attn.o_proj.bias")
        mlp = {name: {"kernel": t(f"{p}mlp.{name}_proj.weight").T}
               for name in ("gate", "up", "down")}
        if c.mlp_bias:
            for name in mlp:
                mlp[name]["bias"] = t(f"{p}mlp.{name}_proj.bias")
        params[f"layer_{i}"] = {
            "attn_norm": {"scale": t(f"{p}input_layernorm.weight")}, "attn": attn,
            "mlp_norm": {"scale": t(f"{p}post_attention_layernorm.weight")}, "mlp": mlp}
    return params


def _gpt2_params(t: _Tensors, c: ModelConfig) -> dict:
    d, h, n = c.d_model, c.head_dim, c.num_heads
    params = {"embed": {"embedding": t("wte.weight")}, "pos_embed": {"embedding": t("wpe.weight")},
              "final_norm": {"scale": t("ln_f.weight"), "bias": t("ln_f.bias")}}
    for i in range(c.num_layers):
        p = f"h.{i}."
        qkv_w, qkv_b = t(f"{p}attn.c_attn.weight"), t(f"{p}attn.c_attn.bias")  # [D, 3D], [3D]
        attn = {name: {"kernel": qkv_w[:, j * d:(j + 1) * d].reshape(d, n, h),
                       "bias": qkv_b[j * d:(j + 1) * d].reshape(n, h)}
                for j, name in enumerate(("q", "k", "v"))}
        attn["o"] = {"kernel": t(f"{p}attn.c_proj.weight").reshape(n, h, d),
                     "bias": t(f"{p}attn.c_proj.bias")}
        params[f"layer_{i}"] = {
            "attn_norm": {"scale": t(f"{p}ln_1.weight"), "bias": t(f"{p}ln_1.bias")},
            "attn": attn,
            "mlp_norm": {"scale": t(f"{p}ln_2.weight"), "bias": t(f"{p}ln_2.bias")},
            "mlp": {"up": {"kernel": t(f"{p}mlp.c_fc.weight"), "bias": t(f"{p}mlp.c_fc.bias")},
                    "down": {"kernel": t(f"{p}mlp.c_proj.weight"),
                             "bias": t(f"{p}mlp.c_proj.bias")}}}
    return params


def _check_shapes(config: ModelConfig, params: dict) -> None:
    """Every tensor has exactly the shape the model expects; nothing is missing or extra."""
    import jax

    from kvjax.model.transformer import param_shapes

    expected = param_shapes(config)
    flat_expected = dict(jax.tree_util.tree_flatten_with_path(expected)[0])
    flat_got = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    for path, leaf in flat_expected.items():
        name = jax.tree_util.keystr(path)
        if path not in flat_got:
            raise CheckpointError(f"no tensor was mapped to {name}")
        if tuple(flat_got[path].shape) != tuple(leaf.shape):
            raise CheckpointError(f"{name}: shape {tuple(flat_got[path].shape)} in the "
                                  f"checkpoint, the config implies {tuple(leaf.shape)}")
    extra = set(flat_got) - set(flat_expected)
    if extra:
        raise CheckpointError(f"unexpected tensors {sorted(map(jax.tree_util.keystr, extra))}")


def load_hf(path) -> tuple[ModelConfig, dict]:
    """Loads a Hugging Face checkpoint folder; returns (config, float32 params on device)."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.exists():
        raise CheckpointError(f"no config.json in {path}")
    hf = json.loads(config_file.read_text())
    config = config_from_hf(hf)
    tensors = read_safetensors(path)
    if hf["model_type"] == "gpt2":
        params = _gpt2_params(_Tensors(tensors, ("transformer.", "")), config)
    else:
        params = _llama_params(_Tensors(tensors, ("model.", "")), config)
    if not config.tie_embeddings:
        params["lm_head"] = {"kernel": _Tensors(tensors, ("",))("lm_head.weight").T}
    _check_shapes(config, params)
    import jax

    return config, jax.device_put(params)  # on device once, not copied at every step


def _family_of(c: ModelConfig) -> str:
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
    c, family = config, _family_of(config)
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


def _hf_tensors(config: ModelConfig, params) -> dict[str, np.ndarray]:
    c, p = config, params

    def a(x) -> np.ndarray:
        return np.ascontiguousarray(np.asarray(x, np.float32))

    if _family_of(c) == "gpt2":
        out = {"transformer.wte.weight": a(p["embed"]["embedding"]),
               "transformer.wpe.weight": a(p["pos_embed"]["embedding"]),
               "transformer.ln_f.weight": a(p["final_norm"]["scale"]),
               "transformer.ln_f.bias": a(p["final_norm"]["bias"])}
        for i in range(c.num_layers):
            layer, pre = p[f"layer_{i}"], f"transformer.h.{i}."
            attn = layer["attn"]
            out[pre + "attn.c_attn.weight"] = a(np.concatenate(
                [np.asarray(attn[n]["kernel"]).reshape(c.d_model, -1) for n in "qkv"], axis=1))
            out[pre + "attn.c_attn.bias"] = a(np.concatenate(
                [np.asarray(attn[n]["bias"]).reshape(-1) for n in "qkv"]))
            out[pre + "attn.c_proj.weight"] = a(np.asarray(attn["o"]["kernel"]).reshape(
                -1, c.d_model))
            out[pre + "attn.c_proj.bias"] = a(attn["o"]["bias"])
            for norm, name in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
                out[pre + f"{name}.weight"] = a(layer[norm]["scale"])
                out[pre + f"{name}.bias"] = a(layer[norm]["bias"])
            for ours, theirs in (("up", "c_fc"), ("down", "c_proj")):
                out[pre + f"mlp.{theirs}.weight"] = a(layer["mlp"][ours]["kernel"])
                out[pre + f"mlp.{theirs}.bias"] = a(layer["mlp"][ours]["bias"])
        return out
    out = {"model.embed_tokens.weight": a(p["embed"]["embedding"]),
           "model.norm.weight": a(p["final_norm"]["scale"])}
    if not c.tie_embeddings:
        out["lm_head.weight"] = a(np.asarray(p["lm_head"]["kernel"]).T)
    for i in range(c.num_layers):
        layer, pre = p[f"layer_{i}"], f"model.layers.{i}."
        for n in "qkv":
            kernel = np.asarray(layer["attn"][n]["kernel"])
            out[pre + f"self_attn.{n}_proj.weight"] = a(kernel.reshape(c.d_model, -1).T)
            if c.qkv_bias:
                out[pre + f"self_attn.{n}_proj.bias"] = a(
                    np.asarray(layer["attn"][n]["bias"]).reshape(-1))
        out[pre + "self_attn.o_proj.weight"] = a(
            np.asarray(layer["attn"]["o"]["kernel"]).reshape(-1, c.d_model).T)
        if c.o_bias:
            out[pre + "self_attn.o_proj.bias"] = a(layer["attn"]["o"]["bias"])
        for n in ("gate", "up", "down"):
            out[pre + f"mlp.{n}_proj.weight"] = a(np.asarray(layer["mlp"][n]["kernel"]).T)
            if c.mlp_bias:
                out[pre + f"mlp.{n}_proj.bias"] = a(layer["mlp"][n]["bias"])
        out[pre + "input_layernorm.weight"] = a(layer["attn_norm"]["scale"])
        out[pre + "post_attention_layernorm.weight"] = a(layer["mlp_norm"]["scale"])
    return out


def save_hf(path, config: ModelConfig, params) -> None:
    """Writes `config.json` + `model.safetensors` that `transformers` (and `load_hf`) load."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = _hf_tensors(config, params)
    (path / "config.json").write_text(json.dumps(hf_config(config), indent=2))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
