"""The serving engine: continuous batching over a paged cache with an exact prefix cache."""

from kvjax.engine.engine import Engine
from kvjax.engine.requests import InvalidRequestError, Request, RequestResult, StreamEvent

__all__ = ["Engine", "InvalidRequestError", "Request", "RequestResult", "StreamEvent"]
