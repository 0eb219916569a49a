"""Prefix-reuse benchmark: the same workloads with the prefix cache on and off, in one run.

Workloads (token ids from a seeded generator, on the bench model):
  (a) system prompt: requests sharing a long system prompt, each with a short unique suffix;
  (b) multi-turn:    conversations whose every turn extends the previous prompt + answer
                     (with the reused tokens of an ideal cache: every full page computed
                     before, answers included);
  (c) few-shot:      the same shared examples followed by different queries.
For each: total prefill time, mean TTFT, reused-token fraction, and the ratio of measured
prefill time (on / off) to the ideal (computed tokens on / off); plus the host-side time
(matching, allocation, insertion) as a fraction of prefill time.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

from kvjax.config_files import load_config
from kvjax.engine.engine import Engine
from kvjax.lab import workloads
from kvjax.lab.report import emit, markdown_table, write_results
from kvjax.model.transformer import init_params


def _workloads(args, vocab: int, page_size: int) -> dict:
    return {
        "system_prompt": lambda eng: eng.generate(workloads.shared_system_prompt(
            args.requests, args.system_len, args.suffix_len, vocab, args.new_tokens, seed=1)),
        "multi_turn": _multi_turn(args, vocab, page_size),
        "few_shot": lambda eng: eng.generate(workloads.few_shot(
            args.requests // 2, args.examples, args.example_len, args.suffix_len, vocab,
            args.new_tokens, seed=3)),
    }


def ideal_reused(calls: list[list[tuple[list[int], list[int]]]], page_size: int) -> int:
    """Tokens an ideal cache reuses over `calls` (each a list of (prompt, answer) run by
    one `generate`, in order): every full page a request shares with what was computed
    before it, i.e. earlier calls' prompts and answers (the last answer token is never
    cached) and earlier prompts of its own call, up to its last token's page (computed for
    its logits)."""
    total, seen = 0, []

    def common_pages(a: list[int], b: list[int]) -> int:
        n = 0
        while (n + 1) * page_size <= min(len(a), len(b)) and \
                a[n * page_size:(n + 1) * page_size] == b[n * page_size:(n + 1) * page_size]:
            n += 1
        return n

    for call in calls:
        prompts = []
        for prompt, _ in call:
            best = max((common_pages(prompt, h) for h in seen + prompts), default=0)
            total += min(best, (len(prompt) - 1) // page_size) * page_size
            prompts.append(prompt)
        seen += [prompt + answer[:-1] for prompt, answer in call]
    return total


def _multi_turn(args, vocab: int, page_size: int):
    """The multi-turn workload, its results, and the ideal cache's reused tokens."""
    def run(eng):
        convs = workloads.run_multi_turn(eng, args.conversations, args.turns,
                                         args.turn_system_len, args.user_len, vocab,
                                         args.new_tokens, seed=2)
        calls = [[(c.results[t].prompt_ids, c.results[t].tokens) for c in convs]
                 for t in range(args.turns)]
        results = [r for c in convs for r in c.results]
        results[0].stats["ideal_reused_tokens"] = ideal_reused(calls, page_size)
        return results
    return run


def _run(params, model, engine_config, workload) -> dict:
    eng = Engine(params, model, engine_config)
    t0 = time.perf_counter()
    results = workload(eng)
    wall = time.perf_counter() - t0
    m = eng.metrics()
    computed = sum(r.stats["computed_tokens"] for r in results)
    ideal = results[0].stats.get("ideal_reused_tokens")
    return {"reused_over_ideal": None if not ideal else
            sum(r.stats["reused_tokens"] for r in results) / ideal,
            "wall_s": wall, "prefill_s": m["prefill_s"], "mean_ttft_s": m["mean_ttft_s"],
            "token_reuse_rate": m["token_reuse_rate"], "computed_tokens": computed,
            "prompt_tokens": m["prompt_tokens"], "host_s": m["host_s"],
            "tokens": [r.tokens for r in results]}


