"""`kvjax.device_check --tiny` on CPU: every section present, and its figures agree with the
arithmetic they come from (the GPU figures themselves need a GPU)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from kvjax import device_check, memory
from kvjax.config import CacheConfig, load_config
from kvjax.device_check import TINY_MODEL
from kvjax.model.transformer import init_params


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(exit status, report) of one `--tiny` run."""
    out = tmp_path_factory.mktemp("device_check") / "report.json"
    rc = device_check.main(["--tiny", "--out", str(out)])
    return rc, json.loads(out.read_text())


def test_tiny_run_writes_every_section(tiny):
    rc, report = tiny
    assert rc == 0
    assert report["passed"] is True
    assert {"settings", "device", "model", "kernel_check", "prefix_ttft", "decode",
            "environment", "total_s"} <= set(report)
    assert report["settings"]["batches"] == [1, 2]
    assert report["device"]["platform"] == "cpu"
    assert report["device"]["peak_hbm_bytes_per_s"] is None  # unknown device: no fraction
    assert report["model"]["num_params"] == memory.num_params(TINY_MODEL)
    assert report["environment"]["versions"]["jax"] == jax.__version__


def test_kernel_matches_reference_within_tolerance(tiny):
    check = tiny[1]["kernel_check"]
    assert check["backend"] == "pallas_gpu" and check["interpret"] is True
    assert [(c["q_dtype"], c["precision"]) for c in check["cases"]] == [
        ("bfloat16", "default"), ("float32", "default"), ("float32", "highest")]
    for case in check["cases"]:
        assert case["passed"], case
        assert case["tol"] == device_check.TOLERANCE[case["q_dtype"]]
        assert 0 <= case["max_abs_error"] <= case["tol"]
    timing = check["timing"]
    assert timing["kernel_speedup"] == pytest.approx(timing["reference_ms"] / timing["kernel_ms"])


def test_warm_request_reuses_the_cached_prefix(tiny):
    ttft = tiny[1]["prefix_ttft"]
    prefix, suffix = ttft["prefix_tokens"], ttft["suffix_tokens"]
    assert (prefix, suffix) == (64, 8)
    assert ttft["cold_reused_tokens"] == 0 and ttft["cold_computed_tokens"] == prefix + suffix
    assert ttft["warm_reused_tokens"] == prefix and ttft["warm_computed_tokens"] == suffix
    assert ttft["prefill_chunks_cold_over_warm"] == 3  # 72 tokens in chunks of 32, then 8
    assert ttft["cold_ttft_s"] > 0 and ttft["warm_ttft_s"] > 0
    assert ttft["speedup"] == pytest.approx(ttft["cold_ttft_s"] / ttft["warm_ttft_s"])


def test_decode_bandwidth_counts_weights_once_and_every_rows_kv(tiny):
    """bytes/step = every weight but the embedding lookup (the tied head reads it) + each
    row's K/V over its context, read, and the new token's, written, all in bfloat16."""
    decode = tiny[1]["decode"]
    assert [p["batch"] for p in decode["points"]] == [1, 2]
    assert decode["skipped_batches"] == [] and decode["note"] is None
    shapes = jax.eval_shape(lambda: init_params(TINY_MODEL))
    leaves = jax.tree_util.tree_leaves_with_path(shapes)
    weights = 2 * sum(math.prod(x.shape) for path, x in leaves if path[-1].key != "scale")
    cfg = TINY_MODEL
    kv_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # K and V, bfloat16
    for point in decode["points"]:
        b, context, steps = point["batch"], point["context"], point["steps"]
        kv = sum(b * (context + i + 1) * kv_token + b * kv_token for i in range(steps)) / steps
        for name in ("reference", "kernel"):
            r = point[name]
            assert r["bytes_per_step"] == weights + kv
            assert r["tokens_per_s"] == pytest.approx(b * steps / r["seconds_per_call"])
            assert r["hbm_bytes_per_s"] == pytest.approx(
                r["bytes_per_step"] * steps / r["seconds_per_call"])
            assert r["tokens_per_s"] > 0 and r["hbm_bytes_per_s"] > 0
        assert point["kernel"]["backend"] == "pallas_gpu"
        assert point["kernel_speedup"] == pytest.approx(
            point["reference"]["seconds_per_call"] / point["kernel"]["seconds_per_call"])


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
