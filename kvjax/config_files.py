"""TOML config files and `--set a.b=c` overrides, checked against the dataclasses of
`kvjax.config` (every error names the offending key)."""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from pathlib import Path
from typing import Any

from kvjax.config import Config, ConfigError, EngineConfig, _require

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


_SECTIONS: dict[str, type] = typing.get_type_hints(Config)


def check_type(value: Any, annotation: Any, key: str) -> Any:
    """Checks a TOML value against a field annotation; returns it (lists become tuples)."""
    if annotation is Any:  # checked by the config's own validation
        return value
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return check_type(value, option, key)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if origin is tuple:
        _require(isinstance(value, (list, tuple)), key, f"expected a list, got {value!r}")
        args = typing.get_args(annotation)
        if Ellipsis in args:  # tuple[X, ...]
            return tuple(check_type(v, args[0], key) for v in value)
        _require(len(value) == len(args), key, f"expected {len(args)} items, got {value!r}")
        return tuple(check_type(v, a, key) for v, a in zip(value, args, strict=True))
    if dataclasses.is_dataclass(annotation) and isinstance(value, dict):
        return build(annotation, value, key)
    if annotation is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        _require(ok, key, f"expected a number, got {value!r}")
        return float(value)
    if annotation is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        _require(ok, key, f"expected an integer, got {value!r}")
        return value
    _require(isinstance(value, annotation), key,
             f"expected {annotation.__name__}, got {value!r}")
    return value


def build(cls: type, table: dict[str, Any], section: str = ""):
    """Builds dataclass `cls` from a TOML table, naming the bad key on any error."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    prefix = f"{section}." if section else ""
    kwargs = {}
    moved = getattr(cls, "MOVED", {})
    for key, value in table.items():
        if key in moved:
            raise ConfigError(f"{prefix}{key}", f"moved: set {moved[key]}")
        if cls is EngineConfig and key == "cache":
            raise ConfigError(f"{prefix}{key}", "set the cache section (one cache config: "
                              "it is the engine's too)")
        if key not in names:
            raise ConfigError(f"{prefix}{key}",
                              f"unknown key (known: {', '.join(sorted(names))})")
        kwargs[key] = check_type(value, hints[key], f"{prefix}{key}")
    try:
        return cls(**kwargs)
    except ConfigError as e:
        if section and not e.key.startswith(f"{section}."):
            raise e.under(section) from None
        raise


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parses `a.b=value`; the value is read as TOML, or taken as a plain string."""
    if "=" not in text:
        raise ConfigError(text, "an override must look like section.key=value")
    key, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip().split("."), value


def apply_overrides(raw: dict[str, Any], overrides: typing.Iterable[str]) -> dict[str, Any]:
    """Returns a copy of a nested TOML dict with each `a.b=value` override applied."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(".".join(path), f"{part} is not a table")
        node[path[-1]] = value
    return out


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Builds a `Config` from a nested dict (a parsed TOML file)."""
    sections = {}
    for name, table in raw.items():
        if name not in _SECTIONS:
            raise ConfigError(name, f"unknown section (known: {', '.join(sorted(_SECTIONS))})")
        if not isinstance(table, dict):
            raise ConfigError(name, "must be a table")
        sections[name] = build(_SECTIONS[name], table, name)
    return Config(**sections)


def load_config(path: str | Path, overrides: typing.Iterable[str] = ()) -> Config:
    """Loads a TOML config file and applies `section.key=value` overrides."""
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    return config_from_dict(apply_overrides(raw, overrides))
