"""The engine's speculative-decoding side: the draft's weights, γ per call, stats.

The draft model's pages are the second pool of the engine's `KVCacheManager`
(`kvjax.cache.manager`: its K/V have the draft's shapes; its own allocator and prefix trie,
keyed by the draft's namespace: the draft's weights and attention structure, no adapter:
the draft runs without one). A reused prompt therefore skips prefill for both models. This
module holds the draft's weights, runs `spec_loop` over both caches through the manager (or,
with `SpecConfig.tree_nodes`, `tree_loop`'s n-gram or EAGLE trees, for greedy and sampled
rows alike) and keeps the statistics. With `SpecConfig.adaptive` and `tree_nodes`, each
call's tree width comes from `tree_policy.WidthPolicy` and a round's cost measured per node
count (the verify's, and an EAGLE head's drafting).
"""

from __future__ import annotations

from collections import Counter

import jax
import numpy as np

from kvjax.cache.identity import model_fingerprint
from kvjax.cache.manager import KVCacheManager
from kvjax.config import ConfigError, ModelConfig, SpecConfig
from kvjax.decode.batching import bucket, page_table, pages_for
from kvjax.decode.sampling import any_sampled
from kvjax.decode.state import DecodeState
from kvjax.errors import NonCausalCacheError
from kvjax.model.layout import store
from kvjax.model.plan import FAST, NumericsPlan
from kvjax.sharding.plan import ShardingPlan
from kvjax.speculative.eagle import head_config
from kvjax.speculative.eagle_engine import EagleSide
from kvjax.speculative.eagle_file import HeadFile
from kvjax.speculative.eagle_tree_device import candidates
from kvjax.speculative.gamma import GammaPolicy
from kvjax.speculative.loop import (
    DraftState,
    RowStats,
    SpecLoopResult,
    spec_loop,
    verify_widths,
)
from kvjax.speculative.rules import predicted_speedup
from kvjax.speculative.stats import SpecStats
from kvjax.speculative.tree_loop import TreeLoopResult, tree_loop
from kvjax.speculative.tree_policy import WidthPolicy, tree_widths


def write_ahead(spec: SpecConfig, size: int | None = None) -> int:
    """The most cache slots a call writes past the kept history: a chain's γ drafts (`size`,
    or the config's γ); a tree's nodes but the root (`size` nodes, or `tree_nodes`); an
    EAGLE tree's nodes (its head's pages, one pair behind the target's, hold the root's
    pair past them too), or with `rerank` every candidate the head grows before the cut."""
    if spec.drafter == "eagle":
        return candidates(spec.tree_nodes if size is None else size, spec.gamma,
                          spec.branches, spec.rerank)
    if spec.tree_nodes is not None:
        return (spec.tree_nodes if size is None else size) - 1
    return spec.gamma if size is None else size


