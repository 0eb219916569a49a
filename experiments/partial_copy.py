"""Partial-page copy off vs on: prompt tokens reused beyond whole pages, outputs unchanged.

Without it, a request reuses only the whole pages before its divergence from a cached
history; the matching tokens of the page it diverges in are recomputed. With it, the engine
copies that cached page into a fresh one and prefills from the first differing token. A
multi-turn conversation gains little: the page after the previous prompt's last full page
ends in decode-written tokens and was never cached. Each point runs one workload three
times on fresh engines: prefix cache off (the reference), partial copy off, partial copy
on; greedy tokens and every logit must equal the reference's bit for bit.
"""

from __future__ import annotations

import dataclasses

from experiments import common
from kvjax.engine.engine import Engine
from kvjax.lab import workloads

WORKLOADS = ("mid_page", "few_shot", "multi_turn")


@dataclasses.dataclass(frozen=True)
class Params:
    workload: str = "mid_page"
    page_size: int = 16
    model: str = "small"
    requests: int = 12
    shared_len: int = 301  # shared head; 301 ends inside a page for page sizes 4, 16, 64
    suffix_len: int = 40
    examples: int = 3
    example_len: int = 97
    conversations: int = 3  # multi_turn: conversations x turns over a shared_len system prompt
    turns: int = 3
    new_tokens: int = 8
    slots: int = 4
    capacity_tokens: int = 32768

    def __post_init__(self):
        common.check_choice(self, "workload", WORKLOADS)
        common.check_page_size(self)
        common.check_choice(self, "model", common.MODELS)
        common.check_positive(self, "requests", "shared_len", "suffix_len", "examples",
                              "example_len", "conversations", "turns", "new_tokens", "slots")


def _serve(engine, p: Params, vocab: int, seed: int) -> list:
    """Runs the workload on `engine`; returns the request results in order."""
    kw = {"return_logits": True}
    if p.workload == "mid_page":
        return engine.generate(workloads.mid_page_divergence(
            p.requests, p.shared_len, p.shared_len + p.suffix_len, vocab, p.new_tokens,
            seed=seed, **kw))
    if p.workload == "few_shot":
        return engine.generate(workloads.few_shot(
            p.requests, p.examples, p.example_len, p.suffix_len, vocab, p.new_tokens,
            seed=seed, **kw))
    convs = workloads.run_multi_turn(engine, p.conversations, p.turns, p.shared_len,
                                     p.suffix_len, vocab, p.new_tokens, seed=seed, **kw)
    return [r for c in convs for r in c.results]


def run(config) -> dict:
    p = config.params
    params, model = common.model(p.model, config.seed)
    runs = {}
    for name, kw in (("reference", {"prefix_cache": False}),
                     ("off", {"partial_page_copy": False}), ("on", {"partial_page_copy": True})):
        ec = common.engine_config(p.page_size, p.capacity_tokens // p.page_size, p.slots,
                                  mesh=config.mesh, **kw)
        engine = Engine(params, model, ec)
        results = _serve(engine, p, model.vocab_size, config.seed)
        runs[name] = (engine.metrics(), results)
    (m_off, r_off), (m_on, r_on) = runs["off"], runs["on"]
    ref = runs["reference"][1]
    tokens = {k: [r.tokens for r in rs] for k, (_, rs) in runs.items()}
    return {
        "prompt_tokens": m_on["prompt_tokens"],
        "reused_tokens_off": m_off["reused_tokens"], "reused_tokens_on": m_on["reused_tokens"],
        "token_reuse_rate_off": m_off["token_reuse_rate"],
        "token_reuse_rate_on": m_on["token_reuse_rate"],
        "tokens_gained": m_on["reused_tokens"] - m_off["reused_tokens"],
        "partial_copies": m_on["partial_copies"],
        "computed_tokens_off": m_off["computed_tokens"],
        "computed_tokens_on": m_on["computed_tokens"],
        "same_tokens": tokens["on"] == tokens["reference"] == tokens["off"],
        "max_logit_diff_on": common.max_abs_diff([r.logits for r in r_on],
                                                 [r.logits for r in ref]),
        "max_logit_diff_off": common.max_abs_diff([r.logits for r in r_off],
                                                  [r.logits for r in ref]),
        "prefill_off_s": m_off["prefill_s"], "prefill_on_s": m_on["prefill_s"],
    }


MESH = True  # its engines run on a device mesh when the config sets `mesh`

COLUMNS = [
    ("workload", lambda r: r["workload"]),
    ("page size", lambda r: str(r["page_size"])),
    ("reused off", lambda r: f"{r['token_reuse_rate_off']:.1%}"),
    ("reused on", lambda r: f"{r['token_reuse_rate_on']:.1%}"),
    ("tokens gained", lambda r: f"{r['tokens_gained']:,}"),
    ("page copies", lambda r: str(r["partial_copies"])),
    ("computed off / on", lambda r: f"{r['computed_tokens_off']:,} / "
                                    f"{r['computed_tokens_on']:,}"),
    ("outputs == cache off", lambda r: "yes" if r["same_tokens"] else "NO"),
    ("max abs Δlogit on / off", lambda r: f"{r['max_logit_diff_on']:.1g} / "
                                        f"{r['max_logit_diff_off']:.1g}"),
]


def headline(rows: list[dict]) -> str:
    best = max(rows, key=lambda r: r["tokens_gained"])
    exact = all(r["same_tokens"] and r["max_logit_diff_on"] == 0 and
                r["max_logit_diff_off"] == 0 for r in rows)
    return (f"Partial-page copy gains up to {best['tokens_gained']:,} reused tokens "
            f"({best['token_reuse_rate_off']:.1%} -> {best['token_reuse_rate_on']:.1%}, "
            f"{best['workload']}, page size {best['page_size']}); tokens and logits equal the "
            f"cache-off reference bit for bit at every point: {'yes' if exact else 'NO'}.")


def plot(rows: list[dict], out) -> list:
    plt, fig, ax = common.figure(7.0, 3.8)
    labels = [f"{r['workload']}\npage {r['page_size']}" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [100 * r["token_reuse_rate_off"] for r in rows], 0.4,
           label="partial copy off")
    ax.bar([i + 0.2 for i in x], [100 * r["token_reuse_rate_on"] for r in rows], 0.4,
           label="partial copy on")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("prompt tokens reused (%)")
    ax.set_title("Partial-page copy (outputs bitwise equal to the cache-off reference)",
                 fontsize=9)
    ax.legend(fontsize=8)
    return [common.save(plt, fig, out, "partial_copy.png")]
