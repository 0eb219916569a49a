"""`kvjax bench startup`: a new process's steps to its first answers, cold and warm."""

from __future__ import annotations

from kvjax.bench.startup import STEPS, measure, table


def test_a_warm_process_loads_every_program_its_entry_points_compile():
    """Two fresh processes on the tiny model (a random one: `--model random`): the cold one
    finds nothing in its empty cache folder; the warm one asks for the same programs and
    gets every one the entry points compile (the engine's and both answers') from the
    cache, and the load step's too (`kvjax.models.load` switches the cache on; a random
    model's `init_params` compiles before any entry point, so it is not cached)."""
    runs = measure("random", 2, "configs/tiny.toml", 1)
    rows = {row["step"]: row for row in table(runs)}
    assert list(rows) == list(STEPS)
    for step, row in rows.items():
        assert row["cold s"] > 0 and row["warm s"] > 0
        assert row["cold from cache"] == 0
        assert row["warm programs"] == row["cold programs"]
        if step in ("engine", "first answer", "second answer"):
            assert row["warm from cache"] == row["warm programs"], step
    assert rows["engine"]["cold programs"] > 0 and rows["first answer"]["cold programs"] > 0
