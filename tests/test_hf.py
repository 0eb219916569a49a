"""Hugging Face checkpoints load and compute what `transformers` computes.

Small random checkpoints of each family are built with transformers (PyTorch, CPU) in a
temporary folder; kvjax loads them and its logits (whole sequence, and through the paged
cache) and greedy generations are compared with transformers'.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs the hf extra (scripts/test installs it)")
transformers = pytest.importorskip("transformers")

import kvjax  # noqa: E402
from kvjax import CacheConfig, ModelConfig  # noqa: E402
from kvjax.io import CheckpointError, config_from_hf, hf_config, load_hf  # noqa: E402

TOL = 2.5e-5  # kvjax vs transformers logits (std ~0.8-1.2): measured <= 2.5e-6 (llama, paged)
# Gemma's logits (std 1.3-1.6, embeddings scaled by sqrt(d)): measured 7.5e-6 (gemma2) and
# 1.4e-5 (gemma3) whole sequence, <= 8.6e-6 paged; the bound
GEMMA_TOL = 1e-4
COMMON = dict(vocab_size=101, max_position_embeddings=128)
LLAMA = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0, **COMMON)
GPT2 = dict(vocab_size=101, n_positions=128, n_embd=64, n_layer=2, n_head=4)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
               "rope_theta": 10000.0}  # a 16-token original context: most frequencies move
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
             "rope_theta": 10000.0}  # cos/sin scaled by 0.1 ln 4 + 1
# three layers: sliding, full, sliding (window 5 < the 20-token tests); a large soft-cap
# scale so that capping changes the scores (attention std ~ 3, cap 4)
GEMMA = dict(LLAMA, num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=8,
             sliding_window=5, layer_types=["sliding_attention", "full_attention",
                                            "sliding_attention"])
FAMILIES = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        tie_word_embeddings=False, **LLAMA)),
    "llama_tied_bias": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        tie_word_embeddings=True, attention_bias=True, mlp_bias=True, **LLAMA)),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(
        sliding_window=6, **LLAMA)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**LLAMA)),
    "qwen2_window": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        use_sliding_window=True, sliding_window=6, max_window_layers=0, **LLAMA)),
    "qwen2_layer_windows": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        use_sliding_window=True, sliding_window=5, max_window_layers=1, **LLAMA)),
    "llama3_rope": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        rope_parameters=LLAMA3_ROPE, **LLAMA)),
    "llama_yarn": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        rope_parameters=YARN_ROPE, **LLAMA)),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **dict(LLAMA, head_dim=24))),  # head_dim != hidden / heads
    "phi3": lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(
        pad_token_id=0, eos_token_id=2, sliding_window=6, **LLAMA)),
    "gemma2": lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        attn_logit_softcapping=4.0, final_logit_softcapping=3.0, **GEMMA)),
    "gemma3": lambda: transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                            "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        **GEMMA)),
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2)),
}
# families whose configs export (phi3 computes what mistral does: it exports as mistral)
EXPORTED = ("llama", "llama_tied_bias", "mistral", "qwen2", "qwen2_window", "phi3", "gpt2")


def _randomize(model) -> None:
    """Random weights everywhere (biases and norms too), so nothing passes by being 0 or 1."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if p.ndim == 1 else 0.0))


def _save(name: str, folder, **save_kw):
    torch.manual_seed(0)
    model = FAMILIES[name]().eval()
    _randomize(model)
    if name in ("mistral", "qwen2_layer_windows", "phi3", "gemma2", "gemma3"):
        model.config._attn_implementation = "eager"
    model.save_pretrained(folder, **save_kw)
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    model = _save(request.param, folder)
    config, params = load_hf(folder)
    return request.param, model, config, params


def _tol(name: str) -> float:
    return GEMMA_TOL if name.startswith("gemma") else TOL


def _tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 101, size=(2, n))


def test_full_sequence_logits_match(family):
    name, model, config, params = family
    tokens = _tokens(20)
    with torch.no_grad():
        ref = model(torch.tensor(tokens)).logits.numpy()
    got = np.asarray(kvjax.forward(params, config, tokens))
    assert np.abs(got - ref).max() <= _tol(name)


