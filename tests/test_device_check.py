"""`kvjax.bench.device_check --tiny` on CPU: every section present, and its figures agree with
hand arithmetic. The run measures as usual, but the times it reports are replaced by known
ones (and the CPU given a peak bandwidth), so every figure derived from a time is checked
against a value worked out here; the GPU figures themselves need a GPU."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from kvjax import memory
from kvjax.bench import device_check, device_measure
from kvjax.bench.device_check import TINY_MODEL
from kvjax.config import CacheConfig
from kvjax.config_files import load_config
from kvjax.engine.engine import Engine
from kvjax.lab import timing as lab_timing
from kvjax.model.transformer import init_params

# The times the `--tiny` run reports, in place of those it measures:
KERNEL_S = [0.006, 0.0025]  # check_kernel times the reference alone, then the kernel
# Each repetition of prefix_ttft: a cold request, then a warm one; the first pair compiles.
TTFT_S = [10.0, 9.0, 0.030, 0.004, 0.050, 0.012]
STEP_S = {(1, "reference"): 0.002, (1, "kernel"): 0.001,  # (batch, backend): s a decode step
          (2, "reference"): 0.003, (2, "kernel"): 0.0025}
PEAK = 4e9  # bytes/s, given to the CPU so the fraction of peak is reported


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(exit status, report, the times measured) of one `--tiny` run that measures as usual
    but reports the known times above."""
    kernel_s, ttft_s, measured = list(KERNEL_S), list(TTFT_S), []

    def median_seconds(fn, reps, warmup=2):
        measured.append(lab_timing.median_seconds(fn, reps, warmup))
        return kernel_s.pop(0)

    def multistep_seconds(params, config, holder, table, lengths, decode_steps, reps,
                          kernel=None):
        measured.append(lab_timing.multistep_seconds(params, config, holder, table, lengths,
                                                     decode_steps, reps, kernel))
        return STEP_S[len(lengths), "reference" if kernel is None else "kernel"]

    class KnownTTFT(Engine):
        def generate(self, requests):
            results = super().generate(requests)
            for result in results:
                result.stats["ttft_s"] = ttft_s.pop(0)
            return results

    out = tmp_path_factory.mktemp("device_check") / "report.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(device_measure, "median_seconds", median_seconds)
        mp.setattr(device_measure, "multistep_seconds", multistep_seconds)
        mp.setattr(device_measure, "Engine", KnownTTFT)
        mp.setattr(device_check, "peak_hbm", lambda kind: PEAK)
        rc = device_check.main(["--tiny", "--out", str(out)])
    assert kernel_s == ttft_s == []  # every known time was reported
    return rc, json.loads(out.read_text()), measured


def test_tiny_run_writes_every_section(tiny):
    rc, report, measured = tiny
    assert rc == 0
    assert report["passed"] is True
    assert {"settings", "device", "model", "kernel_check", "prefix_ttft", "decode",
            "environment", "total_s"} <= set(report)
    assert report["settings"]["batches"] == [1, 2]
    assert report["device"]["platform"] == "cpu"
    assert report["device"]["peak_hbm_bytes_per_s"] == PEAK
    assert report["model"]["num_params"] == memory.num_params(TINY_MODEL)
    assert report["environment"]["versions"]["jax"] == jax.__version__
    # 2 kernel timings and 2 batches × 2 backends of decode, each really measured
    assert len(measured) == 6 and all(s > 0 for s in measured)


def test_kernel_matches_reference_within_tolerance(tiny):
    check = tiny[1]["kernel_check"]
    assert check["backend"] == "pallas_gpu" and check["interpret"] is True
    assert [(c["q_dtype"], c["precision"]) for c in check["cases"]] == [
        ("bfloat16", "default"), ("float32", "default"), ("float32", "highest")]
    for case in check["cases"]:
        assert case["passed"], case
        assert case["tol"] == device_measure.TOLERANCE[case["q_dtype"]]
        assert 0 <= case["max_abs_error"] <= case["tol"]
    timing = check["timing"]
    # reference 6 ms, kernel 2.5 ms: 6 / 2.5 = 2.4 (float64 arithmetic: measured error 0)
    assert (timing["reference_ms"], timing["kernel_ms"]) == pytest.approx((6.0, 2.5), rel=1e-12)
    assert timing["kernel_speedup"] == pytest.approx(2.4, rel=1e-12)


def test_warm_request_reuses_the_cached_prefix(tiny):
    ttft = tiny[1]["prefix_ttft"]
    prefix, suffix = ttft["prefix_tokens"], ttft["suffix_tokens"]
    assert (prefix, suffix) == (64, 8)
    assert ttft["cold_reused_tokens"] == 0 and ttft["cold_computed_tokens"] == prefix + suffix
    assert ttft["warm_reused_tokens"] == prefix and ttft["warm_computed_tokens"] == suffix
    assert ttft["prefill_chunks_cold_over_warm"] == 3  # 72 tokens in chunks of 32, then 8
    # The compiling pair (10 s, 9 s) is left out: cold median(0.030, 0.050) = 0.040, warm
    # median(0.004, 0.012) = 0.008, speedup 0.040 / 0.008 = 5 (with the first pair: 0.050 /
    # 0.012 = 4.17). Measured error 0.
    assert (ttft["cold_ttft_s"], ttft["warm_ttft_s"]) == pytest.approx((0.040, 0.008), rel=1e-12)
    assert ttft["speedup"] == pytest.approx(5.0, rel=1e-12)


