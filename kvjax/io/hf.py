"""Hugging Face checkpoints: `config.json` + `*.safetensors` (sharded too) to kvjax, and back.

The config is mapped by `kvjax.io.hf_families` (the per-family option table); here, the
tensors. A missing, extra or misshapen tensor is a clear error naming it.

Layouts: a Hugging Face `Linear` stores `weight [out, in]` (y = x W^T); GPT-2's `Conv1D`
stores `[in, out]` (y = x W). kvjax kernels are `[in, ...out]`: q/k/v `[D, heads, H]`,
o `[heads, H, D]`, MLP `[in, out]`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kvjax.config import ModelConfig
from kvjax.io.hf_families import (
    ALIASES,
    FAMILIES,
    GEMMA,
    LLAMA_LIKE,
    MAPPED,
    NO_EFFECT,
    OPTIONS,
    CheckpointError,
    config_from_hf,
    family_of,
    hf_config,
)

__all__ = ["ALIASES", "FAMILIES", "LLAMA_LIKE", "MAPPED", "NO_EFFECT", "OPTIONS",
           "CheckpointError", "config_from_hf", "eos_ids", "hf_config", "load_hf",
           "read_safetensors", "save_hf"]


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

    def __call__(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """The tensor as float32; with `shape`, checked against it first (a tensor that is
        reshaped or split before `_check_shapes` could otherwise load scrambled)."""
        for prefix in self.prefixes:
            if prefix + name in self.tensors:
                x = np.asarray(self.tensors[prefix + name], np.float32)
                if shape is not None and x.shape != shape:
                    raise CheckpointError(f"tensor {prefix}{name} has shape {x.shape}; the "
                                          f"config implies {shape}")
                return x
        raise CheckpointError(f"missing tensor {self.prefixes[0]}{name}")


def _attention(t: _Tensors, c: ModelConfig, p: str, fused: bool) -> dict:
    """One layer's q, k, v, o (and q/k norms) from `{p}self_attn.*`; Phi-3 fuses q, k, v
    into one `qkv_proj` [(N + 2K) * H, D]."""
    d, h, n, k = c.d_model, c.head_dim, c.num_heads, c.num_kv_heads
    heads = {"q": n, "k": k, "v": k}
    if fused:
        qkv = t(f"{p}self_attn.qkv_proj.weight", ((n + 2 * k) * h, d))
        w = dict(zip("qkv", np.split(qkv, [n * h, (n + k) * h]), strict=True))
    else:
        w = {name: t(f"{p}self_attn.{name}_proj.weight", (heads[name] * h, d))
             for name in "qkv"}
    attn = {}
    for name in "qkv":
        attn[name] = {"kernel": w[name].T.reshape(d, heads[name], h)}
        if c.qkv_bias:
            attn[name]["bias"] = t(f"{p}self_attn.{name}_proj.bias",
                                   (heads[name] * h,)).reshape(heads[name], h)
    attn["o"] = {"kernel": t(f"{p}self_attn.o_proj.weight", (d, n * h)).T.reshape(n, h, d)}
    if c.o_bias:
        attn["o"]["bias"] = t(f"{p}self_attn.o_proj.bias")
    return attn


# kvjax's norm -> the Hugging Face name, by layout: Llama's post_attention_layernorm is the
# MLP's input norm; Gemma's is the attention output's (then pre_feedforward_layernorm)
_NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
_SANDWICH = {"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
             "mlp_norm": "pre_feedforward_layernorm",
             "post_mlp_norm": "post_feedforward_layernorm"}


def _llama_params(t: _Tensors, c: ModelConfig, family: str) -> dict:
    """Llama-like families. Gemma's norms scale by (1 + weight): stored as that sum (in
    float32, as Gemma computes it)."""
    offset = np.float32(1.0 if family in GEMMA else 0.0)

    def norm(name: str) -> dict:
        return {"scale": t(name) + offset}

    params = {"embed": {"embedding": t("embed_tokens.weight")}, "final_norm": norm("norm.weight")}
    for i in range(c.num_layers):
        p = f"layers.{i}."
        attn = _attention(t, c, p, fused=family == "phi3")
        if c.qk_norm:
            attn |= {f"{x}_norm": norm(f"{p}self_attn.{x}_norm.weight") for x in "qk"}
        if family == "phi3":  # gate then up, along the output rows
            gate, up = np.split(t(f"{p}mlp.gate_up_proj.weight"), 2)
            mlp = {"gate": {"kernel": gate.T}, "up": {"kernel": up.T},
                   "down": {"kernel": t(f"{p}mlp.down_proj.weight").T}}
        else:
            mlp = {name: {"kernel": t(f"{p}mlp.{name}_proj.weight").T}
                   for name in ("gate", "up", "down")}
        if c.mlp_bias:
            for name in mlp:
                mlp[name]["bias"] = t(f"{p}mlp.{name}_proj.bias")
        norms = _SANDWICH if c.sandwich_norms else _NORMS
        params[f"layer_{i}"] = {"attn": attn, "mlp": mlp} | {
            ours: norm(f"{p}{theirs}.weight") for ours, theirs in norms.items()}
    return params


def _gpt2_params(t: _Tensors, c: ModelConfig) -> dict:
    d, h, n = c.d_model, c.head_dim, c.num_heads
    params = {"embed": {"embedding": t("wte.weight")}, "pos_embed": {"embedding": t("wpe.weight")},
              "final_norm": {"scale": t("ln_f.weight"), "bias": t("ln_f.bias")}}
    for i in range(c.num_layers):
        p = f"h.{i}."
        qkv_w, qkv_b = t(f"{p}attn.c_attn.weight", (d, 3 * d)), t(f"{p}attn.c_attn.bias",
                                                                 (3 * d,))
        attn = {name: {"kernel": qkv_w[:, j * d:(j + 1) * d].reshape(d, n, h),
                       "bias": qkv_b[j * d:(j + 1) * d].reshape(n, h)}
                for j, name in enumerate(("q", "k", "v"))}
        attn["o"] = {"kernel": t(f"{p}attn.c_proj.weight", (n * h, d)).reshape(n, h, d),
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
    params = params_from_tensors(hf, config, read_safetensors(path))
    import jax

    return config, jax.device_put(params)  # on device once, not copied at every step


def eos_ids(path) -> tuple[int, ...]:
    """A checkpoint folder's end-of-sequence ids, as transformers' `generate` takes them:
    `generation_config.json`'s `eos_token_id` (an id or a list: Llama 3 names three), else
    `config.json`'s; () when neither names one."""
    path = Path(path)
    for name in ("generation_config.json", "config.json"):
        file = path / name
        value = json.loads(file.read_text()).get("eos_token_id") if file.exists() else None
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise CheckpointError(f"{file}: eos_token_id={value!r} is not an id or a list "
                                  f"of ids")
        return tuple(dict.fromkeys(ids))
    return ()


def params_from_tensors(hf: dict, config: ModelConfig, tensors: dict[str, np.ndarray]) -> dict:
    """The kvjax parameter tree of a checkpoint's tensors under their Hugging Face names
    (`hf`: its config.json, `config`: what `config_from_hf` made of it), every shape
    checked."""
    if hf["model_type"] == "gpt2":
        params = _gpt2_params(_Tensors(tensors, ("transformer.", "")), config)
    else:
        params = _llama_params(_Tensors(tensors, ("model.", "")), config, hf["model_type"])
    if not config.tie_embeddings:
        params["lm_head"] = {"kernel": _Tensors(tensors, ("",))("lm_head.weight").T}
    _check_shapes(config, params)
    return params


def _hf_tensors(config: ModelConfig, params) -> dict[str, np.ndarray]:
    c, p = config, params

    def a(x) -> np.ndarray:
        return np.ascontiguousarray(np.asarray(x, np.float32))

    if family_of(c) == "gpt2":
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
