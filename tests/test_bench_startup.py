"""`kvjax bench startup`: a new process's steps to its first answers, cold and warm."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvjax.bench.startup import STEPS, measure, table

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_warm_process_loads_every_program_its_entry_points_compile(monkeypatch):
    """Two fresh processes on the tiny model (a random one: `--model random`): the cold one
    finds nothing in its empty cache folder; the warm one gets every program the engine and
    its warm-up ask for from the cache (a random model's `init_params` compiles before any
    entry point switches the cache on, so the load step's programs are not cached), and
    neither asks for a program after the warm-up, whatever the questions' lengths."""
    monkeypatch.setenv("KVJAX_KEEP_PROGRAMS", "1")  # kvjax's kept steps, a user's default
    runs = measure("random", 2, str(ROOT / "configs/tiny.toml"), 1)
    rows = {row["step"]: row for row in table(runs)}
    assert list(rows) == list(STEPS)
    for step, row in rows.items():
        assert row["cold s"] > 0 and row["warm s"] > 0
        assert row["cold from cache"] == 0
        if step in ("engine", "warm-up"):
            assert row["warm programs"] > 0, step
            assert row["warm from cache"] == row["warm programs"], step
        if step in ("first answer", "second answer"):  # after the warm-up: nothing
            assert row["cold programs"] == row["warm programs"] == 0, step
