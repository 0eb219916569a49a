"""The quickstart tour: prefix reuse with miss causes, then speculative decoding, on trained models.

Uses the trained target/draft pair if `scripts/train` made it; otherwise trains both at a
short setting first (about a minute and a half on two CPU cores; weaker models, same code).
Part "prefix": requests sharing a system prompt, a follow-up turn, tenants, a position
shift and a cache too small for two prompts, each with the tokens it reused and why the
rest was not reused; every output is compared with a prefix-cache-off engine. Part "spec":
plain decoding vs the model drafter and the n-gram drafter on held-out prompts (speedup,
acceptance, and the check that greedy tokens are unchanged).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from experiments import common
from kvjax.decode.batching import pages_for
from kvjax.engine.engine import Engine
from kvjax.engine.requests import Request
from kvjax.io.tokenizer import ByteTokenizer
from kvjax.speculative.operating_point import held_out_prompts, measure_point
from kvjax.train.loop import is_trained, trained

SYSTEM = ("You are the kvjax tour guide. A KV-cache entry is the state a specific computation "
          "produced for a specific token history. Reusing it is valid only when the new "
          "request would reproduce that exact computation: same token ids, same positions, "
          "same weights, same adapter, same attention structure, same cache dtype. Answer "
          "in Python.\n")
QUESTIONS = ("def fibonacci(n):\n", "class LRUCache:\n", "import os\n\ndef walk(root):\n")


@dataclasses.dataclass(frozen=True)
class Params:
    part: str = "prefix"
    use_trained: bool = True  # use the pair scripts/train made, when it exists
    target_dir: str = "checkpoints/target"
    draft_dir: str = "checkpoints/draft"
    short_dir: str = "checkpoints/tour"  # otherwise a short-setting pair is trained here
    target_train: str = "configs/train_target.toml"
    draft_train: str = "configs/train_draft.toml"
    target_set: tuple[str, ...] = ("train.steps=80", "train.batch_size=8", "train.seq_len=128",
                                   "train.warmup_steps=8", "train.eval_every=80",
                                   "train.eval_batches=2", "train.checkpoint_every=80")
    draft_set: tuple[str, ...] = ("train.steps=200", "train.batch_size=8",
                                  "train.seq_len=128", "train.warmup_steps=20",
                                  "train.eval_every=200", "train.eval_batches=2",
                                  "train.checkpoint_every=200")
    new_tokens: int = 24
    spec_prompts: int = 2
    spec_prompt_len: int = 256
    spec_tokens: int = 64
    gamma: int = 4

    def __post_init__(self):
        common.check_choice(self, "part", ("prefix", "spec"))
        common.check_positive(self, "new_tokens", "spec_prompts", "spec_prompt_len",
                              "spec_tokens", "gamma")
        common.check_files(self, "target_train", "draft_train")


def models(p: Params):
    """(target, draft, where): the full pair if its training finished, else the short pair
    (trained now, or finished if interrupted)."""
    full = p.use_trained and is_trained(p.target_train, p.target_dir) and is_trained(
        p.draft_train, p.draft_dir)
    if full:
        return (trained(p.target_train, p.target_dir), trained(p.draft_train, p.draft_dir),
                p.target_dir)
    short = Path(p.short_dir)
    return (trained(p.target_train, str(short / "target"), p.target_set),
            trained(p.draft_train, str(short / "draft"), p.draft_set), str(short))


def run(config) -> list[dict]:
    p = config.params
    target, draft, where = models(p)
    if p.part == "prefix":
        return _prefix(p, target, where)
    return _spec(p, config.seed, target, draft, where)


def _prefix(p: Params, target, where: str) -> list[dict]:
    """Scenes of prefix reuse on one engine (and a small one for capacity)."""
    tok = ByteTokenizer()
    system = tok.encode(SYSTEM)
    q = [tok.encode(text) for text in QUESTIONS]
    ec = common.engine_config(16, 512, 4)
    scenes = [
        ("first request (cold)", Request(system + q[0], p.new_tokens)),
        ("same system prompt, new question", Request(system + q[1], p.new_tokens)),
        ("tenant acme, salted", Request(system + q[2], p.new_tokens, tenant="acme")),
        ("tenant acme, system prompt public",
         Request(system + q[2], p.new_tokens, tenant="acme", public_prefix=len(system))),
        ("same prompt at position 32", Request(system + q[1], p.new_tokens, position_base=32)),
    ]
    engine = Engine(*target, ec, tokenizer=tok)
    off = Engine(*target, dataclasses.replace(ec, prefix_cache=False), tokenizer=tok)
    rows = [_scene(name, engine, off, r) for name, r in scenes]
    first = engine.generate([scenes[0][1]])  # again, to continue the conversation
    follow = Request(system + q[0] + first[0].tokens + tok.encode("\n# and memoized:\n"),
                     p.new_tokens)
    rows.append(_scene("follow-up turn (prompt + answer + more)", engine, off, follow))
    # A pool that holds one prompt and its answer, and 4 pages more: A, B, A.
    small = common.engine_config(16, pages_for(len(system + q[0]) + p.new_tokens, 16) + 4, 1)
    tight = Engine(*target, small, tokenizer=tok)
    other = tok.encode(SYSTEM.upper())
    for name, tokens in (("small cache: prompt A", system + q[0]),
                         ("small cache: prompt B (evicts A)", other + q[0]),
                         ("small cache: prompt A again", system + q[0])):
        rows.append(_scene(name, tight, off, Request(tokens, p.new_tokens)))
    for row in rows:
        row["models"] = where
    return rows


def _scene(name: str, engine: Engine, off: Engine, request: Request) -> dict:
    (result,) = engine.generate([request])
    (reference,) = off.generate([request])
    s = result.stats
    text = ByteTokenizer().decode(result.tokens)
    return {"case": name, "prompt_tokens": s["prompt_tokens"],
            "reused_tokens": s["reused_tokens"], "miss_cause": s["miss_cause"] or "-",
            "miss_fields": s["miss_fields"], "same_as_cache_off": result.tokens ==
            reference.tokens, "ttft_s": s["ttft_s"], "text": text}


def _spec(p: Params, seed: int, target, draft, where: str) -> list[dict]:
    prompts = held_out_prompts(p.spec_prompts, p.spec_prompt_len, seed=seed)
    rows = []
    for drafter, gamma in (("model", p.gamma), ("ngram", max(1, p.gamma // 2))):
        r = measure_point(target, draft, prompts, drafter, gamma, False, 0.0, 0.0,
                          p.spec_tokens, gen_tokens=p.spec_tokens, slots=1, reps=1)
        rows.append({"case": f"{drafter} drafter, γ {gamma}", "speedup": r["speedup"],
                     "alpha": r["alpha"], "tokens_per_call": r["mean_accepted_length"],
                     "same_as_plain": r["same"] == r["prompts"], "models": where,
                     "decode_s": r["decode_s"], "plain_decode_s": r["plain_decode_s"]})
    return rows


TIMING = ("speedup",)

COLUMNS = [
    ("case", lambda r: r["case"]),
    ("reused / prompt tokens", lambda r: f"{r['reused_tokens']} / {r['prompt_tokens']}"
     if "prompt_tokens" in r else "-"),
    ("why not more", lambda r: (r["miss_cause"] + (f" ({', '.join(r['miss_fields'])})"
                                                   if r["miss_fields"] else ""))
     if "miss_cause" in r else "-"),
    common.SPEEDUP_COLUMN,
    ("α", lambda r: f"{r['alpha']:.2f}" if "alpha" in r else "-"),
    common.CALLS_COLUMN,
    common.REFERENCE_COLUMN,
]


def headline(rows: list[dict]) -> str:
    prefix = [r for r in rows if "reused_tokens" in r]
    spec = [r for r in rows if "speedup" in r]
    lines = [f"Models: {rows[0]['models']}"]
    if prefix:
        reused = sum(r["reused_tokens"] for r in prefix)
        total = sum(r["prompt_tokens"] for r in prefix)
        exact = all(r["same_as_cache_off"] for r in prefix)
        lines.append(f"- prefix cache: {reused:,} of {total:,} prompt tokens reused; every "
                     f"output equals the cache-off engine's: {'yes' if exact else 'NO'}")
    lines += [common.spec_line(r) for r in spec]
    return "\n".join(lines)


def plot(rows: list[dict], out) -> list:
    prefix = [r for r in rows if "reused_tokens" in r]
    spec = [r for r in rows if "speedup" in r]
    plt, fig, (ax1, ax2) = common.figure(11.0, 4.2, ncols=2)
    if prefix:
        y = list(range(len(prefix)))[::-1]
        ax1.barh(y, [r["reused_tokens"] for r in prefix], color="tab:green", label="reused")
        ax1.barh(y, [r["prompt_tokens"] - r["reused_tokens"] for r in prefix],
                 left=[r["reused_tokens"] for r in prefix], color="tab:gray",
                 label="computed")
        ax1.set_yticks(y, [f"{r['case']} [{r['miss_cause']}]" for r in prefix], fontsize=7)
        ax1.set_xlabel("prompt tokens")
        ax1.legend(fontsize=7)
        ax1.set_title("Prefix reuse, and why the rest was not reused", fontsize=9)
    if spec:
        ax2.bar(["plain"] + [r["case"] for r in spec], [1.0] + [r["speedup"] for r in spec],
                color=["tab:gray"] + ["tab:blue"] * len(spec))
        ax2.set_ylabel("decode speedup")
        ax2.set_title("Speculative decoding (greedy tokens unchanged)", fontsize=9)
        ax2.tick_params(axis="x", labelsize=8)
    return [common.save(plt, fig, out, "tour.png")]
