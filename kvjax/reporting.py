"""Benchmark output: progress lines and Markdown tables on stdout, JSON with the environment."""

from __future__ import annotations

import json
import platform
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import jax

Column = tuple[str, Callable[[dict], str]]  # header, cell of a result row


def emit(text: str = "") -> None:
    """One line of benchmark output (the results channel, stdout)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def markdown_table(rows: Sequence[dict], columns: Sequence[Column]) -> str:
    """A Markdown table; the first column is left-aligned when it holds text."""
    first_text = bool(rows) and isinstance(columns[0][1](rows[0]), str) and \
        not columns[0][1](rows[0]).replace(",", "").isdigit()
    aligns = ["---" if first_text else "---:"] + ["---:"] * (len(columns) - 1)
    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "|".join(aligns) + "|"]
    lines += ["| " + " | ".join(cell(r) for _, cell in columns) + " |" for r in rows]
    return "\n".join(lines)


def environment() -> dict:
    return {"jax": jax.__version__, "device": str(jax.devices()[0]),
            "machine": platform.machine(), "processor": platform.processor(),
            "python": platform.python_version()}


def write_results(out, table: str, results: list[dict], **meta) -> Path:
    """Prints `table` and writes {meta, environment, results} as JSON to `out`."""
    emit("\n" + table)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**meta, "environment": environment(), "results": results},
                              indent=2, default=str))
    emit(f"\nwrote {out}")
    return out
