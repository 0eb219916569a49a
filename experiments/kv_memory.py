"""KV memory: MHA vs GQA vs MQA and float32 vs bfloat16 vs int8 pages, bytes per token and
decode time.

For each attention layout (query heads fixed, KV heads = query heads / 1 / all) and page
format: the calculator's bytes per token (`kvjax.memory.kv_bytes`, int8's scales included),
the bytes per token of the cache the engine actually allocates (its K and V arrays, and
int8's scales, over its token slots), and the on-device multi-step decode time per token at
one batch and context (median of repetitions after warm-up). bfloat16 and int8 pages store
rounded K/V, so their outputs differ from float32 pages': the largest logit difference on a
short greedy generation is reported beside it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from experiments import common
from kvjax import memory
from kvjax.cache.paged import cache_bytes, init_cache
from kvjax.config import CacheConfig, ModelConfig
from kvjax.decode.batching import pages_for
from kvjax.decode.generate import generate
from kvjax.lab.timing import Holder, contiguous_pages, filled_with_noise, multistep_seconds
from kvjax.memory.calculator import KV_FORMATS, kv_bytes_per_scalar
from kvjax.model.transformer import init_params

LAYOUTS = ("mha", "gqa", "mqa")
PROBE_LEN = 96  # prompt tokens of the bfloat16-vs-float32 logit comparison


@dataclasses.dataclass(frozen=True)
class Params:
    attention: str = "gqa"
    cache_dtype: str = "float32"
    num_layers: int = 4
    d_model: int = 512
    num_heads: int = 8
    gqa_kv_heads: int = 2
    d_ff: int = 1408
    batch: int = 8
    context: int = 1024
    decode_steps: int = 32
    reps: int = 5
    page_size: int = 16

    def __post_init__(self):
        common.check_choice(self, "attention", LAYOUTS)
        # int4_kivi's open pages need a row per sequence: `kvjax bench kv_format` measures it
        common.check_choice(self, "cache_dtype", tuple(f for f in KV_FORMATS
                                                      if f != "int4_kivi"))
        common.check_positive(self, "num_layers", "d_model", "num_heads", "gqa_kv_heads",
                              "d_ff", "batch", "context", "decode_steps", "reps", "page_size")
        self.model_config()  # the model's own checks (head counts, divisibility)

    def kv_heads(self) -> int:
        return {"mha": self.num_heads, "gqa": self.gqa_kv_heads, "mqa": 1}[self.attention]

    def model_config(self) -> ModelConfig:
        return ModelConfig(vocab_size=256, num_layers=self.num_layers, d_model=self.d_model,
                           num_heads=self.num_heads, num_kv_heads=self.kv_heads(),
                           d_ff=self.d_ff,
                           max_seq_len=max(self.context + self.decode_steps + 64, PROBE_LEN + 64))


def run(config) -> dict:
    p = config.params
    model = p.model_config()
    params = init_params(model, config.seed)
    chunk = max(64, p.page_size)
    cache_cfg = CacheConfig(page_size=p.page_size, num_pages=1, dtype=p.cache_dtype,
                            prefill_chunk=chunk, attn_block=chunk)
    table, paged_cfg = contiguous_pages(cache_cfg, p.batch, p.context + p.decode_steps + 1)
    cache = init_cache(model, paged_cfg)
    slots = paged_cfg.num_pages * paged_cfg.page_size
    measured = cache_bytes(cache) / slots
    per_number = kv_bytes_per_scalar(p.cache_dtype, model.head_dim)
    calculated = memory.kv_bytes(model.num_layers, model.num_kv_heads, model.head_dim, 1,
                                 bytes_per_scalar=per_number)
    holder = Holder(filled_with_noise(cache))
    lengths = np.full(p.batch, p.context, np.int32)
    seconds = multistep_seconds(params, model, holder, table, lengths, p.decode_steps, p.reps)
    del holder
    return {
        "kv_heads": model.num_kv_heads, "head_dim": model.head_dim,
        "bytes_per_token_calculator": calculated, "bytes_per_token_measured": measured,
        "calculator_matches": calculated == measured,
        "cache_bytes_at_context": calculated * p.batch * p.context,
        "decode_ms_per_token": seconds * 1e3,
        "max_logit_diff_vs_f32": _dtype_diff(params, model, p, chunk),
    }


def _dtype_diff(params, model: ModelConfig, p: Params, chunk: int) -> float:
    """Largest |logit| difference between this page format and float32 (greedy, 16
    tokens)."""
    if p.cache_dtype == "float32":
        return 0.0
    prompts = [[(7 * i + 3 * j) % 256 for j in range(PROBE_LEN)] for i in range(2)]
    logits = {}
    for dtype in ("float32", p.cache_dtype):
        pages = 2 * pages_for(PROBE_LEN + 16, p.page_size)
        cache = CacheConfig(page_size=p.page_size, num_pages=pages, dtype=dtype,
                            prefill_chunk=chunk, attn_block=chunk)
        result = generate(params, model, prompts, 16, cache=cache, return_logits=True)
        logits[dtype] = result.logits
    return common.max_abs_diff(logits["float32"], logits[p.cache_dtype])


TIMING = ("decode_ms_per_token",)

COLUMNS = [
    ("attention", lambda r: f"{r['attention'].upper()} ({r['kv_heads']} KV heads)"),
    ("cache", lambda r: r["cache_dtype"]),
    ("bytes/token (calculator)", lambda r: f"{r['bytes_per_token_calculator']:,}"),
    ("bytes/token (measured)", lambda r: f"{r['bytes_per_token_measured']:,.0f}"),
    ("KV at batch x context", lambda r: memory.human_bytes(r["cache_bytes_at_context"])),
    ("decode ms/token", lambda r: f"{r['decode_ms_per_token']:.2f}"),
    ("max abs Δlogit vs f32", lambda r: f"{r['max_logit_diff_vs_f32']:.2g}"),
]


def headline(rows: list[dict]) -> str:
    match = all(r["calculator_matches"] for r in rows)
    big = max(rows, key=lambda r: r["bytes_per_token_measured"])
    small = min(rows, key=lambda r: r["bytes_per_token_measured"])
    fast = min(rows, key=lambda r: r["decode_ms_per_token"])
    slow = max(rows, key=lambda r: r["decode_ms_per_token"])
    return (f"Calculator == measured cache bytes per token at every point: "
            f"{'yes' if match else 'NO'}. {big['attention'].upper()}/{big['cache_dtype']} "
            f"holds {big['bytes_per_token_measured'] / small['bytes_per_token_measured']:.0f}x "
            f"the bytes per token of {small['attention'].upper()}/{small['cache_dtype']}; "
            f"decode per token ranges from {fast['decode_ms_per_token']:.2f} ms "
            f"({fast['attention'].upper()}/{fast['cache_dtype']}) to "
            f"{slow['decode_ms_per_token']:.2f} ms ({slow['attention'].upper()}/"
            f"{slow['cache_dtype']}).")


def plot(rows: list[dict], out) -> list:
    plt, fig, (ax1, ax2) = common.figure(9.0, 3.6, ncols=2)
    dtypes = list(dict.fromkeys(r["cache_dtype"] for r in rows))
    layouts = list(dict.fromkeys(r["attention"] for r in rows))
    width = 0.8 / max(len(dtypes), 1)
    for i, dtype in enumerate(dtypes):
        rs = [next(r for r in rows if r["attention"] == a and r["cache_dtype"] == dtype)
              for a in layouts if any(r["attention"] == a and r["cache_dtype"] == dtype
                                      for r in rows)]
        x = [j + (i - (len(dtypes) - 1) / 2) * width for j in range(len(rs))]
        ax1.bar(x, [r["bytes_per_token_measured"] / 1024 for r in rs], width, label=dtype)
        ax2.bar(x, [r["decode_ms_per_token"] for r in rs], width, label=dtype)
    for ax in (ax1, ax2):
        ax.set_xticks(range(len(layouts)), [a.upper() for a in layouts])
        ax.legend(fontsize=8, title="cache", title_fontsize=8)
    ax1.set_ylabel("KV bytes per token (KiB)")
    ax2.set_ylabel("decode time per token (ms)")
    first = rows[0]
    fig.suptitle(f"KV memory and decode time (batch {first['batch']}, context "
                 f"{first['context']})", fontsize=10)
    return [common.save(plt, fig, out, "kv_memory.png")]