def test_paged_cache_logits_and_greedy_tokens_match(family):
    name, model, config, params = family
    prompts = [list(map(int, _tokens(13, 1)[0])), list(map(int, _tokens(7, 2)[0]))]
    res = kvjax.generate(params, config, prompts, 10, return_logits=True,
                         cache=CacheConfig(page_size=4, num_pages=32, prefill_chunk=16,
                                           attn_block=8))
    for prompt, tokens, logits in zip(prompts, res.tokens, res.logits, strict=True):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=0)
        hf_tokens = out.sequences[0, len(prompt):].tolist()
        hf_logits = torch.stack(out.logits, dim=1)[0].numpy()
        assert tokens == hf_tokens, name
        assert np.abs(logits - hf_logits).max() <= _tol(name), name


@pytest.mark.parametrize("name", EXPORTED)
def test_export_back_to_safetensors(name, tmp_path):
    """kvjax -> safetensors: transformers loads the export and computes the same logits."""
    from kvjax.io import save_hf

    model = _save(name, tmp_path / "hf")
    config, params = load_hf(tmp_path / "hf")
    save_hf(tmp_path / "out", config, params)
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = torch.tensor(_tokens(12, 3))
    with torch.no_grad():  # measured 1.1e-6
        np.testing.assert_allclose(exported(tokens).logits.numpy(),
                                   model(tokens).logits.numpy(), atol=1e-5, rtol=0)
    assert load_hf(tmp_path / "out")[0] == config


@pytest.mark.parametrize("name", sorted(set(FAMILIES) - set(EXPORTED)))
def test_export_refuses_the_families_it_does_not_write(name, tmp_path):
    from kvjax.io import save_hf

    _save(name, tmp_path / "hf")
    config, params = load_hf(tmp_path / "hf")
    with pytest.raises(CheckpointError, match="export is implemented for"):
        save_hf(tmp_path / "out", config, params)


def test_sharded_checkpoint(tmp_path):
    model = _save("llama", tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    config, params = load_hf(tmp_path)
    tokens = _tokens(9)
    with torch.no_grad():
        ref = model(torch.tensor(tokens)).logits.numpy()
    assert np.abs(np.asarray(kvjax.forward(params, config, tokens)) - ref).max() <= TOL


def test_unsupported_architecture_and_missing_tensor_are_named(tmp_path):
    _save("llama", tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(hf | {"model_type": "falcon"}))
    with pytest.raises(CheckpointError, match="unsupported architecture model_type='falcon'"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensor model.layers.1.mlp.up_proj.weight"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf | {"rope_scaling": {
        "rope_type": "longrope", "factor": 8.0}}))
    with pytest.raises(CheckpointError, match="rope type 'longrope' is not implemented"):
        load_hf(tmp_path)


@pytest.mark.parametrize(("tensor", "change", "named"), [
    ("model.layers.1.mlp.up_proj.weight", lambda w: np.concatenate([w, w[:1]]),
     r"\['layer_1'\]\['mlp'\]\['up'\]\['kernel'\]: shape \(64, 97\) in the checkpoint, the "
     r"config implies \(64, 96\)"),
    ("model.layers.1.mlp.up_proj.weight", lambda w: w.T,  # same size, transposed
     r"\['layer_1'\]\['mlp'\]\['up'\]\['kernel'\]: shape \(96, 64\)"),
    ("model.layers.0.input_layernorm.weight", lambda w: w.reshape(8, 8),
     r"\['layer_0'\]\['attn_norm'\]\['scale'\]: shape \(8, 8\)"),
    ("model.embed_tokens.weight", lambda w: w[:-1],
     r"\['embed'\]\['embedding'\]: shape \(100, 64\)"),
    # attention projections are reshaped into heads on load: checked before, by their names
    ("model.layers.0.self_attn.q_proj.weight", lambda w: np.concatenate([w, w[:1]]),
     r"tensor model\.layers\.0\.self_attn\.q_proj\.weight has shape \(65, 64\); the "
     r"config implies \(64, 64\)"),
    ("model.layers.1.self_attn.k_proj.weight", lambda w: w.T,  # same size
     r"tensor model\.layers\.1\.self_attn\.k_proj\.weight has shape \(64, 32\)"),
    ("model.layers.1.self_attn.o_proj.weight", lambda w: w.reshape(32, 128),
     r"tensor model\.layers\.1\.self_attn\.o_proj\.weight has shape \(32, 128\)"),
], ids=["up_extra_row", "up_transposed", "norm_2d", "embedding_short", "q_extra_row",
        "k_transposed", "o_reshaped"])
