"""Cache identity: the namespace a cached K/V page lives under, and the digests behind it.

A cached state may be reused only by a request that would recompute it bit for bit: same
weights, same adapter, same position base, same attention structure, same cache dtype,
and (when a tenant salt is set) the same tenant. Sampling settings act after the logits
and are deliberately not part of it. Plain Python + numpy: no JAX.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import weakref

import numpy as np

from kvjax.config import ModelConfig

NO_ADAPTER = "none"


# Digests of trees whose every leaf is immutable (a device array, not a numpy array),
# keyed by the leaves' paths and ids, with weak references that prove the ids still name
# the same arrays: an engine built again on the same weights does not hash them again
# (Gemma 3 270M's float32 weights: a gigabyte). Numpy leaves can change in place: always
# hashed.
_DIGESTS: dict[tuple, tuple[list, str]] = {}
_KEEP = 8


def digest_tree(tree) -> str:
    """sha256 over every leaf's path, dtype, shape and bytes (sorted by path)."""
    leaves = []

    def visit(node, path: str) -> None:
        if isinstance(node, dict):
            for key in sorted(node):
                visit(node[key], f"{path}/{key}")
        else:
            leaves.append((path, node))

    visit(_to_dict(tree), "")
    key = _immutable_key(leaves)
    if key is not None and key in _DIGESTS:
        refs, digest = _DIGESTS[key]
        if all(ref() is leaf for ref, (_, leaf) in zip(refs, leaves, strict=True)):
            return digest
    h = hashlib.sha256()
    for path, leaf in leaves:
        array = np.asarray(leaf)
        h.update(f"{path}:{array.dtype.str}:{array.shape}".encode())
        h.update(np.ascontiguousarray(array).tobytes())
    digest = h.hexdigest()
    if key is not None:
        while len(_DIGESTS) >= _KEEP:
            del _DIGESTS[next(iter(_DIGESTS))]
        _DIGESTS[key] = ([weakref.ref(leaf) for _, leaf in leaves], digest)
    return digest


def _immutable_key(leaves: list) -> tuple | None:
    """The cache key of leaves that are all immutable arrays (not numpy's), else None."""
    if not leaves or any(isinstance(leaf, np.ndarray) or not hasattr(leaf, "__array__")
                         for _, leaf in leaves):
        return None
    try:
        [weakref.ref(leaf) for _, leaf in leaves]
    except TypeError:
        return None
    return tuple((path, id(leaf)) for path, leaf in leaves)


def _to_dict(tree):
    """Flax FrozenDicts and other mappings as plain dicts."""
    if hasattr(tree, "items"):
        return {str(k): _to_dict(v) for k, v in tree.items()}
    return tree


def model_fingerprint(config: ModelConfig, params, plan=None) -> str:
    """Digest of the config, every weight and the numerics plan the steps run them with (a
    `kvjax.model.plan.NumericsPlan`, `plan_identity`); changing any of them changes it.
    Without a plan, the weights' identity (checkpoints)."""
    return fingerprint_of(dataclasses.asdict(config), params,
                          None if plan is None else plan_identity(plan))


# plan fields that change no bit: the layer loop runs the unrolled layers' operations in
# their order (tests/test_layer_loop.py), so its pages are the unrolled layers' pages
SAME_BITS = ("layer_loop",)


def plan_identity(plan) -> dict:
    """The fields of a numerics plan that change a token's bits (every one but SAME_BITS)."""
    return {k: v for k, v in dataclasses.asdict(plan).items() if k not in SAME_BITS}


def fingerprint_of(config: dict, params, plan: dict | None = None) -> str:
    """`model_fingerprint` of a config and plan given as dicts (a checkpoint's saved config
    is checked as it was written)."""
    text = json.dumps(config, sort_keys=True)
    if plan is not None:
        text += json.dumps(plan, sort_keys=True)
    return hashlib.sha256(text.encode() + digest_tree(params).encode()).hexdigest()[:32]


def adapter_identity(name: str | None, adapter) -> str:
    """`name@digest` of a LoRA adapter's weights; "none" without one."""
    if name is None:
        return NO_ADAPTER
    return f"{name}@{digest_tree(adapter)[:16]}"


def attention_signature(config: ModelConfig) -> str:
    """What decides which keys a query sees, how positions enter the states and how scores
    become weights: per-layer windows, RoPE bases and scaling, the score scale and cap."""
    c = config
    position = "learned"
    if c.position == "rope":
        position = f"rope(theta={c.rope_theta},scaling={dict(c.rope_scaling)})"
        if c.local_rope_theta is not None:
            position += f",local_rope(theta={c.local_rope_theta})"
    windows = ",".join(map(str, c.windows)) if c.layer_types else c.sliding_window
    scores = f"scale={c.query_scale},softcap={c.attn_softcap}"
    return f"causal={c.causal},window={windows},positions={position},scores={scores}"


@dataclasses.dataclass(frozen=True)
class CacheNamespace:
    """Everything besides the token ids that decides a cached state."""

    model: str
    adapter: str
    position_base: int
    attention: str
    kv_dtype: str
    salt: str | None = None

    def differing_fields(self, other: CacheNamespace) -> list[str]:
        return [f.name for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(other, f.name)]

    def with_salt(self, salt: str | None) -> CacheNamespace:
        return dataclasses.replace(self, salt=salt)
