"""Pieces the shipped experiments share: model presets, engine runs, plots (host code)."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import numpy as np

from kvjax.config import CacheConfig, ConfigError, EngineConfig, ModelConfig
from kvjax.memory.calculator import kv_bytes, kv_bytes_per_scalar

# Random-weight models: exactness and reuse do not depend on training, and a fixed seed
# makes every run identical. "tiny" is the smoke scale.
MODELS = {
    "tiny": ModelConfig(vocab_size=256, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2,
                        d_ff=128, max_seq_len=4096),
    "small": ModelConfig(vocab_size=256, num_layers=4, d_model=256, num_heads=8,
                         num_kv_heads=2, d_ff=704, max_seq_len=4096),
}


def check_choice(params, key: str, choices) -> None:
    """ConfigError naming `key` unless `params.key` is one of `choices`."""
    value = getattr(params, key)
    if value not in choices:
        raise ConfigError(key, f"{value!r} is not one of {', '.join(map(repr, choices))}")


def check_positive(params, *keys: str) -> None:
    """ConfigError naming the first of `keys` whose value is below 1."""
    for key in keys:
        if getattr(params, key) < 1:
            raise ConfigError(key, f"must be >= 1, got {getattr(params, key)}")


def check_files(params, *keys: str) -> None:
    """ConfigError naming the first of `keys` whose value is not an existing file."""
    for key in keys:
        if not Path(getattr(params, key)).is_file():
            raise ConfigError(key, f"no such file: {getattr(params, key)}")


def check_page_size(params) -> None:
    if params.page_size < 1 or params.capacity_tokens % params.page_size:
        raise ConfigError("page_size", f"must be >= 1 and divide capacity_tokens "
                          f"({params.capacity_tokens}), got {params.page_size}")


@functools.cache
def model(name: str, seed: int):
    """(params, config) of a preset, initialised from `seed` (cached per process)."""
    from kvjax.model.transformer import init_params

    config = MODELS[name]
    return init_params(config, seed), config


# The real-model experiments' (and tests/test_real_model.py's) engines compile every step
# for at least this context (`EngineConfig.min_context`): one shape for every prompt and turn
# up to it, where widths that grow with the sequence compiled a few per run (the bits are the
# same: attention visits no block past a row's end).
REAL_MODEL_CONTEXT = 2048


@functools.cache
def real_model(name: str):
    """`kvjax.models.load(name)`, loaded once per process (the real-model experiments and
    their smoke tests share it)."""
    from kvjax import models

    return models.load(name)


def engine_config(page_size: int, num_pages: int, slots: int, chunk: int = 64,
                  mesh: str | None = None, **engine_kw) -> EngineConfig:
    """An engine whose prefill chunk and attention block are `chunk` tokens at every page
    size, so a token's arithmetic is the same whatever the page size; on `mesh` if given
    (the config's top-level `mesh`, for experiments with `MESH = True`)."""
    chunk = max(chunk, page_size)
    cache = CacheConfig(page_size=page_size, num_pages=num_pages, prefill_chunk=chunk,
                        attn_block=chunk)
    return EngineConfig(cache=cache, max_slots=slots, mesh=mesh, **engine_kw)


TIERS = ("none", "host", "host+disk")  # the tier settings experiments sweep


def tier_fields(p, model: ModelConfig, working: int, folder: str | None) -> dict:
    """The `CacheConfig` fields of the tiers `p` names (p.tiers, p.host_capacity and
    p.disk_capacity in working sets of `working` pages of p.page_size tokens in
    p.kv_format, scales included; the disk tier in `folder`)."""
    if p.tiers == "none" or folder is None:
        return {}
    page = kv_bytes(model.num_layers, model.num_kv_heads, model.head_dim, p.page_size, 1,
                    kv_bytes_per_scalar(p.kv_format, model.head_dim, p.page_size))
    out = {"host_bytes": round(p.host_capacity * working * page)}
    if p.tiers == "host+disk":
        out.update(disk_dir=folder, disk_bytes=round(p.disk_capacity * working * page))
    return out


# Summary-table columns several experiments share: (header, cell of a row).
CAPACITY_COLUMN = ("cache", lambda r: f"{r['capacity']:.0%} ({r['num_pages']} pages)")
OUTPUTS_COLUMN = ("outputs", lambda r: r["tokens_digest"][:8])
# the tours' speculative rows and whether a row's output equals its reference
SPEEDUP_COLUMN = ("speedup", lambda r: f"{r['speedup']:.2f}x" if "speedup" in r else "-")
CALLS_COLUMN = ("tokens/call",
                lambda r: f"{r['tokens_per_call']:.2f}" if "tokens_per_call" in r else "-")
REFERENCE_COLUMN = ("output == reference", lambda r: "yes" if r.get(
    "same_as_cache_off", r.get("same_as_plain")) else "NO")


def spec_line(r: dict) -> str:
    """A tour's headline line for a speculative row."""
    return (f"- {r['case']}: {r['speedup']:.2f}x over plain decoding, "
            f"{r['tokens_per_call']:.2f} tokens per target call, greedy tokens unchanged: "
            f"{'yes' if r['same_as_plain'] else 'NO'}")


def tokens_digest(tokens) -> str:
    """A short digest of generated token lists (to compare outputs across points)."""
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]


def max_abs_diff(a_list, b_list) -> float:
    """Largest |a - b| over matching logits arrays (inf where shapes differ)."""
    worst = 0.0
    for a, b in zip(a_list, b_list, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            return float("inf")
        worst = max(worst, float(np.max(np.abs(a - b))) if a.size else 0.0)
    return worst


def figure(width: float = 6.4, height: float = 4.2, ncols: int = 1):
    """A headless matplotlib figure: (plt, fig, axes), one axes per column."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width, height), dpi=100)
    return plt, fig, axes


def save(plt, fig, out: Path, name: str) -> Path:
    path = Path(out) / name
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
