"""One decode context against grown page tables: what covering the whole context from
start-up costs a short conversation (`kvjax bench context`).

Two engines of the same model and defaults: "whole" (`EngineConfig.min_context` None: every
page table covers the engine's whole context, one shape, nothing compiled as a chat grows)
and "grown" (`min_context=0`: each call's table is the longest row's need in powers of two,
a new shape as a sequence grows). Each answers the same requests (`--requests` prompts of
each length in `--prompt-lens`, `--gen-tokens` greedy tokens each, one at a time as a chat
does; prefix cache off so every pass does the same work), an untimed pass each, then
`--reps` passes with the engines taking turns; the medians of the engines' decode and
prefill timers per token, and their ratio. The tokens must agree (a table's width changes
no bit: attention visits no block past a row's end).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvjax.bench import bench_model
from kvjax.config import EngineConfig
from kvjax.engine import Engine, Request
from kvjax.lab.report import emit, markdown_table, write_results


def timed_pass(engine: Engine, prompts: list[list[int]], tokens: int
               ) -> tuple[float, float, list]:
    """(decode seconds per token, prefill seconds per token, the answers) of one pass."""
    before = engine.metrics()
    answers = [engine.generate([Request(p, tokens, ignore_eos=True)])[0].tokens
               for p in prompts]
    after = engine.metrics()
    decoded = len(prompts) * (tokens - 1)
    prompt_tokens = sum(map(len, prompts))
    return ((after["decode_s"] - before["decode_s"]) / decoded,
            (after["prefill_s"] - before["prefill_s"]) / prompt_tokens, answers)


def measure(params, config, prompt_lens, requests: int, tokens: int, reps: int) -> list[dict]:
    """One row per prompt length (module docstring)."""
    base = EngineConfig(prefix_cache=False, max_slots=1)
    engines = {"whole": Engine(params, config, base),
               "grown": Engine(params, config, dataclasses.replace(base, min_context=0))}
    rng = np.random.default_rng(0)
    rows = []
    for length in prompt_lens:
        prompts = [[int(t) for t in rng.integers(1, config.vocab_size, length)]
                   for _ in range(requests)]
        answers = {name: timed_pass(e, prompts, tokens)[2] for name, e in engines.items()}
        if answers["whole"] != answers["grown"]:
            raise AssertionError("the page table's width changed an answer")
        times = {name: [] for name in engines}
        for _ in range(reps):
            for name, e in engines.items():
                times[name].append(timed_pass(e, prompts, tokens)[:2])
        med = {name: np.median(np.asarray(t), axis=0) for name, t in times.items()}
        rows.append({"prompt": length, "context": engines["whole"].runner.context,
                     "whole decode ms": 1e3 * med["whole"][0],
                     "grown decode ms": 1e3 * med["grown"][0],
                     "decode ratio": med["whole"][0] / med["grown"][0],
                     "whole prefill ms": 1e3 * med["whole"][1],
                     "grown prefill ms": 1e3 * med["grown"][1],
                     "prefill ratio": med["whole"][1] / med["grown"][1]})
    return rows


COLUMNS = [("prompt", lambda r: str(r["prompt"])),
           ("decode ms/token whole", lambda r: f"{r['whole decode ms']:.2f}"),
           ("grown", lambda r: f"{r['grown decode ms']:.2f}"),
           ("whole / grown", lambda r: f"{r['decode ratio']:.3f}"),
           ("prefill ms/token whole", lambda r: f"{r['whole prefill ms']:.3f}"),
           ("grown", lambda r: f"{r['grown prefill ms']:.3f}"),
           ("whole / grown", lambda r: f"{r['prefill ratio']:.3f}")]


def main(args) -> int:
    params, config, name = bench_model(args)
    lens = [int(x) for x in args.prompt_lens.split(",")]
    emit(f"one decode context vs grown page tables: {name}, prompts {lens}, "
         f"{args.requests} requests of {args.gen_tokens} tokens, {args.reps} reps, medians")
    rows = measure(params, config, lens, args.requests, args.gen_tokens, args.reps)
    emit(f"whole context: {rows[0]['context']} tokens")
    write_results(args.out, markdown_table(rows, COLUMNS), rows, model=name,
                  gen_tokens=args.gen_tokens, requests=args.requests)
    return 0
