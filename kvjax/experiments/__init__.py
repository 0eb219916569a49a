"""Shipped experiments: one module each, run by `kvjax run configs/<name>.toml`.

An experiment module exposes

    Params                  a frozen dataclass: the experiment's parameters, validated on
                            construction (`ConfigError` naming the bad field)
    run(config) -> rows     one sweep point: `config` is a `kvjax.runner.PointConfig`
                            (params, seed, scale, out, mesh); returns a list of metric dicts
    COLUMNS                 the summary table: (header, cell of a row) pairs
    plot(rows, out) -> [paths]   PNG plots of all rows into folder `out`
    TIMING (optional)       metric keys that are timings (besides keys ending in `_s`)
    headline(rows) (optional)    one line for the summary and `--list`
    MESH (optional)         True: its engines take `config.mesh` (a config's `mesh = ...`)

and a module docstring whose first line describes it. A config may also name any
importable module (`experiment = "experiments.my_ablation"`, found from the working
directory too) with the same interface.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys
from types import ModuleType

from kvjax.config import ConfigError

_NOT_EXPERIMENTS = {"common"}


def shipped() -> list[str]:
    """Names of the experiment modules in this package."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__)
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
        module = importlib.import_module(f"{__name__}.{name}")
    else:
        raise ConfigError("experiment", f"unknown experiment {name!r} (shipped: "
                          f"{', '.join(shipped())}; or a dotted module path)")
    missing = [a for a in ("Params", "run", "COLUMNS", "plot") if not hasattr(module, a)]
    if missing:
        raise ConfigError("experiment", f"module {module.__name__} lacks "
                          f"{', '.join(missing)} (see kvjax.experiments)")
    return module


def describe(module: ModuleType) -> str:
    """The first line of the module's docstring."""
    lines = (module.__doc__ or "").strip().splitlines()
    return lines[0] if lines else ""


def on_mesh() -> list[str]:
    """The shipped experiments whose engines run on a device mesh (`MESH = True`)."""
    return [name for name in shipped() if getattr(load(name), "MESH", False)]
