"""Prefix reuse vs page size: reused tokens, page reuse, prefill time and memory per workload.

Only whole pages are shared, so a smaller page reuses more of a shared prefix (up to the
last full page before the divergence) but costs a longer page table and more gather work
per attention block. Each point runs one workload through the engine with the prefix cache
on. The prefill chunk and attention block are the same number of tokens at every page size,
so the generated tokens must be identical across page sizes (checked by digest).
"""

from __future__ import annotations

import dataclasses

from experiments import common
from kvjax.engine.engine import Engine
from kvjax.lab import workloads
from kvjax.memory.calculator import human_bytes

WORKLOADS = ("system_prompt", "multi_turn", "few_shot")


@dataclasses.dataclass(frozen=True)
class Params:
    workload: str = "system_prompt"
    page_size: int = 16
    model: str = "small"
    requests: int = 16  # system prompt and few-shot requests
    system_len: int = 500  # shared system prompt (not a multiple of any page size > 4)
    suffix_len: int = 32  # each request's own tokens
    conversations: int = 4
    turns: int = 4
    turn_system_len: int = 200
    user_len: int = 24
    examples: int = 4
    example_len: int = 100
    new_tokens: int = 8
    slots: int = 8
    capacity_tokens: int = 65536  # cache size in tokens (unbounded for these workloads)

    def __post_init__(self):
        common.check_choice(self, "workload", WORKLOADS)
        common.check_page_size(self)
        common.check_choice(self, "model", common.MODELS)
        common.check_positive(self, "requests", "system_len", "suffix_len", "conversations",
                              "turns", "new_tokens", "slots", "examples", "example_len",
                              "user_len")


def run_workload(engine, p: Params, vocab: int, seed: int) -> list:
    """Runs the workload `p.workload` on `engine`; returns the request results."""
    if p.workload == "system_prompt":
        return engine.generate(workloads.shared_system_prompt(
            p.requests, p.system_len, p.suffix_len, vocab, p.new_tokens, seed=seed))
    if p.workload == "few_shot":
        return engine.generate(workloads.few_shot(
            p.requests, p.examples, p.example_len, p.suffix_len, vocab, p.new_tokens,
            seed=seed))
    convs = workloads.run_multi_turn(engine, p.conversations, p.turns, p.turn_system_len,
                                     p.user_len, vocab, p.new_tokens, seed=seed)
    return [r for c in convs for r in c.results]


def run(config) -> dict:
    p = config.params
    params, model = common.model(p.model, config.seed)
    ec = common.engine_config(p.page_size, p.capacity_tokens // p.page_size, p.slots,
                              mesh=config.mesh)
    run_workload(Engine(params, model, ec), p, model.vocab_size, config.seed)  # compiles
    engine = Engine(params, model, ec)
    results = run_workload(engine, p, model.vocab_size, config.seed)
    m = engine.metrics()
    return {
        "prompt_tokens": m["prompt_tokens"], "reused_tokens": m["reused_tokens"],
        "computed_tokens": m["computed_tokens"], "token_reuse_rate": m["token_reuse_rate"],
        "page_reuse_rate": m["page_reuse_rate"], "resident_pages": m["resident_pages"],
        "resident_bytes": m["resident_bytes"],
        "kv_bytes_per_reused_token": m["resident_bytes"] / max(m["reused_tokens"], 1),
        "prefill_s": m["prefill_s"], "mean_ttft_s": m["mean_ttft_s"], "host_s": m["host_s"],
        "prefill_tokens_per_s": m["computed_tokens"] / max(m["prefill_s"], 1e-9),
        "misses_by_cause": m["misses_by_cause"],
        "tokens_digest": common.tokens_digest([r.tokens for r in results]),
    }


MESH = True  # its engines run on a device mesh when the config sets `mesh`

COLUMNS = [
    ("workload", lambda r: r["workload"]),
    ("page size", lambda r: str(r["page_size"])),
    ("reused tokens", lambda r: f"{r['token_reuse_rate']:.1%}"),
    ("page reuse", lambda r: f"{r['page_reuse_rate']:.1%}"),
    ("computed tokens", lambda r: f"{r['computed_tokens']:,}"),
    ("prefill s", lambda r: f"{r['prefill_s']:.2f}"),
    ("mean TTFT s", lambda r: f"{r['mean_ttft_s']:.3f}"),
    ("cached KV", lambda r: human_bytes(r["resident_bytes"])),
    common.OUTPUTS_COLUMN,
]


def headline(rows: list[dict]) -> str:
    lines = []
    for w in dict.fromkeys(r["workload"] for r in rows):
        rs = [r for r in rows if r["workload"] == w]
        lo, hi = min(rs, key=lambda r: r["page_size"]), max(rs, key=lambda r: r["page_size"])
        same = len({r["tokens_digest"] for r in rs}) == 1
        lines.append(f"- {w}: page size {lo['page_size']} reuses "
                     f"{lo['token_reuse_rate']:.1%} of prompt tokens, page size "
                     f"{hi['page_size']} {hi['token_reuse_rate']:.1%}; prefill "
                     f"{lo['prefill_s']:.2f} s vs {hi['prefill_s']:.2f} s; outputs "
                     f"{'identical' if same else 'DIFFER'} across page sizes")
    return "\n".join(lines)


def plot(rows: list[dict], out) -> list:
    plt, fig, (ax1, ax2, ax3) = common.figure(11.0, 3.5, ncols=3)
    sizes = sorted({r["page_size"] for r in rows})
    for w in dict.fromkeys(r["workload"] for r in rows):
        rs = sorted((r for r in rows if r["workload"] == w), key=lambda r: r["page_size"])
        x = [r["page_size"] for r in rs]
        ax1.plot(x, [100 * r["token_reuse_rate"] for r in rs], "o-", label=w)
        ax2.plot(x, [r["prefill_s"] for r in rs], "o-", label=w)
        ax3.plot(x, [r["resident_bytes"] / 2**20 for r in rs], "o-", label=w)
    for ax in (ax1, ax2, ax3):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set_xlabel("page size (tokens)")
    ax1.set_ylabel("prompt tokens reused (%)")
    ax2.set_ylabel("total prefill time (s)")
    ax3.set_ylabel("cached prefix KV at the end (MiB)")
    ax1.legend(fontsize=8)
    fig.suptitle("Prefix reuse vs page size", fontsize=10)
    return [common.save(plt, fig, out, "prefix_page_size.png")]

