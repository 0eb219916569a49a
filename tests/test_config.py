from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvjax import CacheConfig, ConfigError, EngineConfig, ModelConfig, load_config
from kvjax.config import Config
from kvjax.config_files import build, config_from_dict
from kvjax.model.plan import NumericsPlan

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# Experiment configs (`experiment = ...`, run by `kvjax run`) are tested in test_experiments.
CONFIGS = sorted(p for p in (Path(__file__).parent.parent / "configs").glob("*.toml")
                 if "experiment" not in tomllib.loads(p.read_text()))


def test_there_are_configs():
    assert len(CONFIGS) >= 3


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_parses(path):
    config = load_config(path)
    assert config.model.num_heads % config.model.num_kv_heads == 0
    assert config.cache.prefill_chunk % config.cache.page_size == 0


def test_dotted_overrides(tmp_path):
    config = load_config(CONFIGS[0], ["model.num_layers=4", "cache.dtype=bfloat16",
                                      "sampling.top_p=0.5", "model.sliding_window=8"])
    assert config.model.num_layers == 4
    assert config.cache.dtype == "bfloat16"
    assert config.sampling.top_p == 0.5
    assert config.model.sliding_window == 8


@pytest.mark.parametrize(("raw", "key", "message"), [
    ({"model": {"num_layerz": 2}}, "model.num_layerz", "unknown key"),
    ({"modle": {}}, "modle", "unknown section"),
    ({"model": {"num_heads": 8, "num_kv_heads": 3}}, "model.num_kv_heads", "must divide"),
    ({"model": {"num_layers": "four"}}, "model.num_layers", "expected an integer"),
    ({"model": {"num_layers": True}}, "model.num_layers", "expected an integer"),
    ({"model": {"norm": "batch"}}, "model.norm", "not one of"),
    ({"model": {"dtype": "int8"}}, "model.dtype", "not one of"),  # a page format, not weights
    ({"cache": {"page_size": 16, "prefill_chunk": 24}}, "cache.prefill_chunk",
     "not a multiple of page_size"),
    ({"cache": {"dtype": "float16"}}, "cache.dtype", "not one of"),
    ({"sampling": {"top_p": 0.0}}, "sampling.top_p", "must be in"),
    ({"sampling": {"temperature": -1}}, "sampling.temperature", ">= 0"),
    ({"model": {"num_layers": 2, "layer_types": ["full"]}}, "model.layer_types",
     "1 given for 2 layers"),
    ({"model": {"num_layers": 1, "layer_types": ["sliding"]}}, "model.layer_types",
     "need a sliding_window"),
    ({"model": {"num_layers": 1, "layer_types": ["local"], "sliding_window": 4}},
     "model.layer_types", "not one of"),
    ({"model": {"rope_scaling": [["rope_type", "ntk"]]}}, "model.rope_scaling", "not one of"),
    ({"model": {"rope_scaling": [["rope_type", "llama3"], ["factor", 8.0]]}},
     "model.rope_scaling", "llama3 needs"),
    ({"model": {"attn_softcap": 0.0}}, "model.attn_softcap", "> 0"),
    ({"model": {"max_seq_len": 512, "rope_scaling": [
        ["rope_type", "dynamic"], ["factor", 2.0], ["original_max_position_embeddings", 256]]}},
     "model.max_seq_len", "past where dynamic RoPE starts rescaling"),
])
def test_bad_keys_and_values_name_the_key(raw, key, message):
    with pytest.raises(ConfigError, match=message) as info:
        config_from_dict(raw)
    assert info.value.key == key
    assert str(info.value).startswith(f"{key}:")


def test_override_of_unknown_key_names_it():
    with pytest.raises(ConfigError) as info:
        load_config(CONFIGS[0], ["cache.pagesize=4"])
    assert info.value.key == "cache.pagesize"


def test_defaults_and_replace():
    config = ModelConfig(d_model=96, num_heads=6, num_kv_heads=2)
    assert config.head_dim == 16
    assert config.group_size == 3
    assert CacheConfig(page_size=4, attn_block=16).block_pages == 4
    hash(config)  # frozen configs are static jit arguments


def test_the_numerics_plan_is_no_model_key_and_checks_its_fields():
    """How the steps run a model moved out of `[model]` into a `NumericsPlan` beside it: a
    file naming a moved key is told where it went. A plan built from a table (`build`) has
    `row_blocks` as [product, block] pairs checked item by item; a wrong length, an
    unknown product or a transposed product that is not one whole product is an error
    naming the key."""
    for key, value in [("numerics", "invariant"), ("row_block", 16), ("row_blocks", []),
                       ("transposed", ["q"]), ("fused", True)]:
        with pytest.raises(ConfigError, match=f"model.{key}: moved: set "):
            config_from_dict({"model": {key: value}})
    plan = build(NumericsPlan, {"mode": "invariant", "transposed": ["q"],
                                "row_blocks": [["q", 0], ["o", 16]]})
    assert plan.row_blocks == (("q", 0), ("o", 16)) and plan.transposed == ("q",)
    assert plan.block("o") == 16 and plan.block("mlp up") == plan.row_block
    for bad, key in [({"row_blocks": [["q", 0, 1]]}, "expected 2 items"),
                     ({"row_blocks": [["z", 0]]}, "'z' is not a row product"),
                     ({"row_blocks": [["q", 1]]}, "a block is 0 or >= 2"),
                     ({"transposed": ["o"]}, "row block 0"),
                     ({"mode": "exact"}, "'exact' is not one of")]:
        with pytest.raises(ConfigError, match=key):
            build(NumericsPlan, {"mode": "invariant", **bad})


def test_a_config_has_one_cache_config():
    """`[cache]` is the engine's cache too: `engine.cache` follows it, a file cannot set
    the engine's apart, and two different ones given in Python are refused."""
    config = config_from_dict({"cache": {"page_size": 8, "prefill_chunk": 64}})
    assert config.engine.cache == config.cache and config.cache.page_size == 8
    with pytest.raises(ConfigError, match="engine.cache: set the cache section"):
        config_from_dict({"engine": {"cache": {"page_size": 8}}})
    eight = CacheConfig(page_size=8, prefill_chunk=64)
    assert Config(engine=EngineConfig(cache=eight)).cache == eight
    with pytest.raises(ConfigError, match="engine.cache: differs from cache"):
        Config(cache=eight, engine=EngineConfig(cache=CacheConfig(page_size=4)))
