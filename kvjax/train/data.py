"""The training corpus every machine has: the Python standard library's source files.

Files are split into train and validation by a hash of their relative path (so the split is
the same wherever the same Python is installed), encoded with the byte tokenizer and joined
with <|eos|>. Batches are random windows drawn from a generator seeded by (seed, step), so
a resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import numpy as np

from kvjax.io.tokenizer import ByteTokenizer

SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3"}


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py")
                  if not SKIP_DIRS.intersection(p.relative_to(root).parts))


def split_of(relative: str, validation_fraction: float) -> str:
    h = int.from_bytes(hashlib.sha256(relative.encode()).digest()[:4], "big") / 2**32
    return "validation" if h < validation_fraction else "train"


def load_corpus(validation_fraction: float = 0.05, max_files: int | None = None,
                root: str | Path | None = None) -> dict[str, np.ndarray]:
    """{"train": uint16 ids, "validation": uint16 ids} of the standard library's sources."""
    tok = ByteTokenizer()
    eos = tok.token_id("<|eos|>")
    root = Path(root or sysconfig.get_paths()["stdlib"])
    by_split: dict[str, list[Path]] = {"train": [], "validation": []}
    for path in stdlib_files(root):
        by_split[split_of(path.relative_to(root).as_posix(), validation_fraction)].append(path)
    if max_files is not None:  # a small corpus that still has both splits
        n_val = max(1, round(max_files * validation_fraction))
        by_split = {"train": by_split["train"][: max_files - n_val],
                    "validation": by_split["validation"][:n_val]}
    parts: dict[str, list[np.ndarray]] = {"train": [], "validation": []}
    for split, paths in by_split.items():
        for path in paths:
            data = np.frombuffer(path.read_bytes(), np.uint8).astype(np.uint16)
            parts[split] += [data, np.array([eos], np.uint16)]
    if not parts["train"] or not parts["validation"]:
        raise ValueError(f"the corpus under {root} has too few files for both splits")
    return {k: np.concatenate(v) for k, v in parts.items()}


def batch(ids: np.ndarray, batch_size: int, seq_len: int, seed: int, step: int) -> np.ndarray:
    """int32[batch_size, seq_len + 1] random windows, a pure function of (seed, step)."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(ids) - seq_len - 1, size=batch_size)
    return np.stack([ids[s:s + seq_len + 1] for s in starts]).astype(np.int32)
