"""ShareGPT conversations replayed on the real model: prefix reuse against the ideal, TTFT.

Conversations from ShareGPT (`kvjax.data.sharegpt`, at least two user turns, at most
`max_tokens` tokens of text) are replayed on SmolLM2-135M-Instruct as a chat client would
(`kvjax.lab.replay`): each user turn in order, rendered with the model's chat template,
with the model's own answers (up to `new_tokens`, or the recorded ones teacher-forced with
`mode = "trace"`) in the history; every conversation starts at once, or at Poisson
arrivals of `rate` per second. Each point runs once with the prefix cache off (the
reference: its outputs, TTFT and end-to-end time; one run per page size, shared by the
points) and once with the cache on, holding `capacity` times the working set (every
conversation's final history, in pages) beside the running requests' pages: with
`running = "longest"` those are `slots` x the longest request's pages (no request ever
waits for pages), with `"peak"` the most pages the cache-off run held at once (what the
running requests needed: the cache then has `capacity` x the working set and no more).

With `tiers` the pages the device pool evicts go to host memory (`host_capacity` x the
working set's bytes) and on to a disk folder (`disk_capacity` x), and come back when a later
turn needs them (`kvjax.cache.tiers`); `kv_format` is the pages' format (the cache-off
reference runs in the same format). With `restart`, once half the turns have finished (and
the running ones with them) the engine writes its cache to the disk tier
(`PagePool.persist`, as a process does before it ends) and a new engine, its device pool
and host tier empty, serves the rest on the same folder (`replay`'s restart).

Reported: reused / ideal prompt tokens (ideal: the full pages some earlier request wrote
that a prompt starts with, short of its last token: what an unbounded exact cache serves),
reuse by tier, misses by cause, evictions, TTFT and end-to-end time per turn (medians) on
and off, and whether every turn's tokens and logits equal the cache-off run's, bitwise.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import shutil
import statistics
import tempfile

from experiments import common
from kvjax import models
from kvjax.config import ConfigError
from kvjax.data import sharegpt
from kvjax.decode.batching import pages_for
from kvjax.engine.engine import Engine
from kvjax.lab.replay import MODES, poisson_arrivals, replay
from kvjax.memory.calculator import KV_FORMATS

RUNNING = ("longest", "peak")


@dataclasses.dataclass(frozen=True)
class Params:
    model: str = "smollm2-135m-instruct"
    conversations: int = 64
    min_turns: int = 2
    max_turns: int = 6  # user turns replayed per conversation, at most
    max_tokens: int = 768  # text tokens of a conversation's turns together, at most
    new_tokens: int = 32  # answer tokens per turn, at most (it ends at the end of turn)
    mode: str = "chat"
    page_size: int = 16
    capacity: float = 1.0  # the prefix cache, as a fraction of the working set
    schedule: str = "fcfs"
    slots: int = 8
    rate: float = 0.0  # conversations per second (Poisson); 0: all at once
    # pages in each engine's pool, pinned (0: the running requests' pages + capacity x the
    # working set); the smoke variant pins the real-model tests' pool, whose compiled steps
    # it then shares
    pool_pages: int = 0
    running: str = "longest"  # the running requests' pages: "longest" or "peak" (above)
    tiers: str = "none"
    host_capacity: float = 0.5  # the host tier, as a fraction of the working set's bytes
    disk_capacity: float = 2.0
    kv_format: str = "float32"
    restart: bool = False

    def __post_init__(self):
        common.check_positive(self, "conversations", "min_turns", "max_turns", "max_tokens",
                              "new_tokens", "page_size", "slots")
        common.check_choice(self, "mode", MODES)
        common.check_choice(self, "schedule", ("fcfs", "lpm"))
        common.check_choice(self, "tiers", common.TIERS)
        common.check_choice(self, "running", RUNNING)
        common.check_choice(self, "kv_format", tuple(KV_FORMATS))
        for key in ("host_capacity", "disk_capacity"):
            if not 0 < getattr(self, key) <= 16:
                raise ConfigError(key, f"must be in (0, 16], got {getattr(self, key)}")
        if not 0 < self.capacity <= 4:
            raise ConfigError("capacity", f"must be in (0, 4], got {self.capacity}")
        if self.rate < 0:
            raise ConfigError("rate", f"must be >= 0, got {self.rate}")
        if self.pool_pages < 0:
            raise ConfigError("pool_pages", f"must be >= 0, got {self.pool_pages}")
        if self.model not in models.MODELS:
            raise ConfigError("model", f"unknown model {self.model!r} (known: "
                              f"{', '.join(sorted(models.MODELS))})")


def _replay(p: Params, seed: int, engine: Engine, on_step=None, restart=None):
    model = common.real_model(p.model)
    conversations = sharegpt(p.conversations, min_turns=p.min_turns, max_turns=p.max_turns,
                             max_tokens=p.max_tokens, tokenizer=model.tokenizer, seed=seed)
    arrivals = poisson_arrivals(len(conversations), p.rate or None, seed)
    return replay(engine, conversations, model.template.render, mode=p.mode,
                  max_new_tokens=p.new_tokens, arrivals=arrivals,
                  decode=model.tokenizer.decode, return_logits=True, on_step=on_step,
                  restart=restart)


def _engine(p: Params, num_pages: int, tiers: dict | None = None, **kw) -> Engine:
    model = common.real_model(p.model)
    ec = common.engine_config(p.page_size, num_pages, p.slots, schedule=p.schedule,
                              min_context=common.REAL_MODEL_CONTEXT, **kw)
    ec = dataclasses.replace(ec, cache=dataclasses.replace(ec.cache, dtype=p.kv_format,
                                                           **(tiers or {})))
    return Engine(model.params, model.config, ec, eos_tokens=model.stop_tokens)


def _longest(p: Params) -> int:
    """A bound on a request's tokens: the conversation's text, and per turn the template's
    markers and an answer (the chat template's own system prompt included)."""
    return p.max_tokens + p.max_turns * (p.new_tokens + 16) + 64


@functools.cache
def _reference(p: Params, seed: int):
    """The cache-off run (what the cached points must reproduce), the working set, and the
    most pages the running requests held at once."""
    pages = p.pool_pages or p.slots * pages_for(_longest(p), p.page_size)
    engine = _engine(p, pages, prefix_cache=False)
    peak = [0]

    def sample() -> None:  # with the cache off every page in use is a running request's
        peak[0] = max(peak[0], pages - engine.kv.stats()["free_pages"])

    turns = _replay(p, seed, engine, on_step=sample)
    last = {}
    for t in turns:
        last[t.conversation] = t  # a conversation's turns come in order
    working = sum(pages_for(len(t.prompt_ids) + len(t.tokens) - 1, p.page_size)
                  for t in last.values())
    return turns, working, peak[0]


def run(config) -> dict:
    p = config.params
    off_params = dataclasses.replace(p, capacity=1.0, schedule="fcfs", tiers="none",
                                     running="longest", restart=False)
    reference, working, peak = _reference(off_params, config.seed)
    running = peak if p.running == "peak" else p.slots * pages_for(_longest(p), p.page_size)
    num_pages = p.pool_pages or running + round(p.capacity * working)
    folder = tempfile.mkdtemp(prefix="kvjax-sharegpt-tiers-")
    tiers = common.tier_fields(p, common.real_model(p.model).config, working, folder)
    live: list[Engine] = []  # the engine in use (a restart replaces it)
    done: list[dict] = []  # the metrics of engines a restart ended
    persisted = 0  # pages the first engine wrote to disk at the restart

    def restart() -> Engine:
        nonlocal persisted
        old = live.pop()
        done.append(old.metrics())
        if old.pool.tiers is not None and old.pool.tiers.disk is not None:
            persisted = old.pool.persist()
        live.append(_engine(p, num_pages, tiers))
        return live[0]

    try:
        live.append(_engine(p, num_pages, tiers))
        turns = _replay(p, config.seed, live[0],
                        restart=(len(reference) // 2, restart) if p.restart else None)
        m = _summed(done + [live[0].metrics()])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    key = lambda t: (t.conversation, t.turn)  # noqa: E731
    same = [(a.prompt_ids, a.tokens, a.logits_digest) == (b.prompt_ids, b.tokens,
                                                           b.logits_digest)
            for a, b in zip(sorted(turns, key=key), sorted(reference, key=key), strict=True)]
    causes, by_tier = m["misses_by_cause"], m["by_tier"]
    later = [t for t in turns if t.turn > 1]
    after = [t for t in turns if t.after_restart]
    return {
        "conversations": len({t.conversation for t in turns}), "turns": len(turns),
        "num_pages": num_pages, "working_set_pages": working, "running_pages": running,
        "prompt_tokens": sum(len(t.prompt_ids) for t in turns),
        "reused_tokens": sum(t.stats.get("reused_tokens", 0) for t in turns),
        "ideal_tokens": sum(t.ideal_reused for t in turns),
        "later_turns_reused": sum(t.stats.get("reused_tokens", 0) for t in later),
        "later_turns_ideal": sum(t.ideal_reused for t in later),
        "misses_cold": causes.get("cold", 0), "misses_capacity": causes.get("capacity", 0),
        "misses_divergence": causes.get("divergence", 0),
        "misses_other": sum(v for k, v in causes.items()
                            if k not in ("cold", "capacity", "divergence")),
        "evictions": m["evictions"], "preemptions": m["preemptions"],
        "reused_host": by_tier.get("host", 0), "reused_disk": by_tier.get("disk", 0),
        "restore_s": m["restore_s"],
        "after_restart_reused": sum(t.stats.get("reused_tokens", 0) for t in after),
        "after_restart_ideal": sum(t.ideal_reused for t in after),
        "persisted_pages": persisted,
        "ttft_s": _median(t.stats.get("ttft_s", 0.0) for t in turns),
        "ttft_off_s": _median(t.stats.get("ttft_s", 0.0) for t in reference),
        "e2e_s": _median(t.finished_s - t.arrival_s for t in turns),
        "e2e_off_s": _median(t.finished_s - t.arrival_s for t in reference),
        "wall_s": max(t.finished_s for t in turns),
        "wall_off_s": max(t.finished_s for t in reference),
        "same_as_cache_off": all(same) and len(same) == len(reference),
        "failed_turns": sum(t.status != "finished" for t in turns),
        "tokens_digest": common.tokens_digest([t.tokens for t in turns]),
        "model": p.model,
    }


def _summed(metrics: list[dict]) -> dict:
    """The engines' metrics a row reads, summed over the engines (a restart brings in a
    second one)."""
    out = {"misses_by_cause": collections.Counter(), "by_tier": collections.Counter(),
           "evictions": 0, "preemptions": 0, "restore_s": 0.0}
    for m in metrics:
        tiers = m.get("tiers") or {}
        out["misses_by_cause"].update(m["misses_by_cause"])
        out["by_tier"].update(tiers.get("reused_tokens", {"device": m["reused_tokens"]}))
        out["evictions"] += m["evictions"]
        out["preemptions"] += m["preemptions"]
        out["restore_s"] += tiers.get("restore_s", 0.0)
    return out


def _median(values) -> float:
    values = list(values)
    return statistics.median(values) if values else 0.0


def _of_ideal(r: dict) -> float:
    return r["reused_tokens"] / max(r["ideal_tokens"], 1)


def _series(r: dict) -> str:
    """A row's settings other than its cache capacity."""
    extra = [x for x in (r.get("tiers", "none"), r.get("kv_format", "float32"),
                         "restart" if r.get("restart") else "none")
             if x not in ("none", "float32")]
    return "/".join([f"page {r['page_size']}", r["schedule"], *extra])


def _label(r: dict) -> str:
    return f"{r['capacity']:.0%}/{_series(r)}"


COLUMNS = [
    ("page", lambda r: str(r["page_size"])),
    common.CAPACITY_COLUMN,
    ("schedule", lambda r: r["schedule"]),
    ("reused / ideal tokens", lambda r: f"{r['reused_tokens']:,} / {r['ideal_tokens']:,} "
     f"({_of_ideal(r):.1%})"),
    ("of prompt tokens", lambda r: f"{r['reused_tokens'] / max(r['prompt_tokens'], 1):.1%}"),
    ("tiers, pages", lambda r: f"{r['tiers']}, {r['kv_format']}"),
    ("from host / disk", lambda r: f"{r['reused_host']:,} / {r['reused_disk']:,}"),
    ("misses cold / capacity / divergence",
     lambda r: f"{r['misses_cold']} / {r['misses_capacity']} / {r['misses_divergence']}"),
    ("evictions", lambda r: f"{r['evictions']:,}"),
    ("after a restart: reused / ideal", lambda r: f"{r['after_restart_reused']:,} / "
     f"{r['after_restart_ideal']:,} ({r['persisted_pages']:,} pages persisted)"
     if r.get("restart") else "-"),
    ("TTFT on / off (median)", lambda r: f"{r['ttft_s'] * 1e3:.0f} / "
     f"{r['ttft_off_s'] * 1e3:.0f} ms"),
    ("end-to-end on / off (median)", lambda r: f"{r['e2e_s']:.2f} / {r['e2e_off_s']:.2f} s"),
    common.REFERENCE_COLUMN,
]


def headline(rows: list[dict]) -> str:
    r0 = rows[0]
    best = max(rows, key=_of_ideal)
    lines = [f"ShareGPT replay on {r0['model']}: {r0['conversations']} conversations, "
             f"{r0['turns']} turns, {r0['mode']} mode"]
    lines.append(f"- reused / ideal prompt tokens: best {_of_ideal(best):.1%} "
                 f"({_label(best)}); "
                 + ", ".join(f"{_label(r)}: {_of_ideal(r):.1%}" for r in rows))
    lines.append(f"- every turn equal to the cache-off run, bitwise: "
                 f"{'yes' if all(r['same_as_cache_off'] for r in rows) else 'NO'}")
    return "\n".join(lines)


def plot(rows: list[dict], out) -> list:
    plt, fig, (ax1, ax2) = common.figure(10.0, 3.8, ncols=2)
    for i, series in enumerate(sorted({_series(r) for r in rows})):
        rs = sorted((r for r in rows if _series(r) == series), key=lambda r: r["capacity"])
        ax1.plot([100 * r["capacity"] for r in rs], [100 * _of_ideal(r) for r in rs], "o-",
                 color=f"C{i}", label=series)
    ax1.set_xlabel("prefix cache (% of the working set)")
    ax1.set_ylabel("reused tokens (% of ideal)")
    ax1.legend(fontsize=7)
    labels = [_label(r) for r in rows]
    x = list(range(len(rows)))
    ax2.bar([i - 0.2 for i in x], [1e3 * r["ttft_s"] for r in rows], 0.4, label="cache on")
    ax2.bar([i + 0.2 for i in x], [1e3 * r["ttft_off_s"] for r in rows], 0.4,
            label="cache off", color="tab:gray")
    ax2.set_xticks(x, labels, rotation=45, fontsize=6, ha="right")
    ax2.set_ylabel("median TTFT (ms)")
    ax2.legend(fontsize=7)
    fig.suptitle(f"ShareGPT replay on {rows[0]['model']}", fontsize=10)
    return [common.save(plt, fig, out, "sharegpt_reuse.png")]
