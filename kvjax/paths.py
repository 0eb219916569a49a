"""Where kvjax keeps what it caches for the user: plain Python, no JAX."""

from __future__ import annotations

import os
from pathlib import Path


def cache_home(environ=os.environ) -> Path:
    """kvjax's folder in the user's cache folder: `$XDG_CACHE_HOME/kvjax`, else
    `~/.cache/kvjax` (the XDG base directory convention)."""
    base = environ.get("XDG_CACHE_HOME", "")
    return (Path(base) if os.path.isabs(base) else Path.home() / ".cache") / "kvjax"
