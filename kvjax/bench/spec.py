"""Speculative decoding operating point: measured vs predicted speedup across γ and drafters.

On the trained target/draft pair (`scripts/train configs/train_target.toml`, then
`configs/train_draft.toml`) and prompts cut from the held-out (validation) split of the
stdlib corpus: plain engine decoding, then the engine with the model drafter and with the
n-gram drafter at each γ, then adaptive γ. Greedy, so every run must give the plain run's
tokens (counted). Decode time is the engine's own decode timer (prefill excluded), the
median over repetitions after an untimed warm-up run that compiles.

For each point: α = E[min(p, q)], acceptance rate, tokens per target call, the measured
speedup (plain decode time / speculative decode time, the two run back to back and the
median of the pair ratios taken), the textbook predicted speedup
(1 − α^(γ+1)) / ((1 − α)(γc + 1)) at the measured α and c, the prediction with the
measured verify cost (1 + s·γ target steps per verify; see `kvjax.speculative.cost`),
and the cost model: measured tokens per call / (γc + 1 + sγ), which drops the i.i.d.
acceptance assumption, so measured / cost model is the loop's own efficiency.
"""

from __future__ import annotations

import statistics

import numpy as np

from kvjax.config import CacheConfig, EngineConfig, SpecConfig
from kvjax.decode.batching import pages_for
from kvjax.engine.engine import Engine
from kvjax.engine.requests import Request
from kvjax.io.checkpoint import load
from kvjax.lab.progress import Progress
from kvjax.lab.report import emit, markdown_table, write_results
from kvjax.speculative.cost import cost_ratio, verify_slope
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


def _run(target, draft, prompts, args, spec: SpecConfig | None, decode_steps: int):
    """One engine run over the prompts: (decode seconds, metrics, tokens)."""
    new = args.gen_tokens
    need = pages_for(max(map(len, prompts)) + new + 9, 16) * args.slots
    ec = EngineConfig(cache=CacheConfig(page_size=16, num_pages=need + 16),
                      max_slots=args.slots, decode_steps=decode_steps, prefix_cache=False)
    engine = Engine(*target, ec, draft=draft if spec else None, spec=spec)
    results = engine.generate([Request(tokens=p, max_new_tokens=new) for p in prompts])
    metrics = engine.metrics()
    return metrics["decode_s"], metrics, [r.tokens for r in results]


def _paired(target, draft, prompts, args, spec: SpecConfig, decode_steps: int):
    """Plain and speculative runs back to back, args.reps times after a warm-up of each:
    the median of the per-pair time ratios (drift in the machine's speed cancels)."""
    _run(target, None, prompts, args, None, decode_steps)
    _run(target, draft, prompts, args, spec, decode_steps)
    ratios, plain_times, spec_times = [], [], []
    for _ in range(args.reps):
        plain_s, _, plain_tokens = _run(target, None, prompts, args, None, decode_steps)
        spec_s, metrics, tokens = _run(target, draft, prompts, args, spec, decode_steps)
        ratios.append(plain_s / spec_s)
        plain_times.append(plain_s)
        spec_times.append(spec_s)
    same = sum(a == b for a, b in zip(tokens, plain_tokens, strict=True))
    return (statistics.median(ratios), statistics.median(plain_times),
            statistics.median(spec_times), metrics, same)


def main(args) -> int:
    t_config, t_params = load(args.target)
    d_config, d_params = load(args.draft)
    target, draft = (t_params, t_config), (d_params, d_config)
    prompts = held_out_prompts(args.prompts, args.prompt_len)
    gammas = [int(g) for g in args.gammas.split(",")]
    context = args.prompt_len + args.gen_tokens // 2
    c_model = cost_ratio(target, draft, args.slots, context)
    slope = verify_slope(target, args.slots, context, max(gammas) + 1)
    emit(f"measured c (draft/target step) = {c_model:.4f}, verify slope s = {slope:.4f} "
         f"(batch {args.slots}, context {context})")
    rows = []
    points = [(d, g) for d in ("model", "ngram") for g in gammas]
    with Progress(len(points) + 4, "operating point") as bar:
        for drafter, gamma in points:
            rows.append(measure_point(target, draft, prompts, args, drafter, gamma, False,
                                      c_model if drafter == "model" else 0.0, slope,
                                      args.gen_tokens))
            bar.update(1)
        for drafter in ("model", "ngram"):
            c = c_model if drafter == "model" else 0.0
            fixed = [r for r in rows if r["drafter"] == drafter and not r["adaptive"]]
            best = max(fixed, key=lambda r: r["speedup"])
            best["best"] = True
            # Adaptive γ re-chooses γ at every engine call (every `adaptive_steps` tokens);
            # the best fixed γ is rerun at the same call granularity for a like-for-like
            # comparison.
            same_grain = measure_point(target, draft, prompts, args, drafter, best["gamma"],
                                       False, c, slope, args.adaptive_steps)
            adaptive = measure_point(target, draft, prompts, args, drafter, max(gammas), True,
                                     c, slope, args.adaptive_steps)
            adaptive["vs_best_fixed"] = adaptive["speedup"] / same_grain["speedup"]
            adaptive["best_fixed_same_grain"] = same_grain["speedup"]
            rows.append(adaptive)
            bar.update(2)
    table = markdown_table(rows, COLUMNS)
    for r in rows:
        if r["adaptive"]:
            emit(f"adaptive γ ({r['drafter']}): {r['speedup']:.2f}x vs best fixed γ "
                 f"{r['best_fixed_same_grain']:.2f}x at the same {args.adaptive_steps}-token "
                 f"calls ({r['vs_best_fixed']:.3f}); γ chosen: {r['gamma_history']}")
    write_results(args.out, table, rows, c_model=c_model,
                  verify_slope=slope, prompts=args.prompts, prompt_len=args.prompt_len,
                  gen_tokens=args.gen_tokens, slots=args.slots, reps=args.reps)
    if args.plot:
        plot_operating_point(rows, args.plot)
        emit(f"wrote {args.plot}")
    return 0


def measure_point(target, draft, prompts, args, drafter, gamma, adaptive, c, slope,
                  decode_steps) -> dict:
    spec = SpecConfig(drafter=drafter, gamma=gamma, adaptive=adaptive,
                      cost_ratio=c if adaptive else None, verify_slope=slope if adaptive else None)
    speedup, plain_s, seconds, metrics, same = _paired(target, draft, prompts, args, spec,
                                                       decode_steps)
    s = metrics["spec"]
    history = s["gamma_history"]
    g = round(sum(history) / len(history)) if adaptive else gamma
    return {
        "drafter": drafter, "gamma": gamma, "adaptive": adaptive, "decode_steps": decode_steps,
        "alpha": s["alpha"], "acceptance_rate": s["acceptance_rate"],
        "mean_accepted_length": s["mean_accepted_length"], "c": c,
        "predicted": predicted_speedup(s["alpha"], g, c),
        "predicted_verify": predicted_speedup(s["alpha"], g, c, slope),
        "cost_model": s["mean_accepted_length"] / (g * c + 1 + slope * g),
        "speedup": speedup, "decode_s": seconds, "plain_decode_s": plain_s,
        "accepted_by_position": s["accepted_by_position"],
        "drafted_by_position": s["drafted_by_position"], "wasted": s["wasted"],
        "target_calls": s["target_calls"], "gamma_history": history if adaptive else [],
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
