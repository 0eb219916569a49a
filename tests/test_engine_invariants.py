"""Hypothesis state machine over the engine: random submit / step / cancel / evict.

Invariants after every rule: each page's reference count equals the references the live
sequences and the trie hold; a page a sequence has decoded into is referenced by it alone;
free + referenced pages account for the whole cache. At the end: nothing leaked, and every
page the trie holds contains exactly the K/V a fresh prefill of its history computes.
"""

from __future__ import annotations

import collections

import numpy as np
from engine_helpers import CACHE, CONFIG, engine, params, with_cache
from helpers import prefill
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvjax import Request, SamplingConfig, init_cache

P = params(seed=4)
NUM_PAGES = 36
PS = CACHE.page_size
SYSTEM = list(range(3, 30))


class EngineMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.eng = engine(P, cache=with_cache(num_pages=NUM_PAGES), max_slots=3,
                          decode_steps=3, partial_page_copy=True, poison_freed=True)
        self.ids: list[int] = []

    @rule(prefix=st.integers(0, len(SYSTEM)), suffix=st.lists(st.integers(0, 5), max_size=9),
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

    @precondition(lambda self: self.eng._reqs)
    @rule(data=st.data())
    def cancel(self, data):
        self.eng.cancel(data.draw(st.sampled_from(sorted(self.eng._reqs))))

    @rule(pages=st.integers(1, 8))
    def evict(self, pages):
        self.eng.trie.evict(pages)

    @invariant()
    def refcounts_match_the_holders(self):
        holders = collections.Counter(self.eng.trie.pages())
        for req in self.eng._reqs.values():
            for seq in req.seqs:
                holders.update(seq.pages)
        alloc = self.eng.allocator
        for page in range(NUM_PAGES):
            assert alloc.refcount(page) == holders[page], page
        assert alloc.num_free == NUM_PAGES - len(holders)

    @invariant()
    def decoded_pages_have_one_writer(self):
        for req in self.eng._reqs.values():
            for seq in req.seqs:
                if seq.slot is None or seq.length <= len(req.tokens):
                    continue
                first_written = len(req.tokens) // PS
                for page in seq.pages[first_written:(seq.length - 1) // PS + 1]:
                    assert self.eng.allocator.refcount(page) == 1

    def teardown(self):
        for _ in self.eng.stream():
            pass
        trie_pages = self.eng.trie.pages()
        assert self.eng.allocator.num_free + len(trie_pages) == NUM_PAGES
        assert all(self.eng.allocator.refcount(page) == 1 for page in trie_pages)
        k = np.asarray(self.eng.cache.k)
        v = np.asarray(self.eng.cache.v)
        for _, history, page in self.eng.trie.entries()[:12]:
            pages = list(range(len(history) // PS))
            _, fresh = prefill(P, CONFIG, CACHE, init_cache(CONFIG, CACHE), history, pages)
            np.testing.assert_array_equal(k[:, :, page], np.asarray(fresh.k)[:, :, pages[-1]])
            np.testing.assert_array_equal(v[:, :, page], np.asarray(fresh.v)[:, :, pages[-1]])


EngineMachine.TestCase.settings = settings(
    max_examples=30, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestEngineInvariants = EngineMachine.TestCase
