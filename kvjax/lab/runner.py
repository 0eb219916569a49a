"""`kvjax run CONFIG`: resolve an experiment config, run its sweep, keep a resumable journal.

A config is a TOML file:

    experiment = "prefix_page_size"   # a module in experiments/ (or a dotted path)
    seed = 0
    scale = "full"                    # "full" | "small" (the smoke variant)
    [params]                          # the experiment's Params fields
    requests = 32
    [sweep]                           # a grid: the cartesian product of these lists
    page_size = [1, 4, 16, 64]
    [small.params]                    # applied over [params] when scale = "small"
    requests = 4
    [small.sweep]                     # replaces these sweep keys when scale = "small"
    page_size = [4, 16]

`mesh = "data=2,model=4"` (top level) runs the engines of an experiment with `MESH = True`
on that device mesh (see `kvjax.sharding`).

`--set` takes `seed=1`, `scale=small`, `mesh=model=8`, `params.requests=8` (or just
`requests=8`, which also fixes a swept field) and `sweep.page_size=[4,16]`. Everything
is checked, every sweep point built and validated, before any work starts. Finished points
are appended to `points.jsonl` in the results folder, so an interrupted run resumes where
it stopped.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import json
import math
import sys
import time
import typing
from pathlib import Path
from types import ModuleType
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from kvjax import sharding
from kvjax.config import ConfigError
from kvjax.config_files import build, check_type, parse_override
from kvjax.lab import registry as experiments
from kvjax.lab import results
from kvjax.lab.progress import Progress

TOP_LEVEL = ("experiment", "seed", "scale", "mesh", "params", "sweep", "small")
SCALARS = ("experiment", "seed", "scale", "mesh")  # the top-level keys --set may give
SCALES = ("full", "small")


@dataclasses.dataclass(frozen=True)
class PointConfig:
    """What an experiment's `run` gets for one sweep point."""

    params: Any  # the experiment's Params, with this point's swept values
    seed: int
    scale: str  # "full" | "small"
    out: Path  # the results folder (for artifacts an experiment wants to keep)
    point: dict  # the swept values of this point
    mesh: str | None = None  # "data=D,model=M": engines run on this mesh (MESH experiments)


@dataclasses.dataclass(frozen=True)
class Experiment:
    """A resolved config: the module, base parameters, and every point of the sweep."""

    source: str
    module: ModuleType
    name: str
    seed: int
    scale: str
    params: Any
    sweep: dict[str, list]
    points: list[tuple[dict, Any]]  # (swept values, Params) in sweep order
    overrides: tuple[str, ...] = ()
    mesh: str | None = None

    def resolved(self) -> dict:
        """The JSON form written to config.json and compared on resume."""
        mesh = {} if self.mesh is None else {"mesh": self.mesh}
        return json.loads(json.dumps({
            "experiment": self.name, "seed": self.seed, "scale": self.scale, **mesh,
            "params": dataclasses.asdict(self.params), "sweep": self.sweep,
            "points": [p for p, _ in self.points]}, default=results.plain))

    def default_out(self) -> Path:
        stem = Path(self.source).stem
        return Path("results") / (stem if self.scale == "full" else f"{stem}-{self.scale}")


def shipped_configs(folder: Path) -> dict[str, list[Path]]:
    """Experiment name -> the config files in `folder` that run it."""
    found: dict[str, list[Path]] = {}
    for path in sorted(Path(folder).glob("*.toml")):
        try:
            name = tomllib.loads(path.read_text()).get("experiment")
        except tomllib.TOMLDecodeError:
            continue
        if isinstance(name, str):
            found.setdefault(name, []).append(path)
    return found


def point_id(point: dict) -> str:
    return json.dumps(point, sort_keys=True, default=results.plain)


