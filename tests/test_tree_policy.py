"""The tree-size policies (`kvjax.speculative.tree_policy`) pick the verify width from the
measured verify cost per node count and either the tree's path probabilities, the round's
drafting cost and its calibration (`TreeSizePolicy`) or what earlier calls accepted at
each width (`WidthPolicy`, the engine's n-gram trees): each case against figures worked
out by hand."""

from __future__ import annotations

import pytest

from kvjax.speculative.tree_policy import (
    TreeSizePolicy,
    WidthPolicy,
    expected_tokens,
    interpolated,
    tree_widths,
)

COST = {1: 1.0, 2: 1.2, 4: 1.5, 8: 2.5}  # v(N) in decode steps, as `kvjax bench tree` gives
# a chain of 3 likely drafts (path probabilities .9 .8 .7), then 4 unlikely branches
PARENTS = [-1, 0, 1, 2, 0, 4, 1, 6]
PROBS = [1.0, 0.9, 0.8, 0.7, 0.05, 0.04, 0.03, 0.02]


def test_costs_between_and_past_the_measured_node_counts():
    assert interpolated({1: 1.0, 4: 1.6}, 2) == pytest.approx(1.2)
    assert interpolated({1: 1.0, 4: 1.6}, 8) == pytest.approx(2.4)  # the last slope on
    assert interpolated({4: 1.6}, 8) == pytest.approx(1.6)
    assert interpolated({2: 2.0, 4: 1.0}, 8) == pytest.approx(1.0)  # not -1: the cheapest
    with pytest.raises(ValueError, match="no measured"):
        interpolated({}, 2)


def test_expected_tokens_sum_the_path_probabilities():
    assert expected_tokens(PROBS[:4]) == pytest.approx([1.0, 1.9, 2.7, 3.4])
    assert expected_tokens(PROBS[:3], k=0.5) == pytest.approx([1.0, 1.45, 1.85])


def test_the_policy_picks_the_width_with_the_most_tokens_per_cost():
    # tokens / cost: N=1 1/1, N=2 1.9/1.2 = 1.58, N=4 3.4/1.5 = 2.27, N=8 3.54/2.5 = 1.42
    assert TreeSizePolicy(COST, sizes=(1, 2, 4, 8)).choose(PARENTS, PROBS) == 4
    # verifying is nearly free past 4: N=8 3.54/1.55 = 2.28 > 2.27
    cheap = {**COST, 8: 1.55}
    assert TreeSizePolicy(cheap, sizes=(1, 2, 4, 8)).choose(PARENTS, PROBS) == 8
    # only 1, 2 and 8 compiled: N=2 1.58 beats N=8 1.42
    assert TreeSizePolicy(COST, sizes=(1, 2, 8)).choose(PARENTS, PROBS) == 2
    # a smaller tree: no width past its node count
    assert TreeSizePolicy(COST, sizes=(1, 2, 4, 8)).choose(PARENTS[:3], PROBS[:3]) == 2


def test_the_round_s_drafting_cost_and_the_calibration_move_the_choice():
    # drafting 3 levels at 0.5 each is paid whatever is verified: N=1 1/2.5 = 0.4,
    # N=2 1.9/2.7 = 0.70, N=4 3.4/3.0 = 1.13, N=8 3.54/4.0 = 0.89
    assert TreeSizePolicy(COST, 0.5, sizes=(1, 2, 4, 8)).choose(PARENTS, PROBS) == 4
    # a dear drafter (10 per level: 30 paid) is amortised by verifying more: N=4
    # 3.4/31.5 = 0.1079, N=8 3.54/32.5 = 0.1089
    assert TreeSizePolicy(COST, 10.0, sizes=(1, 2, 4, 8)).choose(PARENTS, PROBS) == 8
    # with cheap width 8 and no drafting cost 8 wins; an over-confident drafter (a tenth
    # of its predicted drafts accepted) makes every draft worth a tenth: N=1 1.0, N=2
    # 1.09/1.2 = 0.91, N=4 1.24/1.5 = 0.83, N=8 1.254/1.55 = 0.81
    policy = TreeSizePolicy({**COST, 8: 1.55}, sizes=(1, 2, 4, 8))
    policy.observe(PROBS[:4], accepted=0.24)  # predicted 2.4
    assert policy.k == pytest.approx(0.1)
    assert policy.choose(PARENTS, PROBS) == 1


