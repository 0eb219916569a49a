"""kvjax: a JAX research framework for provably exact cached decoding."""

from kvjax import memory
from kvjax.cache.allocator import AllocatorError, PageAllocator
from kvjax.cache.paged import BatchInfo, PagedKVCache, cache_bytes, init_cache
from kvjax.config import (
    CacheConfig,
    Config,
    ConfigError,
    GenerateConfig,
    ModelConfig,
    SamplingConfig,
    load_config,
)
from kvjax.model.transformer import NonCausalCacheError, Transformer, forward, init_params
from kvjax.runtime.generate import GenerateResult, InvalidRequestError, KVPool, generate

__version__ = "0.1.0"

__all__ = [
    "AllocatorError",
    "BatchInfo",
    "CacheConfig",
    "Config",
    "ConfigError",
    "GenerateConfig",
    "GenerateResult",
    "InvalidRequestError",
    "KVPool",
    "ModelConfig",
    "NonCausalCacheError",
    "PageAllocator",
    "PagedKVCache",
    "SamplingConfig",
    "Transformer",
    "cache_bytes",
    "forward",
    "generate",
    "init_cache",
    "init_params",
    "load_config",
    "memory",
]
