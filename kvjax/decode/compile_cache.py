"""Compiled programs kept across processes, in the user's cache folder, switched on by
kvjax's entry points (`kvjax.models.load`, `Engine`, `kvjax.generate`, the `kvjax` command
and the scripts), never by `import kvjax` alone. Two stores share the folder:

- kvjax's steps (prefill, decode and speculative loops, the samplers) by kvjax's own key,
  `programs/` (`kvjax.decode.programs`): a new process runs them without tracing them;
- every other program in JAX's persistent compilation cache, keyed by its HLO, the compile
  options, the backend and the jaxlib version (XLA flags included).

A hit in either loads the executable the compile wrote: the same machine code, so a loaded
program computes the same bits as a fresh compile (tests/test_compile_cache.py compares
them in two processes). Neither key names the CPU, whose instruction sets XLA compiles for,
so kvjax keeps each CPU's programs apart: a subfolder named by a digest of the CPU's model
and flags (`host_folder`), as the probe and kernel caches key theirs, so a cache folder
shared between hosts never hands one host another's code; and each kvjax source apart
(`version`; another's folder unused for `STALE_DAYS` is dropped).

Where: `$KVJAX_XLA_CACHE`, else `xla` in `kvjax.backend.cache_home()`
(`$XDG_CACHE_HOME/kvjax/xla` or `~/.cache/kvjax/xla`), then the CPU's subfolder, then
kvjax's. `KVJAX_XLA_CACHE=0` leaves both off. A user who set JAX's own cache folder
(`jax_compilation_cache_dir`, or the `JAX_COMPILATION_CACHE_DIR` variable) keeps it as
configured (kvjax's steps go to its `programs/`). kvjax caches every program however
quickly it compiled (JAX's default skips those under a second, most of a chat's small
programs) unless the user set that threshold. The folder is bounded
(`KVJAX_XLA_CACHE_BYTES`, default `MAX_BYTES`): when a process enables it over the bound,
the entries used longest ago (the later of their write and read times) are dropped until
it holds half the bound. A process killed while JAX wrote an entry may leave it cut short:
JAX then warns, compiles the program again and leaves the entry, until the folder is
deleted (kvjax's own entries are written whole and renamed into place).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import time
from pathlib import Path

import jax

from kvjax.backend import cache_home
from kvjax.cpu.build import cpu_features

ENV_VAR, BYTES_VAR = "KVJAX_XLA_CACHE", "KVJAX_XLA_CACHE_BYTES"
MAX_BYTES = 4 << 30
JAX_MIN_COMPILE_SECS = 1.0  # JAX's default threshold: left alone when the user changed it

_enabled: list[Path | None] = []  # this process's answer, once enable() has run
_VERSION: list[str] = []
STALE_DAYS = 7  # another kvjax's folder unused this long is dropped


def max_bytes(environ=os.environ) -> int:
    """The folder's bound: `KVJAX_XLA_CACHE_BYTES`, a whole number of bytes, or `MAX_BYTES`."""
    text = environ.get(BYTES_VAR, str(MAX_BYTES))
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{BYTES_VAR}={text!r}: give the compile cache's bound in bytes, "
                         "a whole number >= 0")
    return value


def source_digest(root: Path) -> str:
    """A digest of every source file (.py, .cc, .h) under `root`, names and contents."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.suffix in (".py", ".cc", ".h") and "__pycache__" not in path.parts:
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def version() -> str:
    """This kvjax's folder name: a digest of its source (once a process)."""
    if not _VERSION:
        _VERSION.append(source_digest(Path(__file__).resolve().parents[1])[:12])
    return _VERSION[0]


def host_folder(base: Path) -> Path:
    """This CPU's subfolder of `base` (its model and instruction-set flags' digest)."""
    return base / hashlib.sha256(cpu_features().encode()).hexdigest()[:12]


def folder(environ=os.environ) -> Path | None:
    """The cache folder kvjax would use (module docstring), None when it is switched off."""
    value = environ.get(ENV_VAR, "")
    if value == "0":
        return None
    return host_folder(Path(value) if value else cache_home(environ) / "xla") / version()


def enable(environ=os.environ) -> Path | None:
    """Switches the cache on for this process (once; later calls return the first answer):
    the folder JAX caches in, whether the user's or kvjax's, or None when off."""
    if _enabled:
        return _enabled[0]
    own = jax.config.jax_compilation_cache_dir
    path = Path(own) if own else _switch_on(folder(environ), environ)
    _enabled.append(path)
    return path


def current(kept: bool = False, environ=os.environ) -> Path | None:
    """The folder JAX caches in now: kvjax's once `enable()` switched it on, or the user's
    own; None when off or not switched on yet (nothing is switched on here). `kept`: the
    folder for kvjax's own store (`kvjax.decode.programs`): none where `KVJAX_XLA_CACHE=0`
    or the user's folder is not a local path."""
    own = jax.config.jax_compilation_cache_dir
    if kept and (environ.get(ENV_VAR) == "0" or (own and "://" in own)):
        return None
    if own:
        return Path(own)
    return _enabled[0] if _enabled else None


def _switch_on(path: Path | None, environ) -> Path | None:
    """JAX's cache in `path` (made and pruned first), every program cached unless the user
    set the threshold; None when there is no folder or it cannot be made (an unwritable
    cache folder costs compile time, not a failure)."""
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    drop_versions(path, STALE_DAYS)
    prune(path, max_bytes(environ))
    jax.config.update("jax_compilation_cache_dir", str(path))
    if jax.config.jax_persistent_cache_min_compile_time_secs == JAX_MIN_COMPILE_SECS:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


def drop_versions(path: Path, days: float) -> list[Path]:
    """Removes the folders beside `path` (other kvjax versions' on this CPU) where nothing
    was written or read for `days`; returns them."""
    gone, cutoff = [], time.time() - days * 86400
    for other in path.parent.iterdir():
        if other == path or not other.is_dir():
            continue
        with contextlib.suppress(OSError):
            used = max([other.stat().st_mtime] + [max(f.stat().st_mtime, f.stat().st_atime)
                                                  for f in other.rglob("*") if f.is_file()])
            if used < cutoff:
                shutil.rmtree(other, ignore_errors=True)
                gone.append(other)
    return gone


def prune(path: Path, max_bytes: int) -> list[Path]:
    """When the files under `path` hold more than `max_bytes`, removes those used longest ago
    (the later of write and access time: Linux updates the access time of a file read
    after its last write, and then at most daily) until they hold half of it; returns what
    it removed."""
    files = []
    for entry in path.rglob("*"):
        with contextlib.suppress(OSError):
            if entry.is_file():
                stat = entry.stat()
                files.append((max(stat.st_mtime, stat.st_atime), stat.st_size, entry))
    total = sum(size for _, size, _ in files)
    if total <= max_bytes:
        return []
    gone = []
    for _, size, entry in sorted(files):
        if total <= max_bytes // 2:
            break
        with contextlib.suppress(OSError):
            entry.unlink()
            total -= size
            gone.append(entry)
    return gone
