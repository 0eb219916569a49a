"""Requests, results and stream events of the engine (plain data)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from kvjax.config import SamplingConfig


class InvalidRequestError(ValueError):
    """A request that cannot be served; raised before anything is allocated."""


@dataclasses.dataclass(frozen=True)
class Request:
    """One prompt to continue.

    `tokens` are the rendered token ids (the cache identity is always these ids).
    `tenant` salts the cache: requests of different tenants never share pages, except the
    first `public_prefix` tokens (a shared system prompt), whose full pages stay public.
    `position_base` is the position of the first token. `n` samples share the prompt's
    pages and copy on write.
    """

    tokens: Sequence[int]
    max_new_tokens: int
    sampling: SamplingConfig = SamplingConfig()
    adapter: str | None = None
    tenant: str | None = None
    public_prefix: int = 0
    n: int = 1
    return_logits: bool = False
    position_base: int = 0
    stop_token: int | None = None


@dataclasses.dataclass
class RequestResult:
    id: int
    tokens: list[int] | list[list[int]]  # a list of lists when n > 1
    logits: np.ndarray | list[np.ndarray] | None  # [num_generated, vocab] per sample
    stats: dict
    status: str = "finished"  # "finished" | "cancelled"


@dataclasses.dataclass(frozen=True)
class StreamEvent:
    """New tokens of one sample of one request; `finished` on its last event."""

    request_id: int
    sample: int
    tokens: tuple[int, ...]
    finished: bool
