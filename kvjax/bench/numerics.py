"""The cost of invariant numerics (`kvjax bench numerics`): the same steps under
`numerics="fast"`, `"invariant"` (the engine's default forms: kernels stored transposed
where that makes a product invariant as one dot) and invariant with Flax's kernel layout
(`transposed_kernels=False`: 32-row blocks where one dot is not invariant), side by side,
alternating in passes. Each invariant point takes the forms the engine's start-up probe
chooses for the config's engine settings.

For the config's model: ms per token of the on-device decode loop at batch 1 and 8
(context 512, 32 steps), a 1,024-token prefill at two chunk sizes, and 8 prompts of 128
tokens prefilled one sequence per call vs as one [8, 128] call (which only invariant numerics
make bitwise equal to the one-by-one prefill; the bench checks it). Each figure is the median
over passes of medians of `--reps` timed calls after warm-up; the passes alternate the
modes so that machine drift hits them alike.
"""

from __future__ import annotations

import dataclasses
import statistics

import jax
import numpy as np

from kvjax.cache.paged import BatchInfo, CacheHolder, init_cache
from kvjax.config import CacheConfig
from kvjax.config_files import load_config
from kvjax.decode import steps
from kvjax.decode.batching import page_table
from kvjax.decode.state import decode_state
from kvjax.engine.engine import numerics_plans
from kvjax.lab.report import emit, markdown_table, write_results
from kvjax.lab.timing import filled_with_noise, median_seconds
from kvjax.model.layout import store
from kvjax.model.transformer import init_params

MODES = ("fast", "invariant", "blocks")  # blocks: invariant, kernels in Flax's layout
SETTINGS = {"fast": dict(numerics="fast"), "invariant": dict(numerics="invariant"),
            "blocks": dict(numerics="invariant", transposed_kernels=False)}
CONTEXT, DECODE_STEPS, PREFILL, CHUNKS, PROMPTS, PROMPT_LEN = 512, 32, 1024, (64, 256), 8, 128


class _Point:
    """One model and cache in one mode, with its timed workloads."""

    def __init__(self, model, plan, params, cache_cfg: CacheConfig):
        self.model, self.plan, self.cache_cfg = model, plan, cache_cfg
        self.params = jax.device_put(store(params, plan))
        self.holder = CacheHolder(filled_with_noise(init_cache(model, cache_cfg)))

    def decode(self, batch: int) -> float:
        pages = (CONTEXT + DECODE_STEPS) // self.cache_cfg.page_size + 1
        table = page_table([list(range(i * pages, (i + 1) * pages)) for i in range(batch)],
                           batch, self.cache_cfg.block_pages)
        state = decode_state(table, np.full(batch, CONTEXT), np.zeros(batch),
                             np.full(batch, DECODE_STEPS), np.zeros((batch, 2)))

        def run():
            steps.decode(self.holder, self.params, self.model, state, DECODE_STEPS,
                         plan=self.plan).tokens.block_until_ready()
        return run

    def extend(self, tokens: np.ndarray, lengths: list[int], rows: list[list[int]]):
        batch = BatchInfo(page_table=page_table(rows, len(rows), self.cache_cfg.block_pages),
                          lengths=np.array(lengths, np.int32),
                          num_new=np.full(len(rows), tokens.shape[1], np.int32))
        return self.holder.run(lambda cache: steps.extend(
            self.params, self.model, cache, tokens, batch, last_only=True, plan=self.plan))

    def prefill(self, chunk: int):
        rows = [list(range(PREFILL // self.cache_cfg.page_size + 1))]
        tokens = np.arange(chunk, dtype=np.int32)[None] % self.model.vocab_size

        def run():
            for start in range(0, PREFILL, chunk):
                logits = self.extend(tokens, [start], rows)
            logits.block_until_ready()
        return run

    def prompts(self, together: bool):
        per = PROMPT_LEN // self.cache_cfg.page_size + 1
        rows = [list(range(i * per, (i + 1) * per)) for i in range(PROMPTS)]
        tokens = (np.arange(PROMPTS * PROMPT_LEN, dtype=np.int32).reshape(PROMPTS, -1) * 7
                  % self.model.vocab_size)

        def run():
            if together:
                return np.asarray(self.extend(tokens, [0] * PROMPTS, rows))[:, 0]
            return np.stack([np.asarray(self.extend(tokens[i:i + 1], [0], rows[i:i + 1]))[0, 0]
                             for i in range(PROMPTS)])
        return run


def main(args) -> int:
    config = load_config(args.config, args.set)
    base = config.model
    params = init_params(base)
    cache_cfg = config.cache  # holds 8 x 544 tokens, a 1,024-token prompt, 8 x 128 tokens
    engine = dataclasses.replace(config.engine, cache=cache_cfg)
    points = {m: _Point(base, numerics_plans([base], dataclasses.replace(
        engine, **SETTINGS[m]), 0)[0], params, cache_cfg) for m in MODES}
    for m in MODES[1:]:
        emit(f"{m}: row blocks (0: one product) {dict(points[m].plan.row_blocks)}, "
             f"stored transposed {points[m].plan.transposed}")
    workloads = {f"decode batch {b}, ms/token": (lambda p, b=b: p.decode(b), DECODE_STEPS)
                 for b in (1, 8)}
    workloads |= {f"prefill {PREFILL} tokens, chunk {c}, ms": (lambda p, c=c: p.prefill(c), 1)
                  for c in CHUNKS}
    workloads |= {f"{PROMPTS} x {PROMPT_LEN}-token prompts, {how}, ms":
                  (lambda p, t=t: p.prompts(t), 1)
                  for how, t in (("one per call", False), ("one call", True))}
    emit(f"bench numerics: {args.config}: fast vs invariant, {args.passes} alternating passes, "
         f"medians of {args.reps}")
    times = {(w, m): [] for w in workloads for m in MODES}
    for _ in range(args.passes):
        for name, (make, per) in workloads.items():
            for mode in MODES:
                fn = make(points[mode])
                times[name, mode].append(median_seconds(fn, args.reps) * 1e3 / per)
    bitwise = {m: np.array_equal(points[m].prompts(True)(), points[m].prompts(False)())
               for m in MODES}
    rows = [{"workload": name, **{m: statistics.median(times[name, m]) for m in MODES}}
            for name in workloads]
    for r in rows:
        for m in MODES[1:]:
            r[f"{m}_over_fast"] = r[m] / r["fast"]
        emit(f"{r['workload']}: fast {r['fast']:.1f}, invariant {r['invariant']:.1f} "
             f"({r['invariant_over_fast']:.2f}x), blocks {r['blocks']:.1f} "
             f"({r['blocks_over_fast']:.2f}x)")
    emit(f"8 prompts in one call == one per call, bitwise: {bitwise}")
    write_results(args.out, markdown_table(rows, COLUMNS), rows, config=args.config,
                  overrides=args.set, batched_prefill_bitwise=bitwise)
    return 0


COLUMNS = [
    ("workload", lambda r: r["workload"]),
    ("fast", lambda r: f"{r['fast']:.1f}"),
    ("invariant", lambda r: f"{r['invariant']:.1f}"),
    ("invariant / fast", lambda r: f"{r['invariant_over_fast']:.2f}x"),
    ("invariant, Flax layout", lambda r: f"{r['blocks']:.1f}"),
    ("Flax layout / fast", lambda r: f"{r['blocks_over_fast']:.2f}x"),
]
