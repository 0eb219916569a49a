"""Names a package loads on first use (PEP 562): a package's `__init__` lists them in a
table, `_EXPORTS` (module -> names) and `_SUBMODULES`, so that importing the package runs
none of those modules. Host code (the trie, the scheduler, requests) then imports without
JAX; `tests/test_layout.py` reads the same tables to follow the imports they stand for."""

from __future__ import annotations

import importlib
import sys


def exports(package: str, table: dict[str, tuple[str, ...]], submodules: tuple[str, ...] = ()):
    """`(__getattr__, __dir__)` for `package`: a name in `table` is imported from its module
    on first use and kept; a name in `submodules` is that subpackage."""
    namespace = sys.modules[package].__dict__
    owner = {name: module for module, names in table.items() for name in names}

    def __getattr__(name: str):
        if name in submodules:
            return importlib.import_module(f"{package}.{name}")
        if name not in owner:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value = getattr(importlib.import_module(owner[name]), name)
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *namespace.get("__all__", ())})

    return __getattr__, __dir__
