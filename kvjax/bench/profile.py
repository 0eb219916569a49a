"""Where a decode token's time goes (`kvjax bench profile --model NAME`): the on-device
decode loop of a `kvjax.models` checkpoint (or the config's random model) under fast and
invariant numerics, beside its parts measured alone on the same weights:

- products: the layers' token-row products and the head as a jitted chain of the same
  dots on the model's own kernels, q/k/v and gate/up fused where the engine fuses them
  (one row, as fast numerics decodes; two rows of the kernels stored transposed, as
  invariant numerics decodes one token; two rows is what a lone row is padded to there);
- attention: every layer's paged attention over the same context, the loop alone;
- the rest (norms, RoPE, cache writes, sampling): the step minus both.

Milliseconds per token at batch 1, context `CONTEXT`; medians of `--reps` after a warm-up;
GB/s counts every weight byte once per token.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp

from kvjax.bench.numerics import CONTEXT, DECODE_STEPS, _Point
from kvjax.bench.peer_engine import weight_bytes
from kvjax.cache.paged import BatchInfo, init_cache
from kvjax.config import CacheConfig
from kvjax.config_files import load_config
from kvjax.decode.batching import page_table
from kvjax.engine.engine import numerics_plans
from kvjax.lab.report import emit, markdown_table, write_results
from kvjax.lab.timing import filled_with_noise, median_seconds
from kvjax.model.attention import paged_attention_reference
from kvjax.model.layout import fuse


def _model(args):
    if args.model:
        from kvjax import models

        loaded = models.load(args.model)
        return loaded.config, loaded.params
    from kvjax.model.transformer import init_params

    config = load_config(args.config, args.set).model
    return config, init_params(config)


def _kernels(params, layers: int, fused: bool) -> list[dict[str, jax.Array]]:
    """Per layer the 2-D [inputs, outputs] kernels of its token-row products; `fused`: q/k/v
    as one ("qkv") and gate/up as one ("gate_up"), as the steps of a fused config take them
    (`kvjax.model.layout.fuse`)."""
    if fused:
        params = fuse(params)
    out = []
    for i in range(layers):
        layer = params[f"layer_{i}"]
        kernels = {name: layer[part][name]["kernel"] for part, names in
                   (("attn", ("q", "k", "v", "qkv")),
                    ("mlp", ("gate", "up", "gate_up", "down")))
                   for name in names if name in layer[part]}
        kernels = {n: k.reshape(k.shape[0], -1) for n, k in kernels.items()}
        o = layer["attn"]["o"]["kernel"]
        out.append(kernels | {"o": o.reshape(-1, o.shape[-1])})
    return out


def _products(params, config, plan, rows: int, stored: bool, reps: int) -> float:
    """Seconds of one token's products as a chain of dots (see the module docstring)."""
    layers = _kernels(params, config.num_layers, plan.fused)
    q_width = config.num_heads * config.head_dim
    if stored:
        layers = [{n: jnp.asarray(k.T) for n, k in ks.items()} for ks in layers]
    head = params["embed"]["embedding"] if config.tie_embeddings else \
        params["lm_head"]["kernel"].T  # [V, D]

    def dot(x, k):
        return jax.lax.dot_general(x, k, (((1,), (1 if stored else 0,)), ((), ())))

    def chain(x, layers, head):
        for k in layers:
            if "qkv" in k:
                qkv = dot(x, k["qkv"])
                q, kv = qkv[:, :q_width], qkv[:, q_width:].sum()
            else:
                q = dot(x, k["q"])
                kv = dot(x, k["k"]).sum() + dot(x, k["v"]).sum()
            if "gate_up" in k:
                gate, up = jnp.split(dot(x, k["gate_up"]), 2, axis=1)
                h = jax.nn.silu(gate) * up
            else:
                up = dot(x, k["up"])
                h = jax.nn.silu(dot(x, k["gate"])) * up if "gate" in k else up
            x = x + dot(q, k["o"]) + dot(h, k["down"]) + kv * 1e-9
        return jax.lax.dot_general(x, head, (((1,), (1,)), ((), ())))

    fn = jax.jit(chain)
    x = jnp.full((rows, config.d_model), 0.01, jnp.float32)
    fn(x, layers, head).block_until_ready()
    return median_seconds(lambda: fn(x, layers, head).block_until_ready(), reps)


