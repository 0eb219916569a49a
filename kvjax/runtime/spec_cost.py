"""Step costs for the speculative speedup model, measured on device.

c = a draft decode step's time over a target decode step's (same batch and context), and
v(w) = a target step over w new tokens (a verify of γ + 1 = w) over a one-token step. The
textbook prediction assumes v = 1; on hardware where a step is not purely bandwidth-bound
v(w) > 1, and fits v(w) = 1 + s·(w − 1) well (this CPU, 9.5M target: 1.25 at w = 3, 1.52
at w = 5, 2.0 at w = 9); `verify_slope` measures s.

Each figure is the median of several timed calls of a jitted loop of `STEPS` steps after a
warm-up call (so no Python dispatch is timed); the cache holds zeros, as a step's cost does
not depend on the values.
"""

from __future__ import annotations

import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache.paged import BatchInfo, init_cache, model_positions
from kvjax.config import CacheConfig, ModelConfig
from kvjax.model.transformer import Transformer
from kvjax.runtime.batching import page_table, pages_for

STEPS = 16


@partial(jax.jit, static_argnames=("config", "steps"), donate_argnames=("cache",))
def _steps(params, config: ModelConfig, cache, tokens, batch: BatchInfo, steps: int):
    """`steps` extend calls at the same lengths (each rewrites the same slots)."""
    model = Transformer(config)
    positions = model_positions(batch, tokens.shape[1])

    def body(_, carry):
        cache, acc = carry
        logits, cache = model.apply({"params": params}, tokens, positions, cache, batch)
        return cache, acc + logits.sum(axis=(1, 2))  # every logit is used: none is skipped

    return jax.lax.fori_loop(0, steps, body, (cache, jnp.zeros(tokens.shape[0])))


def step_timer(params, config: ModelConfig, batch: int, context: int, width: int = 1):
    """A compiled, warmed-up callable that returns the seconds of one step of `width` new
    tokens per sequence (`batch` sequences with `context` cached tokens each)."""
    ps = 16
    per_seq = pages_for(context + width, ps)
    cc = CacheConfig(page_size=ps, num_pages=batch * per_seq + 1)
    state = {"cache": init_cache(config, cc)}
    rows = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(batch)]
    info = BatchInfo(page_table=page_table(rows, batch, cc.block_pages),
                     lengths=np.full(batch, context, np.int32),
                     num_new=np.full(batch, width, np.int32))
    tokens = np.zeros((batch, width), np.int32)
    params = jax.device_put(params)

    def timed() -> float:
        t0 = time.perf_counter()
        state["cache"], acc = _steps(params, config, state["cache"], tokens, info, STEPS)
        jax.block_until_ready(acc)
        return (time.perf_counter() - t0) / STEPS

    timed()  # compiles
    return timed


def timed_ratio(numerator, denominator, repeats: int = 9) -> float:
    """Median over `repeats` of numerator() / denominator(), the two timed back to back (so
    drift in the machine's speed cancels)."""
    return float(np.median([numerator() / denominator() for _ in range(repeats)]))


def step_seconds(params, config: ModelConfig, batch: int, context: int, width: int = 1,
                 repeats: int = 5) -> float:
    """Median seconds of one step (see `step_timer`)."""
    timer = step_timer(params, config, batch, context, width)
    return float(np.median([timer() for _ in range(repeats)]))


def cost_ratio(target: tuple, draft: tuple, batch: int, context: int) -> float:
    """c = draft step seconds / target step seconds; target and draft are (params, config)."""
    return timed_ratio(step_timer(*draft, batch, context), step_timer(*target, batch, context))


def verify_slope(target: tuple, batch: int, context: int, width: int) -> float:
    """s in v(w) = 1 + s·(w − 1): the extra cost of each verified token beyond the first,
    in one-token target steps, from a step over `width` tokens."""
    ratio = timed_ratio(step_timer(*target, batch, context, width),
                        step_timer(*target, batch, context))
    return max(ratio - 1.0, 0.0) / (width - 1)
