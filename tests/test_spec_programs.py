"""One speculative program for every γ and every tree width: `spec_loop` takes γ traced under
a static γ_max (`tree_loop` an n-gram tree's width under a static max_nodes), and each γ's
(width's) tokens, logits, statistics and K/V are those of the program compiled for it
alone, bitwise (both drafters, both numerics); a verify padded past γ + 1 (past the width)
changes no bit under invariant numerics; an adaptive engine, whose γ changes from call to
call, compiles one loop and still emits plain decoding's tokens and logits."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from engine_helpers import CACHE, CONFIG, CONTEXT, SLOTS, assert_same
from helpers import prefill

import kvjax
from kvjax import Engine, EngineConfig, SamplingConfig
from kvjax.config import SpecConfig
from kvjax.decode import aot
from kvjax.decode.batching import page_table
from kvjax.decode.sampling import sequence_keys
from kvjax.decode.state import decode_state
from kvjax.engine.requests import Request
from kvjax.model.layout import store
from kvjax.model.plan import FAST, INVARIANT
from kvjax.speculative.gamma import GammaPolicy
from kvjax.speculative.loop import DraftState, spec_loop, verify_widths
from kvjax.speculative.tree_loop import tree_loop

GAMMA_MAX = 3  # verify widths 2, 3, 4: the program holds a branch per γ
DRAFT, NOISE = CONFIG, 0.01  # accepted 5-7 of 36 drafts (0.02: none)
ROWS, NEW = 3, 12
# repetitive prompts (the n-gram drafter finds continuations) of different lengths
PROMPTS = [[5, 6, 7, 8] * 3, [9, 10, 11] * 3 + [12], [13, 14] * 5 + [15, 16, 17]]


@pytest.fixture(scope="module")
def models():
    """A random target (its greedy text repeats itself: n-gram drafts get accepted) and, as
    the draft, the target with noise on every weight (accepted often, not always)."""
    target = kvjax.init_params(CONFIG, seed=1)
    leaves, tree = jax.tree.flatten(target)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    noisy = [x + NOISE * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys,
                                                                                 strict=True)]
    return target, jax.tree.unflatten(tree, noisy)


def _inputs(models, plan, sampling: SamplingConfig | None = None):
    """(target, draft params as `plan` stores them, caches with each prompt prefilled but its
    last token, the state and the draft's rows)."""
    target, draft = (store(p, plan) for p in models)
    caches = [kvjax.init_cache(c, CACHE) for c in (CONFIG, DRAFT)]
    rows = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(ROWS)]  # 8 pages each
    for prompt, pages in zip(PROMPTS, rows, strict=True):
        caches = [prefill(p, c, CACHE, cache, prompt[:-1], pages, plan=plan)[1]
                  for p, c, cache in zip((target, draft), (CONFIG, DRAFT), caches, strict=True)]
    table = page_table(rows, ROWS, CACHE.block_pages)
    lengths = np.array([len(p) - 1 for p in PROMPTS], np.int32)
    last = np.array([p[-1] for p in PROMPTS], np.int32)
    state = decode_state(table, lengths, last, np.full(ROWS, NEW, np.int32),
                         sequence_keys(0, ROWS), [sampling] * ROWS)
    history = np.zeros((ROWS, 64), np.int32)
    for i, p in enumerate(PROMPTS):
        history[i, :len(p)] = p
    rows_state = DraftState(page_table=table, lengths=lengths, prev=np.zeros(ROWS, np.int32))
    return target, draft, caches, state, history, rows_state


def _run(inputs, drafter, plan, gamma, gamma_max, widths=None, sampled=False):
    target, draft, caches, state, history, rows_state = inputs
    copies = [jax.tree.map(lambda x: x.copy(), c) for c in caches]  # the loop donates them
    extra = (dict(draft_params=draft, draft_config=DRAFT, draft=rows_state, draft_plan=plan)
             if drafter == "model" else dict(history=history))
    out, cache, draft_cache = spec_loop(
        target, CONFIG, copies[0], state, drafter=drafter, gamma=gamma, gamma_max=gamma_max,
        widths=widths, max_out=NEW, return_logits=True, plan=plan, draft_cache=copies[1],
        sampled=sampled, **extra)
    return jax.tree.map(np.asarray, (out, cache, draft_cache))