def test_a_misshapen_tensor_is_named(tmp_path, tensor, change, named):
    """A tensor whose shape is not the one config.json implies is a CheckpointError naming
    it (the checkpoint's name for a tensor split or reshaped on load, else the parameter it
    maps to), with both shapes. A transposed k projection used to load scrambled."""
    from safetensors.numpy import load_file, save_file

    _save("llama", tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors[tensor] = np.ascontiguousarray(change(tensors[tensor]))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=named):
        load_hf(tmp_path)


DROP = object()  # a change that removes the key


def _config_json(family: str, **changes) -> dict:
    """A small `config.json` dict as transformers writes it, with `changes`."""
    hf = {"llama": lambda: transformers.LlamaConfig(**LLAMA),
          "mistral": lambda: transformers.MistralConfig(sliding_window=6, **LLAMA),
          "qwen2": lambda: transformers.Qwen2Config(**LLAMA),
          "qwen3": lambda: transformers.Qwen3Config(**LLAMA),
          "phi3": lambda: transformers.Phi3Config(**LLAMA),
          "gemma2": lambda: transformers.Gemma2Config(**GEMMA),
          "gemma3_text": lambda: transformers.Gemma3TextConfig(**GEMMA),
          "gpt2": lambda: transformers.GPT2Config(**GPT2)}[family]().to_dict()
    return {k: v for k, v in (hf | changes).items() if v is not DROP}


# transformers writes the layer types it derived; a window from max_window_layers needs none
QWEN2_WINDOW = dict(use_sliding_window=True, sliding_window=6, layer_types=DROP)
# (family, config.json changes, the option the refusal must name)
REFUSED = [
    ("gpt2", dict(scale_attn_weights=False), "scale_attn_weights"),
    ("gpt2", dict(quantization_config={"quant_method": "gptq"}), "quantization_config"),
    ("llama", dict(quantization_config={"quant_method": "awq"}), "quantization_config"),
    ("gpt2", dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    ("gpt2", dict(reorder_and_upcast_attn=True), "reorder_and_upcast_attn"),
    ("gpt2", dict(add_cross_attention=True), "add_cross_attention"),
    ("gpt2", dict(activation_function="gelu"), "activation_function"),
    ("gpt2", dict(pruned_heads={"0": [1]}), "pruned_heads"),
    ("gpt2", dict(num_attention_heads=2), "n_head"),  # an alias that disagrees
    ("llama", dict(hidden_act="gelu"), "hidden_act"),
    ("mistral", dict(hidden_act="relu"), "hidden_act"),
    ("qwen2", dict(hidden_act="gelu_new"), "hidden_act"),
    ("llama", dict(rope_parameters={"rope_type": "llama3", "factor": 8.0}), "rope_parameters"),
    ("llama", dict(rope_scaling={"type": "longrope", "factor": 2.0}), "rope_scaling"),
    ("llama", dict(rope_parameters=dict(YARN_ROPE, short_factor=[1.0])), "rope_parameters"),
    ("llama", dict(rope_parameters={"full_attention": {}, "sliding_attention": {}}),
     "rope_parameters"),  # per layer type: Gemma 3's
    ("phi3", dict(rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * 8,
                                   "long_factor": [1.0] * 8}), "rope_parameters"),
    ("phi3", dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}),
     "rope_parameters"),
    ("gemma2", dict(hidden_activation="gelu"), "hidden_activation"),
    ("gemma2", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("gemma3_text", dict(rope_parameters={"full_attention": {"rope_type": "default"},
                                          "sliding_attention": {"rope_type": "linear",
                                                                "factor": 2.0}}),
     "rope_parameters"),
    ("gemma3_text", dict(rope_parameters={"rope_type": "linear", "factor": 8.0}),
     "rope_parameters"),  # flat: transformers ignores it
    ("gemma3_text", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("gemma2", dict(sliding_window=None), "layer_types"),  # sliding layers, no window
    ("phi3", dict(rope_parameters={"rope_type": "linear", "factor": 2.0}), "linear"),
    ("qwen3", dict(layer_types=["full_attention"]), "layer_types"),
    ("qwen3", dict(layer_types=["chunked_attention"] * 2), "layer_types"),
    ("llama", dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}),
     "rope_parameters"),
    ("llama", dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    ("llama", dict(head_dim=15), "head_dim"),  # RoPE rotates pairs
    ("qwen2", dict(layer_types=["full_attention"] * 2,
                   rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 2.0}}),
     "rope_parameters"),
    ("mistral", dict(layer_types=["full_attention", "sliding_attention"]), "layer_types"),
    ("qwen2", dict(layer_types=["sliding_attention"] * 2), "layer_types"),  # but no window
]


