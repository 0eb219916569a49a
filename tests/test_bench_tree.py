"""`kvjax bench tree` (kvjax.bench.tree) on the tests' small model: every drafter's answers
are checked against plain decoding (the bench raises on a difference), a repetitive prompt
gets more than one token per call from trees, and the verify cost is measured per node
count beside a decode step."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from engine_helpers import CONFIG, params
from helpers import random_tokens

from kvjax.bench import tree


def test_answers_match_plain_decoding_and_trees_accept_drafts():
    base = random_tokens(7, [6], CONFIG.vocab_size)[0]
    model = SimpleNamespace(params=params(), config=CONFIG, stop_tokens=(CONFIG.vocab_size - 1,))
    picked = [("copying", base * 4 + base[:2]),
              ("random", random_tokens(8, [11], CONFIG.vocab_size)[0])]
    rows = tree.answers(model, picked, 16, 8)
    assert [(r["category"], r["branches"]) for r in rows] == [
        (c, b) for b in tree.BRANCHES for c in ("copying", "random")]
    copying = [r for r in rows if r["category"] == "copying"]
    assert max(r["tokens_per_call"] for r in copying) > 1.0
    assert copying[-1]["nodes_per_call"] >= copying[0]["nodes_per_call"]


@pytest.mark.parametrize("what", ["token", "logit"])
def test_a_tree_answer_that_differs_from_plain_decoding_raises(monkeypatch, what):
    """A last token one off, or only a last logit's last bit: the bench raises."""
    from kvjax.speculative import tree_host

    real = tree_host.tree_generate

    def off_by_one(*a, **kw):
        out = real(*a, **kw)
        if what == "token":
            out.tokens[0][-1] += 1
        else:
            out.logits[0][-1, 0] = np.nextafter(out.logits[0][-1, 0], np.float32(np.inf))
        return out

    monkeypatch.setattr(tree, "tree_generate", off_by_one)
    model = SimpleNamespace(params=params(), config=CONFIG, stop_tokens=(0,))
    with pytest.raises(AssertionError, match="differs from plain decoding"):
        tree.answers(model, [("x", random_tokens(3, [9], CONFIG.vocab_size)[0])], 4, 4)


def test_verify_cost_per_node_count():
    model = SimpleNamespace(params=params(), config=CONFIG)
    for as_tree in (True, False):
        cost = tree.verify_cost(model, prompt_len=24, reps=1, nodes=(1, 4), tree=as_tree)
        assert sorted(cost) == [0, 1, 4] and all(s > 0 for s in cost.values())
