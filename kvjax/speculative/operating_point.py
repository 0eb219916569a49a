"""The speculative decoding operating point: measured vs predicted speedup at one drafter and γ.

Prompts are cut from the held-out (validation) split of the stdlib corpus. A point runs
plain engine decoding and speculative decoding back to back, after an untimed warm-up of
each that compiles, and takes the median of the pair ratios of the engine's own decode
timer (prefill excluded) per decoded token. Greedy by default, so every run must give the
plain run's tokens (counted); sampled points (`sampling`) measure acceptance under the
target's distribution.

Beside the measured speedup: α = E[min(p, q)], acceptance rate, tokens per target call, the
textbook predicted speedup (1 − α^(γ+1)) / ((1 − α)(γc + 1)) at the measured α and c, the
prediction with the measured verify cost (1 + s·γ target steps per verify; see
`kvjax.speculative.cost`), and the cost model: measured tokens per call / (γc + 1 + sγ),
which drops the i.i.d. acceptance assumption, so measured / cost model is the loop's own
efficiency. `kvjax bench spec` and the shipped experiments `spec_operating_point` and
`tour` measure with it.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics

import numpy as np

from kvjax.config import CacheConfig, EngineConfig, SamplingConfig, SpecConfig
from kvjax.decode.batching import pages_for
from kvjax.engine.engine import Engine
from kvjax.engine.requests import Request
from kvjax.speculative.rules import predicted_speedup
from kvjax.train.data import load_corpus

COLUMNS = [
    ("drafter", lambda r: r["drafter"]),
    ("γ", lambda r: "adaptive" if r["adaptive"] else str(r["gamma"])),
    ("α", lambda r: f"{r['alpha']:.3f}"),
    ("accept", lambda r: f"{r['acceptance_rate']:.3f}"),
    ("tokens/call", lambda r: f"{r['mean_accepted_length']:.2f}"),
    ("c", lambda r: f"{r['c']:.3f}"),
    ("predicted", lambda r: f"{r['predicted']:.2f}x"),
    ("predicted (verify cost)", lambda r: f"{r['predicted_verify']:.2f}x"),
    ("measured", lambda r: f"{r['speedup']:.2f}x" + (" **best**" if r.get("best") else "")),
    ("measured / predicted", lambda r: f"{r['speedup'] / r['predicted']:.2f}"),
    ("cost model", lambda r: f"{r['cost_model']:.2f}x"),
    ("measured / cost model", lambda r: f"{r['speedup'] / r['cost_model']:.2f}"),
    ("same tokens", lambda r: f"{r['same']}/{r['prompts']}"),
]


def held_out_prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    """`count` windows of `length` byte tokens from the validation split."""
    ids = load_corpus()["validation"]
    starts = np.random.default_rng(seed).integers(0, len(ids) - length - 1, count)
    return [ids[s:s + length].astype(int).tolist() for s in starts]


def _run(target, draft, prompts, spec: SpecConfig | None, decode_steps: int, gen_tokens: int,
         slots: int, base: EngineConfig | None, eos_tokens: tuple[int, ...],
         sampling: SamplingConfig | None = None):
    """One engine run over the prompts: (decode seconds, metrics, tokens). `base`: the
    engine's cache, slots and numerics (None: a pool sized to the prompts, invariant
    numerics); the prefix cache is off either way, so every run computes every token.
    `sampling`: prompt i's knobs with seed `sampling.seed + i` (None: greedy)."""
    if base is None:
        need = pages_for(max(map(len, prompts)) + gen_tokens + 9, 16) * slots
        ec = EngineConfig(cache=CacheConfig(page_size=16, num_pages=need + 16),
                          max_slots=slots, decode_steps=decode_steps, prefix_cache=False)
    else:
        ec = dataclasses.replace(base, decode_steps=decode_steps, prefix_cache=False)
    engine = Engine(*target, ec, draft=draft if spec else None, spec=spec,
                    eos_tokens=eos_tokens)
    knobs = [SamplingConfig() if sampling is None else
             dataclasses.replace(sampling, seed=sampling.seed + i) for i in range(len(prompts))]
    results = engine.generate([Request(tokens=p, max_new_tokens=gen_tokens, sampling=k)
                               for p, k in zip(prompts, knobs, strict=True)])
    metrics = engine.metrics()
    return metrics["decode_s"], metrics, [r.tokens for r in results]


def _paired(target, draft, prompts, spec: SpecConfig, decode_steps: int, gen_tokens: int,
            slots: int, reps: int, warmup: bool = True, **engine):
    """Plain and speculative runs back to back, `reps` times after a warm-up of each (unless
    the caller warmed up the same shapes): the median of the per-pair ratios of decode time
    per decoded token (drift in the machine's speed cancels; sampled runs' answers differ
    in length, greedy ones do not)."""
    run = functools.partial(_run, target, prompts=prompts, decode_steps=decode_steps,
                            gen_tokens=gen_tokens, slots=slots, **engine)
    if warmup:
        run(None, spec=None)
        run(draft, spec=spec)
    ratios, plain_times, spec_times = [], [], []
    for _ in range(reps):
        plain_s, _, plain_tokens = run(None, spec=None)
        spec_s, metrics, tokens = run(draft, spec=spec)
        ratios.append(plain_s / _decoded(plain_tokens) / (spec_s / _decoded(tokens)))
        plain_times.append(plain_s)
        spec_times.append(spec_s)
    same = sum(a == b for a, b in zip(tokens, plain_tokens, strict=True))
    return (statistics.median(ratios), statistics.median(plain_times),
            statistics.median(spec_times), metrics, same)


