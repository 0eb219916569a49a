"""Eviction under memory pressure: token hit rate vs the unbounded-cache ceiling, misses by cause.

Requests draw one of several shared prompts with Zipf popularity, each adding its own
suffix. The working set is every page those shared prompts fill; the cache gets `capacity`
times the working set plus the running batch's private pages (suffixes, generated tokens).
The engine's trie remembers evicted blocks, so it reports the reuse an unbounded cache
would have had (the ceiling) and attributes each miss to its cause: cold (first sight),
capacity (cached once, since evicted), divergence. Outputs must not depend on the cache
size (greedy tokens compared across the sweep, by digest). The trie evicts leaves only (a
page goes after every page continuing it), so any policy first drops request-private
suffix pages; the policy only orders the shared-prompt chains.
"""

from __future__ import annotations

import dataclasses

from experiments import common
from kvjax.cache.trie import EVICTION_POLICIES
from kvjax.config import ConfigError
from kvjax.decode.batching import pages_for
from kvjax.engine.engine import Engine
from kvjax.lab import workloads


@dataclasses.dataclass(frozen=True)
class Params:
    capacity: float = 0.5  # cache for shared prompts, as a fraction of the working set
    eviction: str = "lru"
    model: str = "small"
    requests: int = 64
    prompts: int = 8  # distinct shared prompts
    prompt_len: int = 256
    suffix_len: int = 16
    zipf: float = 1.0
    one_off: float = 0.0  # fraction of requests with a prompt seen once (a scan)
    new_tokens: int = 4
    slots: int = 4
    page_size: int = 16

    def __post_init__(self):
        if not 0 < self.capacity <= 4:
            raise ConfigError("capacity", f"must be in (0, 4], got {self.capacity}")
        common.check_choice(self, "eviction", EVICTION_POLICIES)
        common.check_choice(self, "model", common.MODELS)
        common.check_positive(self, "requests", "prompts", "prompt_len", "suffix_len",
                              "new_tokens", "slots", "page_size")
        if self.zipf < 0:
            raise ConfigError("zipf", f"must be >= 0, got {self.zipf}")
        if not 0 <= self.one_off < 1:
            raise ConfigError("one_off", f"must be in [0, 1), got {self.one_off}")


def pool_pages(p: Params) -> tuple[int, int, int]:
    """(pages in the cache, working-set pages, private pages of the running batch).

    The shared part of the cache is `capacity` x the working set, but at least one
    prompt's pages (a request must fit); the running requests' own pages (suffix and
    generated tokens) come on top.
    """
    shared = p.prompt_len // p.page_size
    working = p.prompts * shared
    private = p.slots * (pages_for(p.prompt_len + p.suffix_len + p.new_tokens, p.page_size)
                         - shared)
    return private + max(shared, round(p.capacity * working)), working, private


def workload(p: Params, vocab: int, seed: int) -> list:
    """The requests: shared prompts with Zipf popularity, each with its own suffix."""
    return workloads.popular_prompts(p.requests, p.prompts, p.prompt_len, p.suffix_len, vocab,
                                     p.zipf, p.new_tokens, seed=seed, one_off=p.one_off)


def run(config) -> dict:
    p = config.params
    params, model = common.model(p.model, config.seed)
    requests = workload(p, model.vocab_size, config.seed)
    num_pages, working, running = pool_pages(p)
    ec = common.engine_config(p.page_size, num_pages, p.slots, eviction=p.eviction,
                              mesh=config.mesh)
    engine = Engine(params, model, ec)
    results = engine.generate(requests)
    m = engine.metrics()
    causes = m["misses_by_cause"]
    return {
        "num_pages": num_pages, "working_set_pages": working, "running_pages": running,
        "token_reuse_rate": m["token_reuse_rate"],
        "ceiling_token_reuse_rate": m["unbounded_token_reuse_rate"],
        "fraction_of_ceiling": m["token_reuse_rate"] / max(m["unbounded_token_reuse_rate"],
                                                           1e-12),
        "request_hit_rate": m["request_hit_rate"],
        "ceiling_request_hit_rate": m["unbounded_request_hit_rate"],
        "misses_cold": causes.get("cold", 0), "misses_capacity": causes.get("capacity", 0),
        "misses_divergence": causes.get("divergence", 0),
        "misses_other": sum(v for k, v in causes.items()
                            if k not in ("cold", "capacity", "divergence")),
        "evictions": m["evictions"], "preemptions": m["preemptions"],
        "computed_tokens": m["computed_tokens"], "prefill_s": m["prefill_s"],
        "tokens_digest": common.tokens_digest([r.tokens for r in results]),
    }


