"""Tree speculation on a real model (`kvjax bench tree`): tokens per target call of n-gram
chains and trees per MT-Bench category, every answer checked against plain decoding, and
the cost of verifying N tree nodes in one call.

Answers: MT-Bench's first turns in the model's chat template, `requests` questions taken in
turn from each category, answered greedily (up to `gen_tokens` tokens, ended at the end of
turn) under invariant numerics by `kvjax.generate` and by `tree_generate` with the n-gram
tree drafter at 1 branch (a chain), 2 and 4 branches, trees of at most `max_nodes` nodes.
Every tree answer's tokens and logits must equal plain decoding's, bitwise: the bench
raises otherwise (every row it reports holds it). Reported per category and drafter:
tokens per target call (accepted drafts + 1) and draft nodes per call.

Verify cost: one extend of N = 1, 2, 4, ..., 32 tree nodes (a chain; the cost depends on
the node count) after `prompt_len` cached tokens, and of N tokens without tree arrays (the
chain verify), the median of `reps` timed calls after a warm-up, beside a plain decode
step (N = 1 without tree arrays). The speedup a drafter
would reach with a free drafter and a host loop that cost nothing: tokens per call /
(the verify cost at `max_nodes` / a decode step's).
"""

from __future__ import annotations

import numpy as np

from kvjax.cache.paged import BatchInfo, CacheHolder, init_cache
from kvjax.config import CacheConfig
from kvjax.decode import steps
from kvjax.decode.batching import pages_for
from kvjax.decode.generate import generate
from kvjax.lab.progress import Progress
from kvjax.lab.report import emit, markdown_table, write_results
from kvjax.lab.timing import contiguous_pages, filled_with_noise, median_seconds
from kvjax.model.plan import INVARIANT
from kvjax.speculative.tree import NGramTreeDrafter, tree_arrays
from kvjax.speculative.tree_host import tree_generate

BRANCHES = (1, 2, 4)
NODES = (1, 2, 4, 8, 16, 32)


def questions(model, count: int) -> list[tuple[str, list[int]]]:
    """(category, first turn rendered) for `count` MT-Bench questions, categories in turn."""
    from kvjax.data.mtbench import CATEGORIES, mtbench

    by_category = {c: [q for q in mtbench().conversations if q.category == c]
                   for c in CATEGORIES}
    picked = []
    for i in range(count):
        c = CATEGORIES[i % len(CATEGORIES)]
        q = by_category[c][i // len(CATEGORIES)]
        picked.append((c, model.template.render([{"role": "user",
                                                  "content": q.user_turns[0]}])))
    return picked


def answers(model, picked, gen_tokens: int, max_nodes: int,
            progress: Progress | None = None) -> list[dict]:
    """One row per (category, branches): tokens per call; raises on any answer that differs
    from plain decoding's."""
    prompts = [p for _, p in picked]
    stop = model.stop_tokens[0]
    cache = CacheConfig(page_size=16, num_pages=sum(
        pages_for(len(p) + gen_tokens + max_nodes, 16) for p in prompts))
    plain = generate(model.params, model.config, prompts, gen_tokens, cache=cache,
                     return_logits=True, stop_token=stop, plan=INVARIANT)
    rows = []
    for branches in BRANCHES:
        for category in dict.fromkeys(c for c, _ in picked):
            ids = [i for i, (c, _) in enumerate(picked) if c == category]
            got = tree_generate(model.params, model.config, [prompts[i] for i in ids],
                                gen_tokens, NGramTreeDrafter(branches=branches),
                                max_nodes=max_nodes, cache=cache, stop_tokens=(stop,))
            for j, i in enumerate(ids):
                if got.tokens[j] != plain.tokens[i] or not np.array_equal(
                        got.logits[j], np.asarray(plain.logits[i])):
                    raise AssertionError(f"{category} question {j}, {branches} branches: "
                                         f"the tree answer differs from plain decoding's")
            rows.append({"category": category, "branches": branches,
                         "answers": len(ids), "tokens": sum(map(len, got.tokens)),
                         "target_calls": got.target_calls,
                         "tokens_per_call": got.tokens_per_call,
                         "nodes_per_call": got.drafted / max(got.target_calls, 1)})
        if progress is not None:
            progress.update()
    return rows


def verify_cost(model, prompt_len: int, reps: int, nodes=NODES, tree: bool = True,
                plan=INVARIANT) -> dict[int, float]:
    """N -> seconds of one verify of N chain nodes after `prompt_len` cached tokens (as a
    tree, or with `tree=False` as a plain extend of N tokens, the chain verify); key 0: a
    plain decode step; under `plan`."""
    cfg = CacheConfig(page_size=16, num_pages=1)
    table, cfg = contiguous_pages(cfg, 1, prompt_len + max(nodes))
    holder = CacheHolder(filled_with_noise(init_cache(model.config, cfg)))
    out = {}
    for n in (0, *nodes):
        depth, ancestors = tree_arrays([-1, *range(max(n, 1) - 1)])
        batch = BatchInfo(page_table=table, lengths=np.asarray([prompt_len], np.int32),
                          num_new=np.asarray([max(n, 1)], np.int32),
                          depth=depth[None] if n and tree else None,
                          ancestors=ancestors[None] if n and tree else None)
        tokens = np.ones((1, max(n, 1)), np.int32)

        def call(batch=batch, tokens=tokens):
            holder.run(lambda c: steps.extend(model.params, model.config, c, tokens, batch,
                                              plan=plan)).block_until_ready()

        out[n] = median_seconds(call, reps)
    return out


COLUMNS = [
    ("category", lambda r: r["category"]),
    ("branches", lambda r: "chain" if r["branches"] == 1 else str(r["branches"])),
    ("answers / tokens", lambda r: f"{r['answers']} / {r['tokens']}"),
    ("tokens per call", lambda r: f"{r['tokens_per_call']:.2f}"),
    ("nodes per call", lambda r: f"{r['nodes_per_call']:.2f}"),
    ("est. speedup", lambda r: f"{r['speedup']:.2f}x"),
]


def main(args) -> int:
    from kvjax import models

    name = args.model or "smollm2-135m-instruct"
    max_nodes = 8
    model = models.load(name)
    emit(f"bench tree: {name}, {args.requests} MT-Bench first turns x {args.gen_tokens} "
         f"greedy tokens; n-gram trees of {', '.join(map(str, BRANCHES))} branches, at most "
         f"{max_nodes} nodes; verify cost after {args.prompt_len} tokens")
    cost = verify_cost(model, args.prompt_len, args.reps)
    chain = verify_cost(model, args.prompt_len, args.reps, tree=False)
    ratio = cost[max_nodes] / cost[0]
    with Progress(len(BRANCHES), "drafters") as bar:
        rows = answers(model, questions(model, args.requests), args.gen_tokens, max_nodes,
                       bar)
    for r in rows:
        r["speedup"] = r["tokens_per_call"] / ratio
    costs = " | ".join(f"{n}: {cost[n] / cost[0]:.2f}x ({chain[n] / cost[0]:.2f}x)"
                       for n in NODES)
    table = markdown_table(rows, COLUMNS) + (
        f"\n\nverify cost per node count as a tree (as a chain), vs a decode step "
        f"({cost[0] * 1e3:.1f} ms): {costs}\n")
    write_results(args.out, table, rows, model=name, questions=args.requests,
                  gen_tokens=args.gen_tokens, max_nodes=max_nodes,
                  verify_s={str(n): s for n, s in cost.items()},
                  chain_verify_s={str(n): s for n, s in chain.items()})
    return 0
