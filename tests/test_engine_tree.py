"""Tree speculation in the engine (`SpecConfig(drafter="ngram", tree_nodes=N)`: n-gram trees
verified on device by `kvjax.speculative.tree_loop`): greedy tokens and their logits equal
plain decoding's bitwise, a second turn reuses the pages the trees' verifications wrote,
the accepted path's K/V land where plain decoding writes them and nothing else stays (freed
pages poisoned, shared pages untouched), sampled requests verify trees as well, and the
statistics count nodes by depth. (Trees outside the engine: tests/test_tree_loop.py.)
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from engine_helpers import CACHE, CONFIG, CONTEXT, SLOTS, assert_same
from helpers import fresh_prefill, gather_sequence

import kvjax
from kvjax import CacheConfig, Engine, EngineConfig, SamplingConfig
from kvjax.config import ConfigError, SpecConfig
from kvjax.decode.batching import pages_for
from kvjax.engine.requests import Request
from kvjax.speculative.plugin import write_ahead

# as tests/test_engine_spec.py: every sequence here fits the smallest page-table bucket
ONE_BUCKET = CacheConfig(page_size=8, num_pages=96, prefill_chunk=16, attn_block=32)


@pytest.fixture(scope="module")
def target():
    # random-init weights, as tests/test_engine_spec.py's n-gram tests: this model's greedy
    # answers repeat themselves, so the n-gram table drafts and some drafts are accepted
    return kvjax.init_params(CONFIG, seed=1)


def tree_engine(p, spec: SpecConfig | None, cache=ONE_BUCKET, **kw) -> Engine:
    ec = EngineConfig(cache=cache, max_slots=SLOTS, decode_steps=kw.pop("decode_steps", 4),
                      min_context=CONTEXT, **kw)
    return Engine(p, CONFIG, ec, spec=spec)


def prompts() -> tuple[list[Request], list[Request]]:
    """Two waves over a shared 8-token system prompt; the suffixes hold n-grams with several
    continuations ([a, b] then c, d or e), so the trees branch."""
    rng = np.random.default_rng(7)
    system = [int(t) for t in rng.integers(0, 61, 8)]
    a, b, c, d, e = (int(t) for t in rng.choice(61, 5, replace=False))
    branching = [a, b, c, a, b, d, a, b, e, a, b]
    suffixes = [branching, [5, 6, 7], branching * 2 + [9], [int(t) for t in
                                                          rng.integers(0, 61, 11)]]
    first = [Request(tokens=system + s, max_new_tokens=16, return_logits=True)
             for s in suffixes[:2]]
    second = [Request(tokens=system + s, max_new_tokens=16 + i, return_logits=True)
              for i, s in enumerate(suffixes)]
    return first, second


def second_turns(first: list[Request], answers) -> list[Request]:
    """Each first-wave prompt + its answer + 3 tokens: the answer's full pages were written
    by the trees' verifications."""
    return [Request(tokens=list(r.tokens) + a.tokens + [1, 2, 3], max_new_tokens=6,
                    return_logits=True) for r, a in zip(first, answers, strict=True)]


@pytest.fixture(scope="module")
def plain(target):
    """Plain decoding's two waves and second turns (the turns on a cache-off engine)."""
    first, second = prompts()
    engine = tree_engine(target, None)
    got = engine.generate(first), engine.generate(second)
    cold = tree_engine(target, None, prefix_cache=False)
    return (*got, cold.generate(second_turns(first, got[0])))


# (γ, nodes, branches, verify costs): a branching tree whose paths are shorter than its
# nodes, a tree of one branch (the chain of γ 7, through the tree loop), a small tree of two
# branches, and the first with adaptive widths (2, 4 or 8 nodes; costs that make it switch)
@pytest.mark.parametrize(("gamma", "nodes", "branches", "costs"), [
    (3, 8, 4, None), (7, 8, 1, None), (2, 4, 2, None), (3, 8, 4, ((2, 1.0), (8, 3.0)))])
