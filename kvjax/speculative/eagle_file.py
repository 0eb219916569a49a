"""An EAGLE-style head's file: its own parameters and draft vocabulary (orbax), never the
target's weights, and an identity that names the target it was trained on.

Layout of `path/`: `head/` (an orbax tree {"params", "vocab"}) and `eagle.json` (format,
the target's model fingerprint and config, the head's identity, training metadata).
Loading checks the target: a head trained on other weights reads features it has never
seen, so it is refused (`CheckpointError`), and the identity is recomputed from what was
restored, so a corrupted file never drafts silently.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import jax
import numpy as np

from kvjax.cache.identity import digest_tree, model_fingerprint
from kvjax.config import ModelConfig
from kvjax.io.checkpoint import read_json
from kvjax.io.hf import CheckpointError
from kvjax.speculative.eagle import init_head

FORMAT = 1


@dataclasses.dataclass(frozen=True)
class HeadFile:
    params: dict  # the head's (kvjax.speculative.eagle.EagleHead)
    vocab: np.ndarray  # int32[|vocab|]: the draft vocabulary
    target: str  # the target's model fingerprint
    identity: str  # digest of the parameters, the vocabulary and the target
    metadata: dict


def head_identity(params, vocab, target: str) -> str:
    """Digest of a head's parameters, its draft vocabulary and its target's fingerprint."""
    tree = {"params": params, "vocab": np.asarray(vocab, np.int32)}
    return hashlib.sha256((target + digest_tree(tree)).encode()).hexdigest()[:32]


def save_head(path, params, vocab, target_config: ModelConfig, target_params,
              metadata: dict | None = None) -> HeadFile:
    """Writes the head under `path` (replacing it); returns what `load_head` gives back."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    vocab = np.asarray(vocab, np.int32)
    target = model_fingerprint(target_config, target_params)
    identity = head_identity(params, vocab, target)
    saver = ocp.StandardCheckpointer()
    saver.save(path / "head", {"params": params, "vocab": vocab}, force=True)
    saver.wait_until_finished()
    meta = {"format": FORMAT, "target": target, "target_config":
            dataclasses.asdict(target_config), "vocab_size": len(vocab),
            "identity": identity, "metadata": metadata or {}}
    (path / "eagle.json").write_text(json.dumps(meta, indent=2))
    return HeadFile(params, vocab, target, identity, metadata or {})


def load_head(path, target_config: ModelConfig, target_params) -> HeadFile:
    """The head under `path`, checked against the target it will draft for."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    meta = read_json(path, "eagle.json", "an EAGLE head")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: head format {meta.get('format')} is not {FORMAT}")
    target = model_fingerprint(target_config, target_params)
    if meta["target"] != target:
        raise CheckpointError(f"{path} was trained on another target (fingerprint "
                              f"{meta['target']}, this one {target}): train a head for it")
    shapes = {"params": jax.eval_shape(lambda: init_head(target_config)),
              "vocab": jax.ShapeDtypeStruct((meta["vocab_size"],), np.int32)}
    try:
        tree = ocp.StandardCheckpointer().restore(path / "head", shapes)
    except Exception as e:  # orbax raises many kinds; none may pass as a valid load
        raise CheckpointError(f"{path}: cannot restore the head ({type(e).__name__}: "
                              f"{str(e)[:300]})") from None
    vocab = np.asarray(tree["vocab"], np.int32)
    if head_identity(tree["params"], vocab, target) != meta["identity"]:
        raise CheckpointError(f"{path}: the head does not match the identity saved with it "
                              f"(corrupted or partly overwritten)")
    return HeadFile(tree["params"], vocab, target, meta["identity"], meta["metadata"])
