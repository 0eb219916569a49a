"""Requests, results and stream events of the engine (plain data)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from kvjax.config import SamplingConfig
from kvjax.errors import InvalidRequestError


def check_field_types(request: Request) -> None:
    """InvalidRequestError naming the first field of the wrong type (before any arithmetic
    on it could raise a bare TypeError)."""
    def integer(x) -> bool:
        return isinstance(x, (int, np.integer)) and not isinstance(x, bool)

    checks = [("max_new_tokens", integer, "an int"), ("n", integer, "an int"),
              ("position_base", integer, "an int"), ("public_prefix", integer, "an int"),
              ("stop_token", lambda x: x is None or integer(x), "an int or None"),
              ("text", lambda x: x is None or isinstance(x, str), "a str or None"),
              ("tenant", lambda x: x is None or isinstance(x, str), "a str or None"),
              ("adapter", lambda x: x is None or isinstance(x, str), "a str or None"),
              ("return_logits", lambda x: isinstance(x, bool), "a bool"),
              ("sampling", lambda x: isinstance(x, SamplingConfig), "a SamplingConfig")]
    for name, ok, what in checks:
        value = getattr(request, name)
        if not ok(value):
            raise InvalidRequestError(f"{name} must be {what}, got {type(value).__name__} "
                                      f"{value!r}")


@dataclasses.dataclass(frozen=True)
class Request:
    """One prompt to continue: token ids, or `text` / chat `messages` that the engine's
    tokenizer and chat template render to ids (the cache identity is always the ids).

    `tenant` salts the cache: requests of different tenants never share pages, except the
    first `public_prefix` tokens (a shared system prompt), whose full pages stay public.
    `position_base` is the position of the first token. `n` samples share the prompt's
    pages and copy on write.
    """

    tokens: Sequence[int] | None = None
    max_new_tokens: int = 16
    sampling: SamplingConfig = SamplingConfig()
    adapter: str | None = None
    tenant: str | None = None
    public_prefix: int = 0
    n: int = 1
    return_logits: bool = False
    position_base: int = 0
    stop_token: int | None = None
    text: str | None = None
    messages: Sequence[dict] | None = None


@dataclasses.dataclass
class RequestResult:
    id: int
    tokens: list[int] | list[list[int]]  # a list of lists when n > 1
    logits: np.ndarray | list[np.ndarray] | None  # [num_generated, vocab] per sample
    stats: dict
    status: str = "finished"  # "finished" | "cancelled" | "error" (see `error`)
    prompt_ids: list[int] | None = None  # the rendered prompt the cache identity is made of
    text: str | list[str] | None = None  # the generated tokens decoded, with a tokenizer
    error: str | None = None  # why a request ended with status "error" (tokens: as streamed)


@dataclasses.dataclass(frozen=True)
class StreamEvent:
    """New tokens of one sample of one request; `finished` on its last event, which names
    the `error` when the request failed."""

    request_id: int
    sample: int
    tokens: tuple[int, ...]
    finished: bool
    error: str | None = None
