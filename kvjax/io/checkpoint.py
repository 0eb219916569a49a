"""Orbax checkpoints that carry their config and verify themselves on load.

Layout of `path/`: `params/` (an orbax StandardCheckpointer tree) and `kvjax.json` (the
ModelConfig, the model fingerprint, and any metadata such as a training step). Loading
restores into the shapes and dtypes the config implies and recomputes the fingerprint, so
a truncated, mismatched or corrupted checkpoint is an error, never silently wrong weights.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax

from kvjax.cache.identity import fingerprint_of, model_fingerprint
from kvjax.config import ConfigError, ModelConfig
from kvjax.config_files import build
from kvjax.io.hf import CheckpointError
from kvjax.model.transformer import param_shapes

FORMAT = 1


def save(path, config: ModelConfig, params, metadata: dict | None = None) -> str:
    """Writes `params` and `config` under `path` (replacing it); returns the fingerprint."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    fingerprint = model_fingerprint(config, params)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path / "params", params, force=True)
    checkpointer.wait_until_finished()
    meta = {"format": FORMAT, "config": dataclasses.asdict(config),
            "fingerprint": fingerprint, "metadata": metadata or {}}
    (path / "kvjax.json").write_text(json.dumps(meta, indent=2))
    return fingerprint


def read_metadata(path) -> dict:
    return read_json(path, "kvjax.json", "a kvjax checkpoint")


def read_json(path, name: str, what: str) -> dict:
    """`path/name` parsed; CheckpointError when it is missing ("`path` is not `what`") or
    corrupt."""
    meta_file = Path(path) / name
    if not meta_file.exists():
        raise CheckpointError(f"{path} is not {what} (no {name})")
    try:
        return json.loads(meta_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{meta_file} is corrupt: {e}") from None


def load(path) -> tuple[ModelConfig, dict]:
    """Restores (config, params), checking shapes, dtypes and the weight fingerprint."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    meta = read_metadata(path)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {meta.get('format')} is not {FORMAT}")
    try:
        # a config saved before the numerics plan moved out of ModelConfig
        saved = {k: v for k, v in meta["config"].items() if k not in ModelConfig.MOVED}
        config = build(ModelConfig, saved, "config")
    except ConfigError as e:
        raise CheckpointError(f"{path}: the saved config is invalid: {e}") from None
    target = param_shapes(config)
    try:
        params = ocp.StandardCheckpointer().restore(path / "params", target)
    except Exception as e:  # orbax raises many kinds; none may pass as a valid load
        raise CheckpointError(f"{path}: cannot restore params for the saved config "
                              f"({type(e).__name__}: {str(e)[:300]})") from None
    got = jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), params)
    want = jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), target)
    if got != want:
        raise CheckpointError(f"{path}: restored shapes/dtypes differ from the config's")
    if fingerprint_of(meta["config"], params) != meta["fingerprint"]:
        raise CheckpointError(f"{path}: the weights do not match the fingerprint saved with "
                              f"them (corrupted or partly overwritten checkpoint)")
    return config, params
