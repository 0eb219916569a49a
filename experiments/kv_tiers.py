"""Tiers below the device pool: reuse against the unbounded ceiling when the device cache
holds a quarter or half of the working set, with host memory and disk tiers beside it.

The eviction experiment's workload (shared prompts with Zipf popularity, each with its own
suffix; `kvjax.lab.workloads.popular_prompts`) on a cache whose shared part is `capacity`
times the working set (`experiments.eviction.pool_pages`), with evicted pages kept in
`tiers`: none, host memory (`host_capacity` x the working set's bytes), or host memory over
a disk folder (`disk_capacity` x). Page formats float32 and int8. With `restart`, the
first half of the requests runs in one engine and the second half in a new one (its host
tier empty, its disk tier the folder the first one wrote): a restart.

Reported: token reuse against the unbounded ceiling (every page an unbounded device cache
would hold), reuse by tier (device, host, disk), restore seconds, prefill seconds, and
whether every answer (tokens and logits) equals a cache-off engine's with the same page
format, bitwise; int8 rows also give their largest logit difference from float32 pages.
"""

from __future__ import annotations

import dataclasses
import functools
import shutil
import tempfile

import numpy as np

from experiments import common, eviction
from kvjax.config import ConfigError
from kvjax.engine.engine import Engine
from kvjax.memory.calculator import KV_FORMATS

TIERS = common.TIERS


@dataclasses.dataclass(frozen=True)
class Params:
    capacity: float = 0.25  # device cache for shared prompts, as a fraction of the working set
    tiers: str = "host+disk"
    kv_format: str = "float32"
    restart: bool = False
    host_capacity: float = 0.5  # host tier, as a fraction of the working set's bytes
    disk_capacity: float = 2.0
    model: str = "small"
    requests: int = 160
    prompts: int = 12
    prompt_len: int = 384
    suffix_len: int = 16
    zipf: float = 1.0
    new_tokens: int = 4
    slots: int = 4
    page_size: int = 16

    def __post_init__(self):
        common.check_choice(self, "tiers", TIERS)
        common.check_choice(self, "kv_format", tuple(KV_FORMATS))
        for key in ("host_capacity", "disk_capacity"):
            if not 0 < getattr(self, key) <= 16:
                raise ConfigError(key, f"must be in (0, 16], got {getattr(self, key)}")
        _eviction_params(self)  # checks the workload's fields as the eviction experiment does


def _eviction_params(p: Params) -> eviction.Params:
    return eviction.Params(capacity=p.capacity, model=p.model, requests=p.requests,
                           prompts=p.prompts, prompt_len=p.prompt_len,
                           suffix_len=p.suffix_len, zipf=p.zipf, new_tokens=p.new_tokens,
                           slots=p.slots, page_size=p.page_size)


def _engine(p: Params, seed: int, num_pages: int, folder: str | None, **kw) -> Engine:
    params, model = common.model(p.model, seed)
    ec = common.engine_config(p.page_size, num_pages, p.slots, **kw)
    cache = dataclasses.replace(ec.cache, dtype=p.kv_format, **_tier_bytes(p, folder))
    return Engine(params, model, dataclasses.replace(ec, cache=cache))


def _tier_bytes(p: Params, folder: str | None) -> dict:
    _, model = common.model(p.model, 0)
    _, working, _ = eviction.pool_pages(_eviction_params(p))
    return common.tier_fields(p, model, working, folder)


def _requests(p: Params, seed: int):
    _, model = common.model(p.model, seed)
    requests = eviction.workload(_eviction_params(p), model.vocab_size, seed)
    return [dataclasses.replace(r, return_logits=True) for r in requests]


@functools.cache
def _reference(p: Params, seed: int):
    """A cache-off engine's answers in the point's format, and in float32."""
    num_pages, _, _ = eviction.pool_pages(_eviction_params(p))
    out = {}
    for fmt in {p.kv_format, "float32"}:
        q = dataclasses.replace(p, kv_format=fmt, tiers="none")
        out[fmt] = _engine(q, seed, num_pages, None, prefix_cache=False).generate(
            _requests(q, seed))
    return out


@functools.cache
def _ceiling(p: Params, seed: int):
    """The metrics of the same requests in one engine (their unbounded ceiling)."""
    num_pages, _, _ = eviction.pool_pages(_eviction_params(p))
    engine = _engine(p, seed, num_pages, None)
    engine.generate(_requests(p, seed))
    return engine.metrics()


