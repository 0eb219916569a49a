"""Hugging Face checkpoints load and compute what `transformers` computes.

Small random checkpoints of each family are built with transformers (PyTorch, CPU) in a
temporary folder; kvjax loads them and its logits (whole sequence, and through the paged
cache) and greedy generations are compared with transformers'.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs the hf extra (scripts/test installs it)")
transformers = pytest.importorskip("transformers")

import kvjax  # noqa: E402
from kvjax import CacheConfig  # noqa: E402
from kvjax.io import CheckpointError, load_hf  # noqa: E402

TOL = 1e-4
COMMON = dict(vocab_size=101, max_position_embeddings=128)
LLAMA = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0, **COMMON)
FAMILIES = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        tie_word_embeddings=False, **LLAMA)),
    "llama_tied_bias": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        tie_word_embeddings=True, attention_bias=True, mlp_bias=True, **LLAMA)),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(
        sliding_window=6, **LLAMA)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**LLAMA)),
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=101, n_positions=128, n_embd=64, n_layer=2, n_head=4)),
}


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
    if name == "mistral":
        model.config._attn_implementation = "eager"
    model.save_pretrained(folder, **save_kw)
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    model = _save(request.param, folder)
    config, params = load_hf(folder)
    return request.param, model, config, params


def _tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 101, size=(2, n))


def test_full_sequence_logits_match(family):
    _, model, config, params = family
    tokens = _tokens(20)
    with torch.no_grad():
        ref = model(torch.tensor(tokens)).logits.numpy()
    got = np.asarray(kvjax.forward(params, config, tokens))
    assert np.abs(got - ref).max() <= TOL


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
        assert np.abs(logits - hf_logits).max() <= TOL, name


def test_export_back_to_safetensors(family, tmp_path):
    """kvjax -> safetensors: transformers loads the export and computes the same logits."""
    from kvjax.io import save_hf

    _, model, config, params = family
    save_hf(tmp_path, config, params)
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens = torch.tensor(_tokens(12, 3))
    with torch.no_grad():
        np.testing.assert_allclose(exported(tokens).logits.numpy(),
                                   model(tokens).logits.numpy(), atol=1e-5, rtol=0)
    assert load_hf(tmp_path)[0] == config


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
        "rope_type": "llama3", "factor": 8.0}}))
    with pytest.raises(CheckpointError, match="rope scaling 'llama3'"):
        load_hf(tmp_path)
