"""Scheduling: first-come-first-served vs longest-prefix-match first, reuse and mean TTFT.

All requests arrive at once, drawn from a few shared prompts in random order, more than
the batch holds. FCFS admits them in arrival order; LPM admits first the waiting request
whose prompt has the longest cached prefix, so requests that can reuse are served while
their prefix is resident, and cheap prefills go first. With a small cache, FCFS also
evicts prefixes that the next arrivals need. Per request outputs do not depend on the
order (greedy tokens compared by digest, in submission order).
"""

from __future__ import annotations

import dataclasses

from experiments import common
from experiments.eviction import Params as _EvictionParams
from experiments.eviction import pool_pages, workload
from kvjax.engine.engine import Engine


@dataclasses.dataclass(frozen=True)
class Params:
    schedule: str = "fcfs"
    capacity: float = 1.0  # cache for shared prompts, as a fraction of their pages
    model: str = "small"
    requests: int = 48
    prompts: int = 6
    prompt_len: int = 384
    suffix_len: int = 16
    zipf: float = 0.5
    new_tokens: int = 8
    slots: int = 8
    page_size: int = 16

    def __post_init__(self):
        common.check_choice(self, "schedule", ("fcfs", "lpm"))
        _as_eviction(self)  # the shared fields' checks


def _as_eviction(p: Params) -> _EvictionParams:
    """The eviction experiment's parameters for the same workload and cache (LRU)."""
    return _EvictionParams(**{f.name: getattr(p, f.name) for f in dataclasses.fields(p)
                              if f.name != "schedule"})


def run(config) -> dict:
    p = config.params
    params, model = common.model(p.model, config.seed)
    same = _as_eviction(p)
    requests = workload(same, model.vocab_size, config.seed)
    num_pages, _, _ = pool_pages(same)
    ec = common.engine_config(p.page_size, num_pages, p.slots, schedule=p.schedule,
                              mesh=config.mesh)
    Engine(params, model, ec).generate(requests[: p.slots])  # compiles the shapes
    engine = Engine(params, model, ec)
    results = engine.generate(requests)
    m = engine.metrics()
    ttft = sorted(r.stats["ttft_s"] for r in results)
    return {
        "num_pages": num_pages, "token_reuse_rate": m["token_reuse_rate"],
        "request_hit_rate": m["request_hit_rate"], "computed_tokens": m["computed_tokens"],
        "evictions": m["evictions"], "misses_by_cause": m["misses_by_cause"],
        "mean_ttft_s": m["mean_ttft_s"], "p90_ttft_s": ttft[int(0.9 * (len(ttft) - 1))],
        "prefill_s": m["prefill_s"], "host_s": m["host_s"],
        "tokens_digest": common.tokens_digest([r.tokens for r in results]),
    }


MESH = True  # its engines run on a device mesh when the config sets `mesh`

COLUMNS = [
    ("schedule", lambda r: r["schedule"]),
    common.CAPACITY_COLUMN,
    ("token reuse", lambda r: f"{r['token_reuse_rate']:.1%}"),
    ("computed tokens", lambda r: f"{r['computed_tokens']:,}"),
    ("evictions", lambda r: f"{r['evictions']:,}"),
    ("mean TTFT s", lambda r: f"{r['mean_ttft_s']:.3f}"),
    ("p90 TTFT s", lambda r: f"{r['p90_ttft_s']:.3f}"),
    ("prefill s", lambda r: f"{r['prefill_s']:.2f}"),
    common.OUTPUTS_COLUMN,
]


def headline(rows: list[dict]) -> str:
    lines = []
    for cap in sorted({r["capacity"] for r in rows}):
        by = {r["schedule"]: r for r in rows if r["capacity"] == cap}
        if {"fcfs", "lpm"} <= by.keys():
            f, g = by["fcfs"], by["lpm"]
            lines.append(f"- cache {cap:.0%}: reuse FCFS {f['token_reuse_rate']:.1%} vs LPM "
                         f"{g['token_reuse_rate']:.1%}; mean TTFT FCFS {f['mean_ttft_s']:.3f} s "
                         f"vs LPM {g['mean_ttft_s']:.3f} s "
                         f"({g['mean_ttft_s'] / max(f['mean_ttft_s'], 1e-12):.2f}x)")
    same = len({r["tokens_digest"] for r in rows}) == 1
    lines.append(f"- outputs identical under both schedules: {'yes' if same else 'NO'}")
    return "\n".join(lines)


def plot(rows: list[dict], out) -> list:
    plt, fig, (ax1, ax2) = common.figure(9.0, 3.6, ncols=2)
    caps = sorted({r["capacity"] for r in rows})
    for i, schedule in enumerate(("fcfs", "lpm")):
        rs = sorted((r for r in rows if r["schedule"] == schedule), key=lambda r: r["capacity"])
        if not rs:
            continue
        x = [j + (i - 0.5) * 0.4 for j in range(len(rs))]
        ax1.bar(x, [100 * r["token_reuse_rate"] for r in rs], 0.4, label=schedule)
        ax2.bar(x, [r["mean_ttft_s"] for r in rs], 0.4, label=schedule)
    for ax in (ax1, ax2):
        ax.set_xticks(range(len(caps)), [f"cache {c:.0%}" for c in caps])
        ax.legend(fontsize=8)
    ax1.set_ylabel("prompt tokens reused (%)")
    ax2.set_ylabel("mean time to first token (s)")
    fig.suptitle("Scheduling: first-come-first-served vs longest prefix match", fontsize=10)
    return [common.save(plt, fig, out, "scheduling.png")]