def main(args) -> int:
    config = load_config(args.config, args.set)
    model = config.model
    cache = dataclasses.replace(config.cache, num_pages=args.num_pages)
    engine_config = dataclasses.replace(config.engine, cache=cache, max_slots=args.slots,
                                        decode_steps=8)  # the config's other engine knobs
    params = init_params(model, seed=0)
    emit(f"bench prefix: {args.config}: {model.num_layers} layers, d_model {model.d_model}; "
          f"page_size {cache.page_size}, prefill_chunk {cache.prefill_chunk}, "
          f"{cache.num_pages} pages, {args.slots} slots, numerics {engine_config.numerics}")
    wanted = args.workloads.split(",")
    loads = {k: v for k, v in _workloads(args, model.vocab_size, cache.page_size).items()
             if k in wanted}
    rows = []
    for name, workload in loads.items():
        # Warm-up: one untimed run compiles every shape (page-table widths, slots) it uses.
        _run(params, model, engine_config, workload)
        runs = {"on": [], "off": []}
        for rep in range(args.reps):
            for setting in ("on", "off"):
                ec = dataclasses.replace(engine_config, prefix_cache=setting == "on")
                runs[setting].append(_run(params, model, ec, workload))
                emit(f"{name} rep {rep + 1}/{args.reps} cache {setting}: prefill "
                      f"{runs[setting][-1]['prefill_s']:.2f} s")
        on, off = runs["on"][0], runs["off"][0]
        if on["tokens"] != off["tokens"]:  # a check of the run, not a debug assert (-O)
            raise AssertionError(f"{name}: the prefix cache changed the outputs")
        med = {s: {k: statistics.median(r[k] for r in runs[s])
                   for k in ("prefill_s", "mean_ttft_s", "host_s", "wall_s")} for s in runs}
        measured = med["on"]["prefill_s"] / med["off"]["prefill_s"]
        ideal = on["computed_tokens"] / off["computed_tokens"]
        rows.append({
            "workload": name, "prompt_tokens": on["prompt_tokens"],
            "reused_fraction": on["token_reuse_rate"],
            "reused_over_ideal": on["reused_over_ideal"],
            "prefill_s_on": med["on"]["prefill_s"], "prefill_s_off": med["off"]["prefill_s"],
            "ttft_s_on": med["on"]["mean_ttft_s"], "ttft_s_off": med["off"]["mean_ttft_s"],
            "measured_time_ratio": measured, "ideal_ratio": ideal,
            "measured_over_ideal": measured / ideal,
            "host_fraction_of_prefill": med["on"]["host_s"] / med["on"]["prefill_s"],
        })
    write_results(args.out, markdown_table(rows, COLUMNS), rows, config=args.config,
                  overrides=args.set, args=vars(args) | {"func": None})
    return 0


COLUMNS = [
    ("workload", lambda r: r["workload"]),
    ("prompt tokens", lambda r: f"{r['prompt_tokens']:,}"),
    ("reused", lambda r: f"{r['reused_fraction']:.1%}"),
    ("reused / ideal cache", lambda r: "–" if r["reused_over_ideal"] is None
     else f"{r['reused_over_ideal']:.1%}"),
    ("prefill s on / off", lambda r: f"{r['prefill_s_on']:.2f} / {r['prefill_s_off']:.2f}"),
    ("mean TTFT s on / off", lambda r: f"{r['ttft_s_on']:.2f} / {r['ttft_s_off']:.2f}"),
    ("time ratio", lambda r: f"{r['measured_time_ratio']:.3f}"),
    ("ideal ratio", lambda r: f"{r['ideal_ratio']:.3f}"),
    ("measured / ideal", lambda r: f"{r['measured_over_ideal']:.2f}x"),
    ("host / prefill", lambda r: f"{r['host_fraction_of_prefill']:.2%}"),
]
