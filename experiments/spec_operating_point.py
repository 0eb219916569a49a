"""Speculative decoding operating point: measured vs predicted speedup across γ and drafters.

On the trained target/draft pair (trained first when the checkpoints are missing) and
prompts from the held-out split of the stdlib corpus, each point runs plain engine decoding
and speculative decoding (model or n-gram drafter at one γ) back to back, `reps` times after
a warm-up, and takes the median of the pair ratios. Greedy: every run must give the plain
run's tokens (counted). Reported beside the measured speedup: α, acceptance, tokens per
target call, the textbook prediction (1 − α^(γ+1)) / ((1 − α)(γc + 1)) at the measured α
and draft/target cost ratio c, the prediction with the measured verify cost (1 + s·γ target
steps per verify), and the cost model (measured tokens per call over γc + 1 + sγ). c and s
are measured once per process (`kvjax.speculative.cost`). See `kvjax bench spec` for the
adaptive-γ comparison.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from experiments import common
from kvjax.config import ConfigError
from kvjax.memory.calculator import num_params
from kvjax.speculative import operating_point
from kvjax.speculative.cost import cost_ratio, verify_slope
from kvjax.speculative.operating_point import held_out_prompts, measure_point
from kvjax.train.loop import trained


@dataclasses.dataclass(frozen=True)
class Params:
    drafter: str = "model"
    gamma: int = 4
    target_dir: str = "checkpoints/target"
    draft_dir: str = "checkpoints/draft"
    target_train: str = "configs/train_target.toml"
    draft_train: str = "configs/train_draft.toml"
    target_set: tuple[str, ...] = ()  # overrides when the target must be trained here
    draft_set: tuple[str, ...] = ()
    prompts: int = 8
    prompt_len: int = 128  # the pair was trained on 256-token windows: stay inside them
    gen_tokens: int = 128
    reps: int = 3
    slots: int = 1
    slope_gamma: int = 8  # the widest verify the slope s is fitted to
    cost_ratio: float | None = None  # pin c instead of measuring it
    verify_slope: float | None = None  # pin s instead of measuring it

    def __post_init__(self):
        common.check_choice(self, "drafter", ("model", "ngram"))
        if not 1 <= self.gamma <= 32:
            raise ConfigError("gamma", f"must be in [1, 32], got {self.gamma}")
        common.check_positive(self, "prompts", "prompt_len", "gen_tokens", "reps", "slots",
                              "slope_gamma")
        common.check_files(self, "target_train", "draft_train")


@functools.cache
def _pair(p: Params):
    """(target, draft) as (params, config) pairs, trained first if missing."""
    target = trained(p.target_train, p.target_dir, p.target_set)
    draft = trained(p.draft_train, p.draft_dir, p.draft_set)
    return target, draft


@functools.cache
def _costs(p: Params) -> tuple[float, float]:
    """(c, verify slope s), measured once per process at the run's batch and context."""
    target, draft = _pair(p)
    context = p.prompt_len + p.gen_tokens // 2
    c = p.cost_ratio if p.cost_ratio is not None else cost_ratio(target, draft, p.slots,
                                                                 context)
    s = p.verify_slope if p.verify_slope is not None else verify_slope(
        target, p.slots, context, p.slope_gamma + 1)
    return c, s


def run(config) -> dict:
    p = config.params
    shared = dataclasses.replace(p, drafter="model", gamma=1)  # the cache key of a run
    target, draft = _pair(shared)
    c_model, slope = _costs(shared)
    prompts = held_out_prompts(p.prompts, p.prompt_len, seed=config.seed)
    c = c_model if p.drafter == "model" else 0.0
    row = measure_point(target, draft, prompts, p.drafter, p.gamma, False, c, slope,
                        p.gen_tokens, gen_tokens=p.gen_tokens, slots=p.slots, reps=p.reps)
    row["verify_slope"] = slope
    row["target_params"], row["draft_params"] = num_params(target[1]), num_params(draft[1])
    return row


TIMING = ("c", "verify_slope", "predicted", "predicted_verify", "cost_model", "speedup")

COLUMNS = operating_point.COLUMNS


def headline(rows: list[dict]) -> str:
    lines = []
    for drafter in dict.fromkeys(r["drafter"] for r in rows):
        rs = [r for r in rows if r["drafter"] == drafter]
        best = max(rs, key=lambda r: r["speedup"])
        lines.append(f"- {drafter} drafter: best γ {best['gamma']}, {best['speedup']:.2f}x "
                     f"measured vs {best['predicted']:.2f}x textbook and "
                     f"{best['predicted_verify']:.2f}x with the measured verify cost "
                     f"({best['speedup'] / best['predicted_verify']:.2f}); α "
                     f"{best['alpha']:.2f}")
    same = all(r["same"] == r["prompts"] for r in rows)
    lines.append(f"- greedy tokens equal plain decoding at every point: "
                 f"{'yes' if same else 'NO'}")
    return "\n".join(lines)


def plot(rows: list[dict], out) -> list:
    path = Path(out) / "spec_operating_point.png"
    operating_point.plot_operating_point(rows, path)
    return [path]
