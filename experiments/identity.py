"""Identity strictness: reuse lost per namespace field, and the outputs ignoring it changes.

One workload shares a system prompt across groups of requests that differ from the plain
group in exactly one namespace field: a LoRA adapter, a position shift, a tenant salt, or
(after `load_params`) the model weights. The strict engine keys its cache by the full
namespace, so every new value of a field recomputes the shared prompt (a "namespace" miss
naming the field). For each field, an engine that ignores that field reuses the plain
group's pages instead; its outputs are compared with the strict engine's (which equal a
cold recompute, bit for bit). The cache dtype cannot mix inside one pool, so its row
compares a float32-cache engine with a bfloat16-cache engine on the plain group.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from experiments import common
from kvjax.config import ConfigError
from kvjax.engine.engine import Engine
from kvjax.engine.requests import Request
from kvjax.lab.workloads import random_ids
from kvjax.model.lora import init_adapter

FIELDS = ("adapter", "position_base", "salt", "model", "kv_dtype")


@dataclasses.dataclass(frozen=True)
class Params:
    model: str = "small"
    system_len: int = 256
    suffix_len: int = 16
    per_group: int = 4  # requests per field value
    position_shift: int = 100
    tenants: int = 2
    adapter_rank: int = 4
    adapter_scale: float = 0.05
    page_size: int = 16
    new_tokens: int = 8
    slots: int = 4

    def __post_init__(self):
        common.check_choice(self, "model", common.MODELS)
        common.check_positive(self, "system_len", "suffix_len", "per_group", "tenants",
                              "adapter_rank", "page_size", "new_tokens", "slots",
                              "position_shift")
        if self.system_len < self.page_size:
            raise ConfigError("system_len", "must fill at least one page")
        end = self.position_shift + self.system_len + self.suffix_len + self.new_tokens
        if end > common.MODELS[self.model].max_seq_len:
            raise ConfigError("position_shift", f"position_shift + system_len + suffix_len + "
                              f"new_tokens = {end} exceeds the model's max_seq_len "
                              f"{common.MODELS[self.model].max_seq_len}")


class IgnoringEngine(Engine):
    """An engine whose cache namespace leaves out one field (a deliberately unsafe cache)."""

    def __init__(self, *args, ignore: str | None = None, **kwargs):
        self.ignore = ignore
        super().__init__(*args, **kwargs)

    def namespace(self, request: Request):
        ns = super().namespace(request)
        blank = {"adapter": {"adapter": "none"}, "position_base": {"position_base": 0},
                 "model": {"model": "ignored"}}.get(self.ignore, {})
        return dataclasses.replace(ns, **blank)


def _groups(p: Params, vocab: int, seed: int) -> dict[str, list[Request]]:
    """The plain group and one group per mixable field, over one shared system prompt."""
    rng = np.random.default_rng(seed)
    system = random_ids(rng, p.system_len, vocab)

    def group(**kw) -> list[Request]:
        return [Request(system + random_ids(rng, p.suffix_len, vocab), p.new_tokens,
                        return_logits=True, **kw) for _ in range(p.per_group)]

    return {
        "plain": group(),
        "adapter": group(adapter="tuned"),
        "position_base": group(position_base=p.position_shift),
        "salt": [dataclasses.replace(r, tenant=f"tenant{i % p.tenants}")
                 for i, r in enumerate(group())],
        "model": group(),  # served after the weights are reloaded
    }


def _serve(p: Params, config, groups, ignore: str | None, kv_dtype: str = "float32"):
    """Serves every group in order (the model group after a weight reload): (results by
    group, the operator's namespace misses by field, from `engine.metrics()`)."""
    params, model = common.model(p.model, config.seed)
    tuned = init_adapter(model, p.adapter_rank, seed=config.seed + 1, scale=p.adapter_scale)
    ec = common.engine_config(p.page_size, 8192 // p.page_size, p.slots, mesh=config.mesh)
    ec = dataclasses.replace(ec, cache=dataclasses.replace(ec.cache, dtype=kv_dtype))
    engine = IgnoringEngine(params, model, ec, adapters={"tuned": tuned}, ignore=ignore)
    first = [g for g in groups if g != "model"]
    requests = [r for g in first for r in groups[g]]
    if ignore == "salt":
        requests = [dataclasses.replace(r, tenant=None) for r in requests]
    results = engine.generate(requests)
    by_group, i = {}, 0
    for g in first:
        by_group[g], i = results[i:i + len(groups[g])], i + len(groups[g])
    if "model" in groups:
        new_weights = jax.tree_util.tree_map(lambda x: x * 1.01, params)  # "fine-tuned"
        engine.load_params(new_weights)
        by_group["model"] = engine.generate(groups["model"])
    return by_group, engine.metrics()["namespace_misses_by_field"]


def run(config) -> list[dict]:
    p = config.params
    model = common.MODELS[p.model]
    groups = _groups(p, model.vocab_size, config.seed)
    strict, misses = _serve(p, config, groups, ignore=None)
    rows = []
    for field in FIELDS:
        if field == "kv_dtype":
            plain = {"plain": groups["plain"]}
            other = _serve(p, config, plain, ignore=None, kv_dtype="bfloat16")[0]["plain"]
            rows.append(_compare(field, strict["plain"], other, None, None))
            continue
        lax = _serve(p, config, groups, ignore=field)[0][field]
        rows.append(_compare(field, strict[field], lax, strict[field], lax,
                             misses.get(field, 0)))
    return rows


def _compare(field, strict, lax, strict_reuse, lax_reuse, misses: int = 0) -> dict:
    """One field's row: reuse (strict vs ignoring the field), the operator's namespace
    misses naming the field, and the output comparison."""
    changed = sum(a.tokens != b.tokens for a, b in zip(strict, lax, strict=True))
    diff = common.max_abs_diff([a.logits for a in strict], [b.logits for b in lax])
    row = {"field": field, "requests": len(strict), "changed_outputs": changed,
           "max_logit_diff": diff, "outputs_would_change": diff > 0}
    if strict_reuse is None:
        row.update(reused_strict=None, reused_ignoring=None, reuse_lost=None,
                   namespace_misses=None)
        return row
    s = sum(r.stats["reused_tokens"] for r in strict_reuse)
    g = sum(r.stats["reused_tokens"] for r in lax_reuse)
    row.update(reused_strict=s, reused_ignoring=g, reuse_lost=g - s, namespace_misses=misses)
    return row


MESH = True  # its engines run on a device mesh when the config sets `mesh`

COLUMNS = [
    ("field", lambda r: r["field"]),
    ("requests", lambda r: str(r["requests"])),
    ("reused strict / ignoring", lambda r: "separate pools" if r["reuse_lost"] is None
     else f"{r['reused_strict']:,} / {r['reused_ignoring']:,}"),
    ("reuse lost", lambda r: "-" if r["reuse_lost"] is None else f"{r['reuse_lost']:,}"),
    ("namespace misses", lambda r: "-" if r["namespace_misses"] is None
     else str(r["namespace_misses"])),
    ("outputs changed if ignored", lambda r: f"{r['changed_outputs']}/{r['requests']}"),
    ("max abs Δlogit", lambda r: f"{r['max_logit_diff']:.3g}"),
]


def headline(rows: list[dict]) -> str:
    needed = [r["field"] for r in rows if r["outputs_would_change"]]
    free = [r["field"] for r in rows if not r["outputs_would_change"]]
    text = (f"Ignoring {', '.join(needed)} would have changed the outputs (logits differ by up "
            f"to {max((r['max_logit_diff'] for r in rows), default=0):.3g}): those fields are "
            f"needed for exactness.")
    if free:
        text += (f" Ignoring {', '.join(free)} leaves every logit bit-identical: not needed "
                 f"for exactness (the salt is there to isolate tenants); its price is the reuse "
                 f"lost in the table.")
    return text


def plot(rows: list[dict], out) -> list:
    plt, fig, (ax1, ax2) = common.figure(9.0, 3.6, ncols=2)
    mixed = [r for r in rows if r["reuse_lost"] is not None]
    ax1.bar([r["field"] for r in mixed], [r["reuse_lost"] for r in mixed], color="tab:red")
    ax1.set_ylabel("prompt tokens recomputed by the strict cache")
    ax1.set_title("Reuse lost per namespace field", fontsize=9)
    ax2.bar([r["field"] for r in rows], [max(r["max_logit_diff"], 1e-12) for r in rows],
            color="tab:blue")
    ax2.set_yscale("log")
    ax2.set_ylabel("max |Δlogit| if the field were ignored")
    ax2.set_title("Ignoring the field changes logits by (1e-12: nothing)", fontsize=9)
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelsize=8)
    return [common.save(plt, fig, out, "identity.png")]
