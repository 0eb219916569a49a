"""Validation of token-id prompts, shared by generate(), the host speculative path and the
engine (host code: numpy only)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvjax.config import ModelConfig
from kvjax.errors import InvalidRequestError, NonCausalCacheError


def check_token_ids(tokens, vocab_size: int, label: str = "the prompt") -> list[int]:
    """The prompt as a list of ints; InvalidRequestError if empty, non-integer or out of range."""
    ids = np.asarray(tokens)
    if ids.ndim != 1 or ids.size == 0:
        raise InvalidRequestError(f"{label} is empty or not a flat list of token ids")
    if not np.issubdtype(ids.dtype, np.integer):
        raise InvalidRequestError(f"{label} holds non-integer token ids ({ids.dtype})")
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if bad.size:
        raise InvalidRequestError(
            f"{label}: token id {int(ids[bad[0]])} at index {int(bad[0])} is outside the "
            f"vocabulary [0, {vocab_size})")
    return [int(t) for t in ids]


def validate_prompts(config: ModelConfig, prompts, max_new_tokens: int) -> list[list[int]]:
    """Checks every prompt; returns them as lists of ints. Raises InvalidRequestError."""
    if not config.causal:
        raise NonCausalCacheError()
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
            or max_new_tokens < 1:
        raise InvalidRequestError(f"max_new_tokens must be an integer >= 1, got "
                                  f"{max_new_tokens!r}")
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise InvalidRequestError("prompts must be a non-empty list of token-id lists")
    out = []
    for i, prompt in enumerate(prompts):
        ids = check_token_ids(prompt, config.vocab_size, f"prompt {i}")
        if len(ids) + max_new_tokens > config.max_seq_len:
            raise InvalidRequestError(
                f"prompt {i}: {len(ids)} prompt tokens + {max_new_tokens} new tokens exceed "
                f"the model's context max_seq_len={config.max_seq_len}")
        out.append(ids)
    return out
