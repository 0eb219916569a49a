"""`ShardingPlan`: one model's weights, cache and step shardings on a mesh."""

from __future__ import annotations

import math

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kvjax.config import ModelConfig
from kvjax.sharding.rules import (
    StepShardings,
    cache_spec,
    mesh_sizes,
    param_kind,
    param_specs,
    path_names,
    place,
)


class ShardingPlan:
    """A mesh plus the placements of one model's weights and paged cache on it."""

    def __init__(self, mesh: Mesh, config: ModelConfig):
        self.mesh = mesh
        self.sizes = mesh_sizes(mesh)
        self.config = config
        self.notes: list[str] = []
        self.cache_spec = cache_spec(config, self.sizes, self.notes)

    def steps(self, draft: ShardingPlan | None = None) -> StepShardings:
        return StepShardings(self.mesh, self.cache_spec,
                             None if draft is None else draft.cache_spec)

    def place_params(self, params):
        """Weights sharded by the rules table (works in a multi-process run: every process
        passes the same host values and keeps only its own devices' shards)."""
        specs = param_specs(params, self.sizes, self.notes)
        return jax.tree.map(lambda x, s: place(x, NamedSharding(self.mesh, s)), params, specs)

    def place_replicated(self, tree):
        sharding = NamedSharding(self.mesh, PartitionSpec())
        return jax.tree.map(lambda x: place(x, sharding), tree)

    def init_cache(self, cache_config):
        """A zero paged cache made directly in its shards (never whole on one device)."""
        from kvjax.cache.paged import QUANTIZED, init_cache
        if cache_config.dtype in (*QUANTIZED, "int4_kivi"):
            raise NotImplementedError(f"{cache_config.dtype} pages on a mesh: their scales have "
                                      f"no sharding rule yet (use float32 or bfloat16)")
        sharding = NamedSharding(self.mesh, self.cache_spec)
        return jax.jit(lambda: init_cache(self.config, cache_config), out_shardings=sharding)()

    def describe(self) -> list[str]:
        """What is sharded how, one line per kind of array."""
        sizes = ", ".join(f"{a}={n}" for a, n in self.sizes.items())
        lines = [f"mesh {sizes} ({math.prod(self.sizes.values())} devices)"]
        lines.append(f"KV cache [layers, kv_heads, pages, page_size, head_dim]: "
                     f"{tuple(self.cache_spec)}")
        from kvjax.model.transformer import param_shapes
        specs = param_specs(param_shapes(self.config), self.sizes)
        flat = jax.tree_util.tree_flatten_with_path(specs)[0]
        seen = {}
        for path, spec in flat:
            seen.setdefault(param_kind(path_names(path)), spec)
        lines += [f"{name}: {tuple(spec)}" for name, spec in seen.items()]
        return lines + self.notes
