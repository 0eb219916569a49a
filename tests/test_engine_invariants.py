"""Hypothesis state machines over the engine: random submit / step / cancel / evict, on a
plain engine (prompts prefilled in prefill calls, or in packed decode steps) and on one
with a draft model (whose page pool, trie and copy-on-write run beside the target's).

Invariants after every rule, in every page pool: each page's reference count equals the
references the live sequences and the trie hold; a page a sequence has decoded into is
referenced by it alone; free + referenced pages account for the whole cache. At the end:
nothing leaked, and every page a trie holds contains exactly the K/V a fresh prefill of its
history computes (the draft's pages with the draft model). Each run asserts that the pages
it compared include every writer: prefill calls, packed steps, decode steps, verification
and draft steps. Seeded (`SEED`): CI runs the same examples every time, and an edit of a
machine's source does not change them (derandomize alone seeds from the source).
"""

from __future__ import annotations

import collections
import functools
import shutil
import tempfile
from pathlib import Path
from typing import ClassVar

import numpy as np
from engine_helpers import CACHE, CONFIG, CONTEXT, engine, params, with_cache
from helpers import fresh_prefill, small_model
from hypothesis import HealthCheck, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import kvjax
from kvjax import Engine, EngineConfig, Request, SamplingConfig, SpecConfig
from kvjax.cache.tier_block import read_block

NUM_PAGES = 36
PS = CACHE.page_size
PAGE_BYTES = 1024  # 2 layers x 2 KV heads x 4 slots x head dim 8 x float32, K and V
SYSTEM = list(range(3, 30))
DRAFT = small_model(num_layers=1, d_model=16, num_heads=2, num_kv_heads=1, d_ff=32,
                    max_seq_len=256, tie_embeddings=False)


@functools.cache
def target_params():
    """Made on first use, not at import (both xdist workers import every test file)."""
    return params(seed=4)


@functools.cache
def draft_params():
    return kvjax.init_params(DRAFT, seed=5)


SEED = 0