def resolve(path: str | Path, overrides: typing.Iterable[str] = ()) -> Experiment:
    """Loads and validates a config; raises ConfigError before any work."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("config", f"no such file: {path}")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("config", f"{path} is not valid TOML: {e}") from None
    for key in raw:
        if key not in TOP_LEVEL:
            raise ConfigError(key, f"unknown top-level key (known: {', '.join(TOP_LEVEL)})")
    overrides = tuple(overrides)
    parsed = [parse_override(text) for text in overrides]
    for keys, value in parsed:  # the top-level keys first: they choose the module and scale
        if len(keys) == 1 and keys[0] in SCALARS:
            raw[keys[0]] = value
    module = experiments.load(raw.get("experiment", ""))
    seed, scale = raw.get("seed", 0), raw.get("scale", "full")
    check_type(seed, int, "seed")
    if scale not in SCALES:
        raise ConfigError("scale", f"{scale!r} is not one of {', '.join(map(repr, SCALES))}")
    mesh = raw.get("mesh")
    if mesh is not None:
        check_type(mesh, str, "mesh")
        sharding.parse_mesh(mesh)
        if not getattr(module, "MESH", False):
            raise ConfigError("mesh", f"{raw['experiment']!r} does not run on a mesh (the "
                              f"experiments that do: {', '.join(experiments.on_mesh())})")
    params = dict(_table(raw, "params"))
    sweep = dict(_table(raw, "sweep"))
    small = _table(raw, "small")
    for key in small:
        if key not in ("params", "sweep"):
            raise ConfigError(f"small.{key}", "unknown key (known: params, sweep)")
    if scale == "small":
        params.update(_table(small, "params", "small."))
        sweep.update(_table(small, "sweep", "small."))
    fields = {f.name for f in dataclasses.fields(module.Params)}
    for keys, value in parsed:
        if len(keys) == 1 and keys[0] in SCALARS:
            continue
        if len(keys) == 2 and keys[0] == "sweep":
            sweep[keys[1]] = value
        elif (len(keys) == 2 and keys[0] == "params") or (len(keys) == 1 and keys[0] in fields):
            params[keys[-1]] = value
            sweep.pop(keys[-1], None)  # a value set on the command line fixes a swept field
        else:
            raise ConfigError(".".join(keys), f"unknown key for --set (known: experiment, "
                              f"seed, scale, mesh, params.<field>, sweep.<field>; fields of "
                              f"{module.__name__}.Params: {', '.join(sorted(fields))})")
    base = build(module.Params, params, "params")
    grid = _grid(module.Params, fields, sweep)
    points = []
    for values in itertools.product(*grid.values()):
        point = dict(zip(grid, values, strict=True))
        try:
            points.append((point, dataclasses.replace(base, **point)))
        except ConfigError as e:
            where = f"sweep.{e.key}" if e.key in point else f"params.{e.key}"
            raise ConfigError(where, f"at sweep point {point}: "
                              f"{str(e).split(': ', 1)[1]}") from None
    return Experiment(str(path), module, raw["experiment"], seed, scale, base, grid, points,
                      overrides, mesh)


def _table(raw: dict, key: str, prefix: str = "") -> dict:
    table = raw.get(key, {})
    if not isinstance(table, dict):
        raise ConfigError(f"{prefix}{key}", "must be a table")
    return table


def _grid(params_cls: type, fields: set[str], sweep: dict) -> dict[str, list]:
    hints = typing.get_type_hints(params_cls)
    grid = {}
    for key, values in sweep.items():
        if key not in fields:
            raise ConfigError(f"sweep.{key}", f"not a parameter of this experiment (known: "
                              f"{', '.join(sorted(fields))})")
        if not isinstance(values, (list, tuple)) or not values:
            raise ConfigError(f"sweep.{key}", f"must be a non-empty list, got {values!r}")
        grid[key] = [check_type(v, hints[key], f"sweep.{key}") for v in values]
        if len({point_id({"v": v}) for v in grid[key]}) != len(grid[key]):
            raise ConfigError(f"sweep.{key}", f"repeats a value: {values!r}")
    return grid


def memory_maps() -> tuple[int, int] | None:
    """(memory maps this process holds, the kernel's `vm.max_map_count`), or None where
    /proc tells neither (not Linux)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            used = sum(1 for _ in maps)
        return used, int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return None


MAP_MARGIN = 0.9  # of vm.max_map_count: where a sweep's next point must stay


def drop_compiled_code() -> None:
    """Drops every compiled executable (`jax.clear_caches`) and the memory maps it holds.

    XLA:CPU keeps memory maps for each compiled program (three per kernel, hundreds of
    kernels for a 30-layer model) while it is cached, and a sweep compiles each point's
    engines anew (other format, cache or shapes): one SmolLM2 point of the ShareGPT tiers
    sweep added 29,000 of the 65,530 the kernel allows, and a 9-point run failed in the
    compiler with "Cannot allocate memory" at its third point.
    """
    import jax  # here, not at the top: a mesh run picks its CPU devices before JAX starts

    from kvjax.decode import aot

    jax.clear_caches()
    aot.clear()  # the programs the steps hold by kvjax's key
    gc.collect()


def run(exp: Experiment, out: str | Path | None = None, fresh: bool = False,
        echo=print) -> Path:
    """Runs every point not already in the folder's journal; writes the results folder.

    With a mesh, a CPU-only machine is first given the CPU devices it needs (possible only
    before JAX starts), and a mesh larger than the visible devices is refused before any
    work or folder.
    """
    if exp.mesh is not None:
        sharding.request_cpu_devices(math.prod(sharding.parse_mesh(exp.mesh).values()))
        sharding.make_mesh(exp.mesh)
    out = Path(out) if out is not None else exp.default_out()
    resolved = exp.resolved()
    done = results.start(out, resolved, fresh)
    todo = [(p, params) for p, params in exp.points if point_id(p) not in done]
    if done:
        echo(f"resuming {out}: {len(exp.points) - len(todo)} of {len(exp.points)} points "
             f"already done")
    env = results.record_environment(out, exp, resumed=bool(done))
    growth = 0  # the most memory maps one point has added
    with Progress(len(exp.points), exp.name, start=len(exp.points) - len(todo)) as bar:
        for point, params in todo:
            before = memory_maps()
            t0 = time.perf_counter()
            rows = exp.module.run(PointConfig(params, exp.seed, exp.scale, out, point,
                                              exp.mesh))
            rows = [rows] if isinstance(rows, dict) else list(rows)
            results.append_point(out, point_id(point), point, dataclasses.asdict(params), rows,
                                 time.perf_counter() - t0, env["git"]["commit"])
            bar.update(1, done=" ".join(f"{k}={v}" for k, v in point.items()))
            after = memory_maps()
            if before is not None and after is not None:
                # dropped only when a point like the largest so far might not fit: until
                # then the points share their compiled programs
                growth = max(growth, after[0] - before[0])
                if after[0] + growth > MAP_MARGIN * after[1]:
                    drop_compiled_code()
    rows = results.rows_in_order(out, [point_id(p) for p, _ in exp.points])
    written = results.finish(out, exp, rows)
    for path in written:
        echo(f"wrote {path}")
    return out