MESH = True  # its engines run on a device mesh when the config sets `mesh`

COLUMNS = [
    ("policy", lambda r: r["eviction"]),
    ("one-off prompts", lambda r: f"{r['one_off']:.0%}"),
    common.CAPACITY_COLUMN,
    ("token hit rate", lambda r: f"{r['token_reuse_rate']:.1%}"),
    ("ceiling", lambda r: f"{r['ceiling_token_reuse_rate']:.1%}"),
    ("of ceiling", lambda r: f"{r['fraction_of_ceiling']:.1%}"),
    ("misses cold / capacity / divergence",
     lambda r: f"{r['misses_cold']} / {r['misses_capacity']} / {r['misses_divergence']}"),
    ("evictions", lambda r: f"{r['evictions']:,}"),
    ("computed tokens", lambda r: f"{r['computed_tokens']:,}"),
    common.OUTPUTS_COLUMN,
]


def headline(rows: list[dict]) -> str:
    lines = []
    for one_off in sorted({r["one_off"] for r in rows}):
        for cap in sorted({r["capacity"] for r in rows}):
            rs = sorted((r for r in rows if r["capacity"] == cap and r["one_off"] == one_off),
                        key=lambda r: -r["token_reuse_rate"])
            lines.append(f"- {one_off:.0%} one-off prompts, cache at {cap:.0%} of the working "
                         f"set: " + ", ".join(f"{r['eviction']} {r['fraction_of_ceiling']:.0%}"
                                            for r in rs) + " of the unbounded ceiling")
    same = all(len({r["tokens_digest"] for r in rows if r["one_off"] == o}) == 1
               for o in {r["one_off"] for r in rows})
    lines.append(f"- outputs identical at every cache size and policy: "
                 f"{'yes' if same else 'NO'}")
    return "\n".join(lines)


def plot(rows: list[dict], out) -> list:
    plt, fig, (ax1, ax2) = common.figure(10.0, 3.8, ncols=2)
    caps = sorted({r["capacity"] for r in rows})
    policies = list(dict.fromkeys(r["eviction"] for r in rows))
    one_offs = sorted({r["one_off"] for r in rows})
    for i, policy in enumerate(policies):
        for one_off, style in zip(one_offs, ("o-", "s--", "^:", "v-."), strict=False):
            rs = sorted((r for r in rows if r["eviction"] == policy and r["one_off"] == one_off),
                        key=lambda r: r["capacity"])
            ax1.plot([100 * r["capacity"] for r in rs],
                     [100 * r["fraction_of_ceiling"] for r in rs], style, color=f"C{i}",
                     label=f"{policy}, {one_off:.0%} one-off")
    ax1.set_xlabel("cache for shared prompts (% of working set)")
    ax1.set_ylabel("token hit rate (% of unbounded ceiling)")
    ax1.set_xticks([100 * c for c in caps])
    ax1.legend(fontsize=7)
    scan = [r for r in rows if r["one_off"] == one_offs[-1]]
    width = 0.8 / max(len(policies), 1)
    for i, policy in enumerate(policies):
        rs = sorted((r for r in scan if r["eviction"] == policy), key=lambda r: r["capacity"])
        x = [j + i * width for j in range(len(rs))]
        ax2.bar(x, [r["misses_cold"] for r in rs], width, color="tab:gray",
                label="cold" if i == 0 else None)
        ax2.bar(x, [r["misses_capacity"] for r in rs], width,
                bottom=[r["misses_cold"] for r in rs], color=f"C{i}",
                label=f"capacity ({policy})")
    ax2.set_xticks([j + width * (len(policies) - 1) / 2 for j in range(len(caps))],
                   [f"{c:.0%}" for c in caps])
    ax2.set_xlabel("cache for shared prompts (% of working set)")
    ax2.set_ylabel(f"requests missing, by cause ({one_offs[-1]:.0%} one-off)")
    ax2.legend(fontsize=7)
    fig.suptitle("Eviction under memory pressure", fontsize=10)
    return [common.save(plt, fig, out, "eviction.png")]
