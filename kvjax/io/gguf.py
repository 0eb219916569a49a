"""GGUF checkpoints (llama.cpp's format, what local users hold) to kvjax.

`load_gguf(path)` reads the file with the `gguf` package: its architecture metadata becomes
the `config.json` a Hugging Face export of the same model would have (then the same
`config_from_hf` checks every option), and each tensor is dequantized by `gguf` (F32, F16,
BF16, Q8_0, Q4_0, Q4_1, the K-quants: any type it can dequantize) into float32 and renamed
to the Hugging Face layout, undoing the row permutation llama.cpp's converter applies to the
query and key projections (its RoPE pairs neighbouring features, Hugging Face's the two
halves of a head). `gguf_tokenizer` builds the file's tokenizer (`tokenizer.ggml.*`) with
the `tokenizers` library and reads its chat template and special ids.

GGUF lists a tensor's dimensions fastest first: a [rows, cols] numpy array is (cols, rows)
in the file, so a Linear weight arrives [out, in] as Hugging Face stores it.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

from kvjax.io.hf_families import CheckpointError

ARCHITECTURES = ("llama",)  # GGUF `general.architecture` values kvjax loads

# GGUF tensor name (in block i) -> Hugging Face name
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_TENSORS = {"token_embd.weight": "model.embed_tokens.weight",
                "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}

# Metadata keys (after the architecture prefix) that name something kvjax does not compute.
_REFUSED = {
    "expert_count": "mixture-of-experts layers are not implemented",
    "attention.sliding_window": "sliding-window attention from GGUF is not implemented",
    "attn_logit_softcapping": "attention logit soft-capping is not implemented",
    "final_logit_softcapping": "final logit soft-capping is not implemented",
}


def _reader(path: Path):
    """(the file's `GGUFReader`, its metadata): opened once per file version (building the
    reader's fields walks every vocabulary entry: seconds for a 49k-token vocabulary)."""
    if not path.is_file():
        raise CheckpointError(f"no GGUF file at {path}")
    s = path.stat()
    return _open(str(path.resolve()), (s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns))


@functools.lru_cache(maxsize=2)
def _open(path: str, version: tuple):  # version: the file's inode, size, mtime, ctime
    try:
        import gguf
    except ImportError as e:  # pragma: no cover
        raise ImportError("GGUF files need the gguf package: pip install 'kvjax[hf]'") from e
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError) as e:
        raise CheckpointError(f"{path} is not a readable GGUF file: {e}") from e
    meta = {key: field.contents() for key, field in reader.fields.items()
            if not key.startswith("GGUF.")}
    meta = {k: tuple(v) if isinstance(v, list) else v for k, v in meta.items()}  # read-only
    return reader, meta


def gguf_metadata(path) -> dict[str, Any]:
    """Every metadata key of a GGUF file with its value (strings, numbers, lists)."""
    return dict(_reader(Path(path))[1])


def hf_config_of(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """The `config.json` of the Hugging Face export of a GGUF file's model (llama)."""
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
        if get(key):
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
    return {"model_type": "llama", "vocab_size": int(vocab),
            "hidden_size": d_model, "intermediate_size": int(need("feed_forward_length")),
            "num_hidden_layers": int(need("block_count")), "num_attention_heads": heads,
            "num_key_value_heads": int(get("attention.head_count_kv", heads)),
            "head_dim": head_dim, "max_position_embeddings": int(need("context_length")),
            "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
            "rope_theta": float(get("rope.freq_base", 10000.0)),
            "tie_word_embeddings": "output.weight" not in tensor_names}


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row order: within each head, rows (2i, 2i + 1) back to
    (i, i + H/2). w: [heads * H, ...]."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensors(reader, hf: dict) -> dict[str, np.ndarray]:
    """Every tensor dequantized to float32 under its Hugging Face name."""
    from gguf.quants import dequantize

    out = {}
    for t in reader.tensors:
        block, _, rest = t.name.partition(".")
        if t.name.endswith(".bias"):
            raise CheckpointError(f"{t.name}: biases in GGUF checkpoints are not implemented")
        if block == "blk":
            layer, _, rest = rest.partition(".")
            if rest not in _LAYER_TENSORS:
                raise CheckpointError(f"unexpected GGUF tensor {t.name}")
            name = f"model.layers.{layer}.{_LAYER_TENSORS[rest]}"
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
        if rest == "attn_q.weight":
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

    reader, meta = _reader(Path(path))
    hf = hf_config_of(meta, {t.name for t in reader.tensors})
    config = config_from_hf(hf)
    params = params_from_tensors(hf, config, _tensors(reader, hf))
    if dtype != "float32":
        config = dataclasses.replace(config, dtype=dtype)
        params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype), params)
    return config, jax.device_put(params)


_LLAMA3_PRES = ("llama3", "llama-v3", "llama-bpe")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _pre_tokenizer(pre: str | None):
    """The `tokenizers` pre-tokenizer of a byte-level vocabulary's `tokenizer.ggml.pre`."""
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "gpt2":
        return byte_level
    if pre == "smollm":  # digits one by one, then GPT-2's split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        byte_level])
    if pre in _LLAMA3_PRES:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raise CheckpointError(f"tokenizer.ggml.pre={pre!r}: this pre-tokenizer is not implemented "
                          f"(implemented: gpt2, smollm, llama-bpe; a file that names none "
                          f"leaves its split rules unknown)")


def gguf_tokenizer(path):
    """A GGUF file's byte-level BPE vocabulary (`tokenizer.ggml.model` "gpt2") as a
    `tokenizers.Tokenizer`: its tokens and merges, the pre-tokenizer its
    `tokenizer.ggml.pre` names, control tokens (type 3) as special tokens matched whole,
    user-defined ones (type 4) as added tokens, and a post-processor adding BOS / EOS to a
    prompt where `tokenizer.ggml.add_bos_token` / `add_eos_token` say so. Returns
    (tokenizer, BOS token, EOS token, chat template source or None)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    meta = gguf_metadata(path)
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(f"tokenizer.ggml.model={kind!r}: only byte-level BPE ('gpt2') "
                              f"vocabularies are implemented")
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", ())]
    pre = meta.get("tokenizer.ggml.pre")
    # Llama 3 (and llama.cpp for it) looks a whole word up before merging
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges,
                               ignore_merges=pre in _LLAMA3_PRES))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    types = list(meta.get("tokenizer.ggml.token_type", ()))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types, strict=False) if kind == 3])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, types, strict=False) if kind == 4])

    def token(key: str) -> tuple[str, int] | None:  # (token, id)
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return (tokens[i], int(i)) if i is not None and 0 <= i < len(tokens) else None

    bos, eos = token("bos"), token("eos")  # (token, id) or None
    pre = [bos] if bos and meta.get("tokenizer.ggml.add_bos_token") else []
    post = [eos] if eos and meta.get("tokenizer.ggml.add_eos_token") else []
    if pre or post:  # what llama.cpp adds to a prompt
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join([t for t, _ in pre] + ["$A"] + [t for t, _ in post]),
            special_tokens=list(dict.fromkeys(pre + post)))
    return tok, bos and bos[0], eos and eos[0], meta.get("tokenizer.chat_template")
