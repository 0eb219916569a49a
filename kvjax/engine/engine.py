"""The serving engine: prefix reuse on admission, continuous batching, exact by construction.

One scheduling round: admit waiting requests into free batch slots (prefix match, allocate)
and prefill their unmatched suffixes in fixed chunks (prompts sharing calls under invariant
numerics; while others decode, at most `prefill_calls_per_round` calls per round); a prompt
whose last chunk is done samples its first token and caches its full pages; then every
running sequence decodes `decode_steps` tokens on device, and finished requests retire.
The parts: `requests` (validation, rendering, a live request's state), `scheduler` (queue,
slots, preemption order), `runner` (the device calls), `kvjax.cache.manager` (every page and
device cache: the `KVCacheManager` holds a `PagePool` for the target and one for the draft,
and plans admissions), `rounds` (one scheduling round over them), `results` and `stats`;
this facade builds the parts and is the public API.

Exactness (`EngineConfig.numerics="invariant"`, the default): every token's arithmetic
has shapes that do not depend on the step around it (row-blocked products, row-tiled
attention over fixed blocks of absolute positions, fixed-order sums; `kvjax.model.tiled`),
so a token's K/V and logits are the same bits whether it was computed by a prefill chunk,
a decode step or a verification, alone or in any batch. The trie therefore takes every
full page a sample writes: the prompt's at admission, the answer's when the sample
finishes, is preempted or cancelled. Under `numerics="fast"` only prefill-written pages
(one fixed chunk shape) are shared, which keeps cache on == cache off but not batch
invariance. A preempted one-sample request under invariant numerics resumes
(`EngineConfig.preemption="resume"`, the default): its next admission prefills its prompt and
the answer tokens its cache held, and it continues from its last token (`Rounds._preempt`).
Another (n > 1, fast numerics, "recompute") is recomputed from its prompt: its sampling keys
depend only on (seed, sample, position), so it regenerates the same tokens bit for bit, which
the engine checks against what it already streamed (a request that recomputes
differently ends with status "error" instead of streaming a contradiction).

What a request is told (its stats, stream events, errors) depends only on what its own
namespace can see; `metrics()` adds the operator's view (misses another tenant's private
pages explain), aggregated, never per request.
"""

from __future__ import annotations

import collections
import json
import time
import warnings
from collections.abc import Iterator, Sequence

import jax
import numpy as np

from kvjax import sharding
from kvjax.cache.identity import CacheNamespace, adapter_identity, model_fingerprint
from kvjax.cache.manager import KVCacheManager
from kvjax.cache.pool import PagePool
from kvjax.config import ConfigError, EngineConfig, ModelConfig, SpecConfig
from kvjax.decode import compile_cache
from kvjax.decode.sampling import sequence_keys
from kvjax.engine import warmup
from kvjax.engine.engine_metrics import EngineMetrics, tier_metrics
from kvjax.engine.plans import cpu_attention_choice, cpu_kernel_choice
from kvjax.engine.plans import numerics_blocks as numerics_blocks  # the old name's home
from kvjax.engine.plans import numerics_plans as numerics_plans
from kvjax.engine.requests import (
    MAX_STOP_TOKENS,
    LiveRequest,
    Request,
    RequestResult,
    Seq,
    StreamEvent,
    context,
    render,
    stop_ids,
    validate,
)
from kvjax.engine.rounds import Rounds
from kvjax.engine.runner import StepRunner, TargetModel
from kvjax.engine.stats import Timers, aggregate
from kvjax.engine.warmup import Warmup
from kvjax.errors import NonCausalCacheError
from kvjax.model.kernels import AttentionKernel, resolve_backend
from kvjax.model.layout import canonical, store
from kvjax.model.lora import stack_adapters, stacked_shapes
from kvjax.speculative import eagle_engine
from kvjax.speculative.eagle import head_config, head_products
from kvjax.speculative.eagle_file import HeadFile
from kvjax.speculative.plugin import Speculator, write_ahead


