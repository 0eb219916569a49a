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
`tree_nodes`: `tree_loop`), an EAGLE head's trees (a program per width: `tree_nodes`, or
each width an adaptive engine chooses from) and the head's prefill at every prefill width.
Not warmed (compiled at first use): per-token logits (`Request.return_logits`), position
bases (`Request.position_base`) and packed prefill's decode calls. An adaptive engine's
costs (`Speculator.calibrate`) are measured here, as its first call would.

The programs compile on `threads` threads (default: one per CPU core, at most
`MAX_THREADS`): XLA compiles a program on one core, and a warm-up's programs are
independent. Each thread runs its own compile-only session, where no step runs and every
cache is handed back as it came, so the threads share the engine's state without changing
it; the longest compiles (decode loops, the widest prefills) start first.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvjax.config import SamplingConfig
from kvjax.decode import aot
from kvjax.decode.aot import Compiled, Warmup
from kvjax.decode.batching import page_table
from kvjax.decode.prefill import PrefillRow, open_rows
from kvjax.decode.sampling import any_sampled, sample_jit, sampling_rows, sequence_keys
from kvjax.decode.state import decode_state
from kvjax.engine.requests import MAX_STOP_TOKENS
from kvjax.engine.runner import longest_left

MAX_THREADS = 8  # compile threads at most (each holds a program's compile in memory)


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


def warm(runner, rows: Sequence[int] = (1,), sampled: Sequence[bool] = (False, True),
         threads: int | None = None) -> Warmup:
    """Compiles the programs of requests `rows` at a time (prompts prefilled together,
    samples decoded together), greedy and/or sampled (`sampled`), on `threads` threads
    (module docstring)."""
    slots = runner.engine_config.max_slots
    for n in rows:
        if not 1 <= n <= slots:
            raise ValueError(f"warm-up rows must be in [1, max_slots={slots}], got {n}")
    if threads is not None and threads < 1:
        raise ValueError(f"warm-up threads must be >= 1, got {threads}")
    start = time.perf_counter()
    spec = runner.spec
    if spec is not None and spec.spec.adaptive and not spec.calibrated:
        model = runner.model  # the costs the first call would measure (runs, times)
        spec.calibrate(model.params, model.config, model.plan, slots)
    programs = compile_all(_tasks(runner, sorted(set(rows)), sampled), threads)
    return Warmup(tuple(programs), time.perf_counter() - start)


def ahead(runner, rows: list[PrefillRow], draft_rows: list[PrefillRow], widen: bool,
          requests: list) -> list[Compiled]:
    """The programs of an engine's first round, compiled side by side before it runs
    (`compile_all`: compile-only sessions, so nothing runs or changes): the prefill call
    `StepRunner.prefill_call(rows, draft_rows, widen)` is about to make (the target's and a
    draft model's; the rows' starts are not moved), the first tokens' sampler and the
    decode (or speculative) call of its samples (with logits where it asks for them): the
    programs its real calls ask for, so the round compiles nothing more (a guess that fails
    compiles nothing and leaves the round to its own calls). For a lone request only (a
    chat's first answer): a batch's first calls depend on how its prompts are chunked and
    when each starts decoding, and a wrong guess is a compile wasted. An EAGLE engine's
    compile in turn (its head's prefill moves its rows' heads)."""
    if len(requests) != 1 or (runner.spec is not None and runner.spec.eagle is not None):
        return []
    try:
        return compile_all(_ahead_tasks(runner, rows, draft_rows, widen, requests))
    except Exception:  # an optimisation only: the real calls raise what is really wrong
        return []


def _ahead_tasks(runner, rows, draft_rows, widen: bool, requests) -> list[Callable[[], None]]:
    """`ahead`'s compile-only calls, the decode (or speculative) call first."""
    width = runner.call_width(len(rows), widen, longest_left(rows))
    tasks = [functools.partial(runner.target_prefill, rows, width)]
    left = [r for r in draft_rows if r.start < len(r.tokens)]
    if left:
        tasks.append(functools.partial(
            runner.draft_prefill, left, runner.call_width(len(left), widen, longest_left(left))))
    samples = requests[0].n
    sampled = any_sampled([0.0 if r.sampling is None else r.sampling.temperature
                           for r in requests])
    live = min(sum(r.n for r in requests), runner.engine_config.max_slots)
    logits = any(r.return_logits for r in requests)
    if runner.spec is None:
        tasks.insert(0, functools.partial(_decode, runner, live, sampled, logits))
    else:
        tasks[:0] = [functools.partial(_spec_decode, runner, sampled, size, logits)
                     for size in _spec_sizes(runner.spec)]
    tasks.append(functools.partial(_first_tokens, runner, samples, sampled))
    return tasks


