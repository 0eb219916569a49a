"""Shipped experiments: one module each, run by `kvjax run configs/<name>.toml`.

An experiment module exposes

    Params                  a frozen dataclass: the experiment's parameters, validated on
                            construction (`ConfigError` naming the bad field)
    run(config) -> rows     one sweep point: `config` is a `kvjax.lab.runner.PointConfig`
                            (params, seed, scale, out, mesh); returns a list of metric dicts
    COLUMNS                 the summary table: (header, cell of a row) pairs
    plot(rows, out) -> [paths]   PNG plots of all rows into folder `out`
    TIMING (optional)       metric keys that are timings (besides keys ending in `_s`)
    headline(rows) (optional)    one line for the summary and `--list`
    MESH (optional)         True: its engines take `config.mesh` (a config's `mesh = ...`)

and a module docstring whose first line describes it. The shipped experiments live in the
clone's top-level `experiments/` folder (found beside the kvjax package, or above the
working directory); a config may also name any importable module
(`experiment = "mylab.probe"`, found from the working directory too) with the same interface.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys
from pathlib import Path
from types import ModuleType

from kvjax.config import ConfigError

_NOT_EXPERIMENTS = {"common"}
PACKAGE = "experiments"


def root() -> Path | None:
    """The folder that holds `experiments/` (the clone's root), put on `sys.path`; None
    outside a clone (a researcher's own modules still load)."""
    cwd = Path.cwd().resolve()
    for candidate in [Path(__file__).resolve().parents[2], cwd, *cwd.parents]:
        if (candidate / PACKAGE / "__init__.py").is_file():
            if str(candidate) not in sys.path:
                sys.path.insert(0, str(candidate))
            return candidate
    return None


def shipped() -> list[str]:
    """Names of the shipped experiment modules."""
    folder = root()
    if folder is None:
        return []
    return sorted(m.name for m in pkgutil.iter_modules([str(folder / PACKAGE)])
                  if m.name not in _NOT_EXPERIMENTS and not m.name.startswith("_"))


def load(name: str) -> ModuleType:
    """The experiment module `name` (shipped, or a dotted import path)."""
    if not isinstance(name, str) or not name:
        raise ConfigError("experiment", f"must name an experiment, got {name!r}")
    if "." in name:
        if os.getcwd() not in sys.path:  # a researcher's own experiments/ folder
            sys.path.append(os.getcwd())
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            raise ConfigError("experiment", f"cannot import {name!r}: {e}") from None
    elif name in shipped():
        module = importlib.import_module(f"{PACKAGE}.{name}")
    else:
        raise ConfigError("experiment", f"unknown experiment {name!r} (shipped: "
                          f"{', '.join(shipped())}; or a dotted module path)")
    missing = [a for a in ("Params", "run", "COLUMNS", "plot") if not hasattr(module, a)]
    if missing:
        raise ConfigError("experiment", f"module {module.__name__} lacks "
                          f"{', '.join(missing)} (see kvjax.lab.registry)")
    return module


def describe(module: ModuleType) -> str:
    """The first line of the module's docstring."""
    lines = (module.__doc__ or "").strip().splitlines()
    return lines[0] if lines else ""


def on_mesh() -> list[str]:
    """The shipped experiments whose engines run on a device mesh (`MESH = True`)."""
    return [name for name in shipped() if getattr(load(name), "MESH", False)]
