"""`kvjax bench prefix`: the ideal cache the multi-turn benchmark measures reuse against
(`ideal_reused`), and the run's own check that cache-on and cache-off outputs are equal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvjax.bench import prefix
from kvjax.bench.prefix import ideal_reused
from kvjax.cli import main

ROOT = Path(__file__).parent.parent


def test_ideal_reuse_counts_every_full_page_computed_before():
    system = list(range(10))  # 2 full pages of 4, and 2 tokens
    a1, b1 = system + [50, 51], system + [60]
    calls = [[(a1, [70, 71, 72, 73, 74]), (b1, [80, 81])],
             [(a1 + [70, 71, 72, 73, 74] + [90], [1, 2])]]
    # call 1: a1 is cold; b1 shares 2 full pages with a1's prompt (same call).
    # call 2: a1's prompt + answer minus its last token (16 tokens) are 4 full pages; the
    # prompt has 18 tokens, so its last token's page (page 4) is computed: 4 pages reused.
    assert ideal_reused(calls, 4) == 0 + 8 + 16
    assert ideal_reused([[(list(range(8)), [9])], [(list(range(8)), [9])]], 4) == 4


BENCH = ["bench", "prefix", "--config", str(ROOT / "configs/tiny.toml"), "--workloads",
         "system_prompt", "--requests", "3", "--system-len", "20", "--suffix-len", "3",
         "--new-tokens", "3", "--slots", "4", "--num-pages", "64", "--reps", "1"]


def test_the_run_compares_cache_on_and_off_outputs(tmp_path, monkeypatch):
    """`bench prefix` runs each workload with the cache on and off and refuses to report
    when their outputs differ: an engine that changes a token only with the cache on fails
    the run (its results file is not written)."""
    out = tmp_path / "prefix.json"
    assert main([*BENCH, "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["workload"] == "system_prompt" and row["reused_fraction"] > 0

    class Wrong(prefix.Engine):
        def generate(self, requests):
            results = super().generate(requests)
            if self.engine_config.prefix_cache:
                results[-1].tokens[-1] += 1
            return results

    monkeypatch.setattr(prefix, "Engine", Wrong)
    with pytest.raises(AssertionError, match="system_prompt: the prefix cache changed"):
        main([*BENCH, "--out", str(tmp_path / "wrong.json")])
    assert not (tmp_path / "wrong.json").exists()
