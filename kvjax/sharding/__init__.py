"""Device meshes and the one table that says how kvjax shards weights, cache and batches.

kvjax scales out with JAX's own SPMD partitioner (GSPMD): weights and the paged cache are
placed with `NamedSharding`s on a `("data", "model")` mesh and the jitted steps constrain
their inputs and outputs to the same shardings; XLA inserts the collectives. Nothing on the
host changes: the trie, the allocator and the page tables are the same numpy structures on
every process, and a page id names the same page on every shard (the page axis of the cache
is never split; the KV-head axis is).

Every array dimension has a *logical* axis name; `RULES` maps logical axes to mesh axes:

  heads, kv_heads, ff, vocab -> "model"   (tensor parallel, Megatron style)
  batch                      -> "data"    (decode slots; a prefill chunk of one sequence
                                           is not split)
  embed, layers, pages, ...  -> replicated

A dimension whose size the mesh axis does not divide is replicated instead, and the plan
says so in `notes` (for example an MQA model's single KV head on `model=8`: each model
shard keeps the whole cache and computes its own query heads against it).

The functions that need no devices (`parse_mesh`, `param_specs`, `shard_bytes`) let the
memory planner price a mesh this machine does not have.
"""


from kvjax.config import MESH_AXES, parse_mesh
from kvjax.sharding.plan import ShardingPlan
from kvjax.sharding.rules import (
    CACHE_AXES,
    MAX_CPU_DEVICES,
    NORM_AXES,
    PARAM_AXES,
    RULES,
    StepShardings,
    cache_spec,
    initialize,
    logical_spec,
    make_mesh,
    maybe_constrain_cache,
    maybe_replicated,
    mesh_sizes,
    param_axes,
    param_specs,
    place,
    request_cpu_devices,
    resolve_mesh,
    shard_bytes,
)

__all__ = [
    "CACHE_AXES",
    "MAX_CPU_DEVICES",
    "MESH_AXES",
    "NORM_AXES",
    "PARAM_AXES",
    "RULES",
    "ShardingPlan",
    "StepShardings",
    "cache_spec",
    "initialize",
    "logical_spec",
    "make_mesh",
    "maybe_constrain_cache",
    "maybe_replicated",
    "mesh_sizes",
    "param_axes",
    "param_specs",
    "parse_mesh",
    "place",
    "request_cpu_devices",
    "resolve_mesh",
    "shard_bytes",
]
