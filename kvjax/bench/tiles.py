"""Row-invariance benchmark: which row counts change a token row's bits, and what a fixed
row tile costs, for every token-row matmul of a model (`kvjax bench tiles`).

For each matmul shape of the config's model (q, k/v, o, MLP up/down, head): the row
counts M whose row bits differ from the row computed alone (`kvjax.model.tiled.row_classes`),
plainly and tiled; then median times of a plain `[M, d] @ [d, f]` and of the same rows
through fixed tiles of T rows, side by side in one run (ratios; absolute times drift).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.config import load_config
from kvjax.lab.report import emit, markdown_table, write_results
from kvjax.lab.timing import median_seconds
from kvjax.model.tiled import model_shapes, plain_matmul, row_classes, tiled_matmul

ROWS = (1, 8, 64, 256)
TILES = (8, 16, 32)


def _time(matmul, x, w, reps: int) -> float:
    fn = jax.jit(matmul)
    return median_seconds(lambda: fn(x, w).block_until_ready(), reps)


def main(args) -> int:
    model = load_config(args.config, args.set).model
    reps = args.reps
    emit(f"bench tiles: {args.config}: d_model {model.d_model}, d_ff {model.d_ff}, "
         f"vocab {model.vocab_size}; float32; medians of {reps}")
    rng = np.random.default_rng(0)
    rows = []
    for name, (d, f) in model_shapes(model).items():
        classes = {"plain": row_classes(plain_matmul, d, f)}
        classes.update({f"T={t}": row_classes(partial(tiled_matmul, tile=t), d, f)
                        for t in TILES})
        w = jnp.asarray(rng.standard_normal((d, f)).astype(np.float32))
        for m in ROWS:
            x = jnp.asarray(rng.standard_normal((m, d)).astype(np.float32))
            plain = _time(plain_matmul, x, w, reps)
            tiled = {t: _time(partial(tiled_matmul, tile=t), x, w, reps) for t in TILES}
            rows.append({"matmul": name, "d": d, "f": f, "rows": m, "plain_ms": plain * 1e3,
                         **{f"tile{t}_ms": s * 1e3 for t, s in tiled.items()},
                         **{f"tile{t}_over_plain": s / plain for t, s in tiled.items()},
                         "plain_row_classes": classes["plain"],
                         "tiled_row_classes": {t: c for t, c in classes.items() if t != "plain"}})
            emit(f"{name} [{m}, {d}] @ [{d}, {f}]: plain {plain * 1e3:.3f} ms, "
                 + ", ".join(f"T={t} {s / plain:.2f}x" for t, s in tiled.items()))
    write_results(args.out, markdown_table(rows, COLUMNS), rows, config=args.config,
                  overrides=args.set)
    return 0


def _classes(r) -> str:
    plain = r["plain_row_classes"]
    tiled = sorted({m for c in r["tiled_row_classes"].values() for m in c})
    return f"{plain or 'none'} / {tiled or 'none'}"


COLUMNS = [
    ("matmul", lambda r: f"{r['matmul']} {r['d']}x{r['f']}"),
    ("rows M", lambda r: str(r["rows"])),
    ("plain ms", lambda r: f"{r['plain_ms']:.3f}"),
    *[(f"T={t} / plain", lambda r, t=t: f"{r[f'tile{t}_over_plain']:.2f}x") for t in TILES],
    ("M that change a row's bits: plain / tiled", _classes),
]
