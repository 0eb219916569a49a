"""Benchmark output: progress lines and Markdown tables on stdout, JSON with the environment."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import jax

Column = tuple[str, Callable[[dict], str]]  # header, cell of a result row


def emit(text: str = "") -> None:
    """One line of benchmark output (the results channel, stdout)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def refuse(text: str) -> int:
    """Says why a command will not run (stderr); returns its exit status, 2."""
    sys.stderr.write(text + "\n")
    return 2


def markdown_table(rows: Sequence[dict], columns: Sequence[Column]) -> str:
    """A Markdown table; the first column is left-aligned when it holds text."""
    first_text = bool(rows) and isinstance(columns[0][1](rows[0]), str) and \
        not columns[0][1](rows[0]).replace(",", "").isdigit()
    aligns = ["---" if first_text else "---:"] + ["---:"] * (len(columns) - 1)
    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "|".join(aligns) + "|"]
    lines += ["| " + " | ".join(cell(r) for _, cell in columns) + " |" for r in rows]
    return "\n".join(lines)


PACKAGES = ("kvjax", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "chex", "numpy")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit() -> dict:
    """The commit of the kvjax checkout and whether it has uncommitted changes (or None)."""
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                                text=True, check=True, timeout=10).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain"],
                                cwd=root, capture_output=True, text=True, check=True,
                                timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": bool(status.strip())}


def environment() -> dict:
    """Package versions, device, machine and the git commit a result was made with."""
    return {"versions": {p: _version(p) for p in PACKAGES},
            "device": str(jax.devices()[0]), "device_count": jax.device_count(),
            "backend": jax.default_backend(), "cpus": os.cpu_count(),
            "machine": platform.machine(), "processor": platform.processor(),
            "platform": platform.platform(), "python": platform.python_version(),
            "git": git_commit()}


def write_results(out, table: str, results: list[dict], **meta) -> Path:
    """Prints `table` and writes {meta, environment, results} as JSON to `out`."""
    emit("\n" + table)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**meta, "environment": environment(), "results": results},
                              indent=2, default=str))
    emit(f"\nwrote {out}")
    return out
