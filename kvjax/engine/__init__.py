"""The serving engine: continuous batching over a paged cache with an exact prefix cache.

`Engine` loads on first use (PEP 562 `__getattr__`): it imports JAX, and the host modules
here (`requests`, `scheduler`, `results`, `stats`) must import without it.
"""

from __future__ import annotations

from kvjax import lazy
from kvjax.engine.requests import InvalidRequestError, Request, RequestResult, StreamEvent

_EXPORTS = {"kvjax.engine.engine": ("Engine",)}  # module -> names, loaded on first use

__all__ = ["Engine", "InvalidRequestError", "Request", "RequestResult", "StreamEvent"]

__getattr__, __dir__ = lazy.exports(__name__, _EXPORTS)