class Engine:
    """Continuous-batching engine with an exact prefix cache (see the module docstring).

    Every request stops at `eos_tokens` unless it sets `ignore_eos`. Not given (None), they
    are the `tokenizer`'s `eos_ids` (the checkpoint's end of sequence, where transformers,
    vLLM and llama.cpp stop by default) that are inside the model's vocabulary, or none
    without a tokenizer; `()` stops at no EOS.

    `draft`, with `spec`: a draft model's (params, config), or for `drafter="eagle"` an
    EAGLE-style head's `HeadFile` (`kvjax.speculative.eagle_engine`); its pages are the
    draft pool.
    """

    def __init__(self, params, config: ModelConfig, engine_config: EngineConfig | None = None,
                 adapters: dict | None = None, hash_fn=None, tokenizer=None,
                 chat_template=None, draft=None,
                 spec: SpecConfig | None = None, eos_tokens: Sequence[int] | None = None):
        if not config.causal:
            raise NonCausalCacheError()
        compile_cache.enable()  # compiled programs kept across processes
        self.engine_config = ec = engine_config or EngineConfig()
        if draft is not None and spec is None:
            spec = SpecConfig()
        eagle = spec is not None and spec.drafter == "eagle"  # `draft` is a HeadFile
        if isinstance(draft, HeadFile) and not eagle:
            raise ConfigError("spec.drafter", "an EAGLE head's HeadFile drafts with "
                              "SpecConfig(drafter='eagle', tree_nodes=N)")
        if eagle and ec.partial_page_copy:
            raise ConfigError("engine.partial_page_copy", "an EAGLE head's pairs come from "
                              "the target's prefill, which starts at a page boundary")
        configs = [config] + ([] if draft is None else [head_config(config) if eagle
                                                        else draft[1]])
        ahead = 0 if spec is None else write_ahead(spec)
        self.adapters = dict(adapters or {})
        lora = stack_adapters(config, list(self.adapters.values())) if self.adapters else None
        plan, *draft_plan, self.numerics_problems = numerics_plans(
            configs, ec, ahead, [] if lora is None else stacked_shapes(lora),
            extra=[{}, head_products(config, len(draft.vocab))]
            if isinstance(draft, HeadFile) else ())
        self.config = config  # the architecture; how its steps run is `self.plan`
        on, words = cpu_kernel_choice(ec)  # XLA's or kvjax's CPU kernel, and why
        self.products = f"{words}; {cpu_attention_choice(ec, config)[1]}" if on else words
        self.plan = plan.check(config)
        if plan.layer_loop:  # kvjax.engine.plans.layer_loop_choice
            self.products += "; the layers as one loop (one block's program for every layer)"
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        if eos_tokens is None:  # an id past the model's vocabulary is never sampled
            # (a tokenizer written to the protocol before it had eos_ids stops at none)
            eos_tokens = [t for t in getattr(tokenizer, "eos_ids", ())
                          if 0 <= t < config.vocab_size]
        self.eos_tokens = tuple(int(t) for t in eos_tokens)
        if any(not 0 <= t < config.vocab_size for t in self.eos_tokens):
            raise ValueError(f"eos_tokens {list(self.eos_tokens)} are outside the vocabulary")
        if len(set(self.eos_tokens)) > MAX_STOP_TOKENS:
            raise ValueError(f"{len(set(self.eos_tokens))} eos_tokens: at most "
                             f"{MAX_STOP_TOKENS}")
        self.cache_config = ec.cache
        if ec.cache.dtype == "int4_kivi" and (spec is not None or ec.partial_page_copy):
            raise NotImplementedError(
                "int4_kivi pages with speculative decoding or partial_page_copy: a rollback or "
                "a copied part of a page needs float numbers its row's open page does not hold")
        self._adapter_index = {name: i for i, name in enumerate(self.adapters, start=1)}
        self._adapter_ids = {name: adapter_identity(name, a) for name, a in self.adapters.items()}
        mesh = sharding.resolve_mesh(ec.mesh)
        if spec is not None and spec.tree_nodes is not None and (mesh is not None or self.adapters):
            raise ConfigError("spec.tree_nodes", "tree speculation runs on one device "
                              "without adapters (kvjax.speculative.tree_loop): use chains "
                              "(tree_nodes=None) with a mesh or LoRA adapters")
        self.sharding = None if mesh is None else sharding.ShardingPlan(mesh, config)
        if self.sharding is not None and lora is not None:
            lora = self.sharding.place_replicated(lora)
        self.model = TargetModel(params=None, config=config, plan=plan, lora=lora)
        self._next_id = 0
        self._timers = Timers()
        self._backlog: list[StreamEvent] = []
        self.spec = None if spec is None else Speculator(
            spec, draft, config, mesh, draft_plan[0].check(configs[1]) if draft_plan else plan,
            target_plan=self.plan)
        drafting = self.spec is not None and self.spec.config is not None
        self.kv = KVCacheManager.for_engine(
            config, ec, hash_fn, self.sharding,
            draft_config=self.spec.config if drafting else None,
            draft_sharding=self.spec.sharding if drafting else None)
        if drafting:
            self.kv.draft.fingerprint = self.spec.fingerprint
            self.kv.draft.lead = 0 if self.spec.eagle is None else eagle_engine.LEAD
        if self.spec is not None and spec.adaptive and not self.spec.calibrated \
                and jax.process_count() > 1:
            raise ConfigError("spec.adaptive", "with several processes every process must "
                              "choose the same γ: pin spec.cost_ratio and spec.verify_slope, "
                              "or spec.verify_costs for trees (timings measured in each "
                              "process differ)")
        self.attention = resolve_backend(ec.attention, config, cache=ec.cache,
                                         poison_freed=ec.poison_freed)
        if self.attention != "reference":
            self.model.kernel = AttentionKernel(self.attention, ec.attention_interpret)
        if self.sharding is not None:
            draft_plan = None if self.draft_pool is None else self.draft_pool.sharding
            self.model.shardings = self.sharding.steps(draft_plan)
            for note in self.sharding.notes + ([] if draft_plan is None else draft_plan.notes):
                warnings.warn(f"kvjax mesh: {note}", stacklevel=2)
        self.runner = StepRunner(self.model, self.kv, ec, self.spec, self._timers,
                                 probe_ok=not self.numerics_problems)
        self.rounds = Rounds(config, ec, self.runner, self._timers, tokenizer)
        self.scheduler = self.rounds.scheduler
        self.load_params(params)  # last: the runner reads the weights from self.model

    # -- read-only views ----------------------------------------------------------------------
    @property
    def params(self):
        """The weights as loaded: the canonical tree (the steps may hold some kernels
        stored transposed, `kvjax.model.layout`)."""
        return canonical(self.model.params, self.config)

    @property
    def pool(self) -> PagePool:
        """The target model's pool, to inspect (page work goes through `self.kv`)."""
        return self.kv.target

    @property
    def draft_pool(self) -> PagePool | None:
        """The draft model's pool, to inspect (None without a draft model)."""
        return self.kv.draft

    @property
    def cache(self):
        return self.kv.target.cache

    @property
    def allocator(self):  # a read-only view (tests/test_layout.py allows it here)
        return self.kv.target.allocator

    @property
    def trie(self):  # a read-only view (tests/test_layout.py allows it here)
        return self.kv.target.trie

    @property
    def fingerprint(self) -> str:
        return self.kv.target.fingerprint

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    # -- public API ---------------------------------------------------------------------------
    def load_params(self, params) -> None:
        """(Re)loads weights; the model fingerprint, and so the namespace, follows them.

        Refused while requests are live: their namespaces name the weights they started with.
        """
        live = self.rounds.live
        if live:
            raise RuntimeError(f"load_params with {len(live)} live requests: finish or "
                               f"cancel them first")
        if self.spec is not None and self.spec.eagle is not None:
            self.spec.eagle.bind(params)  # before anything changes: refuses other weights
        # Host arrays would be copied at every step: weights live on the device(s).
        self.model.params = (jax.device_put(store(params, self.plan))
                              if self.sharding is None else self.sharding.place_params(params))
        self.kv.target.fingerprint = model_fingerprint(self.config, params, self.plan)

    def warmup(self, rows: Sequence[int] = (1,), sampled: Sequence[bool] = (False, True),
               threads: int | None = None) -> Warmup:
        """Compiles (or loads from the compilation cache) the programs of requests `rows`
        at a time, greedy and sampled, before the first request: afterwards a chat of any
        prompt length within the context compiles nothing. Runs no request and changes no
        page or bit (an adaptive speculative engine measures its costs, as its first call
        would); returns what it compiled and in how long (`print` it). Compiles on
        `threads` threads (default one per core). `kvjax.engine.warmup` says which
        programs it leaves to their first use."""
        return warmup.warm(self.runner, rows, sampled, threads)

    def namespace(self, request: Request) -> CacheNamespace:
        """The namespace (without salt) a request's cached states live under."""
        return self.kv.target.namespace(request.position_base,
                                   self._adapter_ids.get(request.adapter, "none"))

    def submit(self, request: Request) -> int:
        """Queues a request; returns its id. Bad input raises before anything changes."""
        return self._enqueue(self._prepare(request))

    def cancel(self, request_id: int) -> None:
        """Stops a request; its pages return to the allocator."""
        req = self.rounds.live.get(request_id)
        if req is None:
            raise KeyError(f"no live request {request_id}")
        self.rounds.cancel(req)

    def step(self) -> list[StreamEvent]:
        """One scheduling round: admit, decode, retire. Returns the new tokens."""
        return self.rounds.step()

    def stream(self, request_id: int | None = None) -> Iterator[StreamEvent]:
        """Runs the engine, yielding tokens as they are produced: every request's until all
        are finished, or only `request_id`'s until it is finished (the other requests'
        events are kept for a later `stream()`, and so are this request's when the caller
        stops early)."""
        def wanted(event: StreamEvent) -> bool:
            return request_id is None or event.request_id == request_id

        pending = collections.deque(e for e in self._backlog if wanted(e))
        self._backlog = [e for e in self._backlog if not wanted(e)]
        try:
            while True:
                while pending:
                    event = pending.popleft()
                    if wanted(event):
                        yield event
                    else:
                        self._backlog.append(event)
                if not (request_id in self.rounds.live if request_id is not None else
                        (self.scheduler.waiting or self.scheduler.running)):
                    return
                pending.extend(self.step())
        finally:
            self._backlog.extend(pending)  # not yielded: kept for a later stream()

    def run(self) -> dict[int, RequestResult]:
        """Runs until every submitted request is finished; returns (and collects) every
        finished result not collected yet, by id."""
        for _ in self.stream():
            pass
        done = dict(self.rounds.results)
        self.rounds.results.clear()
        return done

    def generate(self, requests: list[Request]) -> list[RequestResult]:
        """Submits `requests` (all validated before any is queued), runs until they are
        finished, returns their results in order. Results and stream events of other
        requests are kept for `result()` / `run()` / `stream()`."""
        ids = [self._enqueue(req) for req in [self._prepare(r) for r in requests]]
        mine = set(ids)
        finished = self.rounds.results
        while not all(i in finished for i in ids):
            self._backlog += [e for e in self.step() if e.request_id not in mine]
        return [finished.pop(i) for i in ids]

    def result(self, request_id: int) -> RequestResult:
        """The finished result of `request_id`, collected (a second call is an error)."""
        if request_id in self.rounds.results:
            return self.rounds.results.pop(request_id)
        if request_id in self.rounds.live:
            waiting = self.rounds.live[request_id] in self.scheduler.waiting
            state = "waiting" if waiting else "running"
            raise KeyError(f"request {request_id} is not finished ({state})")
        if isinstance(request_id, int) and 0 <= request_id < self._next_id:
            raise KeyError(f"the result of request {request_id} was already collected")
        raise KeyError(f"no request {request_id}")

    def metrics(self) -> EngineMetrics:
        """Aggregates over every finished or cancelled request so far (`EngineMetrics`: named
        fields, and `m["key"]` as before)."""
        log = self.rounds.admitted_log
        pages = self.kv.stats()
        counters = self.rounds.counters
        spec = {} if self.spec is None else {
            "draft_prefill_s": self._timers["draft_prefill_s"],
            "draft_reused_tokens": sum(s.get("draft_reused_tokens", 0) for s in log),
            "spec": self.spec.metrics()}
        return EngineMetrics(
            **aggregate(log, self.rounds.operator_log, self.cache_config.page_size),
            errors=counters["error"], evictions=pages["evictions"],
            cow_copies=pages["cow_copies"], partial_copies=counters["partial_copies"],
            preemptions=counters["preemptions"], resident_pages=pages["resident_pages"],
            resident_bytes=pages["resident_pages"] * self.kv.target.page_bytes,
            free_pages=pages["free_pages"], prefill_s=self._timers["prefill_s"],
            decode_s=self._timers["decode_s"], host_s=self._timers["host_s"],
            tiers=tier_metrics(log, pages.get("tiers")), **spec)

    def write_metrics(self, path) -> None:
        """Per-request stats as JSON lines, then one line of aggregates."""
        with open(path, "w") as f:
            for s in self.rounds.stats_log:
                f.write(json.dumps(s) + "\n")
            f.write(json.dumps({"aggregate": self.metrics().as_dict()}) + "\n")

    # -- intake --------------------------------------------------------------------------------
    def _prepare(self, request: Request) -> LiveRequest:
        """A validated request, not queued yet (its id is given when it is)."""
        tokens = validate(request, render(request, self.tokenizer, self.chat_template),
                          self.config, self.cache_config, self.engine_config.max_slots,
                          self.adapters, None if self.spec is None else self.spec.max_seq_len,
                          0 if self.spec is None else write_ahead(self.spec.spec))
        req = LiveRequest(id=-1, request=request, tokens=tokens,
                          namespace=self.namespace(request),
                          context=context(request, tokens, self.cache_config.page_size),
                          adapter_index=self._adapter_index.get(request.adapter, 0),
                          submitted=0.0,  # set when queued
                          stops=stop_ids(request, self.eos_tokens))
        keys = np.asarray(sequence_keys(request.sampling.seed, request.n))
        req.seqs = [Seq(req=req, index=j, key=keys[j]) for j in range(request.n)]
        return req

    def _enqueue(self, req: LiveRequest) -> int:
        req.id = self._next_id
        self._next_id += 1
        req.submitted = time.perf_counter()
        self.rounds.enqueue(req)
        return req.id
