"""Row-invariance benchmark: which row counts change a token row's bits, and what the
row-invariant product costs, for every token-row matmul of a model (`kvjax bench tiles`).

For each matmul shape of the config's model (q, k/v, o, MLP up/down, head), and of
SmolLM2-135M for comparison: the row counts M whose plain row bits differ from the row alone
(`kvjax.model.row_classes.row_classes`), the probed invariant block (`invariant_block`), and
median times of the plain `[M, d] @ [d, f]` beside `invariant_matmul` at the probed block
and at block 8, side by side in one run (ratios; absolute times drift).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.config_files import load_config
from kvjax.lab.report import emit, markdown_table, write_results
from kvjax.lab.timing import median_seconds
from kvjax.model.row_classes import invariant_block, plain_matmul, row_classes
from kvjax.model.tiled import invariant_matmul, model_shapes

ROWS = (1, 8, 64, 256)
SMOLLM2 = {"smol q/o": (576, 576), "smol k/v": (576, 192), "smol mlp up": (576, 1536),
           "smol mlp down": (1536, 576), "smol head": (576, 49152)}


def _time(matmul, x, w, reps: int) -> float:
    fn = jax.jit(matmul)
    return median_seconds(lambda: fn(x, w).block_until_ready(), reps)


def main(args) -> int:
    model = load_config(args.config, args.set).model
    emit(f"bench tiles: {args.config}: d_model {model.d_model}, d_ff {model.d_ff}, "
         f"vocab {model.vocab_size}; SmolLM2-135M shapes beside; float32; medians of "
         f"{args.reps}")
    rng = np.random.default_rng(0)
    rows = []
    for name, (d, f) in {**model_shapes(model), **SMOLLM2}.items():
        block = invariant_block(d, f)
        plain_classes = row_classes(plain_matmul, d, f)
        invariant_classes = row_classes(partial(invariant_matmul, block=block), d, f)
        w = jnp.asarray(rng.standard_normal((d, f)).astype(np.float32))
        for m in ROWS:
            x = jnp.asarray(rng.standard_normal((m, d)).astype(np.float32))
            plain = _time(plain_matmul, x, w, args.reps)
            inv = _time(partial(invariant_matmul, block=block), x, w, args.reps)
            inv8 = _time(partial(invariant_matmul, block=8), x, w, args.reps)
            rows.append({"matmul": name, "d": d, "f": f, "rows": m, "block": block,
                         "plain_ms": plain * 1e3, "invariant_ms": inv * 1e3,
                         "invariant_over_plain": inv / plain, "block8_over_plain": inv8 / plain,
                         "plain_row_classes": plain_classes,
                         "invariant_row_classes": invariant_classes})
            emit(f"{name} [{m}, {d}] @ [{d}, {f}]: plain {plain * 1e3:.3f} ms, invariant "
                 f"(block {block}) {inv / plain:.2f}x, block 8 {inv8 / plain:.2f}x")
    write_results(args.out, markdown_table(rows, COLUMNS), rows, config=args.config,
                  overrides=args.set)
    return 0


COLUMNS = [
    ("matmul", lambda r: f"{r['matmul']} {r['d']}x{r['f']}"),
    ("rows M", lambda r: str(r["rows"])),
    ("plain ms", lambda r: f"{r['plain_ms']:.3f}"),
    ("invariant / plain", lambda r: f"{r['invariant_over_plain']:.2f}x (block {r['block']})"),
    ("block 8 / plain", lambda r: f"{r['block8_over_plain']:.2f}x"),
    ("M that change a row's bits: plain / invariant",
     lambda r: f"{r['plain_row_classes'] or 'none'} / {r['invariant_row_classes'] or 'none'}"),
]
