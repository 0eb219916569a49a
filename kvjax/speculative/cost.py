"""Step costs for the speculative speedup model, measured on device.

c = a draft decode step's time over a target decode step's (same batch and context), and
v(w) = a target step over w new tokens (a verify of γ + 1 = w) over a one-token step. The
textbook prediction assumes v = 1; on hardware where a step is not purely bandwidth-bound
v(w) > 1, and fits v(w) = 1 + s·(w − 1) well (this CPU, 9.5M target: 1.25 at w = 3, 1.52
at w = 5, 2.0 at w = 9); `verify_slope` measures s.

An EAGLE-style head drafts a round's tree itself (its catch-up and one pass per level), so
a round of w nodes costs v(w) + h(w), h the drafting: `round_costs` times the two together,
the verify then the head's drafting, as a round runs them (each evicts the other's weights
from the CPU's caches, so timed apart they would add up to less).

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
from kvjax.config import CacheConfig
from kvjax.decode.batching import page_table, pages_for
from kvjax.decode.steps import model_variables
from kvjax.model.transformer import Transformer
from kvjax.speculative.eagle import head_config
from kvjax.speculative.eagle_tree_device import grow
from kvjax.speculative.tree import tree_arrays
from kvjax.speculative.tree_loop import tree_layout

STEPS = 16


@partial(jax.jit, static_argnames=("configs", "plans", "repeats", "steps", "grow_shape"),
         donate_argnames=("caches",))
def _steps(params: tuple, configs: tuple, plans: tuple, caches: tuple, tokens: tuple,
           batches: tuple, repeats: tuple, steps: int, head=None, grow_shape=None):
    """`steps` times: model i runs `repeats[i]` extend calls at fixed lengths (each rewrites
    the same slots), the models one after the other as in a speculative round; with `head`
    (an `eagle_tree_device.HeadDraft`, its cache the last of `caches`) and `grow_shape`
    (max_nodes, depth, top_k), then the head's drafting of a tree for the first model."""
    models = [Transformer(c, plan=p) for c, p in zip(configs, plans, strict=True)]
    positions = [model_positions(b, t.shape[1]) for b, t in zip(batches, tokens, strict=True)]

    def body(_, carry):
        caches, acc = carry
        caches = list(caches)
        for i, model in enumerate(models):
            for _ in range(repeats[i]):
                variables = model_variables(params[i], None, plans[i])
                logits, caches[i] = model.apply(variables, tokens[i], positions[i],
                                                caches[i], batches[i])
                acc = acc + logits.sum()  # every logit is used: none is skipped
        if head is not None:
            max_nodes, depth, top_k = grow_shape
            last = jnp.zeros(head.cached.shape, jnp.int32)
            _, drafted, nodes, out = grow(head.replace(cache=caches[-1]), last,
                                          jnp.full(last.shape, depth, jnp.int32), max_nodes,
                                          depth, top_k, configs[0], tree_layout)
            caches[-1] = out.cache
            acc = acc + (drafted.sum() + nodes.sum()).astype(acc.dtype)
        return tuple(caches), acc

    return jax.lax.fori_loop(0, steps, body, (caches, jnp.float32(0)))


def step_timer(models: list[tuple], batch: int, context: int, tree: bool = False,
               head: tuple | None = None):
    """A compiled, warmed-up callable returning the seconds of one composite step: for each
    (params, config, plan, width, repeats) in `models`, `repeats` steps of `width` new
    tokens per sequence (`batch` sequences with `context` cached tokens each); with `tree`,
    the tokens are a tree verify's nodes (a chain's layout: the tree mask's arithmetic);
    with `head` = (eagle, max_nodes, depth, top_k), then an EAGLE-style head's drafting of
    a tree (`eagle`: the engine's bound `eagle_engine.EagleSide`; `context` pairs cached)."""
    state, args = {}, {"params": [], "configs": [], "plans": [], "tokens": [], "batches": [],
                       "repeats": []}
    caches = []
    for params, config, plan, width, repeats in models:
        cc, table = _pages(batch, context + width)
        caches.append(init_cache(config, cc))
        layout = {}
        if tree:
            depth, ancestors = tree_arrays(list(range(-1, width - 1)))  # a chain's layout
            layout = dict(depth=np.tile(depth, (batch, 1)),
                          ancestors=np.tile(ancestors, (batch, 1, 1)))
        args["batches"].append(BatchInfo(page_table=table,
                                         lengths=np.full(batch, context, np.int32),
                                         num_new=np.full(batch, width, np.int32), **layout))
        args["params"].append(jax.device_put(params))
        args["configs"].append(config)
        args["plans"].append(plan)
        args["tokens"].append(np.zeros((batch, width), np.int32))
        args["repeats"].append(repeats)
    args = {k: tuple(v) for k, v in args.items()}
    if head is not None:
        eagle, max_nodes, depth, top_k = head
        cc, table = _pages(batch, context + max_nodes + depth + 1)
        caches.append(init_cache(head_config(models[0][1]), cc))
        # `context` pairs cached and one pending a row (the shapes are what a round's are)
        draft = eagle.draft([], batch, cc.block_pages, table.shape[1]).replace(
            page_table=table, cached=np.full(batch, context, np.int32),
            pending=np.ones(batch, np.int32))
        args.update(head=draft, grow_shape=(max_nodes, depth, top_k))
    state["caches"] = tuple(caches)

    def timed() -> float:
        t0 = time.perf_counter()
        state["caches"], acc = _steps(caches=state["caches"], steps=STEPS, **args)
        jax.block_until_ready(acc)
        return (time.perf_counter() - t0) / STEPS

    timed()  # compiles
    return timed