def test_decode_bandwidth_counts_weights_once_and_every_rows_kv(tiny):
    """bytes/step = every weight but the embedding lookup (the tied head reads it) + each
    row's K/V over its context, read, and the new token's, written, all in bfloat16. From
    the known step times (8 steps a call):
      batch 1: reference 2 ms/step: 16 ms a call, 1 / 0.002 = 500 tokens/s;
               kernel 1 ms: 8 ms, 1000 tokens/s; kernel speedup 2 / 1 = 2
      batch 2: reference 3 ms: 24 ms, 2 / 0.003 = 666.7 tokens/s;
               kernel 2.5 ms: 20 ms, 2 / 0.0025 = 800 tokens/s; speedup 3 / 2.5 = 1.2
    and bytes/s = bytes/step / s/step (500, 1000, 333.3 and 400 × bytes/step), a fraction
    bytes/s / 4e9 of the peak given."""
    decode = tiny[1]["decode"]
    assert [p["batch"] for p in decode["points"]] == [1, 2]
    assert decode["skipped_batches"] == [] and decode["note"] is None
    shapes = jax.eval_shape(lambda: init_params(TINY_MODEL))
    leaves = jax.tree_util.tree_leaves_with_path(shapes)
    weights = 2 * sum(math.prod(x.shape) for path, x in leaves if path[-1].key != "scale")
    cfg = TINY_MODEL
    kv_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # K and V, bfloat16
    expect = {  # (batch, backend): (s a call, ms a step, tokens/s, steps/s), by hand above
        (1, "reference"): (0.016, 2.0, 500.0, 500.0), (1, "kernel"): (0.008, 1.0, 1000.0, 1000.0),
        (2, "reference"): (0.024, 3.0, 666.667, 333.333), (2, "kernel"): (0.020, 2.5, 800.0, 400.0)}
    for point in decode["points"]:
        b, context, steps = point["batch"], point["context"], point["steps"]
        assert (context, steps) == (32, 8)
        kv = sum(b * (context + i + 1) * kv_token + b * kv_token for i in range(steps)) / steps
        for name in ("reference", "kernel"):
            r = point[name]
            call_s, step_ms, tokens_per_s, steps_per_s = expect[b, name]
            assert r["bytes_per_step"] == weights + kv
            assert (r["seconds_per_call"], r["ms_per_step"]) == pytest.approx((call_s, step_ms),
                                                                                rel=1e-12)  # 0
            # rel 1e-5 below: measured 1.0e-6, as 666.667 and 333.333 are rounded by hand
            assert r["tokens_per_s"] == pytest.approx(tokens_per_s, rel=1e-5)
            assert r["hbm_bytes_per_s"] == pytest.approx((weights + kv) * steps_per_s, rel=1e-5)
            assert r["fraction_of_peak"] == pytest.approx(
                (weights + kv) * steps_per_s / PEAK, rel=1e-5)
        assert point["kernel"]["backend"] == "pallas_gpu"
        assert point["kernel_speedup"] == pytest.approx({1: 2.0, 2: 1.2}[b], rel=1e-12)  # 0


def test_time_limit_skips_the_remaining_batch_sizes():
    cache = CacheConfig(page_size=16, num_pages=1, dtype="bfloat16", attn_block=32)
    decode = device_check.decode_throughput(
        None, TINY_MODEL, cache, [1, 2], 32, 8, 1, "reference", False, None,
        deadline=time.perf_counter())
    assert decode["points"] == [] and decode["skipped_batches"] == [1, 2]
    assert "time limit" in decode["note"]


def test_cpu_without_tiny_exits_2_and_says_why(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert device_check.main(["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "GPU" in err and "--tiny" in err and "--force" in err
    assert not out.exists()


def test_random_params_of_the_8b_config_are_bfloat16_without_allocating():
    model = load_config(Path(__file__).parent.parent / "configs/models/llama3_8b.toml").model
    shapes = jax.eval_shape(lambda: device_check.random_params(model))
    leaves = jax.tree.leaves(shapes)
    assert {x.dtype for x in leaves} == {jnp.dtype(jnp.bfloat16)}
    assert jax.tree.structure(shapes) == jax.tree.structure(
        jax.eval_shape(lambda: init_params(model)))
    assert sum(math.prod(x.shape) for x in leaves) == memory.num_params(model) == 8_030_261_248


def test_random_params_scales_are_one_and_weights_small():
    params = device_check.random_params(TINY_MODEL)
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        assert x.dtype == jnp.bfloat16
        if path[-1].key == "scale":
            assert (x == 1).all()
        else:
            assert 0.01 < float(jnp.std(x.astype(jnp.float32))) < 0.03


@pytest.mark.parametrize(("kind", "peak"), [
    ("NVIDIA H200", 4.8e12), ("NVIDIA H100 80GB HBM3", 3.35e12), ("NVIDIA H100 PCIe", 2.0e12),
    ("NVIDIA A100-SXM4-80GB", 2.039e12), ("cpu", None), ("NVIDIA L4", None)])
def test_peak_bandwidth_by_device_kind(kind, peak):
    assert device_check.peak_hbm(kind) == peak