def test_trees_cut_by_the_policy_still_emit_plain_greedy_decoding():
    """`tree_generate` with a size policy over the draft model's scored trees (the target
    drafting for itself): each call verifies the width the policy picks, in that compiled
    shape, and the tokens and logits stay plain decoding's, bitwise; an unscored drafter
    is refused."""
    import numpy as np
    from engine_helpers import CACHE, CONFIG, params

    from kvjax.decode.generate import generate
    from kvjax.model.plan import INVARIANT
    from kvjax.speculative.tree import NGramTreeDrafter
    from kvjax.speculative.tree_host import tree_generate
    from kvjax.speculative.tree_model import ModelTreeDrafter

    p = params()
    prompts = [np.random.default_rng(9).integers(1, CONFIG.vocab_size, 13).tolist()]
    want = generate(p, CONFIG, prompts, 20, cache=CACHE, return_logits=True, plan=INVARIANT)
    chosen = []

    class Recording(TreeSizePolicy):
        def choose(self, parents, path_probs):
            chosen.append(super().choose(parents, path_probs))
            return chosen[-1]

    policy = Recording({1: 1.0, 2: 1.1, 4: 1.3, 8: 3.0}, sizes=(1, 2, 4, 8))
    drafter = ModelTreeDrafter(p, CONFIG, CACHE, top_k=2, width=8)
    got = tree_generate(p, CONFIG, prompts, 20, drafter, max_nodes=8, cache=CACHE,
                        size_policy=policy)
    assert got.tokens == want.tokens
    np.testing.assert_array_equal(got.logits[0], np.asarray(want.logits[0]))
    # measured [2, 4, 4, 4, 4, 4, 4]: two compiled widths, never the dear 8
    assert set(chosen) <= {1, 2, 4} and len(set(chosen)) >= 2
    assert got.drafted == sum(c - 1 for c in chosen)
    with pytest.raises(ValueError, match="scores its trees"):
        tree_generate(p, CONFIG, prompts, 4, NGramTreeDrafter(), cache=CACHE,
                      size_policy=policy)


def test_adaptive_trees_choose_from_powers_of_two_the_chain_and_the_tree():
    assert tree_widths(4, 8) == [2, 4, 5, 8]  # 5: the chain of γ 4
    assert tree_widths(7, 8) == [2, 4, 8]
    assert tree_widths(3, 16) == [2, 4, 8, 16]
    assert tree_widths(2, 33) == [2, 3, 4, 8, 16, 32, 33]
    assert tree_widths(1, 2) == [2]


# A call of width 8 with 10 verifications; cut to w nodes they would have accepted
# accepted_by_width[w - 1] drafts: 3 at w = 2, 5 at w = 4, 9 at w = 8.
WIDE = [0, 3, 3, 5, 5, 5, 5, 9]


def test_the_width_policy_tries_the_widest_then_takes_the_most_tokens_per_cost():
    policy = WidthPolicy([2, 4, 8])
    assert policy.choose({2: 1.0}) == 8  # nothing observed yet
    policy.observe(8, 0, WIDE)  # a call that verified nothing teaches nothing
    assert policy.choose({2: 1.0}) == 8
    policy.observe(8, 10, WIDE)
    # tokens per verification: 13 / 10, 15 / 10, 19 / 10
    assert policy.expected_tokens() == pytest.approx([1.3, 1.5, 1.9])
    # per cost: 1.3, 1.25, 0.95
    assert policy.choose({2: 1.0, 4: 1.2, 8: 2.0}) == 2
    # 1.3, 1.364, 1.357
    assert policy.choose({2: 1.0, 4: 1.1, 8: 1.4}) == 4
    # costs between the measured widths are interpolated: v(4) = 1.333 -> 1.3, 1.125, 0.95
    assert policy.choose({2: 1.0, 8: 2.0}) == 2
    flat = WidthPolicy([2, 4, 8])
    flat.observe(8, 10, [0, 4, 4, 4, 4, 4, 4, 4])  # wider trees accepted nothing more
    assert flat.choose({2: 1.0, 4: 1.0, 8: 1.0}) == 2  # the narrowest on ties


