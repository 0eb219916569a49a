"""`Engine.warmup()`: the programs a chat needs, compiled before its first request.

An engine's programs depend on a call's rows, a prefill call's width, the sampler (greedy
or sampled) and the engine's options, never on a prompt's length or the context a sequence
has reached: every page table covers `runner.decode_context` tokens from start-up,
and a prefill call's width is one of a fixed ladder (`prefill_widths`). The warm-up runs
the runner's own host code for each program under `kvjax.decode.aot.compiling()`, so it
asks for exactly the programs the real calls will, compiled (or loaded from the persistent
cache) and not run: no page, statistic or bit changes.

A speculative engine's loop is warmed too: a chain's one program (every γ up to the
config's: `kvjax.speculative.loop.spec_loop`), an n-gram tree's (every width up to
`tree_nodes`: `tree_loop`). Not warmed (compiled at first use): an EAGLE head's trees and prefill,
per-token logits (`Request.return_logits`), position bases (`Request.position_base`) and
packed prefill's decode calls. An adaptive engine's costs (`Speculator.calibrate`) are
measured here, as its first call would.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from kvjax.config import SamplingConfig
from kvjax.decode import aot
from kvjax.decode.aot import Warmup
from kvjax.decode.batching import page_table
from kvjax.decode.prefill import PrefillRow, open_rows
from kvjax.decode.sampling import sample_jit, sampling_rows, sequence_keys
from kvjax.decode.state import decode_state
from kvjax.engine.requests import MAX_STOP_TOKENS


def prefill_widths(runner, rows: int) -> list[int]:
    """Every width `StepRunner.call_width` gives a prefill call of `rows` rows: the chunk,
    and when calls widen, min(chunk, 16) times each power of two below the cap, and the
    cap."""
    chunk = runner.kv.target.cache_config.prefill_chunk
    widths = {chunk}
    if runner.policy.widens_prefill_calls():
        cap = runner.call_width(rows, True, 1 << 30)
        width = min(chunk, 16)
        while width < cap:
            widths.add(width)
            width *= 2
        widths.add(cap)
    return sorted(widths)


def warm(runner, rows: Sequence[int] = (1,), sampled: Sequence[bool] = (False, True)
         ) -> Warmup:
    """Compiles the programs of requests `rows` at a time (prompts prefilled together,
    samples decoded together), greedy and/or sampled (`sampled`)."""
    slots = runner.engine_config.max_slots
    for n in rows:
        if not 1 <= n <= slots:
            raise ValueError(f"warm-up rows must be in [1, max_slots={slots}], got {n}")
    start = time.perf_counter()
    spec = runner.spec
    if spec is not None and spec.spec.adaptive and not spec.calibrated:
        model = runner.model  # the costs the first call would measure (runs, times)
        spec.calibrate(model.params, model.config, model.plan, slots)
    with aot.compiling() as programs:
        for n in sorted(set(rows)):
            _prefill(runner, n if runner.policy.shares_prefill_calls() else 1)
            for s in sampled:
                _first_tokens(runner, n, s)
                if runner.spec is None:
                    _decode(runner, n, s)
        if runner.spec is not None and runner.spec.eagle is None:
            for s in sampled:
                _spec_decode(runner, s)
    return Warmup(tuple(programs), time.perf_counter() - start, _not_warmed(runner))


def _not_warmed(runner) -> tuple[str, ...]:
    spec = runner.spec
    return () if spec is None or spec.eagle is None else ("tree_loop", "head_prefill")


def _rows(runner, n: int, width: int) -> list[PrefillRow]:
    """`n` placeholder rows of `width` tokens (no pages: nothing runs)."""
    kivi = runner.kv.target.cache.open_k is not None
    return [PrefillRow([0] * width, [], open_row=0 if kivi else None) for _ in range(n)]


def _prefill(runner, n: int) -> None:
    """The target's prefill calls at every width (with a draft model, the draft's)."""
    eagle = runner.spec is not None and runner.spec.eagle is not None
    widths = prefill_widths(runner, n)
    for width in widths:
        runner.target_prefill(_rows(runner, n, width), width, features=eagle)
    if runner.spec is not None and not eagle and runner.kv.draft is not None:
        for width in widths:
            runner.draft_prefill(_rows(runner, n, width), width)
        runner.draft_prefill(_rows(runner, 1, 1))  # a request's last draft chunk


def _first_tokens(runner, n: int, sampled: bool) -> None:
    """The sampler of a request's `n` first tokens (`StepRunner.first_tokens`)."""
    sequence_keys(0, n)  # its eager ops compile per sample count
    sampling = SamplingConfig(temperature=1.0) if sampled else None
    vocab = runner.model.config.vocab_size
    sample_jit(np.zeros((n, vocab), np.float32), np.zeros((n, 2), np.uint32),
               np.zeros(n, np.int32), *sampling_rows([sampling] * n))


def _decode(runner, n: int, sampled: bool) -> None:
    """The decode call of `n` live samples (`StepRunner.decode`'s plain decoding)."""
    runner.plain_decode(_state(runner, runner.decode_width(n), sampled), want_logits=False)


def _spec_decode(runner, sampled: bool) -> None:
    """The speculative call (`Speculator.call`; every slot is a row): a chain's one program
    for every γ, an n-gram tree's for every width."""
    spec = runner.spec
    state = _state(runner, runner.engine_config.max_slots, sampled)
    size = spec.spec.gamma if spec.spec.tree_nodes is None else spec.spec.tree_nodes
    spec.call(runner.model, runner.kv, runner.engine_config.decode_steps, [], {}, size, state,
              False, runner.context)


def _state(runner, rows: int, sampled: bool):
    """A decode state of `rows` empty rows, greedy or sampled."""
    kv = runner.kv
    table = page_table([[] for _ in range(rows)], rows, kv.target.cache_config.block_pages,
                       runner.min_pages(kv.target))
    zeros = np.zeros(rows, np.int32)
    sampling = SamplingConfig(temperature=1.0) if sampled else None
    return decode_state(table, zeros, zeros, zeros, np.zeros((rows, 2), np.uint32),
                        [sampling] * rows, np.full((rows, MAX_STOP_TOKENS), -1, np.int32),
                        zeros, zeros if runner.model.lora is not None else None,
                        open_rows(kv.target.cache, {}, rows))