def test_greedy_trees_equal_plain_decoding_bitwise(target, plain, gamma, nodes, branches,
                                                   costs):
    engine = tree_engine(target, SpecConfig(drafter="ngram", gamma=gamma, tree_nodes=nodes,
                                            branches=branches, adaptive=costs is not None,
                                            verify_costs=costs))
    first, second = prompts()
    got = engine.generate(first), engine.generate(second)
    assert_same(got[0], plain[0])  # tokens and each emitted token's logits, bitwise
    assert_same(got[1], plain[1])
    turns = engine.generate(second_turns(first, got[0]))
    assert_same(turns, plain[2])
    for request, result in zip(second_turns(first, got[0]), turns, strict=True):
        assert result.stats["reused_tokens"] == (len(request.tokens) - 4) // 8 * 8
    s = engine.metrics()["spec"]
    assert s["tree_nodes"] == nodes and s["tree_calls"] == s["target_calls"] > 0
    assert len(s["drafted_by_position"]) == gamma  # nodes at depth 1 .. γ
    assert sum(s["drafted_by_position"]) == s["drafted"] > 0
    assert sum(s["accepted_by_position"]) == s["accepted"] > 0
    # every token but a request's first (its prefill's) came out of a verification
    assert s["emitted"] == sum(len(r.tokens) - 1 for r in [*got[0], *got[1], *turns])
    assert s["alpha_count"] == 0  # α is a chain's measure
    # a draft at depth d is emitted only with its ancestors
    assert s["accepted_by_position"] == sorted(s["accepted_by_position"], reverse=True)
    chain = tree_engine(target, SpecConfig(drafter="ngram", gamma=gamma))
    chain.generate(first), chain.generate(second), chain.generate(second_turns(first, got[0]))
    c = chain.metrics()["spec"]
    keys = ("target_calls", "verifications", "drafted", "accepted", "emitted",
            "drafted_by_position", "accepted_by_position")
    if costs is not None:  # the widest first, then the policy's: more than one width
        assert engine.spec.widths[0] == nodes and len(s["tree_widths"]) > 1
        assert sum(s["tree_widths"].values()) == len(engine.spec.widths)
    elif branches == 1:  # a tree of one branch is the chain: the same rounds, call for call
        # (no stop id here: a tree counts the drafts it emits, a chain those it accepted)
        assert [s[k] for k in keys] == [c[k] for k in keys]
    else:  # the branches reach the drafter: more nodes (3, 8, 4: 53 against 39)
        assert s["drafted"] > c["drafted"]
    m = engine.metrics()
    assert m["free_pages"] == ONE_BUCKET.num_pages - m["resident_pages"]  # nothing leaked


