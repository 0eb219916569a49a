"""GGUF checkpoints (llama.cpp's format, what local users hold) to kvjax.

`load_gguf(path)` reads the file (`kvjax.io.gguf_file`): its architecture metadata becomes
the `config.json` a Hugging Face export of the same model would have (then the same
`config_from_hf` checks every option), and each tensor is dequantized by `gguf` (F32, F16,
BF16, Q8_0, Q4_0, Q4_1, the K-quants: any type it can dequantize) into float32 and renamed
to the Hugging Face layout, undoing the row permutation llama.cpp's converter applies to the
query and key projections of a Llama (its RoPE pairs neighbouring features, Hugging Face's
the two halves of a head) and the 1 llama.cpp adds to Gemma's norm weights.
`kvjax.io.gguf_vocab` builds the file's tokenizer (`tokenizer.ggml.*`).

GGUF lists a tensor's dimensions fastest first: a [rows, cols] numpy array is (cols, rows)
in the file, so a Linear weight arrives [out, in] as Hugging Face stores it.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

from kvjax.io.gguf_file import read_gguf
from kvjax.io.hf_families import CheckpointError

ARCHITECTURES = ("llama", "gemma3")  # GGUF `general.architecture` values kvjax loads

# GGUF tensor name (in block i) -> Hugging Face name
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 3's: its norms around both sublayers (sandwich) and on each head of q and k
_GEMMA3_TENSORS = _LAYER_TENSORS | {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_TOP_TENSORS = {"token_embd.weight": "model.embed_tokens.weight",
                "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}

# llama.cpp's Gemma 3 constants, which its GGUF files do not carry: every 6th layer full (the
# rest sliding), RoPE base 10,000 on the sliding layers
_GEMMA3_PATTERN = 6
_GEMMA3_LOCAL_THETA = 10_000.0

# Metadata keys (after the architecture prefix) that name something kvjax does not compute
# (Gemma 3 maps the sliding window and soft-capping).
_REFUSED = {
    "expert_count": "mixture-of-experts layers are not implemented",
    "attention.sliding_window": "sliding-window attention from GGUF is not implemented",
    "attn_logit_softcapping": "attention logit soft-capping is not implemented",
    "final_logit_softcapping": "final logit soft-capping is not implemented",
}


def _reader(path: Path):
    """(the file's tensors, its metadata): read once per file version."""
    if not path.is_file():
        raise CheckpointError(f"no GGUF file at {path}")
    s = path.stat()
    return _open(str(path.resolve()), (s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns))


@functools.lru_cache(maxsize=2)
def _open(path: str, version: tuple):  # version: the file's inode, size, mtime, ctime
    try:
        import gguf  # noqa: F401  (its type table and dequantizers)
    except ImportError as e:  # pragma: no cover
        raise ImportError("GGUF files need the gguf package: pip install 'kvjax[hf]'") from e
    meta, tensors = read_gguf(path)
    meta = {k: tuple(v) if isinstance(v, list) else v for k, v in meta.items()}  # read-only
    return tensors, meta


def gguf_metadata(path) -> dict[str, Any]:
    """Every metadata key of a GGUF file with its value (strings, numbers, lists)."""
    return dict(_reader(Path(path))[1])


def hf_config_of(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """The `config.json` of the Hugging Face export of a GGUF file's model (llama, or
    Gemma 3's text model)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"unsupported GGUF architecture {arch!r} "
                              f"(supported: {', '.join(ARCHITECTURES)})")

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    def need(key: str) -> Any:
        if get(key) is None:
            raise CheckpointError(f"the GGUF file has no {arch}.{key}")
        return get(key)

    for key, why in _REFUSED.items():
        if get(key) and not (arch == "gemma3" and key != "expert_count"):
            raise CheckpointError(f"{arch}.{key}={get(key)!r}: {why}")
    scaling = get("rope.scaling.type", "none")
    # llama.cpp scales linearly when a factor is given without a type
    factor = get("rope.scaling.factor", get("rope.scale_linear", 1.0))
    if scaling == "none" and factor not in (0.0, 1.0):
        scaling = f"linear, factor {factor}"
    if scaling != "none" or "rope_freqs.weight" in tensor_names:
        kind = scaling if scaling != "none" else "llama3 (rope_freqs.weight)"
        raise CheckpointError(f"{arch}.rope.scaling: rope scaling {kind!r} is not "
                              f"implemented (only plain RoPE)")
    heads = int(need("attention.head_count"))
    d_model = int(need("embedding_length"))
    head_dim = int(get("attention.key_length", d_model // heads))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise CheckpointError(f"{arch}.attention.value_length differs from key_length: "
                              f"not implemented")
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise CheckpointError(f"{arch}.rope.dimension_count={get('rope.dimension_count')}: "
                              f"partial rotary embeddings are not implemented")
    vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    hf = {"model_type": "llama", "vocab_size": int(vocab),
            "hidden_size": d_model, "intermediate_size": int(need("feed_forward_length")),
            "num_hidden_layers": int(need("block_count")), "num_attention_heads": heads,
            "num_key_value_heads": int(get("attention.head_count_kv", heads)),
            "head_dim": head_dim, "max_position_embeddings": int(need("context_length")),
            "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
            "rope_theta": float(get("rope.freq_base", 10000.0)),
            "tie_word_embeddings": "output.weight" not in tensor_names}
    return _gemma3(hf, get, need) if arch == "gemma3" else hf


def _gemma3(hf: dict, get, need) -> dict:
    """Gemma 3's text model: sliding and full layers with their RoPE bases, queries scaled
    by head_dim^-1/2 (llama.cpp's rule: the 27B model, 62 layers, by (d_model /
    heads)^-1/2), optional soft-capping."""
    scalar = hf["head_dim"]
    if hf["num_hidden_layers"] == 62:
        scalar = hf["hidden_size"] // hf["num_attention_heads"]
    pattern = get("attention.sliding_window_pattern", _GEMMA3_PATTERN)
    if pattern != _GEMMA3_PATTERN:  # llama.cpp ignores the key for gemma3: 6 it is
        raise CheckpointError(f"gemma3.attention.sliding_window_pattern={pattern!r}: only "
                              f"llama.cpp's Gemma 3 pattern ({_GEMMA3_PATTERN}) is implemented")
    return hf | {
        "model_type": "gemma3_text", "sliding_window": int(need("attention.sliding_window")),
        "sliding_window_pattern": _GEMMA3_PATTERN,
        "rope_local_base_freq": _GEMMA3_LOCAL_THETA, "query_pre_attn_scalar": scalar,
        "attn_logit_softcapping": get("attn_logit_softcapping"),
        "final_logit_softcapping": get("final_logit_softcapping")}


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row order: within each head, rows (2i, 2i + 1) back to
    (i, i + H/2). w: [heads * H, ...]."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensors(tensors, hf: dict) -> dict[str, np.ndarray]:
    """Every tensor dequantized to float32 under its Hugging Face name."""
    from gguf.quants import dequantize

    gemma = hf["model_type"] == "gemma3_text"
    layer_tensors = _GEMMA3_TENSORS if gemma else _LAYER_TENSORS
    out = {}
    for t in tensors:
        block, _, rest = t.name.partition(".")
        if t.name.endswith(".bias"):
            raise CheckpointError(f"{t.name}: biases in GGUF checkpoints are not implemented")
        if block == "blk":
            layer, _, rest = rest.partition(".")
            if rest not in layer_tensors:
                raise CheckpointError(f"unexpected GGUF tensor {t.name}")
            name = f"model.layers.{layer}.{layer_tensors[rest]}"
        elif t.name in _TOP_TENSORS:
            name = _TOP_TENSORS[t.name]
        else:
            raise CheckpointError(f"unexpected GGUF tensor {t.name}")
        try:
            w = np.asarray(dequantize(t.data, t.tensor_type), np.float32)
        except NotImplementedError as e:
            raise CheckpointError(f"{t.name}: the gguf package cannot dequantize "
                                  f"{t.tensor_type.name}") from e
        w = w.reshape(tuple(int(n) for n in reversed(t.shape)))
        if gemma:  # its RoPE rotates a head's two halves in llama.cpp too: no permutation
            if t.name.endswith("norm.weight"):
                w = w - np.float32(1.0)  # llama.cpp stores Gemma's (1 + w); Hugging Face w
        elif rest == "attn_q.weight":
            w = _unpermute(w, hf["num_attention_heads"])
        elif rest == "attn_k.weight":
            w = _unpermute(w, hf["num_key_value_heads"])
        out[name] = w
    return out


def load_gguf(path, dtype: str = "float32"):
    """Loads a GGUF file; returns (ModelConfig, params on device) with every tensor
    dequantized to float32 (`dtype="bfloat16"`: the model and its parameters in bfloat16)."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from kvjax.io.hf import config_from_hf, params_from_tensors

    tensors, meta = _reader(Path(path))
    hf = hf_config_of(meta, {t.name for t in tensors})
    config = config_from_hf(hf)
    params = params_from_tensors(hf, config, _tensors(tensors, hf))
    if dtype != "float32":
        config = dataclasses.replace(config, dtype=dtype)
        params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype), params)
    return config, jax.device_put(params)
