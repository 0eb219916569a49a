"""Orbax checkpoints carry their config and refuse to load anything but the saved weights."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import jax
import numpy as np
import pytest
from helpers import small_model

import kvjax
from kvjax.cache.identity import digest_tree, model_fingerprint
from kvjax.io import CheckpointError, load, read_metadata, save

# A failed orbax restore leaves tensorstore callbacks on a closed event loop; harmless here.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(scope="module")
def model():
    config = small_model(norm="layer", mlp="gelu", qkv_bias=True, mlp_bias=True)
    return config, kvjax.init_params(config, seed=3)


def _largest_file(folder):
    return max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def test_round_trip_is_bitwise_and_carries_the_config(model, tmp_path):
    config, params = model
    fingerprint = save(tmp_path / "ck", config, params, metadata={"step": 7})
    loaded_config, loaded = load(tmp_path / "ck")
    assert loaded_config == config
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(loaded),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    assert model_fingerprint(loaded_config, loaded) == fingerprint
    assert read_metadata(tmp_path / "ck")["metadata"] == {"step": 7}


def test_truncated_data_is_an_error(model, tmp_path):
    config, params = model
    save(tmp_path / "ck", config, params)
    data = _largest_file(tmp_path / "ck" / "params")
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="cannot restore|fingerprint"):
        load(tmp_path / "ck")


def test_flipped_bytes_are_an_error(model, tmp_path):
    config, params = model
    save(tmp_path / "ck", config, params)
    data = _largest_file(tmp_path / "ck" / "params")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError):
        load(tmp_path / "ck")


def test_config_that_does_not_match_the_params_is_an_error(model, tmp_path):
    config, params = model
    save(tmp_path / "ck", config, params)
    meta_file = tmp_path / "ck" / "kvjax.json"
    meta = json.loads(meta_file.read_text())
    meta["config"]["d_ff"] = config.d_ff * 2
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="cannot restore"):
        load(tmp_path / "ck")
    meta["config"] = dataclasses.asdict(dataclasses.replace(config, rope_theta=500.0))
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="fingerprint"):  # same shapes, other model
        load(tmp_path / "ck")
    meta["config"]["num_kv_heads"] = 3
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="num_kv_heads"):
        load(tmp_path / "ck")


def test_a_checkpoint_saved_with_numerics_fields_in_its_config_loads(model, tmp_path):
    """Checkpoints written before the numerics plan moved out of ModelConfig hold
    `numerics`, `row_block`, `row_blocks`, `transposed` and `fused` in their saved config,
    and a fingerprint over that config as written: they load (the moved keys dropped) and
    are still checked (a changed value of a moved key is caught)."""
    config, params = model
    save(tmp_path / "ck", config, params)
    meta_file = tmp_path / "ck" / "kvjax.json"
    meta = json.loads(meta_file.read_text())
    meta["config"] |= {"numerics": "fast", "row_block": 32, "row_blocks": [],
                       "transposed": [], "fused": False}
    text = json.dumps(meta["config"], sort_keys=True)  # the fingerprint as it was computed
    meta["fingerprint"] = hashlib.sha256(text.encode() + digest_tree(params).encode()
                                         ).hexdigest()[:32]
    meta_file.write_text(json.dumps(meta))
    assert load(tmp_path / "ck")[0] == config
    meta["config"]["row_block"] = 16
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="fingerprint"):
        load(tmp_path / "ck")


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no kvjax.json"):
        load(tmp_path)
