"""`kvjax bench gamma`: one speculative program for every γ against a program per γ, on the
tiny model: every way emits the same tokens (the bench refuses otherwise), each γ's row
has its three timings, and the last row the programs' compile seconds."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvjax.bench.gamma import Setup, measure, prompt_tokens
from kvjax.config_files import load_config
from kvjax.model.transformer import init_params

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_every_program_emits_the_same_tokens():
    config = load_config(str(ROOT / "configs/tiny.toml")).model
    setup = Setup(init_params(config, seed=0), config, prompt_tokens(config.vocab_size, 40), 12)
    rows = measure(setup, [1, 3], reps=1)
    assert [r["gamma"] for r in rows] == [1, 3, "all"]
    for row in rows[:2]:
        assert all(row[f"{w} ms"] > 0 for w in ("alone", "one", "padded"))
    total = rows[-1]
    assert total["one compile s"] > 0 and total["alone compile s"] > total["padded compile s"]
