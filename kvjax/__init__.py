"""kvjax: a JAX research framework for provably exact cached decoding."""

from kvjax import backend, io, memory, models, speculative  # backend first: XLA flags
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
from kvjax.model.transformer import Transformer, forward, init_params

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
