"""The engine on a device mesh: same answers as one device, and the sharding rules.

The mesh runs happen in subprocesses (`mesh_check.py` on 8 fake CPU devices; two
`multiprocess_check.py` processes joined by `jax.distributed`), so the rest of the suite
keeps its one device.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import sharp_params, small_model, tol
from jax.sharding import PartitionSpec as P

import kvjax
from kvjax import sharding
from kvjax.config import ConfigError, EngineConfig

HERE = Path(__file__).parent
MESHES = ("mha 1x8", "mha 2x4", "mha 8x1", "mqa 1x8")


def _child_env() -> dict:
    """A child process's environment: no XLA_FLAGS (it sets its own device count), and the
    tests folder on the path before the caller's own (so it imports the kvjax we import)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("XLA_FLAGS", None)
    return env


def _python(script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = _child_env()
    return subprocess.run([sys.executable, str(HERE / script), *args], capture_output=True,
                          text=True, env=env, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def mesh_runs(tmp_path_factory) -> dict:
    proc = _python("mesh_check.py", str(tmp_path_factory.mktemp("mesh_results")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


# -- same answers on the mesh ---------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("case", MESHES)
def test_mesh_matches_one_device(mesh_runs, case):
    """Greedy tokens identical to one device, float32 logits within tol, same reuse; no
    warning but the replication notes (a donated cache whose sharding changed would warn)."""
    run = mesh_runs[case]
    assert mesh_runs["devices"] == 8
    assert run["tokens"] == run["ref_tokens"]
    assert run["max_logit_diff"] <= tol(1.3e-5)
    assert run["reused"] == run["ref_reused"]
    assert sum(run["reused"]) > 0  # the second wave did reuse the system prompt's pages
    assert all(w.startswith("kvjax mesh: ") and "replicated" in w for w in run["warnings"])


@pytest.mark.parametrize(("case", "cache_shard", "q_shard", "embed_shard"), [
    # cache [layers, kv_heads, pages, page_size, head_dim]; q kernel [embed, heads, head_dim];
    # embedding [vocab, embed]. KV heads and query heads split on "model", vocab too.
    ("mha 1x8", [1, 1, 96, 8, 16], [128, 1, 16], [8, 128]),
    ("mha 2x4", [1, 2, 96, 8, 16], [128, 2, 16], [16, 128]),
    ("mha 8x1", [1, 8, 96, 8, 16], [128, 8, 16], [64, 128]),
    ("mqa 1x8", [1, 1, 96, 8, 16], [128, 1, 16], [8, 128]),  # one KV head: replicated
])
def test_mesh_shards_as_the_rules_say(mesh_runs, case, cache_shard, q_shard, embed_shard):
    run = mesh_runs[case]
    assert run["cache_shard"] == cache_shard
    assert run["q_shard"] == q_shard
    assert run["embed_shard"] == embed_shard


def test_mqa_on_a_wide_mesh_says_the_cache_is_replicated(mesh_runs):
    notes = mesh_runs["mqa 1x8"]["warnings"]
    assert "kvjax mesh: KV cache: kv_heads (1) is not divisible by model=8; replicated on " \
           "model" in notes
    assert mesh_runs["mha 2x4"]["warnings"] == []


def test_prefix_cache_on_vs_off_is_bitwise_on_the_mesh(mesh_runs):
    run = mesh_runs["prefix on vs off 2x4"]
    assert run["bitwise"] and run["tokens"] == run["ref_tokens"]
    assert sum(run["ref_reused"]) == 0 and sum(run["reused"]) > 0


@pytest.mark.parametrize("case", ["spec model 2x4", "spec ngram 2x4", "pallas_gpu 2x4",
                                  "partial copy, poison 2x4", "lora 2x4"])
def test_spec_kernel_page_copies_and_adapters_on_the_mesh(mesh_runs, case):
    """Speculative decoding (greedy), the GPU kernel under shard_map (interpret mode),
    partial-page copies with NaN-poisoned freed pages, and LoRA adapters per request give
    one device's greedy tokens, with its reuse counts and logits within tol."""
    run = mesh_runs[case]
    assert run["tokens"] == run["ref_tokens"]
    assert run["reused"] == run["ref_reused"]
    assert run["max_logit_diff"] <= tol(6.7e-6)
    if case == "lora 2x4":
        assert run["tokens_differ_from_base"] > 0  # the adapter did change outputs
    if case == "pallas_gpu 2x4":  # the kernel ran (fast numerics), not the reference
        assert run["kernel_calls"] and set(run["kernel_calls"]) == {"pallas_gpu"}


def test_an_experiment_config_runs_on_a_mesh(mesh_runs):
    """`kvjax run` with `mesh=data=2,model=4`: the same metrics as on one device (timings
    and what is resident aside), and the summary says where it ran."""
    from experiments import prefix_page_size
    from kvjax.lab.results import is_timing

    run = mesh_runs["run prefix_page_size 2x4"]
    one, mesh = run["rows"]["None"], run["rows"]["data=2,model=4"]
    assert len(one) == len(mesh) == 1
    # On one device the answers' pages are cached too (invariant numerics); a mesh keeps
    # the fast rules (prompt pages only): what is resident differs, nothing else.
    resident = ("resident_pages", "resident_bytes", "kv_bytes_per_reused_token")
    same = {k: v for k, v in one[0].items()
            if not is_timing(k, prefix_page_size) and k not in resident}
    assert same == {k: mesh[0][k] for k in same}
    assert mesh[0]["resident_pages"] < one[0]["resident_pages"]
    assert same["reused_tokens"] > 0
    assert "on mesh data=2,model=4 (8 cpu devices)" in run["summary_mesh_line"]


# -- several processes ------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_run_one_sharded_generate(tmp_path):
    """Two local CPU processes (4 devices each, loopback) serve one data=2,model=4 mesh and
    agree with this single-device process."""
    from multiprocess_check import CONFIG, ENGINE, requests

    port = _free_port()
    env = _child_env()
    procs = [subprocess.Popen([sys.executable, str(HERE / "multiprocess_check.py"), str(port),
                               str(i), str(tmp_path / f"{i}.json")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    try:
        logs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:  # a process left waiting for a dead peer is not left behind
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-2000:] for log in logs)
    outs = [json.loads((tmp_path / f"{i}.json").read_text()) for i in range(2)]
    assert outs[0]["process_count"] == 2 and outs[0]["devices"] == 8
    assert outs[0]["local_devices"] == 4
    params = sharp_params(CONFIG, seed=5)
    ref = kvjax.Engine(params, CONFIG, ENGINE).generate(requests())
    for out in outs:
        assert out["tokens"] == [r.tokens for r in ref]
        for got, want in zip(out["logits"], ref, strict=True):
            err = np.abs(np.asarray(got) - np.asarray(want.logits)).max()
            assert err <= tol(9.5e-6)


# -- the rules, without devices ---------------------------------------------------------------
def test_parse_mesh():
    assert sharding.parse_mesh("data=2,model=4") == {"data": 2, "model": 4}
    assert sharding.parse_mesh("model=8") == {"data": 1, "model": 8}
    assert sharding.parse_mesh({"data": 2}) == {"data": 2, "model": 1}
    for bad, message in (("model=0", "must be an integer >= 1"), ("pipe=2", "unknown axis"),
                         ("model", "expected 'data=D,model=M'"), ("model=2,model=2", "twice")):
        with pytest.raises(ConfigError, match=message):
            sharding.parse_mesh(bad)
    with pytest.raises(ConfigError, match="mesh"):
        EngineConfig(mesh="model=x")


def test_mesh_needs_enough_devices():
    with pytest.raises(ConfigError, match="needs 64 devices; 1 are visible.*device_count=64"):
        sharding.make_mesh("data=8,model=8")


def test_param_specs_follow_the_rules_table():
    config = small_model(num_heads=8, num_kv_heads=2, d_model=64, d_ff=128, vocab_size=64,
                         tie_embeddings=False)
    params = kvjax.init_params(config)
    notes: list[str] = []
    specs = sharding.param_specs(params, {"data": 2, "model": 4}, notes)
    attn, mlp = specs["layer_0"]["attn"], specs["layer_0"]["mlp"]
    assert attn["q"]["kernel"] == P(None, "model", None)
    assert attn["k"]["kernel"] == P(None, None, None)  # 2 KV heads on model=4: replicated
    assert attn["o"]["kernel"] == P("model", None, None)
    assert mlp["gate"]["kernel"] == P(None, "model") and mlp["down"]["kernel"] == P("model", None)
    assert specs["embed"]["embedding"] == P("model", None)
    assert specs["lm_head"]["kernel"] == P(None, "model")
    assert specs["final_norm"]["scale"] == P(None)
    assert notes == ["attn/k/kernel: kv_heads (2) is not divisible by model=4; replicated on "
                     "model", "attn/v/kernel: kv_heads (2) is not divisible by model=4; "
                     "replicated on model"]
    assert sharding.cache_spec(config, {"data": 2, "model": 2}) == P(None, "model", None, None,
                                                                     None)


def test_shard_bytes_by_hand():
    # [32, 8, 1000, 16, 128] bf16 cache split 8 ways on kv heads: 32*1*1000*16*128*2 bytes.
    spec = P(None, "model", None, None, None)
    assert sharding.shard_bytes((32, 8, 1000, 16, 128), jnp.bfloat16, spec,
                                {"data": 1, "model": 8}) == 131_072_000
    assert sharding.shard_bytes((10, 7), "float32", P("model", None),
                                {"data": 1, "model": 4}) == 3 * 7 * 4  # ceil(10 / 4) rows


def test_unknown_parameter_has_no_rule():
    with pytest.raises(KeyError, match="no sharding rule for parameter layer_0/attn/rot/kernel"):
        sharding.param_axes(("layer_0", "attn", "rot", "kernel"), 2)


def test_adaptive_gamma_across_processes_needs_pinned_costs(monkeypatch):
    """Each process would measure its own timings and could pick another γ (another
    program: the collectives would hang), so measured costs are refused there."""
    import jax

    from kvjax import Engine, SpecConfig

    config = small_model()
    params = kvjax.init_params(config)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ConfigError, match="spec.adaptive: with several processes"):
        Engine(params, config, spec=SpecConfig(drafter="ngram", adaptive=True))
    Engine(params, config, spec=SpecConfig(drafter="ngram", adaptive=True, verify_slope=0.1))


def test_describe_says_what_is_sharded_how():
    """The plan's description (no devices needed: an abstract 2x4 mesh)."""
    from jax.sharding import AbstractMesh

    config = small_model(num_heads=8, num_kv_heads=2, d_model=64)
    lines = sharding.ShardingPlan(AbstractMesh((2, 4), ("data", "model")), config).describe()
    assert lines[0] == "mesh data=2, model=4 (8 devices)"
    assert "attn/q/kernel: (None, 'model', None)" in lines
    assert "mlp/down/kernel: ('model', None)" in lines
    assert lines[-1] == ("KV cache: kv_heads (2) is not divisible by model=4; replicated on "
                         "model")


def test_a_cpu_only_machine_is_given_the_devices_a_mesh_needs():
    """What `kvjax run` does first with a mesh, in a fresh process (before JAX starts)."""
    code = ("from kvjax import sharding\n"
            "assert sharding.request_cpu_devices(4)\n"
            "mesh = sharding.make_mesh('data=2,model=2')\n"
            "import jax\n"
            "print(jax.device_count(), dict(mesh.shape))\n")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "4 {'data': 2, 'model': 2}"
    assert not sharding.request_cpu_devices(sharding.MAX_CPU_DEVICES + 1)
