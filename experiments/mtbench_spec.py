"""N-gram or EAGLE-style head drafts on MT-Bench per category, real model: tokens per call.

MT-Bench's questions (`kvjax.data.mtbench`: 80 questions of two user turns, 10 in each of
8 categories) are rendered with SmolLM2-135M-Instruct's chat template. Turn 1: the first
question alone; turn 2: the first question, the model's own greedy answer to it (up to
`new_tokens`, ended at the end of turn) and the second question, as a chat client sends it.
Each point decodes one category's prompts, one at a time (batch 1, greedy, answers ended at
the end of turn), with the target alone and with the n-gram drafter at `gamma` (or the
trees of an EAGLE-style head: `drafter="eagle"`, `head` its folder)
(`kvjax.speculative.operating_point.measure_point`: the engine's own decode timer, prefill
excluded, the median of `reps` paired ratios after an untimed run of each on the same
prompts: the decode steps compile per context-length bucket, so a category of longer
prompts would otherwise time compiles), under one numerics plan.

Reported per category: tokens per target call (accepted drafts + 1), α and the acceptance
rate, the speedup over plain decoding, and whether every answer's greedy tokens equal plain
decoding's. With `temperature` > 0 the answers are sampled (the drafts verified by the
exact rule), against plain sampling's time.
"""

from __future__ import annotations

import dataclasses
import functools

from experiments import common
from kvjax import models
from kvjax.config import ConfigError, SamplingConfig, SpecConfig
from kvjax.data import mtbench
from kvjax.data.mtbench import CATEGORIES
from kvjax.decode.batching import pages_for
from kvjax.engine.engine import Engine
from kvjax.engine.requests import Request
from kvjax.speculative.operating_point import measure_point

# the longest prompt and answer a point holds: MT-Bench's longest turn-2 prompt with the
# model's answer is under 1,600 tokens at new_tokens 256 (one pool for every category lets
# the points share their compiled steps)
_POOL_TOKENS = 2048


@dataclasses.dataclass(frozen=True)
class Params:
    model: str = "smollm2-135m-instruct"
    categories: tuple[str, ...] = CATEGORIES
    questions: int = 10  # per category, at most (MT-Bench has 10 in each)
    turn: int = 1
    numerics: str = "fast"
    gamma: int = 4  # a chain's drafts, a tree's depth
    tree_nodes: int | None = None  # n-gram trees of up to this many nodes (None: chains)
    branches: int = 4  # a tree's continuations of the history's n-gram matches
    adaptive: bool = False  # trees: each call's width by the measured verify costs
    # "eagle": the trees of an EAGLE-style head (`head`: its folder, `scripts/train_eagle`;
    # branches: its offers per level; rerank: EAGLE-2's cut of every level's offers)
    drafter: str = "ngram"
    head: str | None = None
    rerank: bool = False
    new_tokens: int = 128  # per answer, at most (it ends at the end of turn)
    # > 0: sampled answers (question i's seed: the config's seed + i; turn 2's history
    # still holds the greedy turn-1 answer), tokens per call under the target's distribution
    temperature: float = 0.0
    decode_steps: int = 16
    reps: int = 1
    page_size: int = 16

    def __post_init__(self):
        common.check_positive(self, "questions", "gamma", "new_tokens", "decode_steps", "reps",
                              "page_size")
        common.check_choice(self, "drafter", ("ngram", "eagle"))
        SpecConfig(drafter=self.drafter, gamma=self.gamma, tree_nodes=self.tree_nodes,
                   branches=self.branches, rerank=self.rerank,
                   adaptive=self.adaptive)  # a ConfigError names what is wrong
        if (self.head is None) == (self.drafter == "eagle"):
            raise ConfigError("head", "the eagle drafter needs a head folder "
                              "(scripts/train_eagle), and only it reads one")
        if self.adaptive and self.tree_nodes is None:
            raise ConfigError("adaptive", "adaptive widths are for trees: set tree_nodes")
        common.check_choice(self, "turn", (1, 2))
        if not self.temperature >= 0:
            raise ConfigError("temperature", f"{self.temperature}: 0 (greedy) or more")
        common.check_choice(self, "numerics", ("fast", "invariant"))
        unknown = sorted(set(self.categories) - set(CATEGORIES))
        if unknown or not self.categories:
            raise ConfigError("categories", f"unknown {unknown} (known: {', '.join(CATEGORIES)})"
                              if unknown else "at least one category")
        if self.model not in models.MODELS:
            raise ConfigError("model", f"unknown model {self.model!r} (known: "
                              f"{', '.join(sorted(models.MODELS))})")