def _decoded(answers: list[list[int]]) -> int:
    """Tokens the decode calls emitted (each answer's first comes from its prefill)."""
    return max(sum(len(a) - 1 for a in answers), 1)


def measure_point(target, draft, prompts, drafter: str, gamma: int, adaptive: bool, c: float,
                  slope: float, decode_steps: int, *, gen_tokens: int, slots: int,
                  reps: int, base: EngineConfig | None = None, eos_tokens: tuple[int, ...] = (),
                  warmup: bool = True, tree_nodes: int | None = None, branches: int = 4,
                  verify_costs: tuple | None = None, rerank: bool = False,
                  sampling: SamplingConfig | None = None) -> dict:
    """One operating point: `gen_tokens` new tokens per prompt from the target alone and with
    `drafter` at `gamma` (adaptive: γ re-chosen from c and `slope` at every engine call of
    `decode_steps` tokens), on `slots` engine slots, paired `reps` times (`_paired`); the
    measured speedup beside the predictions at the measured α. `base`: the engines' cache
    and numerics (a fixed pool lets points of different prompts share compiled steps);
    `eos_tokens`: where an answer stops (none: every prompt gets `gen_tokens`); `warmup`:
    False where the caller already ran these shapes (a warm-up runs every prompt once);
    `tree_nodes`, `branches`, `rerank`: trees instead of chains (`SpecConfig`; adaptive:
    each call's width from `verify_costs`, a round's cost per node count); `sampling`:
    sampled answers (prompt i's seed `sampling.seed + i`; `same` then counts answers that
    happen to equal plain sampling's, not a check)."""
    spec = SpecConfig(drafter=drafter, gamma=gamma, adaptive=adaptive,
                      cost_ratio=c if adaptive else None, verify_slope=slope if adaptive else None,
                      tree_nodes=tree_nodes, branches=branches, rerank=rerank,
                      verify_costs=verify_costs if adaptive and tree_nodes else None)
    speedup, plain_s, seconds, metrics, same = _paired(
        target, draft, prompts, spec, decode_steps, gen_tokens, slots, reps, warmup,
        base=base, eos_tokens=eos_tokens, sampling=sampling)
    s = metrics["spec"]
    history = s["gamma_history"]
    g = round(sum(history) / len(history)) if adaptive else gamma
    chain = tree_nodes is None  # α and the speedup models are a chain's (none for trees)
    return {
        "drafter": drafter, "gamma": gamma, "adaptive": adaptive, "decode_steps": decode_steps,
        "tree_nodes": tree_nodes, "branches": branches if tree_nodes else None,
        "alpha": s["alpha"] if chain else None, "acceptance_rate": s["acceptance_rate"],
        "mean_accepted_length": s["mean_accepted_length"], "c": c,
        "predicted": predicted_speedup(s["alpha"], g, c) if chain else None,
        "predicted_verify": predicted_speedup(s["alpha"], g, c, slope) if chain else None,
        "cost_model": s["mean_accepted_length"] / (g * c + 1 + slope * g) if chain else None,
        "speedup": speedup, "decode_s": seconds, "plain_decode_s": plain_s,
        "accepted_by_position": s["accepted_by_position"],
        "drafted_by_position": s["drafted_by_position"], "wasted": s["wasted"],
        "target_calls": s["target_calls"], "gamma_history": history if adaptive else [],
        "tree_widths": s["tree_widths"],
        "same": same, "prompts": len(prompts),
    }


def plot_operating_point(rows, path) -> None:
    """Measured and predicted speedup against γ per drafter (adaptive rows as bands)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=100)
    for drafter, color in (("model", "tab:blue"), ("ngram", "tab:orange")):
        fixed = sorted((r for r in rows if r["drafter"] == drafter and not r["adaptive"]),
                       key=lambda r: r["gamma"])
        if not fixed:
            continue
        gammas = [r["gamma"] for r in fixed]
        ax.plot(gammas, [r["speedup"] for r in fixed], "o-", color=color,
                label=f"{drafter}: measured")
        ax.plot(gammas, [r["predicted"] for r in fixed], "--", color=color,
                label=f"{drafter}: predicted (textbook)")
        ax.plot(gammas, [r["predicted_verify"] for r in fixed], ":", color=color,
                label=f"{drafter}: predicted (measured verify cost)")
        ax.plot(gammas, [r["cost_model"] for r in fixed], "-.", color=color, linewidth=0.8,
                label=f"{drafter}: cost model (measured tokens/call)")
        best = max(fixed, key=lambda r: r["speedup"])
        ax.plot([best["gamma"]], [best["speedup"]], "*", color=color, markersize=14)
        adaptive = [r for r in rows if r["drafter"] == drafter and r["adaptive"]]
        if adaptive:
            ax.axhline(adaptive[0]["speedup"], color=color, alpha=0.35, linewidth=4,
                       label=f"{drafter}: adaptive γ (measured)")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("γ (drafted tokens per target call)")
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title("Speculative decoding operating point (trained pair, held-out prompts)",
                 fontsize=9)
    ax.legend(fontsize=6, loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