@pytest.mark.parametrize(("family", "changes", "option"), REFUSED,
                         ids=[f"{f}-{o}-{i}" for i, (f, _, o) in enumerate(REFUSED)])
def test_options_kvjax_does_not_implement_are_refused_by_name(family, changes, option):
    hf = _config_json(family, **changes)
    with pytest.raises(CheckpointError, match=rf"\b{option}\b"):
        config_from_hf(hf)


# (family, config.json changes, the ModelConfig fields that change from the family's base)
SUPPORTED = [
    ("gpt2", dict(scale_attn_weights=DROP, reorder_and_upcast_attn=DROP,
                  add_cross_attention=DROP, activation_function=DROP), {}),  # HF defaults
    ("gpt2", dict(activation_function="gelu_pytorch_tanh", summary_type="mean",
                  attn_pdrop=0.5), {}),
    ("gpt2", dict(n_head=DROP, num_attention_heads=2),
     dict(num_heads=2, num_kv_heads=2, head_dim=32)),
    ("gpt2", dict(n_inner=100), dict(d_ff=100)),
    ("gpt2", dict(n_embd=32, n_inner=None), dict(d_model=32, d_ff=128, head_dim=8)),  # 4 * n_embd
    ("gpt2", dict(tie_word_embeddings=False), dict(tie_embeddings=False)),
    ("llama", dict(pretraining_tp=4, attention_dropout=0.3, hidden_act="swish"), {}),
    ("llama", dict(rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
     dict(rope_theta=5e5)),
    ("llama", dict(rope_parameters=DROP, rope_theta=DROP), {}),  # 10000
    ("llama", dict(partial_rotary_factor=1.0), {}),
    ("llama", dict(attention_bias=True, mlp_bias=True),
     dict(qkv_bias=True, o_bias=True, mlp_bias=True)),
    ("llama", dict(head_dim=8), dict(head_dim=8)),
    ("mistral", dict(sliding_window=DROP), dict(sliding_window=4096)),
    ("mistral", dict(sliding_window=None), dict(sliding_window=None)),
    ("mistral", dict(num_key_value_heads=DROP, num_attention_heads=16, head_dim=4),
     dict(num_heads=16, num_kv_heads=8, head_dim=4)),
    ("mistral", dict(attention_bias=True, mlp_bias=True), {}),  # unread: no biases
    ("mistral", dict(layer_types=["sliding_attention"] * 2), {}),
    ("qwen2", dict(mlp_bias=True, attention_bias=False), {}),  # unread: q/k/v biases only
    ("qwen2", dict(sliding_window=6), {}),  # unread without use_sliding_window
    ("qwen2", dict(max_window_layers=0, **QWEN2_WINDOW), dict(sliding_window=6)),
    ("qwen2", dict(max_window_layers=2, **QWEN2_WINDOW), {}),  # no layer reaches the window
    ("qwen2", dict(QWEN2_WINDOW, layer_types=["sliding_attention"] * 2),
     dict(sliding_window=6)),
    ("qwen2", dict(max_window_layers=1, **QWEN2_WINDOW),
     dict(sliding_window=6, layer_types=("full", "sliding"))),
    ("qwen2", dict(QWEN2_WINDOW, layer_types=["sliding_attention", "full_attention"]),
     dict(sliding_window=6, layer_types=("sliding", "full"))),
    ("llama", dict(rope_scaling={"type": "linear", "factor": 2.0}),  # 4.x spelling
     dict(rope_scaling=(("rope_type", "linear"), ("factor", 2.0)))),
    ("llama", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}),  # see hf_rope
     dict(rope_scaling=(("rope_type", "dynamic"), ("factor", 2.0),
                        ("original_max_position_embeddings", 128.0)))),
    ("llama", dict(rope_parameters=LLAMA3_ROPE), dict(rope_scaling=(
        ("rope_type", "llama3"), ("factor", 8.0), ("low_freq_factor", 1.0),
        ("high_freq_factor", 4.0), ("original_max_position_embeddings", 16.0)))),
    ("llama", dict(rope_parameters=dict(YARN_ROPE, mscale=2.0, mscale_all_dim=1.0)),
     dict(rope_scaling=(("rope_type", "yarn"), ("factor", 4.0),
                        ("original_max_position_embeddings", 32.0),
                        ("attention_factor", (0.2 * math.log(4) + 1) / (0.1 * math.log(4) + 1)),
                        ("beta_fast", 32.0), ("beta_slow", 1.0), ("truncate", True)))),
    ("gemma3_text", dict(rope_parameters=DROP, rope_theta=5e5, rope_local_base_freq=5e3,
                         rope_scaling={"rope_type": "linear", "factor": 8.0}),  # 4.x keys
     dict(rope_theta=5e5, local_rope_theta=5e3,
          rope_scaling=(("rope_type", "linear"), ("factor", 8.0)))),
    ("gemma3_text", dict(layer_types=DROP, sliding_window_pattern=2), {}),  # 4.x: every 2nd
    ("gemma2", dict(layer_types=DROP), {}),  # sliding, full, sliding
    ("gemma2", dict(final_logit_softcapping=None, query_pre_attn_scalar=4),
     dict(final_softcap=None, query_scale=0.5)),
    ("gemma2", dict(query_pre_attn_scalar=16), dict(query_scale=None)),  # = head_dim
    ("phi3", dict(sliding_window=7), dict(sliding_window=7)),
]


