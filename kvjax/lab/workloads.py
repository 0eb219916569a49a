"""Synthetic token workloads that exercise prefix reuse (plain Python + numpy).

Each builder returns `Request`s over random token ids from a seeded generator, so a
workload is the same on every machine. Multi-turn chat depends on the model's answers, so
it is a runner that feeds each turn's answer into the next turn's prompt.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvjax.engine.requests import Request, RequestResult


def random_ids(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return [int(t) for t in rng.integers(0, vocab, size=n)]


def shared_system_prompt(num_requests: int, prefix_len: int, suffix_len: int, vocab: int,
                         max_new_tokens: int = 8, seed: int = 0, **request_kw) -> list[Request]:
    """Requests sharing one system prompt, each with its own suffix."""
    rng = np.random.default_rng(seed)
    system = random_ids(rng, prefix_len, vocab)
    return [Request(system + random_ids(rng, suffix_len, vocab), max_new_tokens, **request_kw)
            for _ in range(num_requests)]


def few_shot(num_requests: int, num_examples: int, example_len: int, query_len: int,
             vocab: int, max_new_tokens: int = 8, seed: int = 0,
             **request_kw) -> list[Request]:
    """The same shared examples (in the same order) followed by a different query."""
    rng = np.random.default_rng(seed)
    examples = [t for _ in range(num_examples) for t in random_ids(rng, example_len, vocab)]
    return [Request(examples + random_ids(rng, query_len, vocab), max_new_tokens, **request_kw)
            for _ in range(num_requests)]


def popular_prompts(num_requests: int, num_prompts: int, prompt_len: int, suffix_len: int,
                    vocab: int, zipf: float = 1.0, max_new_tokens: int = 8, seed: int = 0,
                    one_off: float = 0.0, **request_kw) -> list[Request]:
    """Requests drawn from `num_prompts` shared prompts (apps, system prompts) with Zipf
    popularity (prompt k has weight 1 / (k + 1)^zipf), each with its own suffix, in a
    seeded random arrival order. A fraction `one_off` of the requests instead carry a
    prompt of the same length seen only once (a scan that pollutes recency)."""
    rng = np.random.default_rng(seed)
    prompts = [random_ids(rng, prompt_len, vocab) for _ in range(num_prompts)]
    weights = 1.0 / np.arange(1, num_prompts + 1) ** zipf
    picks = rng.choice(num_prompts, size=num_requests, p=weights / weights.sum())
    scan = rng.random(num_requests) < one_off
    return [Request((random_ids(rng, prompt_len, vocab) if s else prompts[k])
                    + random_ids(rng, suffix_len, vocab), max_new_tokens, **request_kw)
            for k, s in zip(picks, scan, strict=True)]


def mid_page_divergence(num_requests: int, prefix_len: int, total_len: int, vocab: int,
                        max_new_tokens: int = 8, seed: int = 0,
                        **request_kw) -> list[Request]:
    """Requests equal up to `prefix_len` (chosen inside a page) and different after."""
    rng = np.random.default_rng(seed)
    head = random_ids(rng, prefix_len, vocab)
    return [Request(head + random_ids(rng, total_len - prefix_len, vocab), max_new_tokens,
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
    system = random_ids(rng, system_len, vocab)
    convs = [Conversation(history=list(system)) for _ in range(num_conversations)]
    for _ in range(turns):
        requests = []
        for conv in convs:
            conv.history += random_ids(rng, user_len, vocab)
            requests.append(Request(list(conv.history), max_new_tokens, **request_kw))
        for conv, result in zip(convs, engine.generate(requests), strict=True):
            conv.results.append(result)
            conv.history += result.tokens
    return convs
