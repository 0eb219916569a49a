"""kvjax: a JAX research framework for provably exact cached decoding.

Importing kvjax runs `backend` (the XLA flags, which must be set before JAX starts) and
nothing else: each public name loads its module on first use (PEP 562 `__getattr__`), so
that host code (`kvjax.cache.trie`, `kvjax.engine.scheduler`, ...) imports without JAX.
"""

from __future__ import annotations

from kvjax import backend as backend  # eager: the XLA flags, before JAX starts
from kvjax import lazy

# module -> the public names it gives `kvjax`, loaded when one is first asked for.
_EXPORTS = {
    "kvjax.cache.allocator": ("AllocatorError", "PageAllocator"),
    "kvjax.cache.identity": ("CacheNamespace",),
    "kvjax.cache.paged": ("BatchInfo", "PagedKVCache", "cache_bytes", "init_cache"),
    "kvjax.cache.pool": ("KVPool", "PagePool"),
    "kvjax.config": ("CacheConfig", "Config", "ConfigError", "EngineConfig", "GenerateConfig",
                     "ModelConfig", "SamplingConfig", "SpecConfig"),
    "kvjax.config_files": ("load_config",),
    "kvjax.decode.generate": ("GenerateResult", "generate"),
    "kvjax.engine.engine": ("Engine",),
    "kvjax.engine.requests": ("InvalidRequestError", "Request", "RequestResult", "StreamEvent"),
    "kvjax.errors": ("NonCausalCacheError",),
    "kvjax.model.lora": ("init_adapter",),
    "kvjax.model.transformer": ("Transformer", "forward", "init_params"),
}
_SUBMODULES = ("io", "memory", "models", "speculative")

__version__ = "0.1.0"

__all__ = sorted([*_SUBMODULES, "backend",
                  *(name for names in _EXPORTS.values() for name in names)])

__getattr__, __dir__ = lazy.exports(__name__, _EXPORTS, _SUBMODULES)