def _pages(batch: int, slots: int, ps: int = 16) -> tuple[CacheConfig, np.ndarray]:
    """A pool of `batch` rows of `slots` token slots each (pages of `ps`; page 0 left out)
    and its page table."""
    per_seq = pages_for(slots, ps)
    cc = CacheConfig(page_size=ps, num_pages=batch * per_seq + 1)
    rows = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(batch)]
    return cc, page_table(rows, batch, cc.block_pages)


def timed_ratio(numerator, denominator, repeats: int = 9) -> float:
    """Median over `repeats` of numerator() / denominator(), the two timed back to back (so
    drift in the machine's speed cancels)."""
    return float(np.median([numerator() / denominator() for _ in range(repeats)]))


def cost_ratio(target: tuple, draft: tuple, batch: int, context: int,
               interleaved: bool = True, draft_steps: int = 4) -> float:
    """c = seconds of a draft step / of a target step; target and draft are (params, config,
    numerics plan).

    `interleaved` (the default) times the draft steps where a speculative round runs them,
    right after a target step: (t(target + k drafts) − t(target)) / (k · t(target)). On this
    CPU that is about 2× the isolated figure (`interleaved=False`): the target's step evicts
    the draft's weights and cache from the CPU caches, and the draft's small steps are
    dominated by reloading them.
    """
    one = step_timer([(*target, 1, 1)], batch, context)
    if not interleaved:
        return timed_ratio(step_timer([(*draft, 1, 1)], batch, context), one)
    both = step_timer([(*target, 1, 1), (*draft, 1, draft_steps)], batch, context)
    return max(timed_ratio(both, one) - 1.0, 0.0) / draft_steps


def verify_slope(target: tuple, batch: int, context: int, width: int) -> float:
    """s in v(w) = 1 + s·(w − 1): the extra cost of each verified token beyond the first,
    in one-token target steps, from a step over `width` tokens."""
    ratio = timed_ratio(step_timer([(*target, width, 1)], batch, context),
                        step_timer([(*target, 1, 1)], batch, context))
    return max(ratio - 1.0, 0.0) / (width - 1)


def verify_costs(target: tuple, batch: int, context: int, widths) -> dict[int, float]:
    """v(w) for each node count in `widths`: a tree verify of w nodes in plain decoding's
    one-token target steps. Measured, not fitted: on CPUs v is not linear in w, and a plan
    that tiles attention by node makes a tree dearer than a chain of as many tokens."""
    one = step_timer([(*target, 1, 1)], batch, context)
    return {w: timed_ratio(step_timer([(*target, w, 1)], batch, context, tree=True), one)
            for w in widths}


def round_costs(target: tuple, eagle, batch: int, context: int, widths, depth: int,
                top_k: int) -> dict[int, float]:
    """v(w) + h(w) for each node count in `widths`: a round of an EAGLE-style head's trees
    (a tree verify of w nodes, then the head's drafting of a tree of w nodes, `depth`
    levels at most, `top_k` offers a level; `eagle`: the engine's `EagleSide`) in plain
    decoding's one-token target steps."""
    one = step_timer([(*target, 1, 1)], batch, context)
    return {w: timed_ratio(step_timer([(*target, w, 1)], batch, context, tree=True,
                                      head=(eagle, w, depth, top_k)), one)
            for w in widths}
