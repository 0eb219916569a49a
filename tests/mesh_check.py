"""The engine on a fake 8-device CPU mesh, against one device: prints JSON for test_sharding.

Run in its own process (the device count is fixed when JAX starts):
`python mesh_check.py RESULTS_FOLDER`.
Every case serves the same two waves of requests (the second wave shares a system prompt
with the first, so it reuses pages) on one device and on a mesh, and reports tokens, reuse
counts, the largest logit difference and the shard shapes the mesh produced.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
from helpers import sharp_params  # noqa: E402

import kvjax  # noqa: E402
from kvjax import CacheConfig, Engine, EngineConfig, Request, SpecConfig  # noqa: E402
from kvjax.config import ModelConfig  # noqa: E402

TARGET = ModelConfig(vocab_size=64, num_layers=1, d_model=128, num_heads=8, num_kv_heads=8,
                     d_ff=128, max_seq_len=256)
DRAFT = ModelConfig(vocab_size=64, num_layers=1, d_model=32, num_heads=4, num_kv_heads=4,
                    d_ff=64, max_seq_len=256)
ENGINE = EngineConfig(cache=CacheConfig(page_size=8, num_pages=96, prefill_chunk=32,
                                        attn_block=16), max_slots=8, decode_steps=4,
                      min_context=TARGET.max_seq_len)  # one page-table width: fewer compiles
SYSTEM = [int(t) for t in np.random.default_rng(0).integers(1, 64, 27)]


def requests() -> list[list[Request]]:
    rng = np.random.default_rng(1)
    prompts = [SYSTEM + [int(t) for t in rng.integers(1, 64, 5 + 6 * i)] for i in range(6)]
    reqs = [Request(p, max_new_tokens=6, return_logits=True) for p in prompts]
    return [reqs[:2], reqs[2:]]


def serve(config: ModelConfig, params, mesh=None, **kw) -> tuple[dict, Engine]:
    spec = kw.pop("spec", None)
    draft = kw.pop("draft", None)
    adapters = kw.pop("adapters", None)
    engine = Engine(params, config, dataclasses.replace(ENGINE, mesh=mesh, **kw), spec=spec,
                    draft=draft, adapters=adapters)
    waves = requests()
    if adapters:  # every other request through the (stacked, replicated) LoRA adapter
        waves = [[dataclasses.replace(r, adapter="tuned" if i % 2 else None)
                  for i, r in enumerate(wave)] for wave in waves]
    results = [r for wave in waves for r in engine.generate(wave)]
    return {"tokens": [r.tokens for r in results],
            "reused": [r.stats["reused_tokens"] for r in results],
            "logits": [np.asarray(r.logits) for r in results]}, engine


def compare(ref: dict, got: dict) -> dict:
    return {"tokens": got["tokens"], "ref_tokens": ref["tokens"], "reused": got["reused"],
            "ref_reused": ref["reused"],
            "max_logit_diff": max(float(np.abs(a - b).max())
                                  for a, b in zip(ref["logits"], got["logits"], strict=True)),
            "bitwise": all(np.array_equal(a, b)
                           for a, b in zip(ref["logits"], got["logits"], strict=True))}


def shards(engine: Engine) -> dict:
    q = engine.params["layer_0"]["attn"]["q"]["kernel"]
    return {"cache_shard": list(engine.cache.k.addressable_shards[0].data.shape),
            "cache_global": list(engine.cache.k.shape),
            "q_shard": list(q.addressable_shards[0].data.shape),
            "embed_shard": list(engine.params["embed"]["embedding"]
                                .addressable_shards[0].data.shape)}


def main() -> None:
    out = {"devices": jax.device_count()}
    for name, config in (("mha", TARGET), ("mqa", dataclasses.replace(TARGET, num_kv_heads=1))):
        params = sharp_params(config, seed=3)
        ref, _ = serve(config, params)
        meshes = (("1x8", "model=8"), ("2x4", "data=2,model=4"), ("8x1", "data=8"))
        on_mesh = {}
        for label, mesh in meshes if name == "mha" else meshes[:1]:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                on_mesh[mesh], engine = serve(config, params, mesh)
            out[f"{name} {label}"] = {**compare(ref, on_mesh[mesh]), **shards(engine),
                                     "warnings": [str(w.message) for w in caught]}
        if name == "mha":
            on = on_mesh["data=2,model=4"]  # the prefix cache is on by default
            off, _ = serve(config, params, "data=2,model=4", prefix_cache=False)
            out["prefix on vs off 2x4"] = compare(off, on)
            draft = (kvjax.init_params(DRAFT, seed=4), DRAFT)
            for drafter in ("model", "ngram"):
                got, _ = serve(config, params, "data=2,model=4", draft=draft,
                               spec=SpecConfig(drafter=drafter, gamma=3))
                out[f"spec {drafter} 2x4"] = compare(ref, got)
            out["pallas_gpu 2x4"] = kernel_on_mesh(config, params)
            # Page copies (partial-page reuse) and NaN-poisoned freed pages on the mesh.
            kw = dict(partial_page_copy=True, poison_freed=True)
            one, _ = serve(config, params, **kw)
            out["partial copy, poison 2x4"] = compare(one, serve(config, params,
                                                                 "data=2,model=4", **kw)[0])
            adapters = {"tuned": kvjax.init_adapter(config, 4, seed=6)}
            one, _ = serve(config, params, adapters=adapters)
            got, _ = serve(config, params, "data=2,model=4", adapters=adapters)
            out["lora 2x4"] = {**compare(one, got), "tokens_differ_from_base": sum(
                a != b for a, b in zip(one["tokens"], ref["tokens"], strict=True))}
    out["run prefix_page_size 2x4"] = experiment_on_mesh(Path(sys.argv[1]))
    json.dump(out, sys.stdout)


def kernel_on_mesh(config: ModelConfig, params) -> dict:
    """The GPU kernel (interpret mode) under shard_map, where it runs: fast numerics (the
    invariant ones attend by the reference), against one device's fast reference."""
    from kvjax.model import transformer

    kernel, calls = transformer.sharded_paged_decode_attention, []

    def counting(*a, **k):
        calls.append(a[4])
        return kernel(*a, **k)

    ref, _ = serve(config, params, numerics="fast")
    transformer.sharded_paged_decode_attention = counting
    try:
        got, _ = serve(config, params, "data=2,model=4", numerics="fast",
                       attention="pallas_gpu", attention_interpret=True)
    finally:
        transformer.sharded_paged_decode_attention = kernel
    return {**compare(ref, got), "kernel_calls": calls}


def experiment_on_mesh(folder: Path) -> dict:
    """`kvjax run configs/prefix_page_size.toml` (one small point) with and without a mesh."""
    from kvjax.lab import runner

    config = Path(__file__).parent.parent / "configs" / "prefix_page_size.toml"
    rows = {}
    for mesh in (None, "data=2,model=4"):
        sets = ["scale=small", "page_size=16", "workload=system_prompt"]
        exp = runner.resolve(config, sets + ([] if mesh is None else [f"mesh={mesh}"]))
        out = runner.run(exp, folder / str(mesh), echo=lambda _: None)
        rows[str(mesh)] = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    summary = (folder / "data=2,model=4" / "summary.md").read_text()
    return {"rows": rows, "summary_mesh_line": summary.strip().splitlines()[-1]}


if __name__ == "__main__":
    main()
