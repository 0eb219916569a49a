"""Restoring a cached prefix from the host or disk tier against prefilling it
(`kvjax bench tiers`).

One engine per tier (host memory; disk, with no host tier above it), the model's context
wide enough for the prompt, one slot. Each repetition takes a new prompt of `prompt_len`
random token ids: it is prefilled cold (its `prefill_s`), every cached page is evicted into
the tier, and the same prompt is admitted again, its full pages restored (the tier's
`restore_s`: finding, checking and writing the pages to the device, until written) and its
last page prefilled; its time to first token is set against the cold one's. The second
answer must equal the first, logits bitwise. Disk pages are read twice: from the operating
system's file cache (as just written), and with the files dropped from it first (fsync,
then POSIX_FADV_DONTNEED), what a restart after the cache is gone reads. Medians over
`reps` after one untimed repetition that compiles the shapes.
"""

from __future__ import annotations

import os
import statistics
import tempfile

import numpy as np

from kvjax.config import CacheConfig, EngineConfig
from kvjax.decode.batching import pages_for
from kvjax.engine import Engine, Request
from kvjax.lab.progress import Progress
from kvjax.lab.report import emit, markdown_table, write_results

PAGE = 16
SCENES = ("host", "disk (file cache)", "disk (dropped from file cache)")


def _drop_file_cache(folder: str) -> None:
    for name in os.listdir(folder):
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _engine(params, config, scene: str, prompt_len: int, folder: str) -> Engine:
    pages = pages_for(prompt_len + 2, PAGE)
    tier = {"host_bytes": 1 << 34} if scene == "host" else {
        "disk_dir": folder, "disk_bytes": 1 << 34}
    cache = CacheConfig(page_size=PAGE, num_pages=2 * pages + 8, **tier)
    return Engine(params, config, EngineConfig(cache=cache, max_slots=1,
                                               min_context=prompt_len + PAGE))


def measure(params, config, prompt_len: int, reps: int, progress=None) -> list[dict]:
    """One row per scene (module docstring)."""
    rng = np.random.default_rng(0)
    rows = []
    for scene in SCENES:
        with tempfile.TemporaryDirectory(prefix="kvjax-bench-tiers-") as folder:
            engine = _engine(params, config, scene, prompt_len, folder)
            pool = engine.kv.target
            cold_s, restore_s, tail_s, ttft, restored = [], [], [], [], 0
            for rep in range(reps + 1):
                prompt = [int(t) for t in rng.integers(0, config.vocab_size, prompt_len)]
                request = Request(prompt, 1, return_logits=True, ignore_eos=True)
                cold = engine.generate([request])[0]
                pool.evict(pool.stats()["resident_pages"])
                if scene.startswith("disk (dropped"):
                    _drop_file_cache(folder)
                before = pool.tiers.restore_s
                warm = engine.generate([request])[0]
                if warm.tokens != cold.tokens or not np.array_equal(warm.logits, cold.logits):
                    raise AssertionError(f"{scene}: the restored prefix changed the answer")
                if rep:
                    cold_s.append(cold.stats["prefill_s"])
                    restore_s.append(pool.tiers.restore_s - before)
                    tail_s.append(warm.stats["prefill_s"])
                    ttft.append(warm.stats["ttft_s"] / cold.stats["ttft_s"])
                    restored = sum(warm.stats["restored_tokens"].values())
        page_bytes = pool.page_bytes
        cold, restore = statistics.median(cold_s), statistics.median(restore_s)
        rows.append({"scene": scene, "prompt_tokens": prompt_len, "restored_tokens": restored,
                     "cold_prefill_s": cold, "restore_s": restore,
                     "last_page_prefill_s": statistics.median(tail_s),
                     "restore_vs_prefill": restore / cold,
                     "ttft_vs_cold": statistics.median(ttft),
                     "restore_mb_per_s": restored // PAGE * page_bytes / restore / 1e6})
        if progress is not None:
            progress.update()
    return rows


COLUMNS = [
    ("restored from", lambda r: r["scene"]),
    ("prompt / restored tokens", lambda r: f"{r['prompt_tokens']:,} / "
     f"{r['restored_tokens']:,}"),
    ("cold prefill", lambda r: f"{r['cold_prefill_s'] * 1e3:.0f} ms"),
    ("restore", lambda r: f"{r['restore_s'] * 1e3:.1f} ms"),
    ("restore / prefill", lambda r: f"{r['restore_vs_prefill']:.3f}x"),
    ("restore rate", lambda r: f"{r['restore_mb_per_s']:,.0f} MB/s"),
    ("then the last page", lambda r: f"{r['last_page_prefill_s'] * 1e3:.0f} ms"),
    ("TTFT vs cold", lambda r: f"{r['ttft_vs_cold']:.3f}x"),
]


def main(args) -> int:
    from kvjax import models

    name = args.model or "smollm2-135m-instruct"
    prompt_len = args.prompt_len
    model = models.load(name)
    emit(f"bench tiers: {name}, a {prompt_len}-token prefix restored vs prefilled, "
         f"pages of {PAGE}, medians of {args.reps}")
    with Progress(len(SCENES), "scenes") as bar:
        rows = measure(model.params, model.config, prompt_len, args.reps, progress=bar)
    write_results(args.out, markdown_table(rows, COLUMNS), rows, model=name,
                  prompt_len=prompt_len, reps=args.reps)
    return 0
