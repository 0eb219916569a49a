"""Speculation on the real model, per MT-Bench category (`kvjax bench eagle`): plain
decoding against n-gram chains and trees, the EAGLE-style head's chains and trees (with
and without the tree-size policy) and both in one tree, batch 1, both turns of each question.

Each picked question's first turn is rendered in the chat template and answered greedily
by plain decoding (up to `gen_tokens`, ended at the end of turn); its second turn follows
that answer (MT-Bench's protocol). Every method answers both turns; per category and
method the bench reports tokens per target call (accepted drafts + 1), the wall time of
whole answers (prefill, drafting, host loop and verify included; the methods take turns
question by question, so the machine's drift hits them alike) and the speedup over plain
decoding's time, and how many answers equal plain decoding's tokens. Under invariant
numerics (`--numerics invariant`) every answer must equal plain decoding's, tokens and
logits bitwise: the bench raises otherwise. Under fast numerics (the default, the speed
setting) a tree's logits are plain decoding's to rounding, so a near-tie may flip a token;
the count says how often.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from kvjax.config import CacheConfig, EngineConfig
from kvjax.decode.batching import pages_for
from kvjax.decode.generate import generate
from kvjax.lab.progress import Progress
from kvjax.lab.report import emit, markdown_table, write_results
from kvjax.model.plan import FAST, INVARIANT, NumericsPlan
from kvjax.speculative.tree import NGramTreeDrafter
from kvjax.speculative.tree_host import device_tree_generate, tree_generate
from kvjax.speculative.tree_policy import TreeSizePolicy
from kvjax.speculative.union_tree import UnionTreeDrafter

POLICY_SIZES = (1, 2, 4, 8, 16)


def turns(model, count: int, gen_tokens: int, plan, cache) -> list[tuple[str, list[int]]]:
    """(category, prompt) of both turns of `count` MT-Bench questions, categories in turn;
    the second turn after plain decoding's answer to the first."""
    from kvjax.data.mtbench import CATEGORIES, mtbench

    by_category = {c: [q for q in mtbench().conversations if q.category == c]
                   for c in CATEGORIES}
    stop = model.stop_tokens[0]
    out = []
    for i in range(count):
        c = CATEGORIES[i % len(CATEGORIES)]
        q = by_category[c][i // len(CATEGORIES)]
        first = [{"role": "user", "content": q.user_turns[0]}]
        prompt = model.template.render(first)
        answer = generate(model.params, model.config, [prompt], gen_tokens, cache=cache,
                          stop_token=stop, plan=plan).tokens[0]
        text = model.tokenizer.decode([t for t in answer if t != stop])
        second = [*first, {"role": "assistant", "content": text},
                  {"role": "user", "content": q.user_turns[1]}]
        out += [(c, prompt), (c, model.template.render(second))]
    return out


def methods(model, head, policy_costs: dict[int, float] | None,
            head_plan: NumericsPlan = FAST, one_cost: bool = False) -> dict:
    """name -> (a fresh drafter, max_nodes, max_depth, size policy or None, on device): the
    host's rounds (`tree_generate`) or the device loop's (`device_tree_generate`; no size
    policy there). The EAGLE head runs `head_plan`. `one_cost` adds the methods run only
    when named: the chains and the n-gram tree of 8 nodes and 7 drafts deep ("... 8 on
    device"), which verify at one cost, and the EAGLE trees cut by EAGLE-2's rerank ("...
    rerank on device")."""
    from kvjax.speculative.eagle_drafter import EagleTreeDrafter

    out = {"n-gram chain": (lambda: NGramTreeDrafter(branches=1), 6, 5, None, False),
           "n-gram tree": (lambda: NGramTreeDrafter(branches=4), 8, 5, None, False),
           "n-gram chain on device": (lambda: NGramTreeDrafter(branches=1), 6, 5, None, True),
           "n-gram tree on device": (lambda: NGramTreeDrafter(branches=4), 8, 5, None, True)}
    if one_cost:
        # chain and tree at one verify cost: 8 nodes, paths of up to 7 drafts (under fast
        # numerics a tree is verified as a chain, one product). The n-gram tree's first
        # continuation is the chain's; the others fill what it leaves of the budget
        out["n-gram chain 8 on device"] = (lambda: NGramTreeDrafter(branches=1), 8, 7, None,
                                           True)
        out["n-gram tree 8 on device"] = (lambda: NGramTreeDrafter(branches=4), 8, 7, None,
                                          True)
    if head is not None:
        def eagle(top_k, width, rerank=False):
            return lambda: EagleTreeDrafter(head, model.params, model.config, top_k=top_k,
                                            width=width, plan=head_plan, rerank=rerank)
        for device in (False, True):
            where = " on device" if device else ""
            out["eagle chain" + where] = (eagle(1, 6), 6, 5, None, device)
            out["eagle tree" + where] = (eagle(2, 8), 8, 5, None, device)
            out["eagle tree 16" + where] = (eagle(4, 16), 16, 6, None, device)
        if one_cost:
            out["eagle chain 8 on device"] = (eagle(1, 8), 8, 7, None, True)
            # EAGLE-2's rerank: every level's offers grown (1 + top_k x depth), the best kept
            out["eagle tree rerank on device"] = (eagle(2, 11, True), 8, 5, None, True)
            out["eagle tree 16 rerank on device"] = (eagle(4, 25, True), 16, 6, None, True)
        # prompt lookup's continuations and the head's tree in one verify (n-gram first,
        # within all but 3 nodes; `kvjax.speculative.union_tree`)
        def union(top_k, width):
            return lambda: UnionTreeDrafter(NGramTreeDrafter(branches=4), eagle(top_k, width)())
        out["n-gram + eagle tree"] = (union(2, 8), 8, 5, None, False)
        out["n-gram + eagle tree 16"] = (union(4, 16), 16, 8, None, False)  # copies run long
        # one draft token a round: this head's operating point (its later drafts are
        # rarely accepted; each costs a head pass and a wider verify)
        out["eagle chain 2 on device"] = (eagle(1, 2), 2, 1, None, True)
        if policy_costs is not None:
            out["eagle tree 16 + policy"] = (eagle(4, 16), 16, 6, policy_costs, False)
    return out


def run(model, picked, gen_tokens: int, plan, cache, table: dict, progress=None
        ) -> list[dict]:
    """One row per (category, method) and one per method over every category."""
    stop = model.stop_tokens[0]
    stats: dict[tuple[str, str], dict] = {}

    def add(category, name, seconds, tokens, calls, accepted, same):
        for key in ((category, name), ("all", name)):
            s = stats.setdefault(key, {"category": key[0], "method": name, "answers": 0,
                                       "tokens": 0, "seconds": 0.0, "calls": 0,
                                       "accepted": 0, "same": 0})
            s["answers"] += 1
            s["tokens"] += tokens
            s["seconds"] += seconds
            s["calls"] += calls
            s["accepted"] += accepted
            s["same"] += same

    for category, prompt in picked:
        t0 = time.perf_counter()
        plain = generate(model.params, model.config, [prompt], gen_tokens, cache=cache,
                         stop_token=stop, plan=plan, return_logits=plan.invariant)
        seconds = time.perf_counter() - t0
        want = plain.tokens[0]
        add(category, "plain", seconds, len(want), len(want), 0, 1)
        for name, (drafter, nodes, depth, costs, device) in table.items():
            policy = None if costs is None else {"size_policy": TreeSizePolicy(
                costs, sizes=POLICY_SIZES)}
            t0 = time.perf_counter()
            got = (device_tree_generate if device else tree_generate)(
                model.params, model.config, [prompt], gen_tokens, drafter(), max_nodes=nodes,
                max_depth=depth, cache=cache, plan=plan, stop_tokens=(stop,), **(policy or {}))
            seconds = time.perf_counter() - t0
            same = got.tokens[0] == want
            if plan.invariant and not (same and np.array_equal(
                    got.logits[0], np.asarray(plain.logits[0]))):
                raise AssertionError(f"{category}, {name}: the answer differs from plain "
                                     f"decoding's")
            add(category, name, seconds, len(got.tokens[0]), got.target_calls + 1,
                got.accepted, int(same))
        if progress is not None:
            progress.update()
    rows = list(stats.values())
    plain_s = {r["category"]: r["seconds"] for r in rows if r["method"] == "plain"}
    for r in rows:
        r["tokens_per_call"] = r["tokens"] / max(r["calls"], 1)
        r["speedup"] = plain_s[r["category"]] / r["seconds"]
    return rows


COLUMNS = [
    ("category", lambda r: r["category"]),
    ("method", lambda r: r["method"]),
    ("answers / tokens", lambda r: f"{r['answers']} / {r['tokens']}"),
    ("tokens per call", lambda r: f"{r['tokens_per_call']:.2f}"),
    ("seconds", lambda r: f"{r['seconds']:.1f}"),
    ("speedup", lambda r: f"{r['speedup']:.2f}x"),
    ("= plain", lambda r: f"{r['same']}/{r['answers']}"),
]


def main(args) -> int:
    from kvjax import models
    from kvjax.bench.tree import verify_cost
    from kvjax.cpu.product import kernel
    from kvjax.engine.plans import cpu_attention_choice, cpu_kernel_choice
    from kvjax.model.layout import store
    from kvjax.speculative.eagle_file import load_head

    name = args.model or "smollm2-135m-instruct"
    plan = INVARIANT if args.numerics == "invariant" else FAST
    ec = EngineConfig(**({"cpu_kernel": args.cpu_kernel} if args.cpu_kernel else {}))
    model = models.load(name)
    # what an engine with that setting would run (float32 pages, no mesh)
    plan = dataclasses.replace(plan, cpu_kernel=cpu_kernel_choice(ec)[0],
                               cpu_attention=cpu_attention_choice(ec, model.config)[0])
    # the target's steps take the parameters as the plan stores them; drafters read the
    # canonical tree (the EAGLE head: the embedding and the output head)
    target = dataclasses.replace(model, params=store(model.params, plan))
    head = load_head(args.head, model.config, model.params) if args.head else None
    wanted = [m.strip() for m in args.methods.split(",") if m.strip()]
    known = sorted(methods(model, head, {}, one_cost=True))
    if set(wanted) - set(known):
        raise SystemExit(f"bench eagle: unknown methods {sorted(set(wanted) - set(known))}; "
                         f"known: {known}")
    emit(f"bench eagle: {name}, {args.requests} MT-Bench questions x 2 turns x up to "
         f"{args.gen_tokens} greedy tokens, {plan.mode} numerics; head "
         f"{args.head or '(none)'}; products: "
         f"{kernel().describe() if plan.cpu_kernel else 'XLA'}; attention: "
         f"{'kvjax CPU kernel' if plan.cpu_attention else 'XLA'}")
    cost = verify_cost(target, args.prompt_len, args.reps, nodes=POLICY_SIZES, plan=plan)
    costs = {n: cost[n] / cost[0] for n in POLICY_SIZES}
    cache = CacheConfig(page_size=16, num_pages=pages_for(4096, 16))
    picked = turns(target, args.requests, args.gen_tokens, plan, cache)
    # the head drafts with fast arithmetic (its drafts never change an answer) on the
    # target's kernels: a pass over a tree of 6 to 16 nodes costs about a fifth less there
    table = methods(model, head, costs, dataclasses.replace(
        FAST, cpu_kernel=plan.cpu_kernel, cpu_attention=plan.cpu_attention),
        one_cost=bool(wanted))
    if wanted:
        table = {m: table[m] for m in wanted}
    # untimed answers to the shortest and the longest prompt first: every shape (page
    # tables come in power-of-two widths) compiled before the clock runs
    by_length = sorted(picked, key=lambda p: len(p[1]))
    run(target, [by_length[0], by_length[-1]], args.gen_tokens, plan, cache, table)
    with Progress(len(picked), "answers") as bar:
        rows = run(target, picked, args.gen_tokens, plan, cache, table, bar)
    text = markdown_table(rows, COLUMNS) + (
        "\n\nverify cost per node count vs a decode step: "
        + ", ".join(f"{n}: {c:.2f}x" for n, c in costs.items()) + "\n")
    write_results(args.out, text, rows, model=name, head=args.head,
                  questions=args.requests, gen_tokens=args.gen_tokens, numerics=plan.mode,
                  cpu_kernel=plan.cpu_kernel, cpu_attention=plan.cpu_attention,
                  verify_cost=costs)
    return 0
