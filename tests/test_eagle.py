"""The EAGLE-style head (`kvjax.speculative.eagle`): its cached steps are its full-sequence
pass, its training loss falls on a tiny target, and its file round-trips and refuses
another target or a corrupted copy."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from eagle_helpers import markov as _markov
from eagle_helpers import train, trained_head
from engine_helpers import CONFIG
from helpers import sharp_params, small_model

from kvjax.cache.paged import BatchInfo, init_cache
from kvjax.config import CacheConfig, ConfigError, TrainConfig
from kvjax.decode.batching import page_table
from kvjax.io.hf import CheckpointError
from kvjax.model.transformer import forward, init_params
from kvjax.speculative.eagle import (
    EagleHead,
    draft_head,
    embed,
    head_config,
    head_extend,
    head_loss,
    init_head,
)
from kvjax.speculative.eagle_file import load_head, save_head
from kvjax.train.eagle import draft_vocab, train_head


def test_the_cached_head_is_its_full_sequence_pass():
    config = small_model()
    target = sharp_params(config, seed=1)
    head = init_head(config, seed=2)
    tokens = _markov(1, 13, config.vocab_size, 0)
    feats = forward(target, config, tokens, features=True)  # [1, 13, D]
    positions = np.arange(12, dtype=np.int32)[None]
    want, _ = EagleHead(head_config(config)).apply(
        {"params": head}, feats[:, :-1], embed(target, config, tokens[:, 1:]), positions)
    cc = CacheConfig(page_size=4, num_pages=5)
    cache = init_cache(head_config(config), cc)
    table = page_table([[1, 2, 3, 4]], 1, cc.block_pages)
    head_w = draft_head(target, config, np.arange(config.vocab_size))
    got = []
    for start, count in ((0, 5), (5, 1), (6, 6)):  # a prefill, a step, a longer extend
        batch = BatchInfo(page_table=table, lengths=np.asarray([start], np.int32),
                          num_new=np.asarray([count], np.int32))
        (_, _, pred), cache = head_extend(head, target, config, cache,
                                          feats[:, start:start + count],
                                          tokens[:, start + 1:start + 1 + count], batch,
                                          head_w, 2)
        got.append(np.asarray(pred))
    got = np.concatenate(got, axis=1)
    # measured 3e-7 (features up to 4): another reduction order, same values
    assert np.abs(got - np.asarray(want)).max() < 1e-5
    assert np.abs(np.asarray(want)).max() > 1.0


def test_draft_vocabulary_keeps_the_masked_text_s_ids_and_the_stop_tokens():
    tokens = np.asarray([[5, 5, 5, 7, 7, 9, 1, 1, 1, 1]])
    mask = np.asarray([[1, 1, 1, 1, 1, 1, 0, 0, 0, 0]], bool)
    # masked counts first (5: 3, 7: 2, 9: 1), then unmasked (1), then the lowest ids
    assert draft_vocab(tokens, mask, 3, 16).tolist() == [5, 7, 9]
    assert draft_vocab(tokens, mask, 4, 16).tolist() == [1, 5, 7, 9]
    assert draft_vocab(tokens, mask, 3, 16, keep=(15,)).tolist() == [5, 7, 15]


def test_the_loss_weights_mix_the_feature_and_token_terms():
    """`head_loss`'s weights: EAGLE's default (1, 0.1) and EAGLE-3's token loss alone (0, 1)
    weigh the same two terms (seen failing with the weights ignored: 0.1 x the token term
    short of the token loss)."""
    config = small_model()
    target = init_params(config, seed=1)
    tokens = _markov(2, 9, config.vocab_size, 0)
    feats = forward(target, config, tokens, features=True)
    args = (init_head(config, seed=2), target, config, feats, tokens,
            np.ones(tokens.shape, bool), np.arange(config.vocab_size))
    eagle, parts = head_loss(*args)
    token, same = head_loss(*args, weights=(0.0, 1.0))
    feature, token_part = float(parts["feature"]), float(parts["token"])
    assert feature > 0.1 and token_part > 1.0  # neither term negligible
    assert {k: float(v) for k, v in same.items()} == {k: float(v) for k, v in parts.items()}
    np.testing.assert_allclose(float(eagle), feature + 0.1 * token_part, rtol=1e-6)
    np.testing.assert_allclose(float(token), token_part, rtol=1e-6)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    return trained_head(tmp_path_factory)


def test_the_head_s_training_loss_falls_on_a_tiny_target(trained):
    result = trained
    history = np.asarray(result["history"])  # step, train loss, validation loss, top-1
    assert history[0, 0] == 0 and history[-1, 0] == 80
    # measured: validation loss 1.21 -> 0.79, top-1 0.02 -> 0.125 (the untrained head
    # agrees with the target's argmax by chance only; a random target's next feature
    # depends on its whole context, so 80 steps learn part of it)
    assert history[-1, 2] < 0.75 * history[0, 2]
    assert history[-1, 3] > history[0, 3] + 0.05
    assert result["head"].vocab.tolist()[0] == 0 and len(result["head"].vocab) == 48


def test_a_resumed_head_training_reaches_the_same_weights(tmp_path, trained):
    whole = trained
    train(tmp_path / "cut", stop_after=40)
    resumed = train(tmp_path / "cut")
    np.testing.assert_array_equal(resumed["history"], whole["history"])  # nan == nan
    for a, b in zip(jax.tree.leaves(whole["head"].params),
                    jax.tree.leaves(resumed["head"].params), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_the_head_file_round_trips_and_refuses_another_target(tmp_path):
    config = small_model()
    target = sharp_params(config, seed=1)
    head = init_head(config, seed=3)
    vocab = np.asarray([0, 4, 9], np.int32)
    saved = save_head(tmp_path / "h", head, vocab, config, target, {"note": "x"})
    got = load_head(tmp_path / "h", config, target)
    assert got.identity == saved.identity and got.metadata == {"note": "x"}
    assert got.vocab.tolist() == [0, 4, 9]
    for a, b in zip(jax.tree.leaves(head), jax.tree.leaves(got.params), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(CheckpointError, match="another target"):
        load_head(tmp_path / "h", config, sharp_params(config, seed=2))
    meta = json.loads((tmp_path / "h" / "eagle.json").read_text())
    meta["identity"] = "0" * 32
    (tmp_path / "h" / "eagle.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="identity"):
        load_head(tmp_path / "h", config, target)


def test_eagle_tree_speculation_emits_plain_greedy_decodings_tokens_and_logits(trained):
    """`tree_generate` with the trained head's trees on its tiny target, against
    `generate` under the invariant plan: the same tokens and logits, bitwise, with drafts
    accepted (the head's features come from the prefill and every verify)."""
    from kvjax.decode.generate import generate
    from kvjax.model.plan import INVARIANT
    from kvjax.speculative.eagle_drafter import EagleTreeDrafter
    from kvjax.speculative.tree_host import tree_generate

    config = CONFIG  # the trained head's target
    target = init_params(config, seed=1)
    prompts = [_markov(1, n, config.vocab_size, 5 + n)[0].tolist() for n in (7, 40)]
    cache = CacheConfig(page_size=4, num_pages=64)
    want = generate(target, config, prompts, 30, cache=cache, return_logits=True,
                    plan=INVARIANT)
    drafter = EagleTreeDrafter(trained["head"], target, config,
                               CacheConfig(page_size=4, num_pages=64), top_k=3, width=8,
                               chunk=8)
    got = tree_generate(target, config, prompts, 30, drafter, max_nodes=8, cache=cache)
    assert got.tokens == want.tokens
    for a, b in zip(got.logits, want.logits, strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    assert got.accepted > 0  # measured 10 drafts accepted in 48 calls
    assert drafter.pool.num_free == 64  # every page back


@pytest.mark.parametrize(("max_nodes", "max_depth", "stop", "rerank"), [
    (8, None, (), False), (6, 2, (25,), False), (6, 3, (), True)])
def test_eagle_trees_on_device_are_the_host_s(trained, max_nodes, max_depth, stop, rerank):
    """`device_tree_generate` (the head drafting inside `tree_loop`: its cache caught up
    with the target's features from every verify, EAGLE-2's growth as fori loops) against
    the host loop with the same head and settings, invariant numerics: the same tokens and
    logits, bitwise, and the same verify calls, drafts and acceptances (the same trees, node
    for node, or the counts would part); the tokens plain decoding's. With EAGLE-2's rerank
    too (10 candidates, 3 levels of 3, cut to 6 nodes)."""
    from kvjax.decode.generate import generate
    from kvjax.model.plan import INVARIANT
    from kvjax.speculative.eagle_drafter import EagleTreeDrafter
    from kvjax.speculative.tree_host import device_tree_generate, tree_generate

    config = CONFIG  # the trained head's target
    target = init_params(config, seed=1)
    prompts = [_markov(1, n, config.vocab_size, 5 + n)[0].tolist() for n in (7, 40, 19)]
    cache = CacheConfig(page_size=4, num_pages=96)

    def drafter():
        return EagleTreeDrafter(trained["head"], target, config,
                                CacheConfig(page_size=4, num_pages=96), top_k=3,
                                width=10 if rerank else 8, chunk=8, plan=INVARIANT,
                                rerank=rerank)

    want = generate(target, config, prompts, 30, cache=cache, return_logits=True,
                    plan=INVARIANT)
    kw = dict(max_nodes=max_nodes, max_depth=max_depth, cache=cache, stop_tokens=stop)
    host = tree_generate(target, config, prompts, 30, drafter(), **kw)
    on_device = drafter()
    got = device_tree_generate(target, config, prompts, 30, on_device, **kw)
    assert got.tokens == host.tokens
    for a, b in zip(got.logits, host.logits, strict=True):
        np.testing.assert_array_equal(a, b)
    assert (got.target_calls, got.drafted, got.accepted) == (
        host.target_calls, host.drafted, host.accepted)
    assert got.accepted > 0
    cuts = 0
    for tokens, plain in zip(got.tokens, want.tokens, strict=True):
        cut = next((i + 1 for i, t in enumerate(plain) if t in stop), len(plain))
        assert tokens == plain[:cut]
        cuts += cut < len(plain)
    assert cuts == (1 if stop else 0)  # with a stop id: one answer ends early
    assert on_device.pool.num_free == 96  # every head page back


def test_a_head_checkpoint_of_other_windows_is_not_resumed(tmp_path):
    """Resuming mixes trainings only when the windows (or the target), the loss weights and
    the schedule are the ones the checkpoint learnt: others are refused, not restored (an
    `--answers own` run into a recorded-answers folder would have resumed that head; seen
    failing with the weights, then the schedule, left out of the check: DID NOT RAISE)."""
    config = small_model()
    target = init_params(config, seed=1)
    train = TrainConfig(steps=4, batch_size=4, learning_rate=3e-3, warmup_steps=1,
                        eval_every=2, checkpoint_every=2, seed=0)

    def run(seed, stop_after=None, steps=4, **weights):
        tokens = _markov(8, 17, config.vocab_size, seed)
        return train_head(target, config, (tokens, np.ones(tokens.shape, bool)),
                          (tokens[:4], np.ones((4, 17), bool)),
                          dataclasses.replace(train, steps=steps), 48, tmp_path,
                          log=lambda *_: None, progress=False, stop_after=stop_after,
                          **weights)

    run(0, stop_after=2)
    with pytest.raises(ValueError, match="trained on other windows"):
        run(1)
    with pytest.raises(ValueError, match="other loss weights"):  # EAGLE-3's token loss
        run(0, weights=(0.0, 1.0))
    with pytest.raises(ValueError, match="another schedule \\(steps 4 -> 8"):
        run(0, steps=8)
    done = run(0)
    assert done["step"] == 4  # the same windows and loss resume
    assert done["head"].metadata["loss_weights"] == {"feature": 1.0, "token": 0.1}


def test_train_eagle_s_command_line_changes_only_what_it_names():
    """`scripts/train_eagle`'s options replace the setting's values, a time limit of 0
    included (seen failing with `if args.time_limit:`), and leave the rest; fewer than one
    conversation or step is refused before any work."""
    from kvjax.train.eagle_run import SETTINGS, build_parser, setting_of

    full = SETTINGS["full"]
    args = build_parser().parse_args(["--conversations", "1920", "--steps", "40",
                                      "--time-limit", "0", "--loss-weights", "0", "1"])
    setting = setting_of(args)
    assert (setting.conversations, setting.train.steps, setting.train.time_limit_s,
            setting.loss_weights) == (1920, 40, 0, (0.0, 1.0))
    assert (setting.validation, setting.seq_len, setting.draft_vocab, setting.answers,
            setting.train.batch_size) == (full.validation, full.seq_len, full.draft_vocab,
                                          "recorded", full.train.batch_size)
    assert setting_of(build_parser().parse_args([])) == full
    with pytest.raises(SystemExit, match="at least 1"):
        setting_of(build_parser().parse_args(["--conversations", "0"]))
    with pytest.raises(ConfigError, match="steps"):
        setting_of(build_parser().parse_args(["--steps", "0"]))


def test_the_rerank_keeps_the_best_nodes_of_every_level():
    """EAGLE-2's rerank (`grow_tree(rerank=True)`), by hand: every node offers tokens of
    log-probability -0.1 and -2.0; two levels of two offers give the candidates 1 (-0.1),
    2 (-2.0), 3 (-0.2, under 1), 4 (-2.1, under 1; the tie with 2's first offer goes to the
    earlier). Three nodes keep the root, 1 and 3: a path two deep where the level-by-level
    tree (no rerank) stops at depth one."""
    from kvjax.speculative.tree_model import grow_tree

    def best_of(parents, tokens):
        n = len(tokens)
        return (np.tile(np.float32([-0.1, -2.0]), (n, 1)),
                np.asarray([[10 * i + 1, 10 * i + 2] for i in range(n)]))

    parents, tokens, probs = grow_tree(7, best_of, 3, 2, 2, rerank=True)
    assert (parents, tokens) == ([-1, 0, 1], [7, 1, 11])
    np.testing.assert_allclose(probs, np.exp([0, -0.1, -0.2]), rtol=1e-6)
    assert grow_tree(7, best_of, 3, 2, 2)[:2] == ([-1, 0, 0], [7, 1, 2])
    # five nodes: every candidate, in their order; two: the root and the best
    assert grow_tree(7, best_of, 5, 2, 2, rerank=True)[:2] == ([-1, 0, 0, 1, 1],
                                                               [7, 1, 2, 11, 12])
    assert grow_tree(7, best_of, 2, 2, 2, rerank=True)[:2] == ([-1, 0], [7, 1])


def test_merged_trees_are_the_union_of_their_root_paths():
    from kvjax.speculative.union_tree import BOTH, FIRST, SECOND, merge_trees

    a = ([-1, 0, 1], [9, 5, 6])  # 9 -> 5 -> 6
    b = ([-1, 0, 0, 1, 3], [9, 5, 7, 8, 4])  # 9 -> 5 -> 8 -> 4, 9 -> 7
    assert merge_trees(a, b, 8) == ([-1, 0, 1, 0, 1, 4], [9, 5, 6, 7, 8, 4],
                                    [BOTH, BOTH, FIRST, SECOND, SECOND, SECOND])
    # out of room: the second tree's nodes in its order while they fit (8 and 4 do not)
    assert merge_trees(a, b, 4) == ([-1, 0, 1, 0], [9, 5, 6, 7], [BOTH, BOTH, FIRST, SECOND])
    assert merge_trees(a, ([-1], [9]), 8) == ([-1, 0, 1], [9, 5, 6], [BOTH, FIRST, FIRST])
    with pytest.raises(ValueError, match="roots differ"):
        merge_trees(a, ([-1], [3]), 8)


def test_union_trees_emit_plain_decoding_and_both_drafters_drafts_are_accepted(trained):
    """n-gram continuations and the trained head's tree in one verify (`UnionTreeDrafter`),
    against `generate` under the invariant plan: the same tokens and logits, bitwise, with
    drafts only the n-gram tree proposed and drafts only the head proposed accepted (the
    head catches up on paths the n-gram tree drafted)."""
    from kvjax.decode.generate import generate
    from kvjax.model.plan import INVARIANT
    from kvjax.speculative.eagle_drafter import EagleTreeDrafter
    from kvjax.speculative.tree import NGramTreeDrafter
    from kvjax.speculative.tree_host import device_tree_generate, tree_generate
    from kvjax.speculative.union_tree import BOTH, FIRST, SECOND, UnionTreeDrafter

    config = CONFIG  # the trained head's target
    target = init_params(config, seed=1)
    chain = _markov(1, 12, config.vocab_size, 3)[0].tolist()
    prompts = [chain * 3, _markov(1, 40, config.vocab_size, 45)[0].tolist()]
    cache = CacheConfig(page_size=4, num_pages=64)
    want = generate(target, config, prompts, 30, cache=cache, return_logits=True,
                    plan=INVARIANT)
    head = EagleTreeDrafter(trained["head"], target, config,
                            CacheConfig(page_size=4, num_pages=64), top_k=3, width=8, chunk=8)
    drafter = UnionTreeDrafter(NGramTreeDrafter(branches=2), head, reserve=3)
    rounds = []  # (sequence, history, parents, tokens, sources) of every tree proposed
    propose = drafter.propose_tree

    def spy(history, *args, seq_id=0, **kw):
        parents, tokens = propose(history, *args, seq_id=seq_id, **kw)
        rounds.append((seq_id, list(history), parents, tokens, drafter.sources))
        return parents, tokens

    drafter.propose_tree = spy
    got = tree_generate(target, config, prompts, 30, drafter, max_nodes=8, cache=cache)
    assert got.tokens == want.tokens
    for a, b in zip(got.logits, want.logits, strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    accepted = dict.fromkeys((FIRST, SECOND, BOTH), 0)  # accepted drafts by who proposed them
    for k, (seq, history, parents, tokens, sources) in enumerate(rounds):
        later = [r for r in rounds[k + 1:] if r[0] == seq]
        after = later[0][1] if later else prompts[seq] + got.tokens[seq]
        node = 0
        for t in after[len(history):]:  # the accepted path; the target's own token ends it
            node = next((i for i in range(len(tokens))
                         if parents[i] == node and tokens[i] == t), None)
            if node is None:
                break
            accepted[sources[node]] += 1
    assert sum(accepted.values()) == got.accepted  # every accepted draft attributed
    # measured: the n-gram tree only 17, the head only 4, both 3 (24 accepted in 34 calls)
    assert accepted[FIRST] > 0 and accepted[SECOND] > 0, accepted
    assert head.pool.num_free == 64  # every page back
    with pytest.raises(ValueError, match="not a UnionTreeDrafter"):  # host rounds only
        device_tree_generate(target, config, prompts, 4, drafter, max_nodes=8, cache=cache)
