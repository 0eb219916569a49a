"""A real chat model (SmolLM2-135M-Instruct): multi-turn reuse with miss causes, n-gram speculation.

The quickstart's tour on a real pretrained checkpoint (`kvjax.models`). Part "chat": a
conversation rendered with the model's own chat template, each turn greedy until the
model's end of turn; each turn reports the prompt tokens it reused (the previous turns'
prompts *and answers*: every full page), why the rest was not reused, and whether its logits
equal a prefix-cache-off engine's, bitwise. Part "spec": the n-gram drafter against plain
decoding on a prompt the answer copies from (speedup, tokens per target call, greedy tokens
unchanged).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from experiments import common
from kvjax import models
from kvjax.config import ConfigError
from kvjax.engine.engine import Engine
from kvjax.engine.requests import Request
from kvjax.speculative.operating_point import measure_point

CODE = ("def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
        "    return total / len(values)\n")


@dataclasses.dataclass(frozen=True)
class Params:
    part: str = "chat"
    model: str = "smollm2-135m-instruct"
    system: str = ""  # "": the template's own (SmolLM2's names the model)
    turns: tuple[str, ...] = ("What is the capital of France?", "And of Germany?",
                              "Which of the two cities is larger?")
    new_tokens: int = 48  # at most, per turn (a turn ends at the model's end of turn)
    page_size: int = 16
    spec_tokens: int = 96
    gamma: int = 4

    def __post_init__(self):
        common.check_choice(self, "part", ("chat", "spec"))
        common.check_positive(self, "new_tokens", "page_size", "spec_tokens", "gamma")
        if self.model not in models.MODELS:
            raise ConfigError("model", f"unknown model {self.model!r} (known: "
                              f"{', '.join(sorted(models.MODELS))})")


def run(config) -> list[dict]:
    p = config.params
    model = common.real_model(p.model)
    if p.part == "chat":
        return _chat(p, model)
    return _spec(p, model)


def _chat(p: Params, model) -> list[dict]:
    ec = common.engine_config(p.page_size, 256, 1, min_context=common.REAL_MODEL_CONTEXT)
    engine = Engine(model.params, model.config, ec, eos_tokens=model.stop_tokens)
    off = Engine(model.params, model.config, dataclasses.replace(ec, prefix_cache=False),
                 eos_tokens=model.stop_tokens)
    messages = [{"role": "system", "content": p.system}] if p.system else []
    rows, history = [], 0
    end = model.tokenizer.decode([model.stop_tokens[0]])  # the end-of-turn text
    for k, question in enumerate(p.turns, 1):
        messages.append({"role": "user", "content": question})
        ids = model.template.render(messages)
        request = Request(ids, p.new_tokens, return_logits=True)
        (result,) = engine.generate([request])
        (reference,) = off.generate([request])
        answer = model.tokenizer.decode(result.tokens)
        s = result.stats
        rows.append({
            "case": f"turn {k}: {question}", "prompt_tokens": s["prompt_tokens"],
            "reused_tokens": s["reused_tokens"],
            # every full page of the conversation so far (previous prompt and answer)
            "ideal_reused": history // p.page_size * p.page_size,
            "miss_cause": s["miss_cause"] or "-", "miss_fields": s["miss_fields"],
            "same_as_cache_off": result.tokens == reference.tokens and np.array_equal(
                np.asarray(result.logits), np.asarray(reference.logits)),
            "stopped_at_end_of_turn": bool(result.tokens)
            and result.tokens[-1] in model.stop_tokens,
            "ttft_s": s["ttft_s"], "answer": answer, "model": p.model})
        history = len(ids) + len(result.tokens) - 1  # the last token is never cached
        messages.append({"role": "assistant", "content": answer.removesuffix(end)})
    return rows


def _spec(p: Params, model) -> list[dict]:
    # the 135M model copies the function and then repeats its docstring: text the n-gram
    # drafter finds in what came before
    ids = model.template.render([{"role": "user", "content": "Copy this function and add a "
                                  f"docstring:\n{CODE}"}])
    r = measure_point((model.params, model.config), None, [ids], "ngram", p.gamma, False, 0.0,
                      0.0, 16, gen_tokens=p.spec_tokens, slots=1, reps=1)
    return [{"case": f"n-gram drafter, γ {p.gamma}", "speedup": r["speedup"],
             "alpha": r["alpha"], "tokens_per_call": r["mean_accepted_length"],
             "same_as_plain": r["same"] == r["prompts"], "decode_s": r["decode_s"],
             "plain_decode_s": r["plain_decode_s"], "model": p.model}]


TIMING = ("speedup",)

COLUMNS = [
    ("case", lambda r: r["case"]),
    ("reused / prompt tokens (ideal)", lambda r: f"{r['reused_tokens']} / "
     f"{r['prompt_tokens']} ({r['ideal_reused']})" if "prompt_tokens" in r else "-"),
    ("why not more", lambda r: r.get("miss_cause", "-")),
    ("answer", lambda r: r["answer"].replace("\n", " ")[:60] if "answer" in r else "-"),
    common.SPEEDUP_COLUMN,
    common.CALLS_COLUMN,
    common.REFERENCE_COLUMN,
]


def headline(rows: list[dict]) -> str:
    chat = [r for r in rows if "reused_tokens" in r]
    spec = [r for r in rows if "speedup" in r]
    lines = [f"Model: {rows[0]['model']}"]
    if chat:
        reused = sum(r["reused_tokens"] for r in chat)
        ideal = sum(r["ideal_reused"] for r in chat)
        lines.append(f"- chat: {reused:,} prompt tokens reused of {ideal:,} reusable (every "
                     f"full page of the earlier turns); every turn's logits equal the "
                     f"cache-off engine's, bitwise: "
                     f"{'yes' if all(r['same_as_cache_off'] for r in chat) else 'NO'}; "
                     f"answers stop at the end of turn: "
                     f"{'yes' if all(r['stopped_at_end_of_turn'] for r in chat) else 'NO'}")
    lines += [common.spec_line(r) for r in spec]
    return "\n".join(lines)


def plot(rows: list[dict], out) -> list:
    chat = [r for r in rows if "reused_tokens" in r]
    plt, fig, ax = common.figure(7.0, 3.6)
    y = list(range(len(chat)))[::-1]
    ax.barh(y, [r["reused_tokens"] for r in chat], color="tab:green", label="reused")
    ax.barh(y, [r["prompt_tokens"] - r["reused_tokens"] for r in chat],
            left=[r["reused_tokens"] for r in chat], color="tab:gray", label="computed")
    ax.set_yticks(y, [r["case"][:40] for r in chat], fontsize=7)
    ax.set_xlabel("prompt tokens")
    ax.legend(fontsize=7)
    ax.set_title(f"{rows[0]['model']}: multi-turn prefix reuse", fontsize=9)
    return [common.save(plt, fig, out, "chat.png")]
