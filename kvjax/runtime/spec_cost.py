"""The draft/target cost ratio c, measured: one decode step of each model, same batch and
context, median of several timed multi-step calls after a warm-up."""

from __future__ import annotations

import time

import jax
import numpy as np

from kvjax.cache.paged import init_cache
from kvjax.config import CacheConfig
from kvjax.runtime import steps
from kvjax.runtime.batching import page_table, pages_for

STEPS = 16


def decode_step_seconds(params, config, batch: int, context: int, repeats: int = 5) -> float:
    """Median seconds per decode step of `config` at `batch` sequences of `context` tokens.

    The cache holds zeros: a step's cost does not depend on the values.
    """
    ps = 16
    per_seq = pages_for(context + STEPS, ps)
    cc = CacheConfig(page_size=ps, num_pages=batch * per_seq + 1)
    cache = init_cache(config, cc)
    rows = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(batch)]
    table = page_table(rows, batch, cc.block_pages)
    lengths = np.full(batch, context, np.int32)
    args = (np.zeros(batch, np.int32), np.full(batch, STEPS, np.int32),
            np.zeros((batch, 2), np.uint32), np.zeros(batch, np.float32),
            np.zeros(batch, np.int32), np.ones(batch, np.float32), np.full(batch, -1, np.int32))
    params = jax.device_put(params)
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        out, _, cache, _ = steps.decode_loop(params, config, cache, table, lengths, *args,
                                             max_steps=STEPS)
        jax.block_until_ready(out)
        if i:  # the first call compiles
            times.append(time.perf_counter() - t0)
    return float(np.median(times)) / STEPS


def cost_ratio(target: tuple, draft: tuple, batch: int, context: int) -> float:
    """c = draft step seconds / target step seconds; target and draft are (params, config)."""
    return (decode_step_seconds(*draft, batch, context)
            / decode_step_seconds(*target, batch, context))