@pytest.mark.parametrize(("family", "changes", "fields"), SUPPORTED,
                         ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(SUPPORTED)])
def test_implemented_option_values_map_to_the_expected_config(family, changes, fields):
    """The expected fields are what transformers' (5.x) config and modeling classes make of
    these options, read from their source; the qwen2_window family below also compares
    logits with transformers itself."""
    base = config_from_hf(_config_json(family))
    assert config_from_hf(_config_json(family, **changes)) == dataclasses.replace(base, **fields)


@pytest.mark.parametrize("config", [
    ModelConfig(),
    ModelConfig(num_kv_heads=2, head_dim=32, tie_embeddings=False, rope_theta=5e5),
    ModelConfig(qkv_bias=True, o_bias=True, mlp_bias=True),  # llama attention_bias, mlp_bias
    ModelConfig(sliding_window=8),  # mistral
    ModelConfig(qkv_bias=True),  # qwen2
    ModelConfig(qkv_bias=True, sliding_window=8),  # qwen2, every layer sliding
    ModelConfig(norm="layer", position="learned", mlp="gelu", qkv_bias=True, o_bias=True,
                mlp_bias=True, norm_eps=1e-5),  # gpt2
])
def test_exported_config_passes_the_import_checks(config):
    assert config_from_hf(json.loads(json.dumps(hf_config(config)))) == config


def test_export_refuses_what_no_family_computes():
    for config in (ModelConfig(causal=False), ModelConfig(mlp_bias=True, sliding_window=8)):
        with pytest.raises(CheckpointError):
            hf_config(config)