def _assert_same_call(got, want, gamma):
    """Tokens, logits, lengths, rounds, statistics (the first γ positions; none past) and
    both caches, bitwise."""
    (out, cache, draft_cache), (ref, ref_cache, ref_draft) = got, want
    for name in ("tokens", "logits", "lengths", "rounds", "draft_lengths", "prev"):
        np.testing.assert_array_equal(getattr(out, name), getattr(ref, name), err_msg=name)
    for name, value in vars(out.stats).items():
        value, expected = np.asarray(value), np.asarray(getattr(ref.stats, name))
        if name.endswith("_by_position"):
            assert not value[:, gamma:].any(), name
            value = value[:, :gamma]
        np.testing.assert_array_equal(value, expected, err_msg=name)
    for a, b in zip(jax.tree.leaves((cache, draft_cache)),
                    jax.tree.leaves((ref_cache, ref_draft)), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("plan", [FAST, INVARIANT], ids=["fast", "invariant"])
@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_one_program_serves_every_gamma(models, drafter, plan):
    inputs = _inputs(models, plan)
    traced = aot.trace_counts().get("spec_loop", 0)
    shared = {g: _run(inputs, drafter, plan, g, GAMMA_MAX) for g in range(1, GAMMA_MAX + 1)}
    assert aot.trace_counts()["spec_loop"] - traced == 1  # one program for γ 1 .. 3
    for gamma, got in shared.items():
        alone = _run(inputs, drafter, plan, gamma, gamma, (gamma + 1,))
        _assert_same_call(got, alone, gamma)
    accepted = [int(out.stats.accepted.sum()) for out, _, _ in shared.values()]
    assert len(set(accepted)) > 1 and min(accepted) > 0  # the γ reached the rounds


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_sampled_rows_get_their_own_program_s_bits(models, drafter):
    """Sampled rows (temperature 0.8, top-k 20; invariant numerics): each γ's tokens,
    logits, K/V and statistics are its own program's, bitwise, the α sums over the padded
    positions included."""
    inputs = _inputs(models, INVARIANT, SamplingConfig(temperature=0.8, top_k=20, seed=3))
    for gamma in (1, 3):
        _assert_same_call(_run(inputs, drafter, INVARIANT, gamma, GAMMA_MAX, sampled=True),
                          _run(inputs, drafter, INVARIANT, gamma, gamma, (gamma + 1,),
                               sampled=True), gamma)


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_a_padded_verify_changes_no_bit_under_invariant_numerics(models, drafter):
    """A verify wider than γ + 1 (the padded columns fed, not written) emits the same tokens,
    logits and K/V as γ + 1 columns: under invariant numerics a row's bits do not depend on
    the call's width."""
    inputs = _inputs(models, INVARIANT)
    for gamma in (1, 2):
        padded = _run(inputs, drafter, INVARIANT, gamma, GAMMA_MAX, (GAMMA_MAX + 1,))
        _assert_same_call(padded, _run(inputs, drafter, INVARIANT, gamma, gamma, (gamma + 1,)),
                          gamma)


TREE_WIDTHS, DEPTH = (2, 4, 8), 3


def _tree(inputs, plan, width, max_nodes, widths):
    target, _, caches, state, history, _ = inputs
    out, cache = tree_loop(target, CONFIG, jax.tree.map(lambda x: x.copy(), caches[0]), state,
                           history, max_nodes=max_nodes, width=width, widths=widths,
                           depth=DEPTH, branches=3, max_out=NEW, return_logits=True, plan=plan)
    return jax.tree.map(np.asarray, (out, cache))


def _assert_same_tree(got, want, width):
    (out, cache), (ref, ref_cache) = got, want
    for name, value in vars(out).items():
        if value is None:
            continue
        expected = getattr(ref, name)
        if name == "accepted_by_width":  # a cut to w >= the width keeps the whole path
            assert (value[:, width:] == value[:, width - 1:width]).all()
            value = value[:, :width]
        np.testing.assert_array_equal(value, expected, err_msg=name)
    for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(ref_cache), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("plan", [FAST, INVARIANT], ids=["fast", "invariant"])
def test_one_tree_program_serves_every_width(models, plan):
    inputs = _inputs(models, plan)
    traced = aot.trace_counts().get("tree_loop", 0)
    shared = {w: _tree(inputs, plan, w, TREE_WIDTHS[-1], TREE_WIDTHS) for w in TREE_WIDTHS}
    assert aot.trace_counts()["tree_loop"] - traced == 1
    for width, got in shared.items():
        _assert_same_tree(got, _tree(inputs, plan, None, width, None), width)
    drafted = [int(out.drafted.sum()) for out, _ in shared.values()]
    assert drafted == sorted(drafted) and len(set(drafted)) == 3  # wider trees, more drafts
    assert min(int(out.accepted.sum()) for out, _ in shared.values()) > 0
    # padded: a width-3 tree verified at 8 columns is the 3-node program's, bitwise
    if plan is INVARIANT:
        _assert_same_tree(_tree(inputs, plan, 3, 8, None), _tree(inputs, plan, None, 3, None), 3)


def _cache_copies(compiled, cache) -> int:
    """Copies of a cache-shaped buffer in a compiled program's HLO."""
    dims = ",".join(map(str, jax.tree.leaves(cache)[0].shape))
    return sum(" copy(" in line and f"[{dims}]" in line
               for line in compiled.as_text().splitlines())


def test_the_shared_programs_update_the_cache_in_place(models):
    """A branch per verify width must not copy the pool each round (XLA copies a cache a
    conditional's branches update: `jax.lax.switch` here compiled to 8 copies of the pool a
    round; `one_of` runs each branch in a while loop of at most one trip, carried in
    place)."""
    target, _, caches, state, history, _ = _inputs(models, FAST)
    chain = spec_loop.lower(target, CONFIG, caches[0], state, drafter="ngram", gamma=1,
                            gamma_max=GAMMA_MAX, max_out=NEW, history=history,
                            sampled=False).compile()
    tree = tree_loop.lower(target, CONFIG, caches[0], state, history, max_nodes=8, width=2,
                           widths=TREE_WIDTHS, depth=DEPTH, max_out=NEW).compile()
    assert _cache_copies(chain, caches[0]) == _cache_copies(tree, caches[0]) == 0


def test_a_gamma_past_the_program_s_bound_is_refused(models):
    inputs = _inputs(models, FAST)
    for gamma in (0, GAMMA_MAX + 1):
        with pytest.raises(ValueError, match="gamma must be in"):
            _run(inputs, "ngram", FAST, gamma, GAMMA_MAX)
    for width, widths in ((0, None), (9, None), (4, (2, 4))):
        with pytest.raises(ValueError, match="max_nodes"):
            _tree(inputs, FAST, width, 8, widths)


def test_adaptive_gamma_chooses_among_the_program_s_widths():
    """The engine's policy prices only the γ its program verifies without padding (1, 2, 4,
    8 under γ_max 8): at α 0.7 and 0.8 the best of every γ (3, 5) is not among them."""
    for alpha, free, offered in ((0.7, 3, 4), (0.8, 5, 4), (0.5, 2, 2)):
        policies = [GammaPolicy(8), GammaPolicy(8, [w - 1 for w in verify_widths(8)])]
        for policy in policies:
            policy.observe(1, alpha, 1.0, [0.0], [0.0])  # running α only: no evidence
        assert [p.choose(0.1, 0.05) for p in policies] == [free, offered]
    with pytest.raises(ValueError, match="choices"):
        GammaPolicy(8, [1, 2, 4])


def test_verify_widths_are_checked():
    assert verify_widths(3) == (2, 3, 4)
    assert verify_widths(8) == (2, 3, 5, 9) and verify_widths(6) == (2, 3, 5, 7)
    assert verify_widths(4, (5, 2, 2)) == (2, 5)
    for gamma_max, widths in ((0, None), (3, (2, 3)), (3, (1, 4)), (3, (4, 6))):
        with pytest.raises(ValueError, match="gamma_max"):
            verify_widths(gamma_max, widths)


def test_an_adaptive_engine_compiles_one_loop(models):
    """Adaptive γ changes from call to call (its history has several values): one `spec_loop`
    program serves them all, and the answers are plain decoding's, tokens and logits bitwise
    (invariant numerics)."""
    target, draft = models
    ec = EngineConfig(cache=CACHE, max_slots=SLOTS, decode_steps=3, min_context=CONTEXT)
    requests = [Request(tokens=p, max_new_tokens=18, return_logits=True) for p in PROMPTS]
    plain = Engine(target, CONFIG, ec).generate(requests)
    traced = aot.trace_counts().get("spec_loop", 0)
    engine = Engine(target, CONFIG, ec, draft=(draft, DRAFT),
                    spec=SpecConfig(drafter="model", gamma=GAMMA_MAX, adaptive=True,
                                    cost_ratio=0.3, verify_slope=0.05))
    assert_same(engine.generate(requests), plain)
    gammas = engine.metrics()["spec"]["gamma_history"]
    assert len(set(gammas)) > 1, gammas
    assert aot.trace_counts()["spec_loop"] - traced == 1