def test_a_narrow_call_updates_its_widths_and_keeps_the_wider_ones_gains():
    policy = WidthPolicy([2, 4, 8])
    policy.observe(8, 10, WIDE)
    policy.observe(2, 10, [0, 8])  # only width 2 learns: 8 drafts in 10 verifications
    # width 2: (0.8 * 13 + 18) / (0.8 * 10 + 10) = 28.4 / 18 = 1.5778; 4 keeps its gain over
    # 2 (15 / 13), 8 its gain over 4 (19 / 15): 1.8205, 2.3060
    assert policy.expected_tokens() == pytest.approx([28.4 / 18, 28.4 / 18 * 15 / 13,
                                                      28.4 / 18 * 19 / 13])
    assert policy.choose({2: 1.0, 4: 1.2, 8: 2.0}) == 2  # 1.578, 1.517, 1.153
    assert policy.choose({2: 1.0, 4: 1.1, 8: 1.4}) == 4  # 1.578, 1.655, 1.647
    policy.observe(4, 10, [0, 2, 2, 10])  # width 4 over 2 now: (0.8 * 15 + 20) /
    # (0.8 * 13 + 12) = 32 / 22.4 (the 4-over-2 gain of both calls of width 4 or more)
    two = (0.8 * 28.4 + 12) / (0.8 * 18 + 10)
    assert policy.expected_tokens() == pytest.approx([two, two * 32 / 22.4,
                                                      two * 32 / 22.4 * 19 / 15])


def test_every_eighth_choice_verifies_the_widest_width():
    policy = WidthPolicy([2, 4, 8])
    policy.observe(8, 10, [0, 4, 4, 4, 4, 4, 4, 4])  # width 2 is best: 1.4 for any cost
    costs = {2: 1.0, 8: 2.0}
    assert [policy.choose(costs) for _ in range(16)] == [2] * 7 + [8] + [2] * 7 + [8]
    # the probe finds 4 worth it: 4 over 2 is now (0.8 * 14 + 24) / (0.8 * 14 + 14) = 1.397,
    # times width 2's 1.4 = 1.956 tokens over v(4) = 1.333: 1.467 > 1.4 (and 8 over 4:
    # (0.8 * 14 + 25) / (0.8 * 14 + 24) = 1.028, 2.011 over v(8) = 2: 1.006)
    policy.observe(8, 10, [0, 4, 4, 14, 14, 14, 14, 15])
    assert policy.expected_tokens() == pytest.approx([1.4, 1.4 * 35.2 / 25.2,
                                                      1.4 * 36.2 / 25.2])
    assert policy.choose(costs) == 4
    never = WidthPolicy([2, 4, 8], explore=0)
    never.observe(8, 10, [0, 4, 4, 4, 4, 4, 4, 4])
    assert {never.choose(costs) for _ in range(16)} == {2}
    wide = WidthPolicy([2, 4, 8])
    wide.observe(8, 10, [0, 1, 1, 3, 3, 3, 3, 9])  # the widest is best: it stays
    assert {wide.choose({2: 1.0, 8: 1.0}) for _ in range(16)} == {8}
    narrow = WidthPolicy([2, 4, 8])
    narrow.observe(2, 10, [0, 3])  # only width 2 seen: no gain measured above it
    assert narrow.expected_tokens() == pytest.approx([1.3, 1.3, 1.3])
