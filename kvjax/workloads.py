"""Synthetic token workloads that exercise prefix reuse (plain Python + numpy).

Each builder returns `Request`s over random token ids from a seeded generator, so a
workload is the same on every machine. Multi-turn chat depends on the model's answers, so
it is a runner that feeds each turn's answer into the next turn's prompt.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvjax.runtime.requests import Request, RequestResult


def _ids(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return [int(t) for t in rng.integers(0, vocab, size=n)]


def shared_system_prompt(num_requests: int, prefix_len: int, suffix_len: int, vocab: int,
                         max_new_tokens: int = 8, seed: int = 0, **request_kw) -> list[Request]:
    """Requests sharing one system prompt, each with its own suffix."""
    rng = np.random.default_rng(seed)
    system = _ids(rng, prefix_len, vocab)
    return [Request(system + _ids(rng, suffix_len, vocab), max_new_tokens, **request_kw)
            for _ in range(num_requests)]


def few_shot(num_requests: int, num_examples: int, example_len: int, query_len: int,
             vocab: int, max_new_tokens: int = 8, seed: int = 0,
             **request_kw) -> list[Request]:
    """The same shared examples (in the same order) followed by a different query."""
    rng = np.random.default_rng(seed)
    examples = [t for _ in range(num_examples) for t in _ids(rng, example_len, vocab)]
    return [Request(examples + _ids(rng, query_len, vocab), max_new_tokens, **request_kw)
            for _ in range(num_requests)]


def mid_page_divergence(num_requests: int, prefix_len: int, total_len: int, vocab: int,
                        max_new_tokens: int = 8, seed: int = 0,
                        **request_kw) -> list[Request]:
    """Requests equal up to `prefix_len` (chosen inside a page) and different after."""
    rng = np.random.default_rng(seed)
    head = _ids(rng, prefix_len, vocab)
    return [Request(head + _ids(rng, total_len - prefix_len, vocab), max_new_tokens,
                    **request_kw) for _ in range(num_requests)]


@dataclasses.dataclass
class Conversation:
    history: list[int]
    results: list[RequestResult] = dataclasses.field(default_factory=list)


def run_multi_turn(engine, num_conversations: int, turns: int, system_len: int,
                   user_len: int, vocab: int, max_new_tokens: int = 8, seed: int = 0,
                   **request_kw) -> list[Conversation]:
    """Chat: each turn's prompt is the previous prompt + the model's answer + a new message.

    All conversations share one system prompt; every turn of every conversation is run on
    `engine` (turn by turn, the conversations of a turn batched together).
    """
    rng = np.random.default_rng(seed)
    system = _ids(rng, system_len, vocab)
    convs = [Conversation(history=list(system)) for _ in range(num_conversations)]
    for _ in range(turns):
        requests = []
        for conv in convs:
            conv.history += _ids(rng, user_len, vocab)
            requests.append(Request(list(conv.history), max_new_tokens, **request_kw))
        for conv, result in zip(convs, engine.generate(requests), strict=True):
            conv.results.append(result)
            conv.history += result.tokens
    return convs
