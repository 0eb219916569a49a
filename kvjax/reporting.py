"""Writing benchmark results: the Markdown table on stdout, JSON with the environment."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import jax


def environment() -> dict:
    return {"jax": jax.__version__, "device": str(jax.devices()[0]),
            "machine": platform.machine(), "processor": platform.processor(),
            "python": platform.python_version()}


def write_results(out, table: str, results: list[dict], **meta) -> Path:
    """Prints `table` and writes {meta, environment, results} as JSON to `out`."""
    print("\n" + table)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**meta, "environment": environment(), "results": results},
                              indent=2, default=str))
    print(f"\nwrote {out}")
    return out
