"""The sharding table and the functions that apply it: logical axes per parameter and cache
dimension, mesh construction and placement, the step shardings, multi-process start (see
`kvjax.sharding`). Needs no model code: the model imports it."""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kvjax.config import MESH_AXES, ConfigError, ModelConfig, parse_mesh

RULES: dict[str, str | None] = {
    "batch": "data",
    "heads": "model",
    "kv_heads": "model",
    "ff": "model",
    "vocab": "model",
    "embed": None,
    "layers": None,
    "pages": None,
    "page_slots": None,
    "head_dim": None,
    "positions": None,
}

# (module name, parameter name) -> logical axes of the parameter, for every weight the
# Transformer has. Norm scales and biases over the model width are "embed" (replicated).
PARAM_AXES: dict[tuple[str, str], tuple[str, ...]] = {
    ("embed", "embedding"): ("vocab", "embed"),
    ("pos_embed", "embedding"): ("positions", "embed"),
    ("q", "kernel"): ("embed", "heads", "head_dim"),
    ("q", "bias"): ("heads", "head_dim"),
    ("k", "kernel"): ("embed", "kv_heads", "head_dim"),
    ("k", "bias"): ("kv_heads", "head_dim"),
    ("v", "kernel"): ("embed", "kv_heads", "head_dim"),
    ("v", "bias"): ("kv_heads", "head_dim"),
    ("o", "kernel"): ("heads", "head_dim", "embed"),
    ("o", "bias"): ("embed",),
    ("gate", "kernel"): ("embed", "ff"),
    ("gate", "bias"): ("ff",),
    ("up", "kernel"): ("embed", "ff"),
    ("up", "bias"): ("ff",),
    ("down", "kernel"): ("ff", "embed"),
    ("down", "bias"): ("embed",),
    ("lm_head", "kernel"): ("embed", "vocab"),
}
NORM_AXES = ("embed",)  # scale / bias of every *_norm module

CACHE_AXES = ("layers", "kv_heads", "pages", "page_slots", "head_dim")  # PagedKVCache.k, .v


def make_mesh(spec: str | dict[str, int]) -> Mesh:
    """A ("data", "model") mesh over the first data*model devices (GSPMD auto axes)."""
    sizes = parse_mesh(spec)
    count = math.prod(sizes.values())
    devices = jax.devices()
    if count > len(devices):
        hint = (" (on CPU, start Python with XLA_FLAGS=--xla_force_host_platform_device_count="
                f"{count} or set jax_num_cpu_devices before first use)"
                if devices[0].platform == "cpu" else "")
        raise ConfigError("mesh", f"{spec!r} needs {count} devices; "
                          f"{len(devices)} are visible{hint}")
    shape = tuple(sizes[a] for a in MESH_AXES)
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    if count == len(devices):  # JAX orders the devices by the machine's topology
        return jax.make_mesh(shape, MESH_AXES, axis_types=auto)
    return Mesh(np.asarray(devices[:count]).reshape(shape), MESH_AXES, axis_types=auto)


def mesh_sizes(mesh: Mesh) -> dict[str, int]:
    return {axis: int(mesh.shape.get(axis, 1)) for axis in MESH_AXES}


def logical_spec(axes: tuple[str | None, ...], shape: tuple[int, ...],
                 sizes: dict[str, int], what: str = "",
                 notes: list[str] | None = None) -> PartitionSpec:
    """The PartitionSpec of an array with logical `axes`; undividable axes are replicated."""
    out = []
    for axis, dim in zip(axes, shape, strict=True):
        mesh_axis = RULES.get(axis) if axis is not None else None
        size = sizes.get(mesh_axis, 1) if mesh_axis else 1
        if size == 1:
            out.append(None)
        elif dim % size:
            out.append(None)
            note = (f"{what}: {axis} ({dim}) is not divisible by {mesh_axis}={size}; "
                    f"replicated on {mesh_axis}")
            if notes is not None and note not in notes:
                notes.append(note)
        else:
            out.append(mesh_axis)
    return PartitionSpec(*out)


def param_axes(path: tuple[str, ...], ndim: int) -> tuple[str, ...]:
    """Logical axes of the parameter at `path` (e.g. ("layer_0", "attn", "q", "kernel"))."""
    module, name = (path[-2] if len(path) > 1 else ""), path[-1]
    if module.endswith("norm"):
        return NORM_AXES[:ndim]
    try:
        axes = PARAM_AXES[(module, name)]
    except KeyError:
        raise KeyError(f"no sharding rule for parameter {'/'.join(path)}: add it to "
                       f"kvjax.sharding.PARAM_AXES") from None
    if len(axes) != ndim:
        raise ValueError(f"{'/'.join(path)} has {ndim} dims, the rule names {axes}")
    return axes


def path_names(path) -> tuple[str, ...]:
    return tuple(str(getattr(p, "key", getattr(p, "name", p))) for p in path)


