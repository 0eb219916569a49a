"""EAGLE-style head trees in the engine (`SpecConfig(drafter="eagle", tree_nodes=N)` with
`draft=HeadFile`; `kvjax.speculative.eagle_engine`): greedy tokens and their logits equal
plain decoding's bitwise, the head's pages (the draft pool) hold the pairs
[F_j, e(h_{j+1})] of their history wherever they were written (prefill, a verify's
catch-up) and are reused through the trie only where every token they depend on matches,
preemption and samples sharing a prompt keep both pools consistent, sampled requests
verify trees too, and what an EAGLE engine cannot serve is refused. (The head's trees
themselves: tests/test_eagle_device.py.)
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from eagle_helpers import trained_head
from engine_helpers import CONFIG, CONTEXT, SLOTS, assert_same
from helpers import gather_sequence
from test_engine_tree import (
    ONE_BUCKET,
    assert_sampled_trees,
    assert_widths_replay,
    prompts,
    second_turns,
)

import kvjax
from kvjax import CacheConfig, Engine, EngineConfig
from kvjax.cache.admission import pool_keys
from kvjax.cache.paged import BatchInfo, init_cache
from kvjax.config import ConfigError, SpecConfig
from kvjax.decode import steps
from kvjax.decode.batching import page_table
from kvjax.engine.requests import Request, salts_per_page
from kvjax.io.hf import CheckpointError
from kvjax.speculative.eagle import head_config
from kvjax.speculative.eagle_engine import head_prefill
from kvjax.speculative.plugin import write_ahead

SPEC = SpecConfig(drafter="eagle", gamma=3, tree_nodes=8, branches=3)
# EAGLE-2's rerank: 1 + 4 x 5 = 21 candidates grown (the head runs the 17 of the first
# four levels, more pairs than the tree's 6 nodes: past them, in rounds far from the call's
# budget, a write-ahead of the tree's nodes would write into other pages), cut to 6
RERANK = SpecConfig(drafter="eagle", gamma=5, tree_nodes=6, branches=4, rerank=True)
# adaptive widths 2, 4, 8 at nearly one cost: the policy moves with what calls accept
ADAPTIVE = SpecConfig(drafter="eagle", gamma=3, tree_nodes=8, branches=3, adaptive=True,
                      verify_costs=((2, 1.0), (4, 1.02), (8, 1.04)))


@pytest.fixture(scope="module")
def target():
    return kvjax.init_params(CONFIG, seed=1)  # tests/test_engine_tree.py's target


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """The tests' head for `target` (`eagle_helpers`: its drafts are right often enough that
    verifications accept some, asserted where it matters)."""
    return trained_head(tmp_path_factory)["head"]


def eagle_engine(target, head, spec=SPEC, cache=ONE_BUCKET, **kw) -> Engine:
    ec = EngineConfig(cache=cache, max_slots=SLOTS, decode_steps=kw.pop("decode_steps", 4),
                      min_context=CONTEXT, **kw)
    return Engine(target, CONFIG, ec, spec=spec, draft=head)


@pytest.fixture(scope="module")
def runs(target, head):
    """Plain decoding's and EAGLE engines' (level by level, reranked, adaptive widths) two
    waves, then second turns (each first-wave prompt + its answer + 3 tokens, over pages
    the verifications wrote). "observed": what each of the adaptive engine's calls told
    its width policy."""
    first, second = prompts()
    out = {"observed": []}
    adaptive = eagle_engine(target, head, ADAPTIVE)
    observe = adaptive.spec.width_policy.observe
    adaptive.spec.width_policy.observe = lambda *a: (out["observed"].append(a), observe(*a))
    for name, engine in (("plain", Engine(target, CONFIG, EngineConfig(
            cache=ONE_BUCKET, max_slots=SLOTS, decode_steps=4, min_context=CONTEXT))),
                         ("eagle", eagle_engine(target, head)),
                         ("rerank", eagle_engine(target, head, RERANK)),
                         ("adaptive", adaptive)):
        got = [engine.generate(first), engine.generate(second)]
        got.append(engine.generate(second_turns(first, got[0])))
        out[name] = (engine, got)
    return out


@pytest.mark.parametrize("name", ["eagle", "rerank", "adaptive"])
def test_greedy_eagle_trees_equal_plain_decoding_bitwise(runs, name):
    engine, got = runs[name]
    for mine, plain in zip(got, runs["plain"][1], strict=True):
        assert_same(mine, plain)  # tokens and each emitted token's logits, bitwise
    s = engine.metrics()["spec"]
    assert s["drafter"] == "eagle" and s["tree_calls"] == s["target_calls"] > 0
    assert sum(s["drafted_by_position"]) == s["drafted"] > 0
    assert s["accepted"] > 0  # some drafts were the target's tokens (measured: 4 of 150)
    assert s["emitted"] == sum(len(r.tokens) - 1 for wave in got for r in wave)
    m = engine.metrics()
    assert m["free_pages"] == ONE_BUCKET.num_pages - m["resident_pages"]  # nothing leaked
    head = engine.draft_pool
    assert head.num_free + head.trie.num_nodes == ONE_BUCKET.num_pages


def test_a_turn_reuses_as_much_in_both_pools(runs):
    """A second turn reuses the pages its first turn's prefill and verifications wrote, as
    many in the head's pool as in the target's (the head's pairs come from the target's
    prefill: the target recomputes what the head lacks); at least the prompt's."""
    first, _ = prompts()
    _, got = runs["eagle"]
    for request, result in zip(first, got[2], strict=True):
        st = result.stats
        assert st["reused_tokens"] == st["draft_reused_tokens"]
        assert st["reused_tokens"] >= (len(request.tokens) - 1) // 8 * 8 > 0


