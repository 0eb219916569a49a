"""Memory planning at scale: full-size configs priced per device on meshes we do not have."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import jax
import pytest
from jax.sharding import AbstractMesh, NamedSharding

from kvjax import CacheConfig, init_cache, load_config, memory, sharding
from kvjax.cli import main
from kvjax.memory import planner as memory_plan

ROOT = Path(__file__).parent.parent
GIB = 2**30
LLAMA_8B = load_config(ROOT / "configs/models/llama3_8b.toml").model
LLAMA_70B = load_config(ROOT / "configs/models/llama3_70b.toml").model

# 70B by hand: per layer q,k,v,o = 8192*128*(64+8+8+64), MLP 3*8192*28672, two norms 2*8192;
# untied embedding and head 2*128256*8192; final norm 8192.
PARAMS_70B = 80 * (8192 * 128 * 144 + 3 * 8192 * 28672 + 2 * 8192) + 2 * 128256 * 8192 + 8192


def plan(config, mesh, **kwargs):
    """The plan at docs/scale-out.md's settings: bf16 weights and KV, 80 GiB devices,
    16-token pages."""
    settings = dict(device_memory=80 * GIB, kv_bytes_per_scalar=2, param_bytes=2,
                    page_size=16, reserve=0.1) | kwargs
    return memory_plan.plan(config, mesh, **settings)


@pytest.mark.parametrize("path", sorted((ROOT / "configs/models").glob("*.toml")),
                         ids=lambda p: p.name)
def test_large_configs_build_as_shapes_with_the_expected_parameter_count(path):
    expected = {"llama3_8b.toml": 8_030_261_248, "llama3_70b.toml": 70_553_706_496}[path.name]
    config = load_config(path).model
    shapes = memory_plan.param_shapes(config)
    leaves = jax.tree.leaves(shapes)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)  # nothing allocated
    assert sum(math.prod(x.shape) for x in leaves) == memory.num_params(config) == expected


def test_8b_on_model_8_by_hand():
    p = plan(LLAMA_8B, "model=8", context=8192)
    # Per layer on one of 8 devices: q and o 4096*32*128/8 = 2,097,152 each, k and v
    # 4096*8*128/8 = 524,288 each, gate/up/down 4096*14336/8 = 7,340,032 each, two
    # replicated norms 2*4096. Embedding and head 128256*4096/8 = 65,667,072 each, final
    # norm 4096 replicated. 2 bytes per weight.
    per_layer = 2 * 2_097_152 + 2 * 524_288 + 3 * 7_340_032 + 8_192
    assert p["weight_bytes"] == 2 * (32 * per_layer + 2 * 65_667_072 + 4_096) == 2_008_031_232
    # K and V, 32 layers, 8 kv heads (one per device), head_dim 128, 2 bytes.
    assert p["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2 // 8 == 16_384
    assert p["kv_split"] == 8
    assert not p["kv_replicated"]
    # 80 GiB less the 10% reserve (8 GiB) less the weights; a sequence of 8192 tokens
    # holds 8192 * 16,384 = 134,217,728 B.
    assert p["kv_budget"] == 85_899_345_920 - 8_589_934_592 - 2_008_031_232 == 75_301_380_096
    assert p["max_batch"] == 75_301_380_096 // 134_217_728 == 561
    assert p["max_context"] == 75_301_380_096 // 16_384 // 16 * 16 == 4_596_016


def test_per_device_bytes_equal_jax_shard_shapes_on_an_abstract_mesh():
    for mesh in ("model=8", "data=2,model=4", "model=16"):
        sizes = sharding.parse_mesh(mesh)
        abstract = AbstractMesh(tuple(sizes.values()), sharding.MESH_AXES)
        shapes = memory_plan.param_shapes(LLAMA_8B)
        specs = sharding.param_specs(shapes, sizes)
        scalars = jax.tree.map(
            lambda x, s, m=abstract: math.prod(NamedSharding(m, s).shard_shape(x.shape)),
            shapes, specs)
        p = plan(LLAMA_8B, mesh)
        assert p["weight_bytes"] == 2 * sum(jax.tree.leaves(scalars)), mesh
        cache = jax.eval_shape(lambda: init_cache(
            LLAMA_8B, CacheConfig(page_size=16, num_pages=4, dtype="bfloat16")))
        spec = NamedSharding(abstract, sharding.cache_spec(LLAMA_8B, sizes))
        kv_shard = 2 * 2 * math.prod(spec.shard_shape(cache.k.shape))  # K and V, bf16
        assert p["kv_bytes_per_token"] * 4 * 16 == kv_shard, mesh


def test_mqa_on_model_8_keeps_the_whole_cache_on_every_device():
    mqa = dataclasses.replace(LLAMA_8B, num_kv_heads=1)
    p = plan(mqa, "model=8")
    unsharded = memory.kv_bytes(32, 1, 128, length=1, bytes_per_scalar=2)
    assert p["kv_bytes_per_token"] == p["kv_bytes_per_token_unsharded"] == unsharded == 16_384
    assert p["kv_replicated"]
    assert p["kv_split"] == 1
    assert "KV cache: kv_heads (1) is not divisible by model=8; replicated on model" in p["notes"]
    text = memory_plan.plan_report(mqa, mesh="model=8")
    assert "16,384 B; not split: the KV heads are replicated on model=8" in text
    # 8 KV heads on 16 model shards are not split either.
    p16 = plan(LLAMA_8B, "model=16")
    assert p16["kv_replicated"]
    assert p16["kv_bytes_per_token"] == 131_072


def test_data_axis_adds_no_kv_capacity():
    # The page pool is replicated over data: data=2,model=4 holds what model=4 holds.
    split = plan(LLAMA_8B, "data=2,model=4")
    alone = plan(LLAMA_8B, "model=4")
    for key in ("weight_bytes", "kv_bytes_per_token", "max_batch", "max_context"):
        assert split[key] == alone[key], key
    assert split["devices"] == 8


@pytest.mark.parametrize("mesh", ["model=1", "model=8", "data=2,model=4"])
@pytest.mark.parametrize("config", [LLAMA_8B, LLAMA_70B], ids=["8b", "70b"])
def test_max_batch_and_context_are_the_largest_that_fit(config, mesh):
    for context in (1000, 2048, 8192, 32768):
        batch = plan(config, mesh, context=context)["max_batch"]
        if batch:
            fits = plan(config, mesh, batch=batch, context=context)
            assert fits["fits"]
            assert (fits["kv_bytes"] + fits["weight_bytes"] + fits["reserve_bytes"]
                    <= 80 * GIB)
        assert not plan(config, mesh, batch=batch + 1, context=context)["fits"]
    for batch in (1, 7, 64):
        context = plan(config, mesh, batch=batch)["max_context"]
        assert context % 16 == 0
        if context:
            assert plan(config, mesh, batch=batch, context=context)["fits"]
        assert not plan(config, mesh, batch=batch, context=context + 1)["fits"]


def test_70b_weights_do_not_fit_one_80_gib_device():
    p = plan(LLAMA_70B, "model=1")
    assert p["weight_bytes"] == 2 * PARAMS_70B == 2 * 70_553_706_496
    assert p["kv_budget"] < 0
    assert p["max_batch"] == p["max_context"] == 0
    assert "weights do not fit" in memory_plan.plan_report(LLAMA_70B, mesh="model=1")


def test_cli_prints_the_report_and_the_plan(capsys):
    assert main(["memory", "--config", str(ROOT / "configs/models/llama3_8b.toml"),
                 "--mesh", "data=2,model=4", "--device-memory-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "KV per token per sequence: 128.00 KiB (131,072 B)" in out  # the existing report
    assert "per-device plan on mesh data=2, model=4 (8 devices), 80.00 GiB per device" in out
    # Per layer on one of 4 devices: q, o 4,194,304; k, v 1,048,576; gate/up/down
    # 14,680,064; norms 8,192. Embedding and head 32,064*4096 each, final norm 4096.
    weights = 2 * (32 * (2 * 4_194_304 + 2 * 1_048_576 + 3 * 14_680_064 + 8_192)
                   + 2 * 32_064 * 4_096 + 4_096)
    assert f"weights per device: 3.74 GiB ({weights:,} B)" in out
    assert "KV per token per device: 32.00 KiB (32,768 B; 131,072 B / 4 KV-head shards)" in out
    assert "every data shard holds the whole pool" in out


def test_cli_table_is_the_scale_table(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["memory", "--table"]) == 0
    out = capsys.readouterr().out
    expected = memory_plan.scale_table({"llama3_8b": LLAMA_8B, "llama3_70b": LLAMA_70B})
    assert out.strip() == expected
    assert "| llama3_8b | model=8 | 1.87 GiB | 16.00 KiB | 561 | 4,596,016 |" in out
    assert "| llama3_70b | model=1 | 131.42 GiB | 320.00 KiB | 0 | weights do not fit |" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["--mesh", "model=0"], "mesh: 'model=0': model must be an integer >= 1, got 0"),
    (["--mesh", "foo=2"], "mesh: 'foo=2': unknown axis 'foo' (axes: data, model)"),
    (["--mesh", "data2"], "expected 'data=D,model=M'"),
    (["--mesh", "model=8", "--reserve", "1.5"], "reserve: must be in [0, 1), got 1.5"),
    (["--table", "nope.toml"], "table: nope.toml: no such file"),
])
def test_cli_rejects_a_bad_mesh_before_printing(argv, message, capsys):
    assert main(["memory", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("kvjax: config error: ")
    assert message in captured.err


def test_cli_counts_a_page_format_with_its_scales(capsys):
    """`--kv-format int8`: one byte per number and a float32 scale per 128-number vector
    (2 x 32 layers x 8 KV heads x 128 x (1 + 4 / 128) = 67,584 B per token), in the report
    and the plan; the table refuses it (its models differ in head_dim)."""
    assert main(["memory", "--kv-format", "int8", "--mesh", "model=1"]) == 0
    out = capsys.readouterr().out
    assert "KV per token per sequence: 66.00 KiB (67,584 B)" in out
    assert "KV per token per device: 66.00 KiB (67,584 B" in out
    assert main(["memory", "--kv-format", "bfloat16"]) == 0
    assert "(131,072 B)" in capsys.readouterr().out
    assert main(["memory", "--table", "--kv-format", "int8"]) == 2
    assert "kv_format: the table takes --kv-bytes" in capsys.readouterr().err
