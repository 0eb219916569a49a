"""Decode latency under arrivals (`kvjax bench arrivals`): what a long prompt's prefill does
to the sequences already decoding.

Seven requests decode (short prompts, long answers) on the config's model; then a
`--arrival-len`-token prompt arrives. Each scheduling round is timed; a running request's
per-token latency in a round is the round's wall time over the tokens it got. Reported over
`--steady` rounds before the arrival and the rounds from the arrival until the newcomer has
its first `--after` tokens: the running requests' median (and steady-state median), p99
and worst per-token latency, and the newcomer's time to first token, for three ways to
prefill while others decode: packed (the decode call's steps prefill the prompt beside the
decode tokens, `packed_prefill`), one prefill call per round between decode calls
(`prefill_calls_per_round` 1, the default), and the whole prompt before the next decode call (0).
One untimed run compiles first; the settings alternate over `--reps` runs; the figures are
medians over runs.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import numpy as np

from kvjax.config import EngineConfig
from kvjax.config_files import load_config
from kvjax.engine.engine import Engine
from kvjax.engine.requests import Request
from kvjax.lab.report import emit, markdown_table, write_results
from kvjax.model.transformer import init_params

RUNNING, PROMPT_LEN = 7, 32


def _scenario(params, model, engine_config, args, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    ids = lambda n: [int(t) for t in rng.integers(0, model.vocab_size, n)]  # noqa: E731
    eng = Engine(params, model, engine_config)
    running = {eng.submit(Request(ids(PROMPT_LEN), max_new_tokens=args.gen_tokens))
               for _ in range(RUNNING)}
    latencies = []

    def timed_round() -> dict[int, int]:
        t0 = time.perf_counter()
        events = eng.step()
        dt = time.perf_counter() - t0
        per_request = {}
        for ev in events:
            per_request[ev.request_id] = per_request.get(ev.request_id, 0) + len(ev.tokens)
        latencies.extend(dt / n for rid, n in per_request.items() if rid in running and n)
        return per_request

    for _ in range(2):  # every running request admitted and decoding
        eng.step()
    for _ in range(args.steady):
        timed_round()
    steady = statistics.median(latencies)
    arrival = time.perf_counter()
    newcomer = eng.submit(Request(ids(args.arrival_len), max_new_tokens=args.after))
    ttft, got = None, 0
    while got < args.after:
        got += timed_round().get(newcomer, 0)
        if ttft is None and got:
            ttft = time.perf_counter() - arrival
    return {"steady_ms": 1e3 * steady, "p50_ms": 1e3 * statistics.median(latencies),
            "p99_ms": 1e3 * float(np.percentile(latencies, 99)),
            "max_ms": 1e3 * max(latencies), "ttft_s": ttft}


def main(args) -> int:
    config = load_config(args.config, args.set)
    model = config.model
    params = init_params(model, seed=0)
    base = EngineConfig(cache=config.cache, max_slots=RUNNING + 1)
    settings = {"packed": dataclasses.replace(base, packed_prefill=True)} | {
        f"calls {calls}": dataclasses.replace(base, packed_prefill=False,
                                              prefill_calls_per_round=calls)
        for calls in (1, 0)}
    emit(f"bench arrivals: {args.config}: {RUNNING} requests decoding, a "
         f"{args.arrival_len}-token prompt arrives; chunk {config.cache.prefill_chunk}, "
         f"decode_steps {base.decode_steps}, numerics {base.numerics}")
    for ec in settings.values():  # compiles every shape the settings use
        _scenario(params, model, ec, args)
    runs = {name: [] for name in settings}
    for rep in range(args.reps):
        for name, ec in settings.items():
            runs[name].append(_scenario(params, model, ec, args, seed=rep))
            r = runs[name][-1]
            emit(f"rep {rep + 1}: {name}: per-token steady "
                 f"{r['steady_ms']:.1f} ms, p50 {r['p50_ms']:.1f}, p99 {r['p99_ms']:.1f}, "
                 f"worst {r['max_ms']:.1f}; TTFT {r['ttft_s']:.2f} s")
    rows = []
    for name, rs in runs.items():
        row = {key: statistics.median(r[key] for r in rs) for key in rs[0]}
        rows.append({"prefill": name, **row,
                     "p99_over_p50": row["p99_ms"] / row["p50_ms"],
                     "max_over_steady": row["max_ms"] / row["steady_ms"]})
    write_results(args.out, markdown_table(rows, COLUMNS), rows, config=args.config,
                  overrides=args.set)
    return 0


COLUMNS = [
    ("prefill while others decode", lambda r: r["prefill"]),
    ("running: per-token ms, steady", lambda r: f"{r['steady_ms']:.1f}"),
    ("p50", lambda r: f"{r['p50_ms']:.1f}"),
    ("p99", lambda r: f"{r['p99_ms']:.1f}"),
    ("worst", lambda r: f"{r['max_ms']:.1f}"),
    ("p99 / p50", lambda r: f"{r['p99_over_p50']:.2f}x"),
    ("worst / steady", lambda r: f"{r['max_over_steady']:.2f}x"),
    ("newcomer TTFT s", lambda r: f"{r['ttft_s']:.2f}"),
]