def _head_reference(engine: Engine, history: list[int]):
    """A fresh head cache holding the pairs [F_j, e(h_{j+1})], j < len(history) - 1, in
    pages 0, 1, ...: the features of one prefill of the whole history (the engine's plan),
    the head over them in one extend."""
    cc, config, eagle = engine.cache_config, engine.config, engine.spec.eagle
    n = len(history)
    table = page_table([list(range(-(-config.max_seq_len // cc.page_size)))], 1,
                       cc.block_pages)
    tokens = np.asarray(history, np.int32)[None]
    (_, feats), _ = steps.extend(engine.model.params, config, init_cache(config, cc), tokens,
                                 BatchInfo(page_table=table, lengths=np.zeros(1, np.int32),
                                           num_new=np.asarray([n], np.int32)),
                                 plan=engine.plan, features=True)
    return head_prefill(eagle.head, eagle.embedding, config,
                        init_cache(head_config(config), cc), feats[:, :-1], tokens[:, 1:],
                        BatchInfo(page_table=table, lengths=np.zeros(1, np.int32),
                                  num_new=np.asarray([n - 1], np.int32)), eagle.plan)


def test_the_engine_s_tree_calls_cut_by_the_rerank(target, head, monkeypatch):
    """`SpecConfig(rerank=True)` reaches every tree call (`tree_loop(rerank=True)`, whose
    trees tests/test_eagle.py checks; this head's reranked trees happen to be its
    level-by-level ones: its deeper offers never outrank a first-level one)."""
    from kvjax.speculative import plugin

    seen, real = [], plugin.tree_loop

    def spy(*args, **kw):
        seen.append(kw["rerank"])
        return real(*args, **kw)

    monkeypatch.setattr(plugin, "tree_loop", spy)
    eagle_engine(target, head, RERANK).generate(prompts()[0][:1])
    assert seen and all(seen)


@pytest.mark.parametrize("name", ["eagle", "rerank", "adaptive"])
def test_the_head_pages_hold_the_pairs_of_their_history(runs, name):
    """Every head page in the trie after the runs (prompts' prefills, answers' pages
    written by the head's catch-ups in tree calls, second turns) holds what a fresh
    prefill of its history's pairs writes, bitwise: the features and tokens the engine
    paired, at the slots it paired them. With the rerank the head writes more candidates'
    pairs than the tree keeps, past the kept ones (the engine's write-ahead holds them);
    with adaptive widths each call's narrower or wider tree."""
    first, second = prompts()
    engine, got = runs[name]
    assert_head_pages(engine, [*first, *second, *second_turns(first, got[0])],
                      [*got[0], *got[1], *got[2]])


def assert_head_pages(engine: Engine, requests: list[Request], answers: list) -> None:
    """Every head page the trie holds for a request's history is a fresh prefill's of its
    pairs, bitwise; at least two requests' pages reach past their prompts."""
    pool, ps = engine.draft_pool, engine.cache_config.page_size
    checked = 0
    for request, answer in zip(requests, answers, strict=True):
        history = list(request.tokens) + answer.tokens
        salts = salts_per_page(request, len(history), ps)
        keys = pool_keys(pool, history, salts, kvjax.cache.trie.history_digests(history, ps))
        pages = pool.match(pool.namespace(0), *keys).pages
        assert len(pages) >= (len(request.tokens) - 1) // ps  # at least the prompt's pairs
        reference = _head_reference(engine, history[: len(pages) * ps + 1])
        for got_kv, want_kv in zip(gather_sequence(pool.cache, pages, len(pages) * ps),
                                   gather_sequence(reference, list(range(len(pages))),
                                                   len(pages) * ps), strict=True):
            np.testing.assert_array_equal(got_kv, want_kv)
        checked += len(pages) * ps > len(request.tokens)  # pages past the prompt: decode's
    assert checked >= 2


def test_adaptive_widths_are_the_policy_s_after_the_calls_before(runs):
    """Each call's width is `WidthPolicy`'s after what the calls before it told it (a
    replayed policy chooses the same), the first the widest; what a call tells is its
    verifications' accepted drafts at each cut to fewer nodes, which its own width's
    cut sums to the drafts it accepted (the head grows a narrower tree as the first
    nodes of a wider one: tests/test_eagle_device.py)."""
    engine, _ = runs["adaptive"]
    assert_widths_replay(engine, runs["observed"])
    assert engine.metrics()["spec"]["accepted"] > 0


def test_a_round_s_cost_times_the_head_s_drafting_with_the_verify(target, head, runs,
                                                                  monkeypatch):
    """Unpinned, an adaptive EAGLE engine measures each width's round at start-up with
    `cost.round_costs` (a tree verify, then the head's drafting, timed together; a
    stand-in here, so the figures are known) and not the verify alone; then the real
    `round_costs` with the engine's own head: one-token target steps per width (a timing:
    only its form)."""
    from kvjax.speculative import cost
    from kvjax.speculative.cost import round_costs

    def verify_only(*_):
        raise AssertionError("an EAGLE round's cost is not the verify's alone")

    monkeypatch.setattr(cost, "verify_costs", verify_only)
    monkeypatch.setattr(cost, "round_costs", lambda t, e, b, c, widths, depth, top_k: {
        2: 1.5, 4: 11.0, 8: 21.0})
    engine = eagle_engine(target, head, dataclasses.replace(ADAPTIVE, verify_costs=None))
    assert_same(engine.generate(prompts()[0]), runs["plain"][1][0])
    assert engine.spec.verify_costs == {2: 1.5, 4: 11.0, 8: 21.0}
    widths = engine.spec.widths
    assert len(widths) > 1 and widths[0] == 8 and set(widths[1:8]) == {2}
    monkeypatch.undo()

    engine, _ = runs["eagle"]
    model = engine.model
    costs = round_costs((model.params, model.config, model.plan), engine.spec.eagle, 2, 32,
                        [2, 8], 3, 3)
    assert set(costs) == {2, 8} and all(0 < c < 100 for c in costs.values())


def test_the_head_reuses_a_page_only_with_the_token_after_it(target, head):
    """A head page's last pair embeds the token after the page: a prompt of two full
    pages leaves one head page (its pairs stop a token short), so a longer prompt over it
    reuses one page in both pools, not the target's two; and a page whose next token
    differs is not reused at all."""
    engine = eagle_engine(target, head)
    rng = np.random.default_rng(3)
    base = [int(t) for t in rng.integers(0, 61, 16)]
    engine.generate([Request(tokens=base, max_new_tokens=2)])
    assert engine.pool.trie.num_nodes == 2 and engine.draft_pool.trie.num_nodes == 1
    longer = Request(tokens=base + [7, 8, 9], max_new_tokens=8, return_logits=True)
    other = Request(tokens=base[:8] + [(base[8] + 1) % 61] + base[9:], max_new_tokens=8,
                    return_logits=True)
    got = engine.generate([longer])
    assert got[0].stats["reused_tokens"] == got[0].stats["draft_reused_tokens"] == 8
    got += engine.generate([other])  # token 8 differs: head page 0's last pair differs
    assert got[1].stats["reused_tokens"] == got[1].stats["draft_reused_tokens"] == 0
    # both were cut by the head's pages, and are told so
    assert [r.stats["miss_cause"] for r in got] == ["draft", "draft"]
    plain = Engine(target, CONFIG, EngineConfig(cache=ONE_BUCKET, max_slots=SLOTS,
                                                decode_steps=4, min_context=CONTEXT))
    assert_same(got, plain.generate([longer, other]))


def test_a_row_done_early_in_a_call_keeps_its_pending_pairs(target, head, runs):
    """A call's rows finish at different rounds (one row's budget cut to 1 here; in
    serving, a row whose drafts were accepted): a finished row stays in the loop writing
    nothing, and after the call every sample's pairs are cached or pending, none lost:
    draft_length + pending == length - 1. The answers stay plain decoding's."""
    engine = eagle_engine(target, head)
    decode, cut = engine.rounds.runner.decode, []

    def one_row_cut(live, budgets, *args, **kw):
        if len(live) > 1:
            budgets = {**budgets, live[0].slot: 1}
            cut.append(live[0].slot)
        out = decode(live, budgets, *args, **kw)
        for seq in live:
            assert seq.draft_length + seq.head.pending == seq.length - 1
        return out

    engine.rounds.runner.decode = one_row_cut
    assert_same(engine.generate(prompts()[1]), runs["plain"][1][1])
    assert len(cut) > 3


def test_a_host_tier_restores_no_page_the_head_cannot_pair(target, head):
    """The head's pages have no lower tiers: with both tries evicted, the target's pages in
    the host tier would be restored for nothing (the head lacks their pairs), so none is;
    the request recomputes its prompt and is still plain decoding's."""
    cache = CacheConfig(page_size=8, num_pages=96, prefill_chunk=16, attn_block=32,
                        host_bytes=1 << 26)
    engine = eagle_engine(target, head, cache=cache)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 61, 40)]
    engine.generate([Request(tokens=prompt, max_new_tokens=4)])
    assert engine.pool.evict(100) == engine.draft_pool.evict(100) == 5
    assert engine.kv.target.tiers.stats()["host"]["pages"] == 5  # the target's only
    request = Request(tokens=prompt + [1, 2], max_new_tokens=4, return_logits=True)
    got = engine.generate([request])
    assert engine.kv.target.tiers.stats()["host"].get("restored_pages", 0) == 0
    assert got[0].stats["reused_tokens"] == 0
    plain = Engine(target, CONFIG, EngineConfig(cache=ONE_BUCKET, max_slots=SLOTS,
                                                decode_steps=4, min_context=CONTEXT))
    assert_same(got, plain.generate([request]))


def test_preemption_and_shared_prompts_keep_both_pools(target, head):
    """A cache too small for every request at once: requests are preempted and resumed,
    two greedy samples share their prompt's pages in both pools (copy on write), and
    every answer is still plain decoding's, bitwise, with no page lost in either pool."""
    small = CacheConfig(page_size=4, num_pages=40, prefill_chunk=16, attn_block=8)
    first, second = prompts()
    requests = [Request(tokens=r.tokens, max_new_tokens=24, return_logits=True)
                for r in second] + [Request(tokens=first[0].tokens, max_new_tokens=12, n=2)]
    engine = eagle_engine(target, head, cache=small)
    got = engine.generate(requests)
    plain = Engine(target, CONFIG, EngineConfig(cache=small, max_slots=SLOTS,
                                                decode_steps=4, min_context=CONTEXT))
    assert_same(got[:4], plain.generate(requests[:4]))
    alone = plain.generate([Request(tokens=first[0].tokens, max_new_tokens=12)])[0].tokens
    assert got[4].tokens == [alone, alone]
    m = engine.metrics()
    assert m["preemptions"] > 0
    assert m["free_pages"] == small.num_pages - m["resident_pages"]
    assert engine.draft_pool.num_free + engine.draft_pool.trie.num_nodes == small.num_pages


def test_sampled_requests_verify_eagle_trees(target, head, runs):
    """As n-gram tree engines do (`assert_sampled_trees`: every call a tree call, a seed's
    tokens and logits the same alone as in a batch, top_k 1 greedy's bitwise, greedy
    neighbours plain decoding's); and the head's pages written along sampled paths hold
    their history's pairs, bitwise."""
    engine, requests, got = assert_sampled_trees(lambda: eagle_engine(target, head),
                                                 runs["plain"][1])
    assert_head_pages(engine, requests, got)


def test_what_an_eagle_engine_cannot_serve_is_refused(target, head):
    engine = eagle_engine(target, head)
    prompt = prompts()[0][0].tokens
    with pytest.raises(ConfigError, match="tree_nodes"):
        SpecConfig(drafter="eagle", gamma=3)  # EAGLE drafts trees only
    with pytest.raises(ConfigError, match="rerank: for EAGLE trees of a fixed size"):
        SpecConfig(drafter="eagle", gamma=3, tree_nodes=8, adaptive=True, rerank=True)
    with pytest.raises(ConfigError, match="rerank: for EAGLE trees"):
        SpecConfig(drafter="ngram", gamma=3, tree_nodes=8, rerank=True)
    with pytest.raises(ConfigError, match="HeadFile"):
        Engine(target, CONFIG, spec=SPEC, draft=(target, CONFIG))
    with pytest.raises(ConfigError, match="drafter='eagle'"):
        Engine(target, CONFIG, spec=SpecConfig(drafter="model"), draft=head)
    with pytest.raises(ConfigError, match="partial_page_copy"):
        eagle_engine(target, head, partial_page_copy=True)
    other = kvjax.init_params(CONFIG, seed=2)
    with pytest.raises(CheckpointError, match="another target"):
        Engine(other, CONFIG, spec=SPEC, draft=head)
    with pytest.raises(CheckpointError, match="another target"):
        engine.load_params(other)
    assert engine.generate([Request(tokens=prompt, max_new_tokens=4)])[0].status == "finished"


def test_the_write_ahead_holds_every_candidate_s_pair():
    """The slots a call may write past a row's kept history (pages are allocated for them):
    an EAGLE tree's nodes, or with the rerank every candidate grown before the cut
    (1 + 4 x 5 = 21 for trees of 6, depth 5, 4 offers a level), at every width."""
    assert write_ahead(SPEC) == 8 and write_ahead(SPEC, 2) == 2
    assert write_ahead(RERANK) == write_ahead(RERANK, 6) == 21
    assert write_ahead(dataclasses.replace(RERANK, tree_nodes=24)) == 24  # more than grown


def test_head_keys_name_every_token_a_page_depends_on():
    """`pool_keys` for a pool one token behind (an EAGLE head's): blocks of the tokens
    after the first, the first named in block 0's salt, each block salted as the page of
    its last token (a public page followed by a tenant's is the tenant's)."""
    pool = kvjax.cache.pool.PagePool(head_config(CONFIG), CacheConfig(page_size=4,
                                                                       num_pages=4))
    tokens, salts = list(range(10, 20)), [None, "t", "t"]
    assert pool_keys(pool, tokens, salts, ["d"] * 3) == (tokens, salts, ["d"] * 3)
    pool.lead = 1
    keyed, keyed_salts, digests = pool_keys(pool, tokens, salts, ["d"] * 3)
    assert keyed == tokens[1:] and keyed_salts == ["t|after:[10]", "t", "t"]
    assert len(digests) == 2  # the full blocks of the 9 keyed tokens
    assert pool_keys(pool, tokens, [None, None, None], [])[1][0] == "after:[10]"