def run(config) -> dict:
    p = config.params
    num_pages, working, running = eviction.pool_pages(_eviction_params(p))
    requests = _requests(p, config.seed)
    folder = tempfile.mkdtemp(prefix="kvjax-kv-tiers-")
    try:
        engine = _engine(p, config.seed, num_pages, folder)
        half = len(requests) // 2 if p.restart else len(requests)
        results = engine.generate(requests[:half])
        engines = [engine]
        if p.restart:
            engines.append(_engine(p, config.seed, num_pages, folder))
            results += engines[1].generate(requests[half:])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    ref = _reference(dataclasses.replace(p, restart=False, tiers="none", capacity=1.0),
                     config.seed)
    same = all(a.tokens == b.tokens and np.array_equal(a.logits, b.logits)
               for a, b in zip(results, ref[p.kv_format], strict=True))
    diff = max(float(np.abs(a.logits - b.logits).max())
               for a, b in zip(results, ref["float32"], strict=True))
    ms = [e.metrics() for e in engines]
    later = ms[-1]  # after a restart: the second engine's half
    by_tier = {"device": 0, "host": 0, "disk": 0}
    for m in ms:
        for tier, n in (m.get("tiers") or {}).get("reused_tokens", {"device": m[
                "reused_tokens"]}).items():
            by_tier[tier] += n
    prompt = sum(m["prompt_tokens"] for m in ms)
    # After a restart the new engine's trie never saw the first half: the ceiling is the
    # one the same requests have in one engine.
    whole = _ceiling(dataclasses.replace(p, restart=False, tiers="none"), config.seed) \
        if p.restart else ms[0]
    ceiling = whole["unbounded_token_reuse_rate"] * whole["prompt_tokens"]
    reused = sum(m["reused_tokens"] for m in ms)
    return {
        "num_pages": num_pages, "working_set_pages": working, "running_pages": running,
        "prompt_tokens": prompt, "reused_tokens": reused,
        "token_reuse_rate": reused / prompt, "ceiling_token_reuse_rate": ceiling / prompt,
        "fraction_of_ceiling": reused / max(ceiling, 1e-12),
        "after_restart_reuse_rate": later["token_reuse_rate"] if p.restart else None,
        "reused_device": by_tier["device"], "reused_host": by_tier["host"],
        "reused_disk": by_tier["disk"],
        "restore_s": sum((m.get("tiers") or {}).get("restore_s", 0.0) for m in ms),
        "prefill_s": sum(m["prefill_s"] for m in ms),
        "evictions": sum(m["evictions"] for m in ms),
        "computed_tokens": sum(m["computed_tokens"] for m in ms),
        "same_as_cache_off": same, "max_logit_diff_vs_f32": diff,
        "tokens_digest": common.tokens_digest([r.tokens for r in results]),
    }


COLUMNS = [
    common.CAPACITY_COLUMN,
    ("tiers", lambda r: r["tiers"]),
    ("format", lambda r: r["kv_format"]),
    ("restart", lambda r: "yes" if r["restart"] else "no"),
    ("token hit rate (of ceiling)", lambda r: f"{r['token_reuse_rate']:.1%} "
     f"({r['fraction_of_ceiling']:.1%})"),
    ("reused device / host / disk", lambda r: f"{r['reused_device']:,} / "
     f"{r['reused_host']:,} / {r['reused_disk']:,}"),
    ("restore / prefill", lambda r: f"{r['restore_s']:.2f} / {r['prefill_s']:.2f} s"),
    ("max |logit - f32|", lambda r: f"{r['max_logit_diff_vs_f32']:.3g}"),
    common.REFERENCE_COLUMN,
]


def headline(rows: list[dict]) -> str:
    lines = []
    for r in sorted(rows, key=lambda r: (r["restart"], r["kv_format"], r["capacity"])):
        if r["tiers"] != "host+disk":
            continue
        plain = [x for x in rows if x["tiers"] == "none" and all(
            x[k] == r[k] for k in ("capacity", "kv_format", "restart"))]
        base = f" (no tiers: {plain[0]['fraction_of_ceiling']:.0%})" if plain else ""
        lines.append(f"- {r['kv_format']}, device cache at {r['capacity']:.0%} of the working "
                     f"set{', restart half way' if r['restart'] else ''}: host + disk reach "
                     f"{r['fraction_of_ceiling']:.0%} of the unbounded ceiling{base}")
    lines.append("- every answer equal to a cache-off engine's in its format, bitwise: "
                 f"{'yes' if all(r['same_as_cache_off'] for r in rows) else 'NO'}")
    return "\n".join(lines)


def plot(rows: list[dict], out) -> list:
    plt, fig, ax = common.figure(6.4, 3.8)
    keys = sorted({(r["kv_format"], r["restart"], r["tiers"]) for r in rows},
                  key=lambda k: (k[0], k[1], TIERS.index(k[2])))
    for fmt, restart, tiers in keys:
        rs = sorted((r for r in rows if (r["kv_format"], r["restart"], r["tiers"])
                     == (fmt, restart, tiers)), key=lambda r: r["capacity"])
        ax.plot([100 * r["capacity"] for r in rs], [100 * r["fraction_of_ceiling"] for r in rs],
                "o-" if fmt == "float32" else "s--", color=f"C{TIERS.index(tiers)}",
                alpha=0.5 if restart else 1.0,
                label=f"{tiers}, {fmt}{', restart' if restart else ''}")
    ax.set_xlabel("device cache for shared prompts (% of working set)")
    ax.set_ylabel("token hit rate (% of unbounded ceiling)")
    ax.legend(fontsize=6)
    fig.suptitle("Host and disk tiers under memory pressure", fontsize=10)
    return [common.save(plt, fig, out, "kv_tiers.png")]
