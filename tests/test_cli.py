from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from kvjax.cli import BENCH_REPS, main

ROOT = Path(__file__).parent.parent


def test_generate_prints_tokens_timings_and_cache_usage(capsys):
    assert main(["generate", str(ROOT / "configs/tiny.toml"),
                 "--set", "generate.max_new_tokens=5"]) == 0
    out = capsys.readouterr().out
    assert out.count("tokens: [") == 2
    assert "pages used" in out
    assert "tokens/s" in out


def test_config_error_names_the_key(capsys):
    assert main(["generate", str(ROOT / "configs/tiny.toml"), "--set", "model.nope=1"]) == 2
    assert "model.nope: unknown key" in capsys.readouterr().err


def test_memory_command(capsys):
    assert main(["memory", "--batch", "16"]) == 0
    out = capsys.readouterr().out
    assert "131,072 B" in out
    assert "2.00 MiB" in out
    assert "bandwidth-bound" in out
    assert main(["memory", "--config", str(ROOT / "configs/bench.toml"), "--batch", "8",
                 "--context", "2048"]) == 0
    assert "8 layers, d_model 512" in capsys.readouterr().out


def test_bench_preemption_runs_both_settings_on_the_same_workload(tmp_path, capsys):
    """The preemption benchmark at a toy size: requests are preempted under both settings,
    only "resume" prefills answer tokens, and the two return the same tokens (the bench
    raises otherwise)."""
    out = tmp_path / "preemption.json"
    assert main(["bench", "preemption", "--config", str(ROOT / "configs/tiny.toml"),
                 "--requests", "4", "--prompt-len", "12", "--gen-tokens", "40", "--fit", "2",
                 "--slots", "4", "--reps", "1", "--out", str(out)]) == 0
    rows = {r["preemption"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["resume"]["preemptions"] > 0 and rows["recompute"]["preemptions"] > 0
    assert rows["resume"]["resumed_tokens"] > 0 == rows["recompute"]["resumed_tokens"]
    assert "| resume |" in capsys.readouterr().out


@pytest.mark.parametrize("which", sorted(BENCH_REPS))
def test_every_benchmark_starts_from_the_command_line(which, monkeypatch):
    """`kvjax bench <which>` reaches its module's main with every default filled (a new
    benchmark once raised KeyError here before it ran)."""
    seen = []
    module = importlib.import_module(f"kvjax.bench.{which}")
    monkeypatch.setattr(module, "main", lambda args: seen.append(args) or 0)
    assert main(["bench", which]) == 0
    (args,) = seen
    assert args.reps >= 1 and args.slots >= 1
    assert args.out == f"results/bench_{which}.json"
    assert None not in (args.requests, args.prompt_len, args.gen_tokens)
