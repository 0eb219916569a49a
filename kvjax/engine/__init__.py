"""The serving engine: continuous batching over a paged cache with an exact prefix cache.

`Engine` loads on first use (PEP 562 `__getattr__`): it imports JAX, and the host modules
here (`requests`, `scheduler`, `results`, `stats`) must import without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvjax import lazy as _lazy
from kvjax.engine.requests import InvalidRequestError, Request, RequestResult, StreamEvent

_EXPORTS = {"kvjax.engine.engine": ("Engine",)}  # module -> names, loaded on first use

__all__ = ["Engine", "InvalidRequestError", "Request", "RequestResult", "StreamEvent"]

if TYPE_CHECKING:  # what static tools read: the names of _EXPORTS (tests/test_layout.py)
    from kvjax.engine.engine import Engine

_getattr, __dir__ = _lazy.exports(__name__, _EXPORTS)


def __getattr__(name: str):
    return _getattr(name)
