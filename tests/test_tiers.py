"""Host and disk tiers for evicted pages (kvjax.cache.tiers): pages come back bitwise, a
second process reuses the first one's disk, and nothing damaged, foreign or another
tenant's is ever reused."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from engine_helpers import CACHE, assert_same, engine, params, with_cache

from kvjax import Request

# Two groups of prompts, each page of them distinct. With 96 pages of 4 tokens, A's pages
# (4 prompts of 60 tokens: 60 pages cached) are mostly evicted while B runs (7 prompts,
# 105 pages), so A again finds its pages in the lower tiers.
_RNG = np.random.default_rng(7)
A = [[int(t) for t in _RNG.integers(2, 61, 60)] for _ in range(4)]
B = [[int(t) for t in _RNG.integers(2, 61, 60)] for _ in range(7)]
PAGE_BYTES = 1024  # 2 layers x 2 KV heads x 4 slots x head dim 8 x float32, K and V


def _requests(prompts, tenant=None):
    return [Request(t, 4, return_logits=True, tenant=tenant) for t in prompts]


@pytest.fixture(scope="module")
def p():
    return params()


@pytest.fixture(scope="module")
def reference(p):
    """A's results from an engine without a prefix cache."""
    return engine(p, prefix_cache=False).generate(_requests(A))


def _replay(eng, tenant=None):
    """A, then B (which evicts A's pages), then A again: A's second results."""
    eng.generate(_requests(A, tenant))
    eng.generate(_requests(B, tenant))
    return eng.generate(_requests(A, tenant))


def _restored(results, tier):
    return sum(r.stats["restored_tokens"].get(tier, 0) for r in results)


@pytest.mark.parametrize(("tiers", "dtype"), [
    ("host", "float32"), ("disk", "float32"), ("host+disk", "float32"), ("host", "int8"),
    ("disk", "bfloat16"), ("disk", "int4_kivi")])
def test_evicted_pages_come_back_bitwise(p, reference, tiers, dtype, tmp_path):
    """Pages evicted to host memory, to disk, or through host to disk (a host tier of 8
    pages) are restored into fresh pages: A's outputs equal the cache-off engine's bitwise
    (float32 pages; int8 pages equal their own format's cache-off run). Freed pages are
    poisoned on device, so a restore that read a page after its eviction shows as NaN."""
    host = {"host": 1 << 30, "disk": 0, "host+disk": 8 * PAGE_BYTES}[tiers]
    disk = {} if tiers == "host" else {"disk_dir": str(tmp_path), "disk_bytes": 1 << 30}
    cache = with_cache(CACHE, dtype=dtype, host_bytes=host, **disk)
    eng = engine(p, cache, poison_freed=True)
    again = _replay(eng)
    expected = reference if dtype == "float32" else engine(
        p, with_cache(CACHE, dtype=dtype), prefix_cache=False).generate(_requests(A))
    assert_same(again, expected)
    m = eng.metrics()
    assert m["evictions"] > 0
    restored_from = {"host+disk": "disk"}.get(tiers, tiers)  # 8 pages: A's went on to disk
    assert _restored(again, restored_from) > 0
    assert m["tiers"][restored_from]["restored_pages"] > 0
    for tier in ("host", "disk"):
        assert (tier in m["tiers"]) == (tier in tiers.split("+"))
    if tiers == "host+disk":
        assert m["tiers"]["host"]["evictions"] > 0
    by_tier = m["tiers"]["reused_tokens"]
    assert sum(by_tier.values()) == m["reused_tokens"]
    assert m["tiers"]["restore_s"] > 0


def test_without_tiers_the_same_replay_recomputes(p):
    """The control: without tiers A's second run reuses less (its pages were evicted)."""
    plain = _replay(engine(p))
    tiered = _replay(engine(p, with_cache(CACHE, host_bytes=1 << 30)))
    reused = [sum(r.stats["reused_tokens"] for r in rs) for rs in (plain, tiered)]
    assert reused[0] < reused[1]
    assert all("restored_tokens" not in r.stats for r in plain)


_CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from engine_helpers import CACHE, engine, params, with_cache
    from test_tiers import A, B, _requests
    eng = engine(params(), with_cache(CACHE, disk_dir={folder!r}, disk_bytes=1 << 30))
    eng.generate(_requests(A))
    eng.generate(_requests(B))
    print("pages on disk:", eng.metrics()["tiers"]["disk"]["pages"])
