"""kvjax: a JAX research framework for provably exact cached decoding.

Importing kvjax runs `backend` (the XLA flags, which must be set before JAX starts) and
nothing else: each public name loads its module on first use (PEP 562 `__getattr__`), so
that host code (`kvjax.cache.trie`, `kvjax.engine.scheduler`, ...) imports without JAX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvjax import backend as backend  # eager: the XLA flags, before JAX starts
from kvjax import lazy as _lazy

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
    "kvjax.model.plan": ("NumericsPlan",),
    "kvjax.model.transformer": ("Transformer", "forward", "init_params"),
}
# every subpackage: `import kvjax` used to import them all, which made each an attribute
_SUBMODULES = ("bench", "cache", "config", "config_files", "data", "decode", "engine", "errors",
               "io", "lab", "memory", "model", "models", "sharding", "speculative", "train")

__version__ = "0.1.0"

__all__ = [
    "AllocatorError",
    "BatchInfo",
    "CacheConfig",
    "CacheNamespace",
    "Config",
    "ConfigError",
    "Engine",
    "EngineConfig",
    "GenerateConfig",
    "GenerateResult",
    "InvalidRequestError",
    "KVPool",
    "ModelConfig",
    "NonCausalCacheError",
    "NumericsPlan",
    "PageAllocator",
    "PagePool",
    "PagedKVCache",
    "Request",
    "RequestResult",
    "SamplingConfig",
    "SpecConfig",
    "StreamEvent",
    "Transformer",
    "backend",
    "cache_bytes",
    "forward",
    "generate",
    "init_adapter",
    "init_cache",
    "init_params",
    "io",
    "load_config",
    "memory",
    "models",
    "speculative",
]

if TYPE_CHECKING:  # what static tools read: the names of _EXPORTS (tests/test_layout.py)
    from kvjax.cache.allocator import AllocatorError, PageAllocator
    from kvjax.cache.identity import CacheNamespace
    from kvjax.cache.paged import BatchInfo, PagedKVCache, cache_bytes, init_cache
    from kvjax.cache.pool import KVPool, PagePool
    from kvjax.config import (
        CacheConfig,
        Config,
        ConfigError,
        EngineConfig,
        GenerateConfig,
        ModelConfig,
        SamplingConfig,
        SpecConfig,
    )
    from kvjax.config_files import load_config
    from kvjax.decode.generate import GenerateResult, generate
    from kvjax.engine.engine import Engine
    from kvjax.engine.requests import InvalidRequestError, Request, RequestResult, StreamEvent
    from kvjax.errors import NonCausalCacheError
    from kvjax.model.lora import init_adapter
    from kvjax.model.plan import NumericsPlan
    from kvjax.model.transformer import Transformer, forward, init_params

_getattr, __dir__ = _lazy.exports(__name__, _EXPORTS, _SUBMODULES)


def __getattr__(name: str):
    return _getattr(name)
