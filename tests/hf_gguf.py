"""transformers' own GGUF loader, the reference the real-model tests compare kvjax with."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest


def transformers_from_gguf(file: Path):
    """(transformers' float32 model, its tokenizer) of a GGUF file, both by transformers' GGUF
    loader. It builds the `gguf` package's `GGUFReader` of the file three times (the config,
    the weights, the tokenizer), a numpy view per metadata value: 7.7 s each for Gemma 3's
    262,144-token vocabulary. Here the three share one reader of the file, which they only
    read (a read-only map), so the reference is what it would be without the sharing."""
    import gguf
    import torch
    import transformers

    reader = functools.lru_cache(maxsize=1)(gguf.GGUFReader)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", lambda path, mode="r": reader(str(path), mode))
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(file.parent), gguf_file=file.name, dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(file.parent),
                                                               gguf_file=file.name)
    assert reader.cache_info().misses == 1, reader.cache_info()
    return model, tokenizer
