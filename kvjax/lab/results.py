"""The results folder of an experiment run (plain Python; no JAX work).

    config.json       the resolved config: experiment, seed, scale, params, sweep, points
    environment.json  package versions, device, machine, git commit, command line
    points.jsonl      the journal: one line per finished sweep point (resume reads it)
    metrics.jsonl     one line per row: the swept values, the other parameters, the metrics
    metrics.csv       the same rows; lists and tables as JSON text
    summary.md        what was run, the headline, the summary table, the plots
    *.png             the experiment's plots
    plots.json        their names (`--fresh` removes only these)
"""

from __future__ import annotations

import csv
import io
import json
import os
import shlex
import shutil
import sys
from pathlib import Path

import numpy as np

from kvjax.config import ConfigError
from kvjax.lab.registry import describe
from kvjax.lab.report import environment, markdown_table

JOURNAL = "points.jsonl"
PLOTS = "plots.json"  # the PNGs this run wrote (so --fresh removes only those)
OWN_FILES = ("config.json", "environment.json", JOURNAL, "metrics.jsonl", "metrics.csv",
             "summary.md", PLOTS)


def plain(value):
    """JSON for numpy scalars and arrays (json.dumps `default=`)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "__array__"):  # jax arrays
        return np.asarray(value).tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def write_json(path: Path, data) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=plain) + "\n")
    os.replace(tmp, path)


def start(out: Path, resolved: dict, fresh: bool) -> set[str]:
    """Prepares `out`; returns the ids of points already finished there (resume).

    A folder holding a run of a different resolved config is an error (unless `fresh`,
    which clears this runner's files, and the PNGs, first).
    """
    config_path = out / "config.json"
    if fresh and out.exists():
        if (out / PLOTS).exists():
            for name in json.loads((out / PLOTS).read_text()):
                (out / name).unlink(missing_ok=True)
        for name in OWN_FILES:
            (out / name).unlink(missing_ok=True)
    if config_path.exists():
        old = json.loads(config_path.read_text())
        if old != resolved:
            raise ConfigError("--out", f"{out} holds results of a different config (compare "
                              f"{config_path}); pass --fresh to overwrite it or choose "
                              f"another --out")
        entries = _journal(out)
        # Rewrite without a torn last line, so that appends start on a fresh line.
        (out / JOURNAL).write_text("".join(json.dumps(e, default=plain) + "\n"
                                           for e in entries.values()))
        return set(entries)
    out.mkdir(parents=True, exist_ok=True)
    write_json(config_path, resolved)
    (out / JOURNAL).unlink(missing_ok=True)
    return set()


def _journal(out: Path) -> dict[str, dict]:
    """point id -> journal entry; a torn last line (a crash mid-write) is dropped."""
    entries = {}
    path = out / JOURNAL
    if not path.exists():
        return entries
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        entries[entry["point_id"]] = entry
    return entries


def append_point(out: Path, pid: str, point: dict, params: dict, rows: list[dict],
                 seconds: float, commit: str | None) -> None:
    """Appends one finished point (its parameters, and the commit it ran at) to the
    journal, flushed to disk."""
    line = json.dumps({"point_id": pid, "point": point, "params": params, "seconds": seconds,
                       "commit": commit, "rows": rows}, default=plain)
    with open(out / JOURNAL, "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def rows_in_order(out: Path, point_ids: list[str]) -> list[dict]:
    """Every row of every point, in sweep order: the swept values, the other parameters,
    then the metrics (each row says everything that produced it)."""
    entries = _journal(out)
    return [{**entries[pid]["point"], **entries[pid]["params"], **row}
            for pid in point_ids for row in entries[pid]["rows"]]


def record_environment(out: Path, exp, resumed: bool) -> dict:
    """Writes environment.json for a new run; a resumed run appends itself to `resumes`,
    so a folder whose points ran on different commits or machines says so."""
    env = {**environment(), "command": sys.argv, "config": exp.source,
           "overrides": list(exp.overrides)}
    path = out / "environment.json"
    if resumed and path.exists():
        first = json.loads(path.read_text())
        first.setdefault("resumes", []).append(env)
        write_json(path, first)
    else:
        write_json(path, {**env, "resumes": []})
    return env


def to_csv(rows: list[dict]) -> str:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: json.dumps(v, default=plain) if isinstance(v, (list, dict, tuple))
                         else v for k, v in row.items()})
    return buffer.getvalue()


def finish(out: Path, exp, rows: list[dict]) -> list[Path]:
    """Writes metrics.jsonl, metrics.csv, the plots and summary.md; returns their paths."""
    (out / "metrics.jsonl").write_text(
        "".join(json.dumps(r, default=plain) + "\n" for r in rows))
    (out / "metrics.csv").write_text(to_csv(rows))
    plots = [Path(p) for p in exp.module.plot(rows, out)]
    write_json(out / PLOTS, [p.name for p in plots])
    (out / "summary.md").write_text(summary(exp, rows, plots, out))
    return [out / "metrics.jsonl", out / "metrics.csv", *plots, out / "summary.md"]


def summary(exp, rows: list[dict], plots: list[Path], out: Path) -> str:
    command = " ".join(["kvjax run", shlex.quote(exp.source),
                        *(f"--set {shlex.quote(o)}" for o in exp.overrides)])
    if exp.scale != "full" and not any(o.startswith("scale=") for o in exp.overrides):
        command += f" --set scale={exp.scale}"
    env = json.loads((out / "environment.json").read_text())
    lines = [f"# {exp.name}: {describe(exp.module)}", "", f"Reproduce: `{command}`", ""]
    if hasattr(exp.module, "headline"):
        lines += [exp.module.headline(rows), ""]
    lines += [markdown_table(rows, exp.module.COLUMNS), ""]
    lines += [f"![{p.stem}]({p.name})" for p in plots]
    git = env["git"]
    where = env["device"]
    if exp.mesh is not None:
        where = f"mesh {exp.mesh} ({env['device_count']} {where.split(':')[0]} devices)"
    lines += ["", f"seed {exp.seed}, scale {exp.scale}; kvjax {env['versions']['kvjax']}, "
              f"jax {env['versions']['jax']} on {where}; commit {git['commit']}"
              + (" (with uncommitted changes)" if git["dirty"] else ""), ""]
    return "\n".join(lines)


def is_timing(key: str, module=None) -> bool:
    """Keys that measure time (they differ between runs; everything else must not)."""
    return key.endswith(("_s", "_ms")) or key in getattr(module, "TIMING", ())


def deterministic(rows: list[dict], module=None) -> list[dict]:
    """The rows without their timing metrics: equal across runs with the same seed."""
    return [{k: v for k, v in r.items() if not is_timing(k, module)} for r in rows]


def publish(out: Path, docs: Path, prefix: str) -> list[Path]:
    """Copies the run's plots to `docs/` as `<prefix>_<name>.png` (the documentation shows them)."""
    docs.mkdir(parents=True, exist_ok=True)
    copied = []
    for png in sorted(out.glob("*.png")):
        target = docs / f"{prefix}_{png.name}" if not png.name.startswith(prefix) \
            else docs / png.name
        shutil.copyfile(png, target)
        copied.append(target)
    return copied