def _engine_config(p: Params):
    # the real-model tests' engine shape (page 16, 64-token chunks, one slot, one table width
    # for every prompt and turn): the smoke run shares their compiled prefill and decode steps
    pages = max(256, pages_for(_POOL_TOKENS, p.page_size))
    return common.engine_config(p.page_size, pages, 1, numerics=p.numerics,
                                min_context=common.REAL_MODEL_CONTEXT)


@functools.cache
def _first_answers(p: Params) -> dict[str, list[list[int]]]:
    """The model's greedy turn-1 answers (token ids, end of turn included), per category:
    what turn 2's history holds. Runs every turn-1 prompt once (it also compiles the plain
    steps the points then time)."""
    model = common.real_model(p.model)
    engine = Engine(model.params, model.config, _engine_config(p), eos_tokens=model.stop_tokens)
    out = {}
    for category, questions in _questions(p).items():
        results = engine.generate([Request(_render(model, q, 1), p.new_tokens)
                                   for q in questions])
        out[category] = [r.tokens for r in results]
    return out


def _questions(p: Params) -> dict[str, list]:
    loaded = mtbench(p.categories)
    return {c: [q for q in loaded.conversations if q.category == c][:p.questions]
            for c in p.categories}


def _render(model, question, turn: int, answer: list[int] | None = None) -> list[int]:
    first, second = (text for _, text in question.turns[:2])
    messages = [{"role": "user", "content": first}]
    if turn == 2:
        while answer and answer[-1] in model.stop_tokens:  # the template ends the turn
            answer = answer[:-1]
        messages += [{"role": "assistant", "content": model.tokenizer.decode(answer)},
                     {"role": "user", "content": second}]
    return model.template.render(messages)


@functools.cache
def _verify_costs(p: Params) -> tuple[tuple[int, float], ...]:
    """A round's cost at each width adaptive trees choose from (the verify's, and an EAGLE
    head's drafting), measured once for the points of a run (every engine would measure
    them again) as an engine calibrates: its own target plan, batch 1, a 128-token context."""
    model = common.real_model(p.model)
    spec = SpecConfig(drafter=p.drafter, gamma=p.gamma, tree_nodes=p.tree_nodes,
                      branches=p.branches, adaptive=True)
    engine = Engine(model.params, model.config, _engine_config(p), spec=spec, draft=_head(p))
    target = engine.model  # its weights as the plan stores them
    engine.spec.calibrate(target.params, target.config, target.plan, 1, 128)
    return tuple(engine.spec.verify_costs.items())


@functools.cache
def _head(p: Params):
    """The EAGLE-style head `p.head` names, checked against the model (None: n-gram)."""
    if p.head is None:
        return None
    from kvjax.speculative.eagle_file import load_head

    model = common.real_model(p.model)
    return load_head(p.head, model.config, model.params)


def run(config) -> list[dict]:
    p = config.params
    model = common.real_model(p.model)
    answers = _first_answers(dataclasses.replace(p, turn=1))
    rows = []
    for category, questions in _questions(p).items():
        prompts = [_render(model, q, p.turn, a)
                   for q, a in zip(questions, answers[category], strict=True)]
        r = measure_point((model.params, model.config), _head(p), prompts, p.drafter, p.gamma,
                          p.adaptive, 0.0, 0.0, p.decode_steps, gen_tokens=p.new_tokens,
                          slots=1, reps=p.reps, base=_engine_config(p),
                          eos_tokens=model.stop_tokens, tree_nodes=p.tree_nodes,
                          branches=p.branches, rerank=p.rerank,
                          verify_costs=_verify_costs(p) if p.adaptive else None,
                          sampling=SamplingConfig(temperature=p.temperature, seed=config.seed)
                          if p.temperature > 0 else None)
        rows.append({"category": category, "prompts": r["prompts"],
                     "prompt_tokens": sum(map(len, prompts)),
                     "tokens_per_call": r["mean_accepted_length"], "alpha": r["alpha"],
                     "acceptance_rate": r["acceptance_rate"], "speedup": r["speedup"],
                     "decode_s": r["decode_s"], "plain_decode_s": r["plain_decode_s"],
                     "target_calls": r["target_calls"], "tree_nodes": p.tree_nodes,
                     "branches": p.branches, "adaptive": p.adaptive,
                     "tree_widths": r["tree_widths"],
                     "same_as_plain": r["same"] == r["prompts"], "model": p.model,
                     "drafter": p.drafter, "rerank": p.rerank, "temperature": p.temperature})
    return rows


