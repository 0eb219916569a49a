"""Tree speculation from the host: per round and sequence a drafter proposes a token tree,
the target runs every node in one extend call of `max_nodes` tokens (tree attention:
`kvjax.cache.paged.BatchInfo`), a root path is accepted (greedy: the longest its argmax
agrees with, `greedy_path`; sampled: `sampled_path`, exact), that path's K/V move into the
slots plain decoding writes (`move_slots`) and the rest is rolled back. Under invariant
numerics every kept K/V and every token's logits are plain decoding's, bitwise
(tests/test_tree_verify.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from kvjax.cache.paged import BatchInfo, move_slots
from kvjax.cache.pool import KVPool
from kvjax.config import CacheConfig, ModelConfig, SamplingConfig
from kvjax.decode import steps
from kvjax.decode.batching import bucket, page_table, pages_for
from kvjax.decode.generate import prefill_prompts
from kvjax.decode.prompts import validate_prompts
from kvjax.decode.sampling import jitted_probabilities, sampling_rows
from kvjax.decode.state import decode_state
from kvjax.model.plan import INVARIANT, NumericsPlan
from kvjax.speculative.eagle_tree_device import candidates
from kvjax.speculative.tree import NGramTreeDrafter, greedy_path, sampled_path, tree_arrays
from kvjax.speculative.tree_loop import tree_loop


@dataclasses.dataclass
class TreeResult:
    tokens: list[list[int]]
    logits: list[np.ndarray]  # per sequence float32[n, V]: the logits each token came from
    target_calls: int  # verify calls (the prompts' prefill aside)
    drafted: int  # draft nodes verified
    accepted: int  # drafts accepted

    @property
    def tokens_per_call(self) -> float:
        """Tokens each verify call emitted: accepted drafts + the target's own, per call."""
        return (self.accepted + self.target_calls) / max(self.target_calls, 1)


def tree_generate(params, config: ModelConfig, prompts, max_new_tokens: int, drafter,
                  max_nodes: int = 8, max_depth: int | None = None,
                  cache: CacheConfig | None = None, plan: NumericsPlan = INVARIANT,
                  sampling: SamplingConfig | None = None,
                  stop_tokens: Sequence[int] = (), size_policy=None) -> TreeResult:
    """Generation like `kvjax.generate(..., plan=plan)`, verifying a tree of up to
    `max_nodes` nodes (the root, the newest token, included) from
    `drafter.propose_tree(history, max_nodes, depth)` per target call, one sequence a call.
    Greedy (no `sampling`, or temperature 0): the same tokens as `generate`, and under an
    invariant plan the same logits, bitwise. Sampled: the target's distribution exactly
    (a deterministic drafter's children one-hot), each sequence drawing from
    `numpy.random.default_rng((sampling.seed, i))`. A sequence ends after one of
    `stop_tokens` (kept). A drafter with `reads_features` (an EAGLE-style head) also gets
    `features`: the target's features (final norm outputs) of the history but its newest
    token, float32[len(history) - 1, D], from the prefill and the verify calls.
    `size_policy` (a `kvjax.speculative.tree_policy.TreeSizePolicy`, for a drafter that
    scores its trees: `last_path_probs`) cuts each tree to the verify width it picks; the
    verify runs in that width (one compiled shape per width)."""
    greedy = sampling is None or sampling.temperature == 0
    reads = getattr(drafter, "reads_features", False)
    if size_policy is not None and not hasattr(drafter, "last_path_probs"):
        raise ValueError("a size policy needs a drafter that scores its trees "
                         "(last_path_probs)")
    prompts, depth, cache, pool = _start(config, prompts, max_new_tokens, max_nodes, max_depth,
                                         cache, plan)
    rows = [pool.allocate(pages_for(len(p), cache.page_size)) for p in prompts]
    if reads:
        done = [_prefill_features(params, config, pool, p, r, plan)
                for p, r in zip(prompts, rows, strict=True)]
        first = [d[0] for d in done]
        # per sequence the features of every cached token, filled in place as it grows
        feats = [np.zeros((len(p) + max_new_tokens, config.d_model), np.float32)
                 for p in prompts]
        for f, (_, prompt_feats) in zip(feats, done, strict=True):
            f[:len(prompt_feats)] = prompt_feats
    else:
        first = np.asarray(prefill_prompts(params, config, pool, prompts, rows, plan))
    rngs = [None if greedy else np.random.default_rng((sampling.seed, i))
            for i in range(len(prompts))]
    outs = [[int(lg.argmax()) if greedy else _draw(lg, sampling, rngs[i])]
            for i, lg in enumerate(first)]
    logits = [[lg] for lg in first]
    lengths = [len(p) for p in prompts]
    result = TreeResult(outs, [], 0, 0, 0)
    for i in range(len(prompts)):
        while len(outs[i]) < max_new_tokens and outs[i][-1] not in stop_tokens:
            left = max_new_tokens - len(outs[i])
            history = prompts[i] + outs[i]
            kw = {"features": feats[i][:lengths[i]]} if reads else {}
            parents, tokens = drafter.propose_tree(history, max_nodes, min(depth, left - 1),
                                                   seq_id=i, **kw)
            width = max_nodes
            if size_policy is not None:
                probs = drafter.last_path_probs
                width = size_policy.choose(parents, probs)
                parents, tokens, probs = parents[:width], tokens[:width], probs[:width]
            (lg, node_feats), path, nxt = _verify(params, config, pool, rows[i], lengths[i],
                                                  parents, tokens, width, plan, sampling,
                                                  rngs[i], reads)
            if size_policy is not None:
                size_policy.observe(probs, len(path) - 1)
            if reads:
                feats[i][lengths[i]:lengths[i] + len(path)] = node_feats[path]
            lengths[i] += len(path)  # the root and the accepted drafts are cached now
            pool.truncate(rows[i], lengths[i])
            emitted = [tokens[j] for j in path[1:]] + [nxt]
            keep = next((k + 1 for k, t in enumerate(emitted) if t in stop_tokens), left)
            outs[i] += emitted[:min(keep, left)]
            logits[i] += list(lg[path][:min(keep, left)])
            result.target_calls += 1
            result.drafted += len(parents) - 1
            result.accepted += min(len(path), keep, left) - 1  # emitted, less one a call
        pool.release(rows[i])
        if hasattr(drafter, "release"):
            drafter.release(i)
    result.logits = [np.stack(lg) for lg in logits]
    return result


