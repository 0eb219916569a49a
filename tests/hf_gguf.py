"""transformers' own GGUF loader, the reference the real-model tests compare kvjax with."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import inspect
import json
import os
from pathlib import Path

import numpy as np
import pytest

from kvjax.backend import cache_home


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


# what computes the answers: the model loader and forward, the GGUF reader, the tokenizer
# and its chat templates
PACKAGES = ("transformers", "torch", "gguf", "accelerate", "tokenizers", "jinja2", "numpy")
_FILE_DIGESTS: dict[tuple, str] = {}


def file_digest(file: Path) -> str:
    """sha256 of a file's bytes (this process hashes each file once)."""
    stat = file.stat()
    key = (str(file), stat.st_size, stat.st_mtime_ns)
    if key not in _FILE_DIGESTS:
        h = hashlib.sha256()
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                h.update(block)
        _FILE_DIGESTS[key] = h.hexdigest()
    return _FILE_DIGESTS[key]


class Reference:
    """transformers' model and tokenizer of a GGUF file (`transformers_from_gguf`), loaded
    at their first use, and every answer the tests ask of them kept on disk
    (`~/.cache/kvjax/test-references`): an answer is stored under a key of its question (a
    name, JSON inputs and the asking file's source), the file's bytes, the versions of the
    packages that answer (`PACKAGES`) and this module's source, so a later run asking the
    same question of the same reference reads what transformers answered; a change to any
    of them (kvjax's answers are in the questions) asks transformers again. Nothing is ever
    answered another way."""

    def __init__(self, file: Path):
        self.file = file
        self._loaded = None
        versions = [importlib.metadata.version(p) for p in PACKAGES]
        self.identity = hashlib.sha256(json.dumps(
            [file_digest(file), versions, Path(__file__).read_text()]).encode()).hexdigest()
        self.folder = cache_home() / "test-references"

    @property
    def model(self):
        if self._loaded is None:
            self._loaded = transformers_from_gguf(self.file)
        return self._loaded[0]

    @property
    def tokenizer(self):
        self.model  # noqa: B018 (loads both)
        return self._loaded[1]

    def answer(self, name: str, inputs, compute):
        """`compute()` (a JSON value, or a list of arrays) for the question (`name`, `inputs`,
        and the source of the file that defines `compute`: a changed question is a new one),
        from the disk when transformers answered it before."""
        asker = Path(inspect.getsourcefile(compute)).read_text()
        key = hashlib.sha256(json.dumps([self.identity, name, inputs, asker]).encode()
                             ).hexdigest()
        path = self.folder / f"{name}-{key[:40]}"
        if path.with_suffix(".json").exists():
            return json.loads(path.with_suffix(".json").read_text())
        if path.with_suffix(".npz").exists():
            with np.load(path.with_suffix(".npz")) as saved:
                return [saved[f"a{i}"] for i in range(len(saved.files))]
        value = compute()
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        if isinstance(value, list) and value and isinstance(value[0], np.ndarray):
            with open(tmp, "wb") as f:
                np.savez(f, **{f"a{i}": a for i, a in enumerate(value)})
            tmp.replace(path.with_suffix(".npz"))
        else:
            tmp.write_text(json.dumps(value))
            tmp.replace(path.with_suffix(".json"))
        return value