def test_only_the_accepted_path_stays_and_shared_pages_keep_their_bits(target):
    """A tree of 8 nodes on 4-token pages: its nodes cross page boundaries and most are
    rejected. After every scheduling round each sequence holds exactly the pages its kept
    history needs and its cache is bitwise a fresh prefill of that history (the accepted
    path moved to plain decoding's slots, the rejected nodes gone); the system prompt's
    pages, shared through the trie, keep their bits; freed pages hold NaN, so reading one
    would show in the outputs."""
    first, second = prompts()
    spec = SpecConfig(drafter="ngram", gamma=3, tree_nodes=8, branches=4)
    engine = tree_engine(target, spec, cache=CACHE, poison_freed=True)
    plain = tree_engine(target, None, cache=CACHE)
    answers = plain.generate(first)
    later = second + second_turns(first, answers)  # turns: answers in the trie, then trees
    reference = plain.generate(later)
    decode, calls = engine.rounds.runner.decode, []

    def checked_decode(live, budgets, *args, **kw):  # tree_loop's contract on pages
        for seq in live:  # a round's nodes sit at most budget - 1 + nodes - 1 slots ahead
            need = seq.length + budgets[seq.slot] + spec.tree_nodes - 1
            assert len(seq.pages) * CACHE.page_size >= need
        calls.append(len(live))
        return decode(live, budgets, *args, **kw)

    engine.rounds.runner.decode = checked_decode
    assert_same(engine.generate(first), answers)
    shared = engine.trie.pages()
    before = [np.asarray(a[:, :, shared]) for a in (engine.cache.k, engine.cache.v)]
    for r in later:
        engine.submit(r)
    checked = 0
    while engine.num_waiting or engine.num_running:
        engine.step()
        for seq in (s for s in engine.scheduler.slots if s is not None):
            history = seq.req.tokens + seq.generated[:-1]
            assert seq.length == len(history)
            assert len(seq.pages) == pages_for(seq.length, CACHE.page_size)
            fresh = fresh_prefill(engine.model.params, engine.config, CACHE, history,
                                  engine.plan)
            for x, y in zip(gather_sequence(engine.cache, seq.pages, seq.length),
                            gather_sequence(fresh, list(range(len(seq.pages))), seq.length),
                            strict=True):
                np.testing.assert_array_equal(x, y)
            checked += 1
    assert checked > 4 and calls
    results = engine.run()
    assert_same([results[i] for i in sorted(results)], reference)
    after = [np.asarray(a[:, :, shared]) for a in (engine.cache.k, engine.cache.v)]
    for x, y in zip(before, after, strict=True):
        np.testing.assert_array_equal(x, y)
    # the finished answers' full pages, written by the trees' last verifications, entered
    # the trie: each holds its history's fresh-prefill K/V
    pages = {tuple(history): page for _, history, page in engine.trie.entries()}
    leaves = [h for h in pages if not any(o[:len(h)] == h and o != h for o in pages)]
    assert len(pages) > len(shared) + len(later)  # the answers' pages are there
    ps = CACHE.page_size
    for leaf in leaves:
        fresh = fresh_prefill(engine.model.params, engine.config, CACHE, list(leaf),
                              engine.plan)
        for end in range(ps, len(leaf) + 1, ps):
            if leaf[:end] in pages:
                for got, want in ((engine.cache.k, fresh.k), (engine.cache.v, fresh.v)):
                    np.testing.assert_array_equal(np.asarray(got[:, :, pages[leaf[:end]]]),
                                                  np.asarray(want[:, :, end // ps - 1]))
    m = engine.metrics()
    assert m["spec"]["wasted"] > 0 and m["spec"]["tree_calls"] > 0
    assert m["free_pages"] == CACHE.num_pages - m["resident_pages"]


def hot(tokens: list[int], seed: int, top_k: int = 3) -> Request:
    """A prompt sampled at temperature 0.9 from the `top_k` likeliest tokens with `seed`,
    12 tokens."""
    return Request(tokens=tokens, max_new_tokens=12, return_logits=True,
                   sampling=SamplingConfig(temperature=0.9, top_k=top_k, seed=seed))


def assert_sampled_trees(engine_for, plain) -> tuple[Engine, list[Request], list]:
    """An engine's sampled requests verify trees (`tree_loop`'s exact rule; its
    distribution: tests/test_tree_sampling.py), every call a tree call: a seed gives the
    same tokens and logits alone as in a batch (its keys and trees are its own), other
    seeds others; top_k 1 samples greedy decoding's tokens and logits, bitwise; greedy
    requests beside the sampled ones stay plain decoding's. `engine_for()` makes a fresh
    engine; `plain`: plain decoding's answers to `prompts()`' two waves. Returns (the
    engine, the requests it served, its results). The sampled
    prompts end in their greedy answers, which repeat themselves: the n-gram trees draft,
    and the top 3 of this random model's flat distributions accept some drafts."""
    first, second = prompts()
    tails = [r.tokens + a.tokens for r, a in zip(second, plain[1], strict=True)]
    sampled = [hot(t, 4 + i) for i, t in enumerate(tails)]
    top_1 = [hot(r.tokens, 9, top_k=1) for r in first]
    engine, requests = engine_for(), sampled + top_1 + second[2:]
    got = engine.generate(requests)
    s = engine.metrics()["spec"]
    assert s["tree_calls"] == s["target_calls"] > 0
    assert sum(r.stats["spec"]["accepted"] for r in got[:len(sampled)]) > 0
    alone = engine_for()
    for request, result in zip(sampled, got, strict=False):
        assert_same([result], alone.generate([request]))
    reseeded = engine_for().generate([hot(t, 40 + i) for i, t in enumerate(tails)])
    assert sum(a.tokens != b.tokens for a, b in zip(reseeded, got, strict=False)) >= 3
    for result, want in zip(got[len(sampled):len(sampled) + len(top_1)], plain[0],
                            strict=True):
        assert result.tokens == want.tokens[:12]
        np.testing.assert_array_equal(result.logits, want.logits[:12])
    assert_same(got[len(sampled) + len(top_1):], plain[1][2:])
    return engine, requests, got


def test_sampled_rows_verify_trees(target, plain):
    assert_sampled_trees(lambda: tree_engine(target, SpecConfig(
        drafter="ngram", gamma=3, tree_nodes=8, branches=4)), plain)


def test_tree_settings_are_checked():
    with pytest.raises(ConfigError, match="tree_nodes"):
        SpecConfig(drafter="model", tree_nodes=8)
    with pytest.raises(ConfigError, match="tree_nodes"):
        SpecConfig(drafter="ngram", gamma=8, tree_nodes=8)  # a path longer than the tree
    assert SpecConfig(drafter="ngram", adaptive=True, tree_nodes=8).verify_costs is None
    # a call of n nodes grows pages for the n - 1 past the root (sampled rows too)
    spec = SpecConfig(drafter="ngram", gamma=4, adaptive=True, tree_nodes=8)
    assert [write_ahead(spec, n) for n in (2, 4, 5, 8, None)] == [1, 3, 4, 7, 7]
    toml = SpecConfig(drafter="ngram", adaptive=True, tree_nodes=8,
                      verify_costs=[[2, 1], [8, 2.5]])  # as a TOML file gives them
    assert toml.verify_costs == ((2, 1.0), (8, 2.5))
    for bad in (dict(tree_nodes=8), dict(adaptive=True)):  # costs choose adaptive trees' width
        with pytest.raises(ConfigError, match="verify_costs"):
            SpecConfig(drafter="ngram", verify_costs=((2, 1.0),), **bad)
    for costs in ((), ((2, 0.0),), ((0, 1.0),)):
        with pytest.raises(ConfigError, match="verify_costs"):
            SpecConfig(drafter="ngram", adaptive=True, tree_nodes=8, verify_costs=costs)
    with pytest.raises(ConfigError, match="branches"):
        SpecConfig(drafter="ngram", tree_nodes=8, branches=0)
    ec = EngineConfig(cache=ONE_BUCKET, max_slots=SLOTS)
    with pytest.raises(ConfigError, match="adapters"):
        Engine(kvjax.init_params(CONFIG, seed=1), CONFIG, ec,
               adapters={"a": kvjax.init_adapter(CONFIG, rank=4, seed=1)},
               spec=SpecConfig(drafter="ngram", tree_nodes=8))
    with pytest.raises(ConfigError, match="one device"):  # even a mesh of one device
        Engine(kvjax.init_params(CONFIG, seed=1), CONFIG,
               dataclasses.replace(ec, mesh="data=1,model=1"),
               spec=SpecConfig(drafter="ngram", tree_nodes=8))
    # a request is checked against the pages a tree writes past its history (7, not γ 4)
    tight = dataclasses.replace(ONE_BUCKET, num_pages=4)
    engine = Engine(kvjax.init_params(CONFIG, seed=1), CONFIG,
                    EngineConfig(cache=tight, max_slots=SLOTS),
                    spec=SpecConfig(drafter="ngram", tree_nodes=8))
    with pytest.raises(kvjax.InvalidRequestError, match="pages"):
        engine.submit(Request(tokens=list(range(20)), max_new_tokens=6))  # 26 + 7 > 32


def test_adaptive_widths_are_the_policy_s_from_measured_costs(target, monkeypatch):
    """Without pinned costs the engine times a tree verify at each width it chooses from
    (`spec_cost`'s timers faked with known durations: a one-token step 8 ticks, trees of 2,
    4 and 8 nodes 9, 12 and 20), then every call's width is `WidthPolicy`'s after the calls
    before it; what a call tells the policy is its verifications' counts at each cut."""
    from kvjax.speculative import cost as spec_cost

    timed = []

    def fake_step_timer(models, batch, context, tree=False):
        ((_, _, _, width, _),) = models
        timed.append((width, tree, batch, context))
        return lambda: {1: 8, 2: 9, 4: 12, 8: 20}[width] / 1024

    monkeypatch.setattr(spec_cost, "step_timer", fake_step_timer)
    engine = tree_engine(target, SpecConfig(drafter="ngram", gamma=3, tree_nodes=8,
                                            adaptive=True))
    seen = []
    observe = engine.spec.width_policy.observe
    engine.spec.width_policy.observe = lambda *a: (seen.append(a), observe(*a))
    first, second = prompts()
    engine.generate(first), engine.generate(second)
    m = engine.metrics()["spec"]
    assert m["verify_costs"] == {2: 9 / 8, 4: 12 / 8, 8: 20 / 8}
    assert sorted(timed) == [(1, False, SLOTS, 128), (2, True, SLOTS, 128),
                             (4, True, SLOTS, 128), (8, True, SLOTS, 128)]
    assert_widths_replay(engine, seen)


def assert_widths_replay(engine, seen: list) -> None:
    """Every call's width (of 2, 4, 8) is a replayed `WidthPolicy`'s after the calls before
    it, more than one width is used, the first the widest; `seen`: what each call told the
    engine's policy (width, verifications, accepted drafts at each cut), which sums to the
    engine's counts (a call's cut at its own width: the drafts it accepted)."""
    from kvjax.speculative.tree_policy import WidthPolicy

    m = engine.metrics()["spec"]
    replay, want = WidthPolicy([2, 4, 8]), []
    for width, verifications, by_width in seen:
        want.append(replay.choose(m["verify_costs"]))
        replay.observe(width, verifications, by_width)
        assert by_width[0] == 0 and list(by_width) == sorted(by_width)  # a cut keeps less
    assert engine.spec.widths == [w for w, _, _ in seen] == want
    assert want[0] == 8 and len(set(want)) > 1
    assert sum(int(v) for _, v, _ in seen) == m["verifications"]
    assert sum(int(b[w - 1]) for w, _, b in seen) == m["accepted"]


def test_a_sampled_operating_point_samples_each_prompt_with_its_own_seed(target):
    """`measure_point(sampling=...)` (`kvjax run configs/mtbench_spec.toml --set
    params.temperature=...`): prompt i is sampled with seed + i, so two copies of one prompt
    get two answers, neither the greedy one; greedy points stay greedy."""
    from kvjax.speculative.operating_point import _run, measure_point

    prompt = prompts()[0][0].tokens
    spec = SpecConfig(drafter="ngram", gamma=3, tree_nodes=8, branches=4)
    run = dict(decode_steps=4, gen_tokens=12, slots=1, base=None, eos_tokens=())
    knobs = SamplingConfig(temperature=0.9, top_k=3, seed=1)
    _, _, greedy = _run((target, CONFIG), None, [prompt], spec, **run)
    _, m, hot = _run((target, CONFIG), None, [prompt, prompt], spec, **run, sampling=knobs)
    assert hot[0] != hot[1] and greedy[0] not in hot
    assert m["spec"]["tree_calls"] == m["spec"]["target_calls"] > 0
    point = measure_point((target, CONFIG), None, [prompt], "ngram", 3, False, 0.0, 0.0, 4,
                          gen_tokens=12, slots=1, reps=1, warmup=False, tree_nodes=8,
                          sampling=knobs)
    # the point's figure is its run's: the same prompt, seed, tree and engine alone
    _, alone, _ = _run((target, CONFIG), None, [prompt], spec, **run, sampling=knobs)
    assert point["prompts"] == 1
    assert point["mean_accepted_length"] == alone["spec"]["mean_accepted_length"]


def test_a_point_compares_decode_time_per_decoded_token(monkeypatch):
    """Sampled answers differ in length between the plain and the speculative run, so the
    speedup is the ratio of decode time per decoded token (an answer's first token comes
    from its prefill): plain 4 s for 10 tokens against 3 s for 5 is 0.67x, not 1.33x."""
    from kvjax.speculative import operating_point

    def run(target, draft, spec, prompts, **kw):
        return (4.0, {}, [[1] * 11]) if spec is None else (3.0, {"spec": {}}, [[1] * 6])

    monkeypatch.setattr(operating_point, "_run", run)
    speedup, *_ = operating_point._paired(None, None, [[1]], SpecConfig(drafter="ngram"), 4,
                                          16, 1, 1, warmup=False)
    assert speedup == pytest.approx(0.4 / 0.6)