def device_tree_generate(params, config: ModelConfig, prompts, max_new_tokens: int,
                         drafter, max_nodes: int = 8, max_depth: int | None = None,
                         cache: CacheConfig | None = None, plan: NumericsPlan = INVARIANT,
                         stop_tokens: Sequence[int] = ()) -> TreeResult:
    """`tree_generate`, greedy, with every round of every sequence on device
    (`kvjax.speculative.tree_loop`): an `NGramTreeDrafter`'s or an `EagleTreeDrafter`'s
    trees, the same tokens and logits as `tree_generate` and plain decoding. `target_calls`
    counts a call per sequence verified, as `tree_generate`'s one-sequence calls do."""
    eagle = getattr(drafter, "reads_features", False)
    if not (hasattr(drafter, "device_draft") if eagle else isinstance(drafter,
                                                                      NGramTreeDrafter)):
        raise ValueError(f"device_tree_generate drafts n-gram or EAGLE-style trees on "
                         f"device: it takes an NGramTreeDrafter's or an EagleTreeDrafter's "
                         f"settings, not a {type(drafter).__name__} (tree_generate runs any "
                         f"drafter from the host)")
    if eagle and max_nodes > drafter.width:
        raise ValueError(f"max_nodes {max_nodes} > the drafter's width {drafter.width}")
    prompts, depth, cache, pool = _start(config, prompts, max_new_tokens, max_nodes, max_depth,
                                         cache, plan)
    n = len(prompts)
    rows = []
    try:
        for p in prompts:  # room for the answer and one tree past it
            rows.append(pool.allocate(pages_for(len(p) + max_new_tokens + max_nodes,
                                                cache.page_size)))
        if eagle:
            done = [_prefill_features(params, config, pool, p, r, plan)
                    for p, r in zip(prompts, rows, strict=True)]
            first = np.stack([d[0] for d in done])
        else:
            first = np.asarray(prefill_prompts(params, config, pool, prompts, rows, plan))
        last = first.argmax(-1).astype(np.int32)
        lengths = np.array([len(p) for p in prompts], np.int32)
        history = np.zeros((n, bucket(int(lengths.max()) + max_new_tokens + 1, 64)), np.int32)
        for i, p in enumerate(prompts):
            history[i, :len(p) + 1] = [*p, last[i]]
        stops = np.asarray(list(stop_tokens) or [-1], np.int32)
        budget = np.where(np.isin(last, stops), 0, max_new_tokens - 1).astype(np.int32)
        state = decode_state(page_table(rows, n, cache.block_pages), lengths, last, budget,
                             np.zeros((n, 2), np.uint32), stop_ids=np.tile(stops, (n, 1)))
        kw = dict(max_nodes=max_nodes, depth=depth, max_out=max(max_new_tokens - 1, 1),
                  return_logits=True, plan=plan)
        if eagle:
            grown = candidates(max_nodes, depth, drafter.top_k, drafter.rerank)
            head = drafter.device_draft(history, lengths, [d[1] for d in done],
                                        max_new_tokens + grown, depth)

            def run(c):
                def inner(hc):
                    res, c2 = tree_loop(params, config, c, state, history, head=head,
                                        head_cache=hc, top_k=drafter.top_k,
                                        rerank=drafter.rerank, **kw)
                    return (res, c2), res.head.cache
                return drafter.pool.run(inner)
        else:
            def run(c):
                return tree_loop(params, config, c, state, history, branches=drafter.branches,
                                 ngram_max=drafter.max_ngram, ngram_min=drafter.min_ngram, **kw)
        out = pool.run(run).replace(head=None)
        out = jax.tree.map(np.asarray, out)
    finally:
        for row in rows:
            pool.release(row)
        if eagle:
            for i in range(n):
                drafter.release(i)
    tokens, logits = [], []
    for i in range(n):
        k = int(np.sum(out.tokens[i] >= 0))
        tokens.append([int(last[i]), *out.tokens[i, :k].tolist()])
        logits.append(np.concatenate([first[i:i + 1], out.logits[i, :k]]))
    return TreeResult(tokens, logits, int(out.verifications.sum()), int(out.drafted.sum()),
                      int(out.accepted.sum()))