""")


def test_a_second_process_reuses_the_first_ones_disk(p, reference, tmp_path):
    """A child process runs A and B with a disk tier; this process, with the same model and
    cache identity, restores A's pages from the child's files and gets the cache-off
    engine's outputs bitwise. The files are the owner's only."""
    code = _CHILD.format(tests=str(Path(__file__).parent), folder=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=600).stdout
    assert int(out.split("pages on disk:")[1]) > 0
    files = list(tmp_path.glob("*.kvpage"))
    assert files and all(f.stat().st_mode & 0o777 == 0o600 for f in files)
    eng = engine(p, with_cache(CACHE, disk_dir=str(tmp_path), disk_bytes=1 << 30))
    first = eng.generate(_requests(A))
    assert_same(first, reference)
    assert _restored(first, "disk") > 0
    assert eng.metrics()["tiers"]["reused_tokens"]["disk"] == _restored(first, "disk")


def test_a_persisted_cache_outlives_the_process(p, reference, tmp_path):
    """`persist()` writes what host memory and the device hold to the disk tier (nothing
    had reached it: the host tier took every eviction): a new engine on the folder restores
    all of A's pages from disk, outputs bitwise the cache-off engine's; a second call
    writes nothing; a pool without a disk tier refuses by name; a small disk keeps its
    bound and the most recently used pages (B's, not A's)."""
    from kvjax.config import ConfigError

    folder = {"disk_dir": str(tmp_path), "disk_bytes": 1 << 30}
    first = engine(p, with_cache(CACHE, host_bytes=1 << 30, **folder))
    first.generate(_requests(A))
    first.generate(_requests(B))
    m = first.metrics()
    assert m["tiers"]["disk"]["pages"] == 0 < m["tiers"]["host"]["pages"]
    assert first.pool.persist() == m["tiers"]["host"]["pages"] + m["resident_pages"]
    assert first.pool.persist() == 0
    again = engine(p, with_cache(CACHE, **folder)).generate(_requests(A))
    assert_same(again, reference)
    assert _restored(again, "disk") == sum(r.stats["reused_tokens"] for r in again) > 0
    with pytest.raises(ConfigError, match="disk tier"):
        engine(p, with_cache(CACHE, host_bytes=1 << 30)).pool.persist()
    small = tmp_path / "small"
    bound = 10 * (PAGE_BYTES + 900)  # a file: the page and a header (< 900 B)
    eng = engine(p, with_cache(CACHE, host_bytes=1 << 30, disk_dir=str(small),
                               disk_bytes=bound))
    eng.generate(_requests(A))
    eng.generate(_requests(B))
    eng.pool.persist()
    assert eng.metrics()["tiers"]["disk"]["bytes"] <= bound
    later = engine(p, with_cache(CACHE, disk_dir=str(small), disk_bytes=bound))
    assert _restored(later.generate(_requests(A)), "disk") == 0
    assert _restored(later.generate(_requests(B[-1:])), "disk") > 0


def _fill_disk(p, folder) -> list[Path]:
    eng = engine(p, with_cache(CACHE, disk_dir=str(folder), disk_bytes=1 << 30))
    eng.generate(_requests(A))
    eng.generate(_requests(B))
    return sorted(folder.glob("*.kvpage"))


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01  # a bit of the last page value
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-7])


@pytest.mark.parametrize("damage", ["flipped", "truncated", "another_model"])
def test_damaged_or_foreign_files_are_never_reused(p, reference, tmp_path, damage):
    """Every file of the disk is damaged one way: a flipped bit, cut short, or replaced by
    the file of another model's page under this one's name. A new engine skips them with a
    warning, counts them, deletes them and recomputes: outputs equal the cache-off run."""
    files = _fill_disk(p, tmp_path / "disk")
    if damage == "another_model":
        other = _fill_disk(params(seed=2), tmp_path / "other")
        assert other
        for mine, theirs in zip(files, other * len(files), strict=False):
            mine.write_bytes(theirs.read_bytes())
    for f in files:
        {"flipped": _flip, "truncated": _truncate}.get(damage, lambda _: None)(f)
    eng = engine(p, with_cache(CACHE, disk_dir=str(tmp_path / "disk"), disk_bytes=1 << 30))
    with pytest.warns(UserWarning, match="skipped a (damaged|foreign) page"):
        again = eng.generate(_requests(A))
    assert_same(again, reference)
    assert _restored(again, "disk") == 0
    disk = eng.metrics()["tiers"]["disk"]
    kind = "skipped_foreign" if damage == "another_model" else "skipped_damaged"
    assert disk[kind] > 0 and disk[kind] == len(files) - len(list(
        (tmp_path / "disk").glob("*.kvpage")))


def test_a_file_of_another_page_layout_of_the_same_format_is_never_reused(p, tmp_path):
    """int4_kivi pages once kept one float32 scale per group where they now keep a float16
    step and minimum: a file of that layout has this engine's namespace, history and an
    intact checksum, but other arrays. It is skipped as foreign (not written into the pool,
    where its arrays do not fit) and recomputed: outputs equal the cache-off run."""
    from kvjax.cache.tier_block import TierBlock, checksum, read_block, write_block

    kivi = with_cache(CACHE, dtype="int4_kivi")
    disk = with_cache(kivi, disk_dir=str(tmp_path), disk_bytes=1 << 30)
    first = engine(p, disk)
    first.generate(_requests(A))
    first.generate(_requests(B))
    files = sorted(tmp_path.glob("*.kvpage"))
    assert files
    for f in files:
        block = read_block(str(f))
        arrays = {name: a[..., 0].astype(np.float32) if name.endswith("_scale") else a
                  for name, a in block.arrays.items()}  # the old layout: one scale per group
        write_block(str(f), TierBlock(block.root, block.key, block.tokens, block.salts, arrays,
                                      checksum(arrays)))
    eng = engine(p, disk)
    with pytest.warns(UserWarning, match="another page layout under its key"):
        again = eng.generate(_requests(A))
    assert_same(again, engine(p, kivi, prefix_cache=False).generate(_requests(A)))
    assert _restored(again, "disk") == 0
    assert eng.metrics()["tiers"]["disk"]["skipped_foreign"] > 0


def test_another_model_finds_nothing_on_the_disk(p, tmp_path):
    """Another model's engine on the same folder matches none of its files (they are named
    by the namespace) and skips none."""
    _fill_disk(p, tmp_path)
    eng = engine(params(seed=2), with_cache(CACHE, disk_dir=str(tmp_path),
                                            disk_bytes=1 << 30))
    results = eng.generate(_requests(A))
    assert _restored(results, "disk") == 0
    disk = eng.metrics()["tiers"]["disk"]
    assert "skipped_foreign" not in disk and "skipped_damaged" not in disk


def test_salted_pages_stay_their_tenants_through_the_tiers(p, reference):
    """Tenant x's evicted pages are restored for x and never for y (same tokens)."""
    eng = engine(p, with_cache(CACHE, host_bytes=1 << 30))
    _replay(eng, tenant="x")
    other = eng.generate(_requests(A, tenant="y"))
    assert _restored(other, "host") == 0
    assert all(r.stats["reused_tokens"] == 0 for r in other)
    assert_same(other, reference)
    eng.generate(_requests(B, tenant="x"))  # evicts A's pages again
    mine = eng.generate(_requests(A, tenant="x"))
    assert _restored(mine, "host") > 0
    assert_same(mine, reference)