TIMING = ("speedup", "decode_s", "plain_decode_s")

COLUMNS = [
    ("numerics", lambda r: r["numerics"]),
    ("turn", lambda r: str(r["turn"])),
    ("category", lambda r: r["category"]),
    ("questions", lambda r: str(r["prompts"])),
    ("tokens/call", lambda r: f"{r['tokens_per_call']:.2f}"),
    ("α", lambda r: "-" if r["alpha"] is None else f"{r['alpha']:.3f}"),  # trees: none
    common.SPEEDUP_COLUMN,
    ("greedy == plain", lambda r: "-" if _sampled(r) else "yes" if r["same_as_plain"]
     else "NO"),
]


def _sampled(row: dict) -> bool:
    return row.get("temperature", 0.0) > 0


def headline(rows: list[dict]) -> str:
    how = f"sampled at temperature {rows[0]['temperature']}" if _sampled(rows[0]) else "greedy"
    lines = [f"MT-Bench, {_drafter(rows[0])} ({_drafts(rows[0])}) on {rows[0]['model']}, "
             f"batch 1, {how}"]
    for numerics, turn in dict.fromkeys((r["numerics"], r["turn"]) for r in rows):
        rs = [r for r in rows if (r["numerics"], r["turn"]) == (numerics, turn)]
        best = max(rs, key=lambda r: r["tokens_per_call"])
        lines.append(f"- {numerics}, turn {turn}: tokens per call "
                     f"{_span(r['tokens_per_call'] for r in rs)} (best: {best['category']}), "
                     f"speedup {_span(r['speedup'] for r in rs)}x")
    if not _sampled(rows[0]):
        lines.append("- every answer's greedy tokens equal plain decoding's: "
                     f"{'yes' if all(r['same_as_plain'] for r in rows) else 'NO'}")
    return "\n".join(lines)


def _drafter(row: dict) -> str:
    return "EAGLE-style head" if row.get("drafter") == "eagle" else "n-gram drafter"


def _drafts(row: dict) -> str:
    """What a round drafted: a chain of γ, or a tree."""
    if row.get("tree_nodes") is None:
        return f"γ {row['gamma']}"
    per = "offers a level" if row.get("drafter") == "eagle" else "branches"
    return (f"{'adaptive ' if row.get('adaptive') else ''}trees of {row['tree_nodes']} "
            f"nodes, depth {row['gamma']}, {row['branches']} {per}")


def _span(values) -> str:
    values = sorted(values)
    low, high = f"{values[0]:.2f}", f"{values[-1]:.2f}"
    return low if low == high else f"{low}-{high}"


def plot(rows: list[dict], out) -> list:
    plt, fig, (ax1, ax2) = common.figure(10.0, 3.8, ncols=2)
    categories = list(dict.fromkeys(r["category"] for r in rows))
    series = list(dict.fromkeys((r["numerics"], r["turn"]) for r in rows))
    width = 0.8 / len(series)
    for i, (numerics, turn) in enumerate(series):
        by = {r["category"]: r for r in rows if (r["numerics"], r["turn"]) == (numerics, turn)}
        x = [k + (i - (len(series) - 1) / 2) * width for k in range(len(categories))]
        label = f"{numerics}, turn {turn}"
        ax1.bar(x, [by[c]["tokens_per_call"] if c in by else 0 for c in categories], width,
                label=label)
        ax2.bar(x, [by[c]["speedup"] if c in by else 0 for c in categories], width, label=label)
    for ax, name in ((ax1, "tokens per target call"), (ax2, "speedup over plain decoding")):
        ax.set_xticks(range(len(categories)), categories, rotation=45, fontsize=7, ha="right")
        ax.set_ylabel(name)
        ax.legend(fontsize=7)
    ax2.axhline(1.0, color="grey", linewidth=0.8)
    fig.suptitle(f"{_drafter(rows[0])} on MT-Bench ({rows[0]['model']}, {_drafts(rows[0])})",
                 fontsize=10)
    return [common.save(plt, fig, out, "mtbench_spec.png")]