def _start(config: ModelConfig, prompts, max_new_tokens: int, max_nodes: int,
           max_depth: int | None, cache: CacheConfig | None, plan: NumericsPlan):
    """(the validated prompts, the paths' depth, the cache config, its pool) of a tree
    generation: by default pages for every prompt, its answer and one tree past it."""
    prompts = validate_prompts(config, prompts, max_new_tokens)
    plan.check(config)
    depth = max_nodes - 1 if max_depth is None else max_depth
    cache = cache or CacheConfig(page_size=16, num_pages=sum(
        pages_for(len(p) + max_new_tokens + max_nodes, 16) for p in prompts))
    return prompts, depth, cache, KVPool(config, cache)


def tree_batch(table: np.ndarray, length: int, parents: Sequence[int], tokens: Sequence[int],
               width: int):
    """(BatchInfo, tokens int32[1, width]) of one sequence's tree verify: its page table
    row [1, P], `length` tokens cached, the tree's nodes padded to `width`."""
    depth, ancestors = tree_arrays(parents, width)
    batch = BatchInfo(page_table=table, lengths=np.asarray([length], np.int32),
                      num_new=np.asarray([len(parents)], np.int32), depth=depth[None],
                      ancestors=ancestors[None])
    fed = np.zeros((1, width), np.int32)
    fed[0, :len(tokens)] = tokens
    return batch, fed


def _prefill_features(params, config: ModelConfig, pool: KVPool, prompt: list[int],
                      row: list[int], plan: NumericsPlan) -> tuple[np.ndarray, np.ndarray]:
    """Prefills one prompt in the cache's chunk shape; (its last token's logits [V], the
    features of every prompt token [n, D])."""
    cc = pool.cache_config
    width, table, feats = cc.prefill_chunk, page_table([row], 1, cc.block_pages), []
    for start in range(0, len(prompt), width):
        part = prompt[start:start + width]
        fed = np.zeros((1, width), np.int32)
        fed[0, :len(part)] = part
        batch = BatchInfo(page_table=table, lengths=np.asarray([start], np.int32),
                          num_new=np.asarray([len(part)], np.int32))
        logits, f = pool.run(lambda c, fed=fed, batch=batch: steps.extend(
            params, config, c, fed, batch, plan=plan, features=True))
        feats.append(np.asarray(f[0, :len(part)]))
    return np.asarray(logits[0, len(part) - 1]), np.concatenate(feats)


def _draw(logits: np.ndarray, sampling: SamplingConfig, rng) -> int:
    p = _probs(logits[None], sampling)[0]
    return int(rng.choice(len(p), p=p))


def _probs(logits: np.ndarray, sampling: SamplingConfig) -> np.ndarray:
    """float64 distributions [n, V] `sampling` draws from, normalised on the host."""
    p = np.asarray(jitted_probabilities(logits[None], *sampling_rows([sampling]))[0], np.float64)
    return p / p.sum(-1, keepdims=True)


def _verify(params, config, pool: KVPool, row: list[int], length: int, parents, tokens,
            max_nodes: int, plan: NumericsPlan, sampling, rng, features: bool = False
            ) -> tuple[tuple[np.ndarray, np.ndarray | None], list[int], int]:
    """One tree verify of a sequence: ((its nodes' logits [max_nodes, V], with `features`
    their features [max_nodes, D]), the accepted path, the token after it), the path's K/V
    moved into place."""
    cc = pool.cache_config
    need = pages_for(length + max_nodes, cc.page_size) - len(row)
    if need > 0:
        row += pool.allocate(need)
    table = page_table([row], 1, cc.block_pages)
    batch, fed = tree_batch(table, length, parents, tokens, max_nodes)
    out = pool.run(lambda c: steps.extend(params, config, c, fed, batch, plan=plan,
                                          features=features))
    lg, node_feats = (out[0][0], np.asarray(out[1][0])) if features else (out[0], None)
    lg = np.asarray(lg)
    if rng is None:
        choice = lg.argmax(-1)
        path = greedy_path(parents, tokens, choice)
        nxt = int(choice[path[-1]])
    else:
        path, nxt = sampled_path(parents, tokens, _probs(lg[:len(parents)], sampling), None,
                                 rng)
    src = np.zeros((1, max_nodes), np.int32)
    src[0, :len(path)] = path
    pool.run(lambda c: (None, move_slots(c, table, batch.lengths, src,
                                         np.asarray([len(path)], np.int32))))
    return (lg, node_feats), path, nxt