@pytest.mark.parametrize("pages", [3, 20])
def test_each_tier_stays_within_its_bytes(p, tmp_path, pages):
    """A host tier of 3 or 20 pages over a disk of 2 * pages files: after the replay the
    host tier holds at most its bytes, the folder at most its bytes, and both evicted."""
    disk_bytes = 2 * pages * (PAGE_BYTES + 900)  # a file: the page and a header (< 900 B)
    eng = engine(p, with_cache(CACHE, host_bytes=pages * PAGE_BYTES, disk_dir=str(tmp_path),
                               disk_bytes=disk_bytes))
    _replay(eng)
    eng.generate(_requests(B))
    tiers = eng.metrics()["tiers"]
    on_disk = sum(f.stat().st_size for f in tmp_path.glob("*.kvpage"))
    assert tiers["host"]["bytes"] <= pages * PAGE_BYTES
    assert on_disk == tiers["disk"]["bytes"] <= disk_bytes
    assert tiers["host"]["evictions"] > 0 and tiers["disk"]["evictions"] > 0
    assert not list(tmp_path.glob("*.tmp"))


def test_the_tiers_benchmark_restores_what_it_prefilled(p, tmp_path, monkeypatch):
    """`kvjax bench tiers` at toy size: each scene restores the prompt's full pages but the
    last (the bench raises if an answer changed), the dropped-file-cache scene runs, and
    no disk folder is left behind (each SmolLM2 run had left 273 MB in /tmp)."""
    import tempfile

    from engine_helpers import CONFIG

    from kvjax.bench import tiers

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    rows = tiers.measure(p, CONFIG, prompt_len=64, reps=1)
    assert list(tmp_path.iterdir()) == []
    assert [r["scene"] for r in rows] == list(tiers.SCENES)
    for r in rows:
        assert r["restored_tokens"] == 48  # (64 - 1) // 16 pages of 16
        assert r["restore_s"] > 0 and r["cold_prefill_s"] > 0


def test_tiers_are_refused_on_a_mesh_and_kept_from_the_draft_pool(p):
    """A mesh has no rule for the tiers' page reads and writes yet: refused by name. A draft
    model's pool gets no tiers (its pages are recomputed), so it never shares the folder."""
    from engine_helpers import CONFIG

    from kvjax import EngineConfig
    from kvjax.cache.manager import KVCacheManager
    from kvjax.cache.pool import PagePool

    tiered = with_cache(CACHE, host_bytes=1 << 20)
    with pytest.raises(NotImplementedError, match="tiers on a device mesh"):
        PagePool(CONFIG, tiered, sharding=object())
    kv = KVCacheManager.for_engine(CONFIG, EngineConfig(cache=tiered), draft_config=CONFIG)
    assert kv.target.tiers is not None and kv.draft.tiers is None
