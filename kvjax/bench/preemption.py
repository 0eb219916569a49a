"""Preemption under memory pressure (`kvjax bench preemption`): resume vs recompute.

`--requests` greedy requests (`--prompt-len`-token prompts, `--gen-tokens` new tokens each,
random ids) on the config's model, all submitted at once into a cache with pages for only
`--fit` of them at full length: running requests outgrow it and the youngest are preempted.
Two settings of `EngineConfig.preemption`: "resume" (the next admission prefills prompt +
answer so far, reusing the pages the preemption cached) and "recompute" (the answer is
decoded again), beside a cache with pages for every request (no preemption, the floor).
One untimed run of each compiles first; the settings alternate over `--reps` runs; the
figures are medians over runs, and every run must return the same tokens in all three.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import numpy as np

from kvjax.config import EngineConfig
from kvjax.config_files import load_config
from kvjax.decode.batching import pages_for
from kvjax.engine.engine import Engine
from kvjax.engine.requests import Request
from kvjax.lab.report import emit, markdown_table, write_results
from kvjax.model.transformer import init_params

MODES = ("resume", "recompute")
ROOMY = "no pressure"


def _run(params, model, engine_config: EngineConfig, requests: list[Request]) -> dict:
    eng = Engine(params, model, engine_config)
    t0 = time.perf_counter()
    results = eng.generate(requests)
    wall = time.perf_counter() - t0
    m = eng.metrics()
    return {"wall_s": wall, "prefill_s": m["prefill_s"], "decode_s": m["decode_s"],
            "preemptions": m["preemptions"], "resumed_tokens": m["resumed_tokens"],
            "recomputed_tokens": m["recomputed_tokens"],
            "tokens": [r.tokens for r in results]}


def main(args) -> int:
    config = load_config(args.config, args.set)
    model, ps = config.model, config.cache.page_size
    params = init_params(model, seed=0)
    rng = np.random.default_rng(0)
    requests = [Request([int(t) for t in rng.integers(0, model.vocab_size, args.prompt_len)],
                        max_new_tokens=args.gen_tokens) for _ in range(args.requests)]
    per_request = pages_for(args.prompt_len + args.gen_tokens, ps)
    pages = args.fit * per_request
    base = EngineConfig(cache=dataclasses.replace(config.cache, num_pages=pages),
                        max_slots=args.slots)
    settings = {mode: dataclasses.replace(base, preemption=mode) for mode in MODES}
    settings[ROOMY] = dataclasses.replace(base, cache=dataclasses.replace(
        config.cache, num_pages=args.requests * per_request))
    emit(f"bench preemption: {args.config}: {args.requests} requests of {args.prompt_len} + "
         f"{args.gen_tokens} tokens, {args.slots} slots, pages for {args.fit} ({pages} of "
         f"{ps} tokens); decode_steps {base.decode_steps}, numerics {base.numerics}")
    for ec in settings.values():  # compiles every shape the settings use
        _run(params, model, ec, requests)
    runs = {mode: [] for mode in settings}
    for rep in range(args.reps):
        for mode, ec in settings.items():
            runs[mode].append(_run(params, model, ec, requests))
            r = runs[mode][-1]
            emit(f"rep {rep + 1}: {mode}: {r['wall_s']:.2f} s (prefill {r['prefill_s']:.2f}, "
                 f"decode {r['decode_s']:.2f}), {r['preemptions']} preemptions, "
                 f"{r['resumed_tokens']} answer tokens resumed, "
                 f"{r['recomputed_tokens']} tokens recomputed")
        if any(rs[-1]["tokens"] != runs[ROOMY][-1]["tokens"] for rs in runs.values()):
            raise AssertionError("the settings returned different tokens")
    resume_wall = statistics.median(r["wall_s"] for r in runs["resume"])
    rows = []
    for mode, rs in runs.items():
        row = {key: statistics.median(r[key] for r in rs) for key in rs[0] if key != "tokens"}
        rows.append({"preemption": mode, **row, "vs_resume": row["wall_s"] / resume_wall})
    write_results(args.out, markdown_table(rows, COLUMNS), rows, config=args.config,
                  overrides=args.set)
    return 0


COLUMNS = [
    ("preemption", lambda r: r["preemption"]),
    ("end to end s", lambda r: f"{r['wall_s']:.2f}"),
    ("prefill s", lambda r: f"{r['prefill_s']:.2f}"),
    ("decode s", lambda r: f"{r['decode_s']:.2f}"),
    ("preemptions", lambda r: f"{r['preemptions']:.0f}"),
    ("answer tokens resumed", lambda r: f"{r['resumed_tokens']:.0f}"),
    ("tokens recomputed", lambda r: f"{r['recomputed_tokens']:.0f}"),
    ("time vs resume", lambda r: f"{r['vs_resume']:.2f}x"),
]
