"""Speculative decoding operating point: measured vs predicted speedup across γ and drafters.

On the trained target/draft pair (`scripts/train configs/train_target.toml`, then
`configs/train_draft.toml`) and prompts cut from the held-out (validation) split of the
stdlib corpus: the model drafter and the n-gram drafter at each γ, then adaptive γ against
the best fixed γ rerun at the same engine-call granularity. Every point is measured by
`kvjax.speculative.operating_point.measure_point` (plain and speculative decoding back to
back, the median of the pair ratios, beside the textbook prediction and the cost model);
c and the verify slope s are measured once (`kvjax.speculative.cost`).
"""

from __future__ import annotations

from kvjax.io.checkpoint import load
from kvjax.lab.progress import Progress
from kvjax.lab.report import emit, markdown_table, write_results
from kvjax.speculative.cost import cost_ratio, verify_slope
from kvjax.speculative.operating_point import (
    COLUMNS,
    held_out_prompts,
    measure_point,
    plot_operating_point,
)


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
    setting = {"gen_tokens": args.gen_tokens, "slots": args.slots, "reps": args.reps}
    rows = []
    points = [(d, g) for d in ("model", "ngram") for g in gammas]
    with Progress(len(points) + 4, "operating point") as bar:
        for drafter, gamma in points:
            rows.append(measure_point(target, draft, prompts, drafter, gamma, False,
                                      c_model if drafter == "model" else 0.0, slope,
                                      args.gen_tokens, **setting))
            bar.update(1)
        for drafter in ("model", "ngram"):
            c = c_model if drafter == "model" else 0.0
            fixed = [r for r in rows if r["drafter"] == drafter and not r["adaptive"]]
            best = max(fixed, key=lambda r: r["speedup"])
            best["best"] = True
            # Adaptive γ re-chooses γ at every engine call (every `adaptive_steps` tokens);
            # the best fixed γ is rerun at the same call granularity for a like-for-like
            # comparison.
            same_grain = measure_point(target, draft, prompts, drafter, best["gamma"], False,
                                       c, slope, args.adaptive_steps, **setting)
            adaptive = measure_point(target, draft, prompts, drafter, max(gammas), True, c,
                                     slope, args.adaptive_steps, **setting)
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