def _tasks(runner, rows: list[int], sampled: Sequence[bool]) -> list[Callable[[], None]]:
    """The warm-up's compile-only calls, the longest first: the decode (or speculative)
    loops, then each prefill width from the widest, then the first tokens' samplers."""
    loops, prefills, samplers = [], [], []
    for n in rows:
        for s in sampled:
            samplers.append(functools.partial(_first_tokens, runner, n, s))
            if runner.spec is None:
                loops.append(functools.partial(_decode, runner, n, s))
        prefills += _prefills(runner, n if runner.policy.shares_prefill_calls() else 1)
    if runner.spec is not None:
        loops += [functools.partial(_spec_decode, runner, s, size)
                  for size in _spec_sizes(runner.spec) for s in sampled]
    return loops + sorted(prefills, key=lambda t: -t.keywords["width"]) + samplers


def compile_all(tasks: list[Callable[[], None]], threads: int | None = None
                ) -> list[Compiled]:
    """Runs each compile-only task in a compile-only session of its own on `threads`
    threads (default: the CPU's cores, at most MAX_THREADS); what they compiled, in the
    tasks' order."""
    def run(task) -> list[Compiled]:
        with aot.compiling() as got:
            task()
        return got

    threads = min(threads or os.cpu_count() or 1, MAX_THREADS, max(len(tasks), 1))
    if threads == 1:
        return [p for task in tasks for p in run(task)]
    with ThreadPoolExecutor(threads, thread_name_prefix="kvjax-warmup") as pool:
        return [p for got in pool.map(run, tasks) for p in got]


def _rows(runner, n: int, width: int) -> list[PrefillRow]:
    """`n` placeholder rows of `width` tokens (no pages: nothing runs)."""
    kivi = runner.kv.target.cache.open_k is not None
    return [PrefillRow([0] * width, [], open_row=0 if kivi else None) for _ in range(n)]


def _prefills(runner, n: int) -> list[functools.partial]:
    """The target's prefill calls of `n` rows at every width (with a draft model, the
    draft's, and a request's last draft chunk), one task each (`width` by keyword)."""
    eagle = runner.spec is not None and runner.spec.eagle is not None
    widths = prefill_widths(runner, n)
    out = [functools.partial(_target_prefill, runner, n, width=w, eagle=eagle) for w in widths]
    if runner.spec is not None and not eagle and runner.kv.draft is not None:
        out += [functools.partial(_draft_prefill, runner, n, width=w) for w in widths]
        out.append(functools.partial(_draft_prefill, runner, 1, width=1, last=True))
    return out


def _target_prefill(runner, n: int, width: int, eagle: bool) -> None:
    """The target's call; with an EAGLE head, then the head's prefill of the pairs the
    call's features complete (`EagleSide.prefill`, as `StepRunner.prefill_call` runs it)."""
    rows = _rows(runner, n, width)
    out = runner.target_prefill(rows, width, features=eagle)
    if eagle:
        heads = [PrefillRow(row.tokens, []) for row in rows]
        for row in rows:
            row.start = width  # where the call left them
        runner.spec.eagle.prefill(runner.kv, rows, heads, out[1], [0] * n,
                                  runner.min_pages(runner.kv.draft))


def _draft_prefill(runner, n: int, width: int, last: bool = False) -> None:
    if last:  # a request's last draft chunk: the runner picks its width
        runner.draft_prefill(_rows(runner, 1, 1))
    else:
        runner.draft_prefill(_rows(runner, n, width), width)


def _first_tokens(runner, n: int, sampled: bool) -> None:
    """The sampler of a request's `n` first tokens (`StepRunner.first_tokens`)."""
    sequence_keys(0, n)  # its eager ops compile per sample count
    sampling = SamplingConfig(temperature=1.0) if sampled else None
    vocab = runner.model.config.vocab_size
    sample_jit(np.zeros((n, vocab), np.float32), np.zeros((n, 2), np.uint32),
               np.zeros(n, np.int32), *sampling_rows([sampling] * n))


def _decode(runner, n: int, sampled: bool, want_logits: bool = False) -> None:
    """The decode call of `n` live samples (`StepRunner.decode`'s plain decoding)."""
    runner.plain_decode(_state(runner, runner.decode_width(n), sampled), want_logits)


def _spec_sizes(spec) -> list[int]:
    """The sizes `Speculator.next_gamma` may give a call, one per program: a chain's γ
    (its one program serves every γ), an n-gram tree's `tree_nodes` (likewise every
    width), an EAGLE head's each width (`tree_nodes`, or an adaptive engine's choices)."""
    if spec.spec.tree_nodes is None:
        return [spec.spec.gamma]
    if spec.eagle is not None and spec.width_policy is not None:
        return list(spec.width_policy.widths)
    return [spec.spec.tree_nodes]


def _spec_decode(runner, sampled: bool, size: int, want_logits: bool = False) -> None:
    """The speculative call (`Speculator.call`; every slot is a row) of `size`."""
    spec = runner.spec
    state = _state(runner, runner.engine_config.max_slots, sampled)
    spec.call(runner.model, runner.kv, runner.engine_config.decode_steps, [], {}, size, state,
              want_logits, runner.context)


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

