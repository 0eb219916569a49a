"""Arrays kept on disk for the inputs they were made from: a digest of those inputs is
stored beside them, and a file of another digest is made again. Host code: numpy only."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np


def load_or_make(file: Path, digest: str, make: Callable[[], dict[str, np.ndarray]]
                 ) -> tuple[dict[str, np.ndarray], bool]:
    """(the arrays, whether they came from `file`): `file`'s when it was written for
    `digest`, else `make()`'s, then written to `file` whole (a temporary file renamed, so an
    interrupted write leaves no file that would pass for a finished one)."""
    file = Path(file)
    if file.is_file():
        with np.load(file) as saved:
            if str(saved["digest"]) == digest:
                return {k: saved[k] for k in saved.files if k != "digest"}, True
    arrays = make()
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(file.stem + ".tmp.npz")
    np.savez(tmp, digest=np.asarray(digest), **arrays)
    tmp.rename(file)
    return arrays, False
