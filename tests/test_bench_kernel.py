"""`kvjax bench kernel` (kvjax.bench.kernel) at small shapes: the chain and product rows
side by side with XLA's, each shape's rows checked bitwise, and the gates computed from the
chain's medians."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kvjax.bench import kernel as bench
from kvjax.bench import kernel_attention
from kvjax.cpu.product import kernel


@pytest.mark.skipif(not kernel().available, reason=kernel().describe())
def test_the_bench_times_both_paths_checks_bits_and_reports_the_gates(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "SMOLLM2", {"d": 64, "ff": 128, "kv": 32, "layers": 2,
                                           "vocab": 320})
    monkeypatch.setattr(bench, "CHECK_ROWS", (1, 2, 7, 9))
    monkeypatch.setattr(kernel_attention, "HEADS", {"layers": 2, "heads": 4, "kv": 2,
                                                    "head_dim": 16, "page": 4})
    monkeypatch.setattr(kernel_attention, "CASES", (("decode", 2, 1, 9),
                                                    ("chunk", 1, 5, 3)))
    monkeypatch.setattr(kernel_attention, "FMA_ROUNDS", 100_000)
    out = tmp_path / "kernel.json"
    args = SimpleNamespace(reps=1, config="configs/bench.toml",
                           set=["model.d_model=64", "model.d_ff=96", "model.num_heads=2",
                                "model.num_kv_heads=1", "model.vocab_size=200"], out=out)
    assert bench.main(args) == 0
    report = json.loads(out.read_text())
    rows = report["results"]
    assert [r["rows"] for r in rows[:4]] == list(bench.ROWS)  # the chain first
    assert all(r["xla_ms"] > 0 and r["kernel_ms"] > 0 for r in rows)
    products, attention = rows[4:-2], rows[-2:]
    assert all(r["bits"] is True for r in products)
    assert [r["shape"] for r in attention] == ["attention, decode", "attention, chunk"]
    assert [r["rows"] for r in attention] == [2, 5] and all(r["xla_fast_ms"] > 0
                                                            for r in attention)
    # the floor: 8 rows' multiply-adds over 16 lanes at the measured rate
    assert report["fma_rate"] > 1e6
    assert report["floor_8_rows_ms"] == pytest.approx(
        8 * kernel_attention.chain_macs(bench.SMOLLM2) / 16 / report["fma_rate"] * 1e3)
    shapes = {r["shape"] for r in products}
    assert "SmolLM2 head (tied) 64x320" in shapes and "bench mlp down 96x64" in shapes
    assert set(report["gates"]) == set(bench.gates(rows[:4]))


def test_the_gates_are_the_issues_bounds():
    def chain(ones, eights, xla256, ours256):
        return [{"rows": 1, "xla_ms": 10.0, "kernel_ms": ones},
                {"rows": 2, "xla_ms": 20.0, "kernel_ms": 10.0},
                {"rows": 8, "xla_ms": 20.0, "kernel_ms": eights},
                {"rows": 256, "xla_ms": xla256, "kernel_ms": ours256}]

    passed = {k: v[2] for k, v in bench.gates(chain(10.5, 12.0, 100.0, 130.0)).items()}
    assert all(passed.values())
    failed = {k: v[2] for k, v in bench.gates(chain(10.6, 12.8, 100.0, 131.0)).items()}
    assert not any(failed.values())
