"""Start-up probe results kept on disk: a process does not probe again what an earlier one
found on the same machine with the same software (the probes of `kvjax.model.tiled` take
seconds per model: docs/benchmarks.md, "Measurements behind design choices").

A result is keyed by the probe's name and arguments, by the source of the package that
defines it (every module beside the probe's: edited probe code, or code it runs, probes
again), and by everything that picks the kernels XLA runs: the jax and jaxlib versions, the
backend and its device kind, `XLA_FLAGS` and `jax_disable_most_optimizations`, and the CPU
(model name and instruction-set flags). `KVJAX_PROBE_CACHE` names the file (default
`probes.json` in `kvjax.backend.cache_home()`); `KVJAX_PROBE_CACHE=0` turns the cache off.
A file that cannot be read is ignored (the probe runs) and one that cannot be written is
skipped.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import os
import pathlib
import sys
import tempfile
from collections.abc import Callable

import jax

from kvjax.backend import cache_home

ENV_VAR = "KVJAX_PROBE_CACHE"


def cache_path() -> pathlib.Path | None:
    """The cache file, or None when `KVJAX_PROBE_CACHE=0`."""
    value = os.environ.get(ENV_VAR, "")
    if value == "0":
        return None
    return pathlib.Path(value) if value else cache_home() / "probes.json"


def environment() -> str:
    """A digest of what decides the probes' answers (see the module docstring)."""
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().split("\n\n")[0].splitlines()
        cpu = "\n".join(line for line in lines if line.startswith(("model name", "flags")))
    except OSError:
        pass
    device = jax.devices()[0]
    parts = [jax.__version__, importlib.metadata.version("jaxlib"), device.platform,
             device.device_kind, os.environ.get("XLA_FLAGS", ""),
             str(jax.config.read("jax_disable_most_optimizations")), cpu]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=16)
def code_digest(module: str) -> str:
    """A digest of the Python files in the folder of `module`'s file (the probes and the
    products, layouts and deltas they run; empty when it has no file)."""
    digest = hashlib.sha256()
    with contextlib.suppress(KeyError, TypeError, OSError):
        for file in sorted(pathlib.Path(sys.modules[module].__file__).parent.glob("*.py")):
            digest.update(file.name.encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _load(path: pathlib.Path) -> dict:
    try:
        table = json.loads(path.read_text())
        return table if isinstance(table, dict) else {}
    except (OSError, ValueError):
        return {}


def _store(path: pathlib.Path, table: dict) -> None:
    """Writes `table` whole through a temporary file and a rename (concurrent writers lose
    at most a result, which is probed again)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False,
                                         suffix=".tmp") as f:
            json.dump(table, f, indent=0, sort_keys=True)
        os.replace(f.name, path)
    except OSError:
        pass


def persistent(probe: Callable[..., bool]) -> Callable[..., bool]:
    """`probe` (positional, JSON-able arguments, a bool result) with its results kept in the
    cache file under the running environment."""
    @functools.wraps(probe)
    def cached(*args) -> bool:
        path = cache_path()
        if path is None:
            return probe(*args)
        key = json.dumps([probe.__name__, list(args), code_digest(probe.__module__),
                          environment()])
        table = _load(path)
        if isinstance(table.get(key), bool):
            return table[key]
        value = bool(probe(*args))
        table = _load(path)
        table[key] = value
        _store(path, table)
        return value

    return cached
