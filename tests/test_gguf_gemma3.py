"""Gemma 3 from GGUF (`kvjax.io.gguf`, architecture "gemma3") and SentencePiece vocabularies
(`kvjax.io.gguf_vocab`, `tokenizer.ggml.model` "llama"), on a small file written here as
llama.cpp's converter writes Gemma 3: norm weights stored as 1 + w, q/k rows in Hugging
Face's order, no sliding-window pattern or local RoPE base in the metadata (llama.cpp's
constants: every 6th layer full, base 10,000). transformers' own GGUF loader reads the same
file: logits and token ids must agree. The real Gemma 3 270M is `tests/test_gemma3.py`.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import kvjax
from kvjax.io.gguf import load_gguf
from kvjax.io.hf import config_from_hf, params_from_tensors
from kvjax.io.tokenizer import load_tokenizer

gguf = pytest.importorskip("gguf")

# head_dim 256: queries scale by its -1/2 power in llama.cpp (key_length) and in transformers,
# whose GGUF mapping leaves query_pre_attn_scalar at its default, 256, whatever the file says
LAYERS, D, HEADS, KV, HEAD, FF, WINDOW = 7, 32, 2, 1, 256, 64, 4
# a SentencePiece vocabulary: control tokens (the turn markers among them), the 256 byte
# tokens, pieces by falling score, user-defined symbols (a newline, runs of two and three
# spaces: both, as in Gemma's vocabulary, where transformers' converter reaches the longer
# run by merging shorter ones and SentencePiece and llama.cpp match it whole)
PIECES = ["▁", "a", "b", "c", "d", "▁a", "ab", "▁ab", "cd", "▁cd", "▁abcd", "abcd", "é", "bc"]
TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>",
          *[f"<0x{b:02X}>" for b in range(256)], *PIECES, "\n", "   ", "  ",
          "x", "y", "z", "xy", "yz"]
TYPES = [3] * 6 + [6] * 256 + [1] * len(PIECES) + [4, 4, 4] + [1] * 5
# scores fall with the id, as in SentencePiece's files: "abcd" merges ab, cd, abcd (merged
# in the reverse order, "bc" first: a, bc, d)
SCORES = [-1000.0] * 6 + [0.0] * 256 + [-float(i) for i in range(len(PIECES))] + [-1000.0] * 3
# ... except "yz", which outranks "xy" though it comes later: SentencePiece (and llama.cpp)
# merge by score, "xyz" -> x, yz; by position in the file (transformers' converter), xy, z
SCORES += [-14.0, -15.0, -16.0, -17.0, -0.5]
TEXTS = ["abcd", "a abcd cd", "dcba", "é ab", "x\nab cd\n", "<start_of_turn>ab<end_of_turn>",
         " abcd", "😀 b"]


def _hf_tensors(rng) -> dict[str, np.ndarray]:
    """Random Gemma 3 weights in Hugging Face's names and layout ([out, in]); norm weights
    spread around 0 (Gemma scales by 1 + w)."""
    def w(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale / np.sqrt(shape[-1])).astype(np.float32)

    out = {"model.embed_tokens.weight": w(len(TOKENS), D, scale=2.0),
           "model.norm.weight": w(D, scale=3.0)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_proj.weight": w(HEADS * HEAD, D, scale=4.0),
                p + "self_attn.k_proj.weight": w(KV * HEAD, D, scale=4.0),
                p + "self_attn.v_proj.weight": w(KV * HEAD, D),
                p + "self_attn.o_proj.weight": w(D, HEADS * HEAD),
                p + "self_attn.q_norm.weight": w(HEAD, scale=2.0),
                p + "self_attn.k_norm.weight": w(HEAD, scale=2.0),
                p + "mlp.gate_proj.weight": w(FF, D), p + "mlp.up_proj.weight": w(FF, D),
                p + "mlp.down_proj.weight": w(D, FF)}
        for name in ("input_layernorm", "post_attention_layernorm",
                     "pre_feedforward_layernorm", "post_feedforward_layernorm"):
            out[f"{p}{name}.weight"] = w(D, scale=3.0)
    return out


_GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
               "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_gemma3(path, tensors: dict[str, np.ndarray]):
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(D)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_key_length(HEAD)
    w.add_value_length(HEAD)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(WINDOW)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_scores(SCORES)
    w.add_token_types(TYPES)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    for name, t in tensors.items():
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            _, _, i, rest = name.split(".", 3)
            gname = f"blk.{i}.{_GGUF_NAMES[rest.removesuffix('.weight')]}.weight"
        if gname.endswith("norm.weight"):
            t = t + np.float32(1.0)  # llama.cpp's converter stores Gemma's 1 + w
        w.add_tensor(gname, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    tensors = _hf_tensors(np.random.default_rng(3))
    return tensors, write_gemma3(tmp_path_factory.mktemp("gemma3") / "small.gguf", tensors)


def test_a_gemma3_file_loads_as_its_hugging_face_checkpoint(small):
    """The config of the file (7 layers: the 6th full, the rest sliding over 4 tokens; RoPE
    bases 1e6 full, 1e4 sliding; q/k norms, sandwich norms, embedding scale, GeGLU) and the
    parameters the Hugging Face import makes of the same weights. (Seen failing: without
    the 1 subtracted from the norms, and with llama's q/k row permutation applied.)"""
    tensors, path = small
    config, params = load_gguf(path)
    assert config.windows == (WINDOW,) * 5 + (None,) + (WINDOW,)
    assert (config.rope_theta, config.local_rope_theta) == (1_000_000.0, 10_000.0)
    assert config.qk_norm and config.sandwich_norms and config.embed_scale
    assert config.mlp == "geglu" and config.tie_embeddings and config.query_scale is None
    hf = {"model_type": "gemma3_text", "vocab_size": len(TOKENS), "hidden_size": D,
          "intermediate_size": FF, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
          "num_key_value_heads": KV, "head_dim": HEAD, "max_position_embeddings": 256,
          "rms_norm_eps": float(np.float32(1e-6)), "rope_theta": 1_000_000.0,
          "rope_local_base_freq": 10_000.0, "sliding_window": WINDOW,
          "query_pre_attn_scalar": HEAD, "tie_word_embeddings": True}
    assert config == config_from_hf(hf)
    want = params_from_tensors(hf, config, tensors)
    # bitwise: the file's 1 + w minus 1 is exact in float32, and adding 1 back gives the
    # stored sum again
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(want),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tokens = np.array([[2, 270, 265, 263, 271, 276, 270, 268, 266, 272, 274]])
    got_logits = np.asarray(kvjax.forward(params, config, tokens))
    assert np.abs(got_logits).max() > 2.0  # logits far enough apart to tell layouts apart


def test_logits_and_token_ids_match_transformers_gguf_loader(small):
    """transformers reads the same file (its own Gemma 3 GGUF mapping and SentencePiece
    converter): logits over 11 positions, past the 4-token window, and the ids of texts
    with byte fallback, user-defined symbols and turn markers."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    _, path = small
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32)
    ref_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    config, params = load_gguf(path)
    tokens = np.array([[2, 270, 265, 263, 271, 276, 270, 268, 266, 272, 274]])
    with torch.no_grad():
        want = ref(torch.tensor(tokens)).logits.numpy()
    got = np.asarray(kvjax.forward(params, config, tokens))
    # measured 1.9e-6 (logits up to 4.1)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    tok, _ = load_tokenizer(path)
    for text in TEXTS:
        assert tok.encode(text) == ref_tok.encode(text, add_special_tokens=False), text
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode_prompt("ab") == ref_tok.encode("ab") == [2, 268]
    # a user-defined symbol is matched whole before any merge, the longest first
    # (SentencePiece, llama.cpp); transformers' converter merges runs of spaces by score, and
    # with this vocabulary's scores makes "▁" + "▁cd" of "  cd" ("ab", "  ", "cd" here).
    # Gemma's own vocabulary ranks them so that both agree (tests/test_gemma3.py).
    assert tok.encode("ab  cd") == [268, 278, 270] and tok.encode("ab   cd") == [268, 277, 270]
    assert tok.encode("abcd") == [273]
    assert tok.encode("xyz") == [279, 283]


def test_gemma3_metadata_rules_and_refusals(tmp_path):
    """llama.cpp's rules where its Gemma 3 files say nothing: the 27B model (62 layers)
    scales queries by (d_model / heads)^-1/2, the others by key_length^-1/2; a sliding
    pattern other than 6, a missing window, or a SentencePiece vocabulary that adds a
    leading space are refused by name."""
    from kvjax.io.gguf import hf_config_of
    from kvjax.io.hf import CheckpointError

    meta = {"general.architecture": "gemma3", "gemma3.block_count": 62,
            "gemma3.embedding_length": 5376, "gemma3.attention.head_count": 32,
            "gemma3.attention.head_count_kv": 16, "gemma3.attention.key_length": 128,
            "gemma3.feed_forward_length": 21504, "gemma3.context_length": 131072,
            "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
            "gemma3.attention.sliding_window": 1024, "gemma3.vocab_size": 262208}
    assert hf_config_of(meta, set())["query_pre_attn_scalar"] == 5376 // 32
    assert hf_config_of(meta | {"gemma3.block_count": 34}, set())["query_pre_attn_scalar"] == 128
    with pytest.raises(CheckpointError, match="sliding_window_pattern=4"):
        hf_config_of(meta | {"gemma3.attention.sliding_window_pattern": 4}, set())
    with pytest.raises(CheckpointError, match="no gemma3.attention.sliding_window"):
        hf_config_of({k: v for k, v in meta.items() if "sliding" not in k}, set())
    tensors = _hf_tensors(np.random.default_rng(0))
    path = write_gemma3(tmp_path / "prefix.gguf", tensors)
    text = path.read_bytes()
    key = b"tokenizer.ggml.add_space_prefix"
    at = text.index(key) + len(key) + 4  # the value after its uint32 type tag: one bool
    path.write_bytes(text[:at] + b"\x01" + text[at + 1:])
    with pytest.raises(CheckpointError, match="add_space_prefix=True"):
        load_tokenizer(path)