def _attention(config, cache_cfg: CacheConfig, reps: int) -> float:
    """Seconds of every layer's paged attention for one token at `CONTEXT` (the reference
    loop the engine runs on CPU)."""
    cache = filled_with_noise(init_cache(config, cache_cfg))
    pages = CONTEXT // cache_cfg.page_size + 1
    batch = BatchInfo(page_table=jnp.asarray(page_table([list(range(pages))], 1,
                                                        cache_cfg.block_pages)),
                      lengths=jnp.full(1, CONTEXT - 1, jnp.int32),
                      num_new=jnp.ones(1, jnp.int32))
    q = jnp.full((1, 1, config.num_heads, config.head_dim), 0.1, jnp.float32)

    def layers(q, cache, batch):
        for layer in range(config.num_layers):
            q = q + paged_attention_reference(q, cache, layer, batch, config.window(layer),
                                              None, config.query_scale, config.attn_softcap)
        return q

    fn = jax.jit(layers)
    fn(q, cache, batch).block_until_ready()
    return median_seconds(lambda: fn(q, cache, batch).block_until_ready(), reps)


def main(args) -> int:
    config, params = _model(args)
    cache_cfg = CacheConfig(page_size=16, num_pages=(CONTEXT + DECODE_STEPS) // 16 + 2)
    engine = dataclasses.replace(load_config(args.config, args.set).engine, cache=cache_cfg)
    gigabytes = weight_bytes(params) / 1e9
    emit(f"bench profile: {args.model or args.config}, {config.num_layers} layers, "
         f"{gigabytes:.3f} GB of weights, context {CONTEXT}, batch 1")
    start = time.perf_counter()
    step, plans = {}, {}
    for mode in ("fast", "invariant"):
        plans[mode] = numerics_plans([config], dataclasses.replace(engine, numerics=mode),
                                     0)[0]
        run = _Point(config, plans[mode], params, cache_cfg).decode(1)
        run()
        step[mode] = median_seconds(run, args.reps) / DECODE_STEPS
    products = {"fast": _products(params, config, plans["fast"], 1, False, args.reps),
                "invariant": _products(params, config, plans["invariant"], 2, True,
                                       args.reps)}
    attention = _attention(config, cache_cfg, args.reps)
    rows = []
    for mode in ("fast", "invariant"):
        rest = step[mode] - products[mode] - attention
        rows.append({"numerics": mode, "step_ms": step[mode] * 1e3,
                     "products_ms": products[mode] * 1e3, "attention_ms": attention * 1e3,
                     "rest_ms": rest * 1e3, "step_gb_s": gigabytes / step[mode],
                     "products_gb_s": gigabytes / products[mode]})
    emit(f"measured in {time.perf_counter() - start:.0f} s")
    write_results(args.out, markdown_table(rows, COLUMNS), rows, model=args.model,
                  config=args.config, context=CONTEXT, weight_gb=gigabytes)
    return 0


COLUMNS = [
    ("numerics (rows)", lambda r: f"{r['numerics']} ({1 if r['numerics'] == 'fast' else 2})"),
    ("whole step ms", lambda r: f"{r['step_ms']:.1f}"),
    ("products ms", lambda r: f"{r['products_ms']:.1f}"),
    ("attention ms", lambda r: f"{r['attention_ms']:.1f}"),
    ("the rest ms", lambda r: f"{r['rest_ms']:.1f}"),
    ("GB/s step / products", lambda r: f"{r['step_gb_s']:.1f} / {r['products_gb_s']:.1f}"),
]