@seed(SEED)
class EngineMachine(RuleBasedStateMachine):
    # pages compared at teardown, per (pool, writer), summed over the run's examples
    checked: ClassVar[collections.Counter] = collections.Counter()
    answer_writer = "decode"

    def __init__(self):
        super().__init__()
        self.eng: Engine | None = None
        self.ids: list[int] = []
        self.packed_spans: list[tuple[tuple[int, ...], int, int]] = []  # (prompt, start, stop)
        # (history, [start, stop) written in the target's pool, the same in the draft's)
        self.decoded: list[tuple[tuple[int, ...], tuple[int, int], tuple[int, int]]] = []

    @initialize(packed=st.booleans())
    def start(self, packed):
        self.eng = self.make_engine(packed)
        self.record_writers()

    def record_writers(self) -> None:
        """Records what each decode call (plain or verifying) and each packed step wrote."""
        runner = self.eng.rounds.runner
        decode, packed_fill = runner.decode, runner.packed_fill

        def recording_decode(live, *args, **kw):
            before = [(seq, seq.length, seq.draft_length) for seq in live]
            out = decode(live, *args, **kw)
            for seq, length, draft_length in before:
                self.decoded.append((tuple(seq.req.tokens + seq.generated),
                                     (length, seq.length), (draft_length, seq.draft_length)))
            return out

        def recording_fill(rows, longest=1):
            fill, tokens = packed_fill(rows, longest)
            if fill is not None:
                for row, count in zip(rows, np.asarray(fill.count), strict=False):
                    self.packed_spans.append((tuple(row.tokens), row.start, row.start + count))
            return fill, tokens

        runner.decode, runner.packed_fill = recording_decode, recording_fill

    def start_speculating(self, spec: SpecConfig, draft=None) -> None:
        """The machine's engine speculating with `spec` (and `draft`), no packed steps."""
        ec = EngineConfig(cache=with_cache(num_pages=NUM_PAGES), max_slots=3, decode_steps=3,
                          min_context=CONTEXT, partial_page_copy=True, poison_freed=True)
        self.eng = Engine(target_params(), CONFIG, ec, draft=draft, spec=spec)
        self.record_writers()

    def make_engine(self, packed: bool) -> Engine:
        """Prompts of up to 57 tokens in 16-token chunks: with `packed`, those with more
        than one chunk left are prefilled in the decode call's steps."""
        return engine(target_params(), cache=with_cache(num_pages=NUM_PAGES), max_slots=3,
                      decode_steps=3, partial_page_copy=True, poison_freed=True,
                      packed_prefill=packed)

    def writer(self, history: tuple[int, ...], pool: int) -> str:
        """Which step wrote a cached page (the last block of `history`), as recorded when it
        was written: a decode call (verification under speculation; the draft's own steps in
        the draft pool), a packed step, else a prefill call (a prompt's, or a resumed
        answer's)."""
        lo, hi = len(history) - PS, len(history)
        for tokens, target, draft in self.decoded:
            start, stop = draft if pool else target
            if tokens[:hi] == history and start < hi and stop > lo:
                return "draft" if pool else self.answer_writer
        for prompt, start, stop in self.packed_spans:
            if prompt[:hi] == history and start < hi and stop > lo:
                return "packed"
        return "prefill"

    def pools(self):
        """(allocator, trie, a sequence's (pages, cached length), model config, numerics
        plan, params) per page pool: the engine's own (its plan, its kernels as it stores
        them)."""
        return [(self.eng.allocator, self.eng.trie, lambda seq: (seq.pages, seq.length),
                 self.eng.config, self.eng.plan, self.eng.model.params)]

    @rule(prefix=st.integers(0, len(SYSTEM)), suffix=st.lists(st.integers(0, 5), max_size=30),
          max_new=st.integers(1, 12), n=st.integers(1, 2), tenant=st.sampled_from([None, "t"]),
          hot=st.booleans())
    def submit(self, prefix, suffix, max_new, n, tenant, hot):
        tokens = SYSTEM[:prefix] + suffix
        if not tokens:
            return
        sampling = SamplingConfig(temperature=1.0, seed=len(self.ids)) if hot else \
            SamplingConfig()
        self.ids.append(self.eng.submit(Request(tokens, max_new, sampling=sampling, n=n,
                                                tenant=tenant, public_prefix=min(8, prefix))))

    @rule()
    def step(self):
        self.eng.step()

    @precondition(lambda self: self.eng.rounds.live)
    @rule(data=st.data())
    def cancel(self, data):
        self.eng.cancel(data.draw(st.sampled_from(sorted(self.eng.rounds.live))))

    @rule(pages=st.integers(1, 8), pool=st.integers(0, 1))
    def evict(self, pages, pool):
        pools = self.pools()
        pools[pool % len(pools)][1].evict(pages)

    @invariant()
    def refcounts_match_the_holders(self):
        for i, (alloc, trie, pages_of, *_) in enumerate(self.pools()):
            holders = collections.Counter(trie.pages())
            for req in self.eng.rounds.live.values():
                for seq in req.seqs:
                    holders.update(pages_of(seq)[0])
            for entry in self.eng.rounds.prefilling:  # prompts still being prefilled
                holders.update(entry.draft.pages if i else entry.row.pages)
            for page in range(NUM_PAGES):
                assert alloc.refcount(page) == holders[page], page
            assert alloc.num_free == NUM_PAGES - len(holders)

    @invariant()
    def decoded_pages_have_one_writer(self):
        for alloc, _, pages_of, *_ in self.pools():
            for req in self.eng.rounds.live.values():
                for seq in req.seqs:
                    pages, length = pages_of(seq)
                    if seq.slot is None or length <= len(req.tokens):
                        continue
                    first_written = len(req.tokens) // PS
                    for page in pages[first_written:(length - 1) // PS + 1]:
                        assert alloc.refcount(page) == 1

    def teardown(self):
        """Nothing leaked, and every cached page holds its history's fresh-prefill K/V: one
        fresh prefill per leaf history covers every page on the path to it."""
        for _ in self.eng.stream():
            pass
        draft = self.eng.draft_pool
        caches = [self.eng.cache] + ([] if draft is None else [draft.cache])
        for i, ((alloc, trie, _, config, plan, p), cache) in enumerate(
                zip(self.pools(), caches, strict=True)):
            trie_pages = trie.pages()
            assert alloc.num_free + len(trie_pages) == NUM_PAGES
            assert all(alloc.refcount(page) == 1 for page in trie_pages)
            pages = collections.defaultdict(list)  # history -> its pages (one per namespace)
            for _, history, page in trie.entries():
                pages[tuple(history)].append(page)
            assert sum(map(len, pages.values())) == len(trie_pages)
            longer = {h[:-PS] for h in pages}
            k, v = np.asarray(cache.k), np.asarray(cache.v)
            compared = set()
            for leaf in (h for h in pages if h not in longer):
                fresh = fresh_prefill(p, config, CACHE, list(leaf), plan)
                fk, fv = np.asarray(fresh.k), np.asarray(fresh.v)
                for end in range(PS, len(leaf) + 1, PS):
                    history = leaf[:end]
                    if history in compared:
                        continue
                    compared.add(history)
                    for page in pages[history]:
                        np.testing.assert_array_equal(k[:, :, page], fk[:, :, end // PS - 1])
                        np.testing.assert_array_equal(v[:, :, page], fv[:, :, end // PS - 1])
                    type(self).checked[i, self.writer(history, i)] += len(pages[history])
            assert compared == set(pages)


class TieredEngineMachine(EngineMachine):
    """The same rules on an engine whose evicted pages go to a host tier of 6 pages and on
    to a disk tier of about 12: after every rule each tier is within its bytes (the folder
    too); at the end every page a tier holds is its history's fresh-prefill K/V, and
    over the run pages were restored from both tiers."""

    checked: ClassVar[collections.Counter] = collections.Counter()
    host_bytes, disk_bytes = 6 * PAGE_BYTES, 12 * (PAGE_BYTES + 700)

    def make_engine(self, packed: bool) -> Engine:
        self.folder = tempfile.mkdtemp(prefix="kvjax-tiers-")
        cache = with_cache(num_pages=NUM_PAGES, host_bytes=self.host_bytes,
                           disk_dir=self.folder, disk_bytes=self.disk_bytes)
        return engine(target_params(), cache=cache,
                      max_slots=3, decode_steps=3, partial_page_copy=True, poison_freed=True,
                      packed_prefill=packed)

    @invariant()
    def tiers_stay_within_their_bytes(self):
        host, disk = self.eng.kv.target.tiers.levels
        on_disk = sum(f.stat().st_size for f in Path(self.folder).glob("*.kvpage"))
        assert host.bytes <= self.host_bytes
        assert on_disk == disk.bytes <= self.disk_bytes

    def teardown(self):
        super().teardown()
        host, disk = self.eng.kv.target.tiers.levels
        blocks = [("host", b) for b in host.blocks.values()] + [
            ("disk", read_block(str(f))) for f in Path(self.folder).glob("*.kvpage")]
        for tier, block in blocks:
            fresh = fresh_prefill(self.eng.model.params, CONFIG, CACHE, list(block.tokens),
                                  self.eng.plan)
            page = len(block.tokens) // PS - 1
            np.testing.assert_array_equal(block.arrays["k"], np.asarray(fresh.k)[:, :, page])
            np.testing.assert_array_equal(block.arrays["v"], np.asarray(fresh.v)[:, :, page])
            type(self).checked[tier] += 1
        for level in (host, disk):
            type(self).checked[f"restored_{level.name}"] += level.stats["restored_pages"]
        shutil.rmtree(self.folder)


class SpecEngineMachine(EngineMachine):
    """The same rules on an engine drafting with a model (γ 2): both pools checked. Packed
    steps are plain decoding only, so this machine draws no `packed` flag."""

    checked: ClassVar[collections.Counter] = collections.Counter()
    answer_writer = "verify"

    @initialize()
    def start(self):
        self.start_speculating(SpecConfig(gamma=2), draft=(draft_params(), DRAFT))

    def pools(self):
        draft = self.eng.draft_pool
        return super().pools() + [(draft.allocator, draft.trie,
                                   lambda seq: (seq.draft_pages, seq.draft_length),
                                   self.eng.spec.config, self.eng.spec.plan,
                                   self.eng.spec.params)]


class TreeEngineMachine(EngineMachine):
    """The same rules on an engine verifying n-gram trees (up to 8 nodes, paths of 3, 4
    branches: the suffixes' 6-token alphabet makes bushy trees) of adaptive widths (2, 4
    or 8 nodes, from pinned verify costs); hot requests verify trees as well (and replay
    their widths when recomputed). No draft pool; packed steps are plain decoding only."""

    checked: ClassVar[collections.Counter] = collections.Counter()
    answer_writer = "verify"

    @initialize()
    def start(self):
        self.start_speculating(SpecConfig(drafter="ngram", gamma=3, tree_nodes=8, branches=4,
                                          adaptive=True, verify_costs=((2, 1.0), (8, 2.0))))
        decode = self.eng.spec.decode

        def counting(model, kv, steps, live, budgets, gamma, state, *args, **kw):
            type(self).checked["sampled_calls"] += bool(np.any(state.temperature > 0))
            return decode(model, kv, steps, live, budgets, gamma, state, *args, **kw)

        self.eng.spec.decode = counting

    def teardown(self):
        super().teardown()
        assert self.eng.metrics()["errors"] == 0  # no recomputation contradicted its stream
        type(self).checked["tree_calls"] += self.eng.spec.tree_calls
        type(self).checked.update(("width", w) for w in self.eng.spec.widths)
        type(self).checked["target_calls"] += self.eng.spec.totals.target_calls


SETTINGS = dict(stateful_step_count=30, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])


def run(machine: type[EngineMachine], examples: int) -> collections.Counter:
    """Runs a machine's examples; returns the pages compared per (pool, writer)."""
    machine.checked = collections.Counter()
    run_state_machine_as_test(machine, settings=settings(max_examples=examples, **SETTINGS))
    return machine.checked


def test_engine_invariants():
    checked = run(EngineMachine, 30)
    for writer in ("prefill", "packed", "decode"):
        assert checked[0, writer] > 0, (writer, checked)


def test_tiered_engine_invariants():
    checked = run(TieredEngineMachine, 12)
    for key in ("host", "disk", "restored_host", "restored_disk"):
        assert checked[key] > 0, (key, checked)


def test_spec_engine_invariants():
    checked = run(SpecEngineMachine, 15)
    for key in ((0, "prefill"), (0, "verify"), (1, "prefill"), (1, "draft")):
        assert checked[key] > 0, (key, checked)


def test_tree_engine_invariants():
    checked = run(TreeEngineMachine, 12)
    for key in ((0, "prefill"), (0, "verify"), "tree_calls"):
        assert checked[key] > 0, (key, checked)
    assert checked["tree_calls"] == checked["target_calls"]  # hot requests' calls too
    assert checked["sampled_calls"] > 0
    assert sum(checked["width", w] > 0 for w in (2, 4, 8)) >= 2, checked