class Speculator:
    """Runs speculative decode calls for the engine and keeps their statistics."""

    def __init__(self, spec: SpecConfig, draft, config: ModelConfig, mesh=None,
                 plan: NumericsPlan = FAST, target_plan: NumericsPlan = FAST):
        self.spec = spec
        # the draft model's (None: the n-gram drafter); its pool is the manager's `draft`;
        # `plan`: how its steps run (the engine's, `kvjax.engine.plans.numerics_plans`)
        self.params = self.config = self.sharding = self.fingerprint = self.eagle = None
        self.plan = plan
        if spec.drafter == "eagle":  # the head's pool is the draft pool (`eagle_engine`)
            if not isinstance(draft, HeadFile):
                raise ConfigError("spec.drafter", "the eagle drafter needs draft=HeadFile "
                                  "(kvjax.speculative.eagle_file.load_head)")
            if mesh is not None:
                raise ConfigError("spec.drafter", "EAGLE trees run on one device")
            self.eagle = EagleSide(draft, config, plan, target_plan, spec.gamma)
            self.config, self.fingerprint = head_config(config), self.eagle.fingerprint
        elif spec.drafter == "model":
            if draft is None:
                raise ConfigError("spec.drafter", "the model drafter needs "
                                  "draft=(draft_params, draft_config)")
            params, draft_config = draft
            if not draft_config.causal:
                raise NonCausalCacheError()
            if draft_config.vocab_size != config.vocab_size:
                raise ConfigError("draft.vocab_size", f"{draft_config.vocab_size} differs from "
                                  f"the target's {config.vocab_size}")
            self.sharding = None if mesh is None else ShardingPlan(mesh, draft_config)
            self.params = (jax.device_put(store(params, plan))
                           if self.sharding is None else self.sharding.place_params(params))
            self.config = draft_config
            self.fingerprint = model_fingerprint(draft_config, params, plan)
        self.totals = SpecStats.empty(spec.gamma)
        self.tree_calls = 0  # target calls that verified trees (with tree_nodes: all)
        self.widths: list[int] = []  # the width of each call that verified trees
        self.policy = GammaPolicy(spec.gamma, [w - 1 for w in self.verify_widths])
        self.width_policy = self.verify_costs = None
        if spec.tree_nodes is not None and spec.adaptive:
            self.width_policy = WidthPolicy(tree_widths(spec.gamma, spec.tree_nodes))
            self.verify_costs = None if spec.verify_costs is None else dict(spec.verify_costs)
        self.cost_ratio = spec.cost_ratio if spec.drafter == "model" else 0.0
        self.verify_slope = spec.verify_slope

    @property
    def max_seq_len(self) -> int | None:
        return None if self.config is None else self.config.max_seq_len

    @property
    def step_shardings(self):
        """The draft's own step shardings (its prefill runs `steps.extend` on its cache)."""
        return None if self.sharding is None else self.sharding.steps()

    @property
    def replays(self) -> bool:
        """Whether a recomputed request must decode under the γ (or tree width) each of its
        calls had: under adaptive sizes, as sampled tokens depend on where rounds start and
        on the tree a round verifies (a greedy row's do not under invariant numerics; under
        fast ones a near-tie may, so every recomputed request replays)."""
        return self.spec.adaptive

    @property
    def verify_widths(self) -> tuple[int, ...]:
        """A chain call's verify widths (`spec_loop`'s `widths`): adaptive γ's one program
        holds `verify_widths`' ladder (the γ it chooses from, so no round verifies padding);
        a fixed γ's holds γ + 1."""
        return verify_widths(self.spec.gamma, None if self.spec.adaptive
                             else (self.spec.gamma + 1,))

    def tree_widths(self, bound: int) -> tuple[int, ...]:
        """A tree call's verify widths (`tree_loop`'s `widths`) under `max_nodes` = bound:
        an adaptive n-gram tree's one program holds every width `WidthPolicy` chooses; an
        EAGLE head's trees and a fixed size verify at the bound."""
        if self.width_policy is None or self.eagle is not None:
            return (bound,)
        return tuple(self.width_policy.widths)

    def write_ahead(self, size: int) -> int:
        """The cache slots a call of `size` (`next_gamma`'s) may write past a row's kept
        history."""
        return write_ahead(self.spec, size)

    def next_gamma(self) -> int:
        """This call's size: a chain's γ, fixed or (adaptive) the policy's
        (`kvjax.speculative.gamma`); with trees, the node count of a call's trees,
        `tree_nodes` or (adaptive) `WidthPolicy`'s."""
        if self.width_policy is not None:
            return self.width_policy.choose(self.verify_costs)
        if self.spec.tree_nodes is not None:
            return self.spec.tree_nodes
        if not self.spec.adaptive:
            return self.spec.gamma
        return self.policy.choose(self.cost_ratio, self.verify_slope)

    def decode(self, model, kv: KVCacheManager, decode_steps: int, live,
               budgets: dict[int, int], gamma: int, state: DecodeState,
               want_logits: bool, min_context: int = 0) -> SpecLoopResult:
        """One `spec_loop` (or `tree_loop`) call over the engine's slots (`state`: a row
        per slot); updates the draft state of `live` and the statistics. `model`: the target
        (`kvjax.engine.runner.TargetModel`), `kv`: the pools; `gamma`: `next_gamma`'s size;
        `min_context` as in `EngineConfig`. Returns the result as numpy."""
        out, tree = self.call(model, kv, decode_steps, live, budgets, gamma, state,
                              want_logits, min_context)
        if tree is not None:
            if self.eagle is not None:
                self.eagle.absorb(live, tree.head)
            self.tree_calls += int(tree.rounds)
            self.widths.append(gamma)
            if self.width_policy is not None:
                rows = [seq.slot for seq in live]
                self.width_policy.observe(gamma, int(tree.verifications[rows].sum()),
                                          tree.accepted_by_width[rows].sum(axis=0))
            gamma = self.spec.gamma
        if out.draft_lengths is not None:
            for seq in live:
                seq.draft_length = int(out.draft_lengths[seq.slot])
                seq.prev = int(out.prev[seq.slot])
        self._record(live, out, gamma)
        return out

    def call(self, model, kv: KVCacheManager, decode_steps: int, live,
             budgets: dict[int, int], gamma: int, state: DecodeState, want_logits: bool,
             min_context: int = 0) -> tuple[SpecLoopResult, TreeLoopResult | None]:
        """`decode`'s device call alone, as numpy (with trees, also the tree result): no
        statistic or sequence changes (`Engine.warmup` runs it compile-only)."""
        slots = len(state.lengths)
        kwargs = {}
        if kv.draft is not None and self.eagle is None:
            rows = [[] for _ in range(slots)]
            lengths = np.zeros(slots, np.int32)
            prev = np.zeros(slots, np.int32)
            for seq in live:
                rows[seq.slot] = seq.draft_pages
                lengths[seq.slot], prev[seq.slot] = seq.draft_length, seq.prev
            kwargs = dict(draft_params=self.params, draft_config=self.config,
                          draft_plan=self.plan, draft=DraftState(
                page_table=page_table(rows, slots, kv.draft.cache_config.block_pages,
                                      pages_for(min_context, kv.draft.cache_config.page_size)),
                lengths=lengths, prev=prev))
        else:
            width = bucket(max([min_context] + [s.length + 1 + budgets[s.slot] for s in live]), 64)
            history = np.zeros((slots, width), np.int32)
            for seq in live:
                row = seq.req.tokens + seq.generated
                history[seq.slot, : len(row)] = row
            kwargs = dict(history=history, ngram_max=self.spec.ngram_max)

        sampled = any_sampled(state.temperature)
        if self.spec.tree_nodes is not None:
            head = None if self.eagle is None else self.eagle.draft(
                live, slots, kv.draft.cache_config.block_pages,
                pages_for(min_context, kv.draft.cache_config.page_size))

            bound = gamma if head is not None else self.spec.tree_nodes  # one n-gram program

            def step(cache, head_cache):
                out, cache = tree_loop(
                    model.params, model.config, cache, state, kwargs["history"],
                    max_nodes=bound, width=gamma, widths=self.tree_widths(bound),
                    depth=self.spec.gamma, branches=self.spec.branches,
                    max_out=decode_steps, ngram_max=self.spec.ngram_max, head=head,
                    head_cache=head_cache, top_k=self.spec.branches, rerank=self.spec.rerank,
                    return_logits=want_logits, plan=model.plan, sampled=sampled)
                if head is None:
                    return out, cache, None
                return out.replace(head=out.head.replace(cache=None)), cache, out.head.cache

            tree = jax.tree.map(np.asarray, kv.run_both(step))
            return _as_chain_result(tree), tree
        out = kv.run_both(lambda cache, draft_cache: spec_loop(
            model.params, model.config, cache, state, drafter=self.spec.drafter,
            gamma=gamma, gamma_max=self.spec.gamma, widths=self.verify_widths,
            max_out=decode_steps, return_logits=want_logits, lora=model.lora,
            sharding=model.shardings, plan=model.plan, draft_cache=draft_cache,
            sampled=sampled, **kwargs))
        return jax.tree.map(np.asarray, out), None

    def _record(self, live, out: SpecLoopResult, gamma: int) -> None:
        self.totals.target_calls += int(out.rounds)
        self.totals.gamma_history.append(gamma)
        call = SpecStats.empty(self.spec.gamma)
        requests = {}
        for seq in live:
            call.add_row(out.stats, seq.slot)
            if seq.req.stats.spec is None:
                seq.req.stats.spec = SpecStats.empty(self.spec.gamma)
            mine = seq.req.stats.spec
            mine.add_row(out.stats, seq.slot)
            requests.setdefault(id(seq.req), (mine, []))[1].append(seq.slot)
        for mine, slots in requests.values():  # once per request: its samples share calls
            mine.target_calls += max(int(out.stats.verifications[s]) for s in slots)
            mine.gamma_history.append(gamma)
        self.totals.merge(call)
        # The policy's input summed as the loop returns it (float32 per row).
        self.policy.observe(gamma, float(sum(out.stats.alpha_sum[s.slot] for s in live)),
                            float(sum(out.stats.alpha_count[s.slot] for s in live)),
                            call.drafted_by_position, call.accepted_by_position)

    @property
    def calibrated(self) -> bool:
        if self.width_policy is not None:
            return self.verify_costs is not None
        return self.cost_ratio is not None and self.verify_slope is not None

    def calibrate(self, params, config: ModelConfig, plan: NumericsPlan, batch: int,
                  context: int = 128) -> None:
        """Measures what is not pinned in the SpecConfig: c (the draft's step time over the
        target's; 0 for the n-gram drafter) and the verify slope, at the engine's batch;
        for adaptive trees a round's cost at each width the policy chooses from: the
        verify's, and with an EAGLE head the verify's and its drafting timed together
        (`kvjax.speculative.cost`)."""
        from kvjax.speculative.cost import cost_ratio, round_costs, verify_costs, verify_slope

        target = (params, config, plan)
        if self.width_policy is not None:
            widths = self.width_policy.widths
            if self.eagle is None:
                self.verify_costs = verify_costs(target, batch, context, widths)
            else:  # the head's drafting timed with the verify, as a round runs them
                self.verify_costs = round_costs(target, self.eagle, batch, context, widths,
                                                self.spec.gamma, self.spec.branches)
            return
        if self.cost_ratio is None:
            self.cost_ratio = cost_ratio(target, (self.params, self.config, self.plan), batch,
                                         context)
        if self.verify_slope is None:
            self.verify_slope = verify_slope(target, batch, context, self.spec.gamma + 1)

    def metrics(self) -> dict:
        summary = self.totals.as_dict(timings=False)
        gammas = self.totals.gamma_history
        mean_gamma = sum(gammas) / len(gammas) if gammas else float(self.spec.gamma)
        c, slope = self.cost_ratio, self.verify_slope
        known = c is not None and self.totals.alpha_count > 0
        gamma = round(mean_gamma)
        summary.update(
            drafter=self.spec.drafter, tree_nodes=self.spec.tree_nodes,
            tree_calls=self.tree_calls, tree_widths=dict(sorted(Counter(self.widths).items())),
            verify_costs=self.verify_costs, cost_ratio=c, verify_slope=slope,
            predicted_speedup=predicted_speedup(summary["alpha"], gamma, c) if known else None,
            predicted_speedup_verify=(predicted_speedup(summary["alpha"], gamma, c, slope)
                                      if known and slope is not None else None))
        return summary


def _as_chain_result(out: TreeLoopResult) -> SpecLoopResult:
    """A tree call's result (numpy) in the chain's terms: a position is a depth (several
    drafts may share one), `accepted` counts the drafts a verification emitted (a chain's
    also counts accepted drafts past a stop id), so every verification emits its accepted
    drafts and one more token; α (E[min(p, q)] per tested position) is a chain's: 0."""
    zeros = np.zeros_like(out.verifications)
    return SpecLoopResult(
        tokens=out.tokens, logits=out.logits, lengths=out.lengths, draft_lengths=None,
        prev=None, rounds=out.rounds, stats=RowStats(
            verifications=out.verifications, drafted=out.drafted, accepted=out.accepted,
            emitted=out.accepted + out.verifications, alpha_sum=zeros.astype(np.float32),
            alpha_count=zeros, drafted_by_position=out.drafted_by_depth,
            accepted_by_position=out.accepted_by_depth))
