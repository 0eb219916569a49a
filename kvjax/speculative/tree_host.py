"""Tree speculation from the host, greedy: per round and sequence a drafter proposes a token
tree, the target runs every node in one extend call of `max_nodes` tokens (tree attention:
`kvjax.cache.paged.BatchInfo`), the longest root path its argmax agrees with is accepted
(`kvjax.speculative.tree.greedy_path`), that path's K/V move into the slots plain decoding
writes (`move_slots`) and the rest is rolled back. Under invariant numerics every kept
K/V and every token's logits are plain decoding's, bitwise (tests/test_tree_verify.py).
Sampled acceptance over a tree is not built yet.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvjax.cache.paged import BatchInfo, move_slots
from kvjax.cache.pool import KVPool
from kvjax.config import CacheConfig, ModelConfig
from kvjax.decode import steps
from kvjax.decode.batching import page_table, pages_for
from kvjax.decode.generate import prefill_prompts
from kvjax.decode.prompts import validate_prompts
from kvjax.model.plan import INVARIANT, NumericsPlan
from kvjax.speculative.tree import greedy_path, tree_arrays


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
                  cache: CacheConfig | None = None,
                  plan: NumericsPlan = INVARIANT) -> TreeResult:
    """Greedy generation like `kvjax.generate(..., plan=plan)` (the same tokens; under an
    invariant plan the same logits, bitwise), verifying a tree of up to `max_nodes` nodes
    (the root, the newest token, included) from `drafter.propose_tree(history, max_nodes,
    depth)` per target call, one sequence a call."""
    prompts = validate_prompts(config, prompts, max_new_tokens)
    plan.check(config)
    depth = max_nodes - 1 if max_depth is None else max_depth
    cache = cache or CacheConfig(page_size=16, num_pages=sum(
        pages_for(len(p) + max_new_tokens + max_nodes, 16) for p in prompts))
    pool = KVPool(config, cache)
    rows = [pool.allocate(pages_for(len(p), cache.page_size)) for p in prompts]
    first = np.asarray(prefill_prompts(params, config, pool, prompts, rows, plan))
    outs = [[int(lg.argmax())] for lg in first]
    logits = [[lg] for lg in first]
    lengths = [len(p) for p in prompts]
    result = TreeResult(outs, [], 0, 0, 0)
    for i in range(len(prompts)):
        while len(outs[i]) < max_new_tokens:
            left = max_new_tokens - len(outs[i])
            parents, tokens = drafter.propose_tree(prompts[i] + outs[i], max_nodes,
                                                   min(depth, left - 1))
            lg, path = _verify(params, config, pool, rows[i], lengths[i], parents, tokens,
                               max_nodes, plan)
            lengths[i] += len(path)  # the root and the accepted drafts are cached now
            pool.truncate(rows[i], lengths[i])
            emitted = [tokens[j] for j in path[1:]] + [int(lg[path[-1]].argmax())]
            outs[i] += emitted[:left]
            logits[i] += list(lg[path][:left])
            result.target_calls += 1
            result.drafted += len(parents) - 1
            result.accepted += len(path) - 1
        pool.release(rows[i])
    result.logits = [np.stack(lg[:max_new_tokens]) for lg in logits]
    return result


def _verify(params, config, pool: KVPool, row: list[int], length: int, parents, tokens,
            max_nodes: int, plan: NumericsPlan) -> tuple[np.ndarray, list[int]]:
    """One tree verify of a sequence: (its nodes' logits [max_nodes, V], the accepted path),
    the path's K/V moved into place."""
    cc = pool.cache_config
    need = pages_for(length + max_nodes, cc.page_size) - len(row)
    if need > 0:
        row += pool.allocate(need)
    depth, ancestors = tree_arrays(parents, max_nodes)
    table = page_table([row], 1, cc.block_pages)
    batch = BatchInfo(page_table=table, lengths=np.asarray([length], np.int32),
                      num_new=np.asarray([len(parents)], np.int32), depth=depth[None],
                      ancestors=ancestors[None])
    fed = np.zeros((1, max_nodes), np.int32)
    fed[0, :len(tokens)] = tokens
    lg = np.asarray(pool.run(lambda c: steps.extend(params, config, c, fed, batch,
                                                    plan=plan)))[0]
    path = greedy_path(parents, tokens, lg.argmax(-1))
    src = np.zeros((1, max_nodes), np.int32)
    src[0, :len(path)] = path
    pool.run(lambda c: (None, move_slots(c, table, batch.lengths, src,
                                         np.asarray([len(path)], np.int32))))
    return lg, path