def param_kind(names: tuple[str, ...]) -> str:
    """A parameter's name without its layer: "layer_3/attn/k/kernel" -> "attn/k/kernel"."""
    return "/".join(n for n in names if not re.fullmatch(r"layer_\d+", n))


def param_specs(params, sizes: dict[str, int], notes: list[str] | None = None):
    """A pytree of PartitionSpecs for `params` (arrays or `jax.eval_shape` structs).

    Notes (one per kind of parameter, not per layer) say what could not be split.
    """
    def spec(path, x):
        names = path_names(path)
        return logical_spec(param_axes(names, x.ndim), x.shape, sizes, param_kind(names), notes)
    return jax.tree_util.tree_map_with_path(spec, params)


def cache_spec(config: ModelConfig, sizes: dict[str, int],
               notes: list[str] | None = None) -> PartitionSpec:
    """The PartitionSpec of the paged cache's K and V: KV heads on "model"."""
    shape = (config.num_layers, config.num_kv_heads, 1, 1, config.head_dim)
    return logical_spec(CACHE_AXES, shape, sizes, "KV cache", notes)


def shard_bytes(shape: tuple[int, ...], dtype, spec: PartitionSpec,
                sizes: dict[str, int]) -> int:
    """Bytes one device holds of an array of `shape` sharded by `spec` over a mesh of `sizes`."""
    per_device = list(shape)
    for i, axis in enumerate(tuple(spec) + (None,) * (len(shape) - len(spec))):
        for name in (axis if isinstance(axis, tuple) else (axis,)):
            if name is not None:
                per_device[i] = -(-per_device[i] // sizes[name])
    return math.prod(per_device) * np.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class StepShardings:
    """What a jitted step needs to constrain its inputs and outputs (hashable: a static arg).

    `cache` is the PartitionSpec of the target cache's K/V, `draft_cache` the draft model's.
    Host-read outputs (tokens, logits, lengths) are replicated, so that every process of a
    multi-process run can read them.
    """

    mesh: Mesh
    cache: PartitionSpec
    draft_cache: PartitionSpec | None = None

    def named(self, spec: PartitionSpec) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def constrain_cache(self, cache, draft: bool = False):
        spec = self.draft_cache if draft else self.cache
        sharding = self.named(spec)
        return cache.replace(k=jax.lax.with_sharding_constraint(cache.k, sharding),
                             v=jax.lax.with_sharding_constraint(cache.v, sharding))

    def replicated(self, tree):
        """Constrains every array of `tree` to be replicated (readable by every process)."""
        sharding = self.named(PartitionSpec())
        return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, sharding), tree)

    def batch(self, x: jax.Array) -> jax.Array:
        """Constrains activations [B, ...] to be split over "data" (when it divides B)."""
        spec = logical_spec(("batch",) + (None,) * (x.ndim - 1), x.shape, mesh_sizes(self.mesh))
        return jax.lax.with_sharding_constraint(x, self.named(spec))


def maybe_constrain_cache(shardings: StepShardings | None, cache, draft: bool = False):
    return cache if shardings is None or cache is None else shardings.constrain_cache(cache, draft)


def maybe_replicated(shardings: StepShardings | None, tree):
    return tree if shardings is None else shardings.replicated(tree)


def place(x, sharding: NamedSharding) -> jax.Array:
    """`x` (host or device array) as a global array with `sharding`.

    Built shard by shard from the host value, so each process of a multi-process run only
    transfers the shards its own devices hold.
    """
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def resolve_mesh(mesh: str | dict | Mesh | None) -> Mesh | None:
    """A Mesh from a spec like "data=2,model=4" (or a Mesh, or None: no mesh)."""
    return mesh if mesh is None or isinstance(mesh, Mesh) else make_mesh(mesh)


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, cpu_devices: int | None = None) -> None:
    """Joins a multi-process JAX run (`jax.distributed.initialize`); call before any JAX work.

    Every process then runs the same program on the same requests: the host side (trie,
    allocator, scheduler) is deterministic, so each process makes the same decisions and
    issues the same jitted steps over the global mesh; outputs the host reads are replicated.
    On a cluster JAX finds the arguments itself (SLURM, Kubernetes, Cloud TPU); give them
    for a hand-started run. `cpu_devices` gives each process that many CPU devices (tests).
    """
    if cpu_devices is not None:
        jax.config.update("jax_num_cpu_devices", cpu_devices)
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id)


MAX_CPU_DEVICES = 64  # the most fake CPU devices `request_cpu_devices` asks for


def request_cpu_devices(count: int) -> bool:
    """Asks JAX for `count` CPU devices so a mesh fits on a CPU-only machine (a no-op for
    GPU/TPU devices). Works only before JAX starts its backends, and for at most
    MAX_CPU_DEVICES; returns whether it asked."""
    if count > MAX_CPU_DEVICES:
        return False
    try:
        jax.config.update("jax_num_cpu_devices", max(count, jax.config.jax_num_cpu_devices))
    except RuntimeError:
        return False
    return True
