"""Errors raised by several layers (device steps, generate(), the engine); imports nothing."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request that cannot be served; raised before anything is allocated."""


NON_CAUSAL_MESSAGE = (
    "causal=False: with bidirectional attention every position attends to later tokens, so "
    "a token's K/V state changes whenever a token is appended; a cached state is never the "
    "state a full recomputation would produce. Cached prefill/decode/verify is refused for "
    "this model; score whole sequences with kvjax.forward instead."
)


class NonCausalCacheError(ValueError):
    """A cached path was asked to run a bidirectional (causal=False) model."""

    def __init__(self):
        super().__init__(NON_CAUSAL_MESSAGE)
