"""The serving engine: prefix reuse on admission, continuous batching, exact by construction.

One scheduling round: admit waiting requests into free batch slots (prefix match, allocate,
prefill only the unmatched suffix, sample the first token, cache the prompt's full pages),
then decode every running sequence `decode_steps` tokens on device, then retire finished
requests. The parts: `requests` (validation, rendering, a live request's state),
`scheduler` (queue, slots, admission plan, preemption order), `runner` (the device calls),
`kvjax.cache.pool` (pages: one `PagePool` for the target, one for the draft), `results`
and `stats`; this facade ties them together.

Exactness: the trie only ever holds pages computed by the prefill path (one fixed chunk
shape, page-block attention), so a page reused from the cache holds exactly the bits a cold
prefill would write. Pages written by decode (one token per row) differ from prefill's in
the last bits, so they are never shared. A preempted request is recomputed from its prompt;
its sampling keys depend only on (seed, sample, position), so it regenerates the same
tokens bit for bit, which the engine checks against what it already streamed (a request
that recomputes differently ends with status "error" instead of streaming a contradiction).

What a request is told (its stats, stream events, errors) depends only on what its own
namespace can see; `metrics()` adds the operator's view (misses another tenant's private
pages explain), aggregated, never per request.
"""

from __future__ import annotations

import collections
import json
import time
import warnings
from collections.abc import Iterator

import jax
import numpy as np

from kvjax import sharding
from kvjax.cache.identity import CacheNamespace, adapter_identity, model_fingerprint
from kvjax.cache.pool import PagePool
from kvjax.cache.trie import history_digests
from kvjax.config import ConfigError, EngineConfig, ModelConfig, SpecConfig
from kvjax.decode.sampling import sequence_keys
from kvjax.engine import results, scheduler
from kvjax.engine.requests import (
    LiveRequest,
    Request,
    RequestResult,
    Seq,
    StreamEvent,
    render,
    salts_per_page,
    validate,
)
from kvjax.engine.runner import StepRunner, TargetModel
from kvjax.engine.stats import Timers, aggregate, record_admission
from kvjax.errors import NonCausalCacheError
from kvjax.model.kernels import AttentionKernel, resolve_backend
from kvjax.model.lora import stack_adapters
from kvjax.speculative.plugin import Speculator, finish_request_stats


class Engine:
    """Continuous-batching engine with an exact prefix cache (see the module docstring)."""

    def __init__(self, params, config: ModelConfig, engine_config: EngineConfig | None = None,
                 adapters: dict | None = None, hash_fn=None, tokenizer=None,
                 chat_template=None, draft: tuple | None = None,
                 spec: SpecConfig | None = None):
        if not config.causal:
            raise NonCausalCacheError()
        self.config = config
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.engine_config = ec = engine_config or EngineConfig()
        self.cache_config = ec.cache
        self.adapters = dict(adapters or {})
        self._adapter_index = {name: i for i, name in enumerate(self.adapters, start=1)}
        self._adapter_ids = {name: adapter_identity(name, a) for name, a in self.adapters.items()}
        mesh = sharding.resolve_mesh(ec.mesh)
        self.sharding = None if mesh is None else sharding.ShardingPlan(mesh, config)
        lora = stack_adapters(config, list(self.adapters.values())) if self.adapters else None
        if self.sharding is not None and lora is not None:
            lora = self.sharding.place_replicated(lora)
        self.pool = PagePool(config, ec.cache, eviction=ec.eviction,
                             evicted_record=ec.evicted_record, hash_fn=hash_fn,
                             poison_freed=ec.poison_freed, sharding=self.sharding)
        self.model = TargetModel(params=None, config=config, lora=lora)
        self._reqs: dict[int, LiveRequest] = {}  # live: waiting or running
        self.load_params(params)
        self.scheduler = scheduler.Scheduler(ec.max_slots, ec.schedule)
        self._results: dict[int, RequestResult] = {}  # finished, not yet collected
        self._next_id = 0
        self._counters = collections.Counter()
        self._timers = Timers()
        self._stats_log: list[dict] = []
        self._operator_log: list[tuple[str | None, tuple[str, ...]]] = []  # (cause, fields)
        self._backlog: list[StreamEvent] = []
        if draft is not None and spec is None:
            spec = SpecConfig()
        self.spec = None if spec is None else Speculator(spec, draft, config, ec, hash_fn, mesh)
        self.draft_pool = None if self.spec is None else self.spec.pool
        if self.spec is not None and spec.adaptive and not self.spec.calibrated \
                and jax.process_count() > 1:
            raise ConfigError("spec.adaptive", "with several processes every process must "
                              "choose the same γ: pin spec.cost_ratio and spec.verify_slope "
                              "(timings measured in each process differ)")
        self.attention = resolve_backend(ec.attention, config, cache=ec.cache,
                                         poison_freed=ec.poison_freed)
        if self.attention != "reference":
            self.model.kernel = AttentionKernel(self.attention, ec.attention_interpret)
        if self.sharding is not None:
            draft_plan = None if self.draft_pool is None else self.draft_pool.sharding
            self.model.shardings = self.sharding.steps(draft_plan)
            for note in self.sharding.notes + ([] if draft_plan is None else draft_plan.notes):
                warnings.warn(f"kvjax mesh: {note}", stacklevel=2)
        self.runner = StepRunner(self.model, self.pool, ec, self.spec, self._timers)

    # -- read-only views ----------------------------------------------------------------------
    @property
    def params(self):
        return self.model.params

    @property
    def cache(self):
        return self.pool.cache

    @property
    def allocator(self):
        return self.pool.allocator

    @property
    def trie(self):
        return self.pool.trie

    @property
    def fingerprint(self) -> str:
        return self.pool.fingerprint

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
        if self._reqs:
            raise RuntimeError(f"load_params with {len(self._reqs)} live requests: finish or "
                               f"cancel them first")
        # Host arrays would be copied at every step: weights live on the device(s).
        self.model.params = (jax.device_put(params) if self.sharding is None
                             else self.sharding.place_params(params))
        self.pool.fingerprint = model_fingerprint(self.config, params)

    def namespace(self, request: Request) -> CacheNamespace:
        """The namespace (without salt) a request's cached states live under."""
        return self.pool.namespace(request.position_base,
                                   self._adapter_ids.get(request.adapter, "none"))

    def submit(self, request: Request) -> int:
        """Queues a request; returns its id. Bad input raises before anything changes."""
        return self._enqueue(self._prepare(request))

    def cancel(self, request_id: int) -> None:
        """Stops a request; its pages return to the allocator."""
        req = self._reqs.get(request_id)
        if req is None:
            raise KeyError(f"no live request {request_id}")
        if req in self.scheduler.waiting:
            self.scheduler.waiting.remove(req)
        self._release(req)
        self._finish(req, status="cancelled")

    def step(self) -> list[StreamEvent]:
        """One scheduling round: admit, decode, retire. Returns the new tokens."""
        events: list[StreamEvent] = []
        self._admit(events)
        if self.scheduler.running:
            self._decode(events)
        elif self.scheduler.waiting:  # validation makes every request fit an empty cache
            raise RuntimeError("the engine cannot admit a request into an idle cache")
        return events

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
                if not (request_id in self._reqs if request_id is not None else
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
        done = dict(self._results)
        self._results.clear()
        return done

    def generate(self, requests: list[Request]) -> list[RequestResult]:
        """Submits `requests` (all validated before any is queued), runs until they are
        finished, returns their results in order. Results and stream events of other
        requests are kept for `result()` / `run()` / `stream()`."""
        ids = [self._enqueue(req) for req in [self._prepare(r) for r in requests]]
        mine = set(ids)
        while not all(i in self._results for i in ids):
            self._backlog += [e for e in self.step() if e.request_id not in mine]
        return [self._results.pop(i) for i in ids]

    def result(self, request_id: int) -> RequestResult:
        """The finished result of `request_id`, collected (a second call is an error)."""
        if request_id in self._results:
            return self._results.pop(request_id)
        if request_id in self._reqs:
            state = "waiting" if self._reqs[request_id] in self.scheduler.waiting else "running"
            raise KeyError(f"request {request_id} is not finished ({state})")
        if isinstance(request_id, int) and 0 <= request_id < self._next_id:
            raise KeyError(f"the result of request {request_id} was already collected")
        raise KeyError(f"no request {request_id}")

    def metrics(self) -> dict:
        """Aggregates over every finished or cancelled request so far."""
        log = [s for s in self._stats_log if "prompt_tokens" in s]
        resident = self.trie.num_nodes
        return {
            **aggregate(log, self._operator_log, self.cache_config.page_size),
            "errors": self._counters["error"],
            "evictions": self.trie.evictions,
            "cow_copies": self.allocator.copies,
            "partial_copies": self._counters["partial_copies"],
            "preemptions": self._counters["preemptions"],
            "resident_pages": resident,
            "resident_bytes": resident * self.pool.page_bytes,
            "free_pages": self.allocator.num_free,
            "prefill_s": self._timers["prefill_s"],
            "decode_s": self._timers["decode_s"],
            "host_s": self._timers["host_s"],
            **({} if self.spec is None else {
                "draft_prefill_s": self._timers["draft_prefill_s"],
                "draft_reused_tokens": sum(s.get("draft_reused_tokens", 0) for s in log),
                "spec": self.spec.metrics()}),
        }

    def write_metrics(self, path) -> None:
        """Per-request stats as JSON lines, then one line of aggregates."""
        with open(path, "w") as f:
            for s in self._stats_log:
                f.write(json.dumps(s) + "\n")
            f.write(json.dumps({"aggregate": self.metrics()}) + "\n")

    # -- intake --------------------------------------------------------------------------------
    def _prepare(self, request: Request) -> LiveRequest:
        """A validated request, not queued yet (its id is given when it is)."""
        tokens = validate(request, render(request, self.tokenizer, self.chat_template),
                          self.config, self.cache_config, self.engine_config.max_slots,
                          self.adapters, None if self.spec is None else self.spec.max_seq_len,
                          0 if self.spec is None else self.spec.spec.gamma)
        ps = self.cache_config.page_size
        req = LiveRequest(id=-1, request=request, tokens=tokens,
                          namespace=self.namespace(request),
                          salts=salts_per_page(request, len(tokens), ps),
                          digests=history_digests(tokens, ps),
                          adapter_index=self._adapter_index.get(request.adapter, 0),
                          submitted=0.0)  # set when queued
        keys = np.asarray(sequence_keys(request.sampling.seed, request.n))
        req.seqs = [Seq(req=req, index=j, key=keys[j]) for j in range(request.n)]
        return req

    def _enqueue(self, req: LiveRequest) -> int:
        req.id = self._next_id
        self._next_id += 1
        req.submitted = time.perf_counter()
        self._reqs[req.id] = req
        self.scheduler.waiting.append(req)
        return req.id

    # -- admission -----------------------------------------------------------------------------
    def _admit(self, events: list[StreamEvent]) -> None:
        sched, ec = self.scheduler, self.engine_config
        while sched.waiting:
            with self._timers("host_s"):
                req = sched.pick(lambda r: len(scheduler.match(self.pool, r,
                                                               ec.prefix_cache).nodes))
            free = sched.free_slots()
            if len(free) < req.request.n or not self._try_admit(req, free, events):
                return

    def _try_admit(self, req: LiveRequest, free_slots: list[int], events) -> bool:
        ec = self.engine_config
        with self._timers("host_s"):
            adm = scheduler.plan_admission(req, self.pool, self.draft_pool, ec.prefix_cache,
                                           ec.partial_page_copy)
            if adm is None:
                return False
            pages = adm.target.commit()
        if adm.target.copy_from is not None:
            self._counters["partial_copies"] += 1
        logits, prefill_s = self.runner.prefill(req, pages, adm.start)
        unbounded = self.runner.cache_prompt(req, pages) if ec.prefix_cache else 0
        draft_pages, draft_reused = ([], 0) if adm.draft is None else \
            self.runner.prefill_draft(req, adm.draft)
        first = self.runner.first_tokens(req, logits)
        for j, seq in enumerate(req.seqs):
            seq.pages, seq.draft_pages = list(pages), list(draft_pages)
            if j > 0:  # the samples share the prompt's pages (copy on write)
                for page in pages:
                    self.allocator.share(page)
                for page in draft_pages:
                    self.draft_pool.allocator.share(page)
            seq.length, seq.last, seq.generated = len(req.tokens), int(first[j]), [int(first[j])]
            seq.logits = [logits] if req.request.return_logits else []
            seq.done = (req.request.max_new_tokens == 1 or seq.last == req.request.stop_token)
            seq.draft_length, seq.prev = len(req.tokens), -1
        self.scheduler.seat(req, free_slots)
        for seq in req.seqs:
            if seq.done:
                self._release_seq(seq)
        record_admission(req, adm.match, adm.reuse, adm.start, adm.target.copied, prefill_s,
                         unbounded, self.cache_config.page_size)
        if self.draft_pool is not None:
            req.stats.setdefault("draft_reused_tokens", draft_reused)
        if self._emit(req, events):
            self._retire_if_done(req)
        return True

    # -- pages ---------------------------------------------------------------------------------
    def _grow(self, seq: Seq, tokens: int) -> bool:
        """Gives `seq` pages it may write for its next `tokens` cache slots, in the target's
        pool and the draft's (copy on write), preempting younger requests if it must."""
        def preempt() -> bool:
            victim = self.scheduler.victim(seq.req)
            if victim is not None:
                self._preempt(victim)
            return victim is not None

        end = seq.length + tokens
        with self._timers("host_s"):
            ok = self.pool.grow(seq.pages, seq.length, end, preempt)
            if ok and self.draft_pool is not None:
                ok = self.draft_pool.grow(seq.draft_pages, seq.draft_length, end, preempt)
        return ok

    def _preempt(self, req: LiveRequest) -> None:
        """Returns a running request's pages and queues it first: it is recomputed from its
        prompt. What it streamed stays; the regenerated tokens are checked against it."""
        self._release(req)
        for seq in req.seqs:
            seq.generated, seq.logits, seq.done, seq.length = [], [], False, 0
            seq.draft_length, seq.prev, seq.checked = 0, -1, 0
        req.calls = 0
        req.stats.pop("spec", None)  # counts the tokens it returns, not the discarded work
        req.stats["preemptions"] = req.stats.get("preemptions", 0) + 1
        self._counters["preemptions"] += 1
        self.scheduler.waiting.appendleft(req)

    def _release(self, req: LiveRequest) -> None:
        for seq in req.seqs:
            self._release_seq(seq)

    def _release_seq(self, seq: Seq) -> None:
        self.pool.release(seq.pages)
        if seq.draft_pages:
            self.draft_pool.release(seq.draft_pages)
        seq.pages, seq.draft_pages = [], []
        self.scheduler.vacate(seq)

    # -- decode --------------------------------------------------------------------------------
    def _decode(self, events: list[StreamEvent]) -> None:
        ec, spec = self.engine_config, self.spec
        gamma = 0
        if spec is not None:
            if spec.spec.adaptive and not spec.calibrated:
                spec.calibrate(self.model.params, self.config, ec.max_slots)
            replay = self._replay_gamma()
            gamma = spec.next_gamma() if replay is None else replay
        budgets = {}
        for seq in self.scheduler.decode_order():
            if seq.slot is None or seq.done:
                continue  # preempted while growing another sequence
            if spec is not None and seq.req.replaying and seq.req.gammas[seq.req.calls] != gamma:
                continue  # recomputing under another γ: it waits for a call with its own
            budget = min(ec.decode_steps, seq.req.request.max_new_tokens - len(seq.generated))
            if self._grow(seq, budget + gamma):  # a verify writes up to γ slots ahead
                budgets[seq.slot] = budget
            elif self.num_running > 1:
                self._preempt(seq.req)  # nothing younger to preempt: wait for the others
        live = [s for s in self.scheduler.slots if s is not None and s.slot in budgets]
        if not live:
            return
        live_reqs = list({s.req.id: s.req for s in live}.values())
        self.runner.decode(live, budgets, gamma)
        if spec is not None:
            for req in live_reqs:
                if req.calls == len(req.gammas):
                    req.gammas.append(gamma)
                req.calls += 1
        for req in live_reqs:
            if not self._emit(req, events):
                continue
            for seq in req.seqs:
                if seq.done:
                    self._release_seq(seq)
            self._retire_if_done(req)

    def _replay_gamma(self) -> int | None:
        """The γ the oldest running request that is recomputing streamed tokens had at this
        call of its first run, or None. Sampled speculative tokens depend on where rounds
        start, so a request regenerates what it streamed only under the same γ per call
        (adaptive γ may have moved since)."""
        replaying = [s.req for s in self.scheduler.running if s.req.replaying]
        if not replaying:
            return None
        oldest = min(replaying, key=lambda r: r.admitted_order)
        return oldest.gammas[oldest.calls]

    # -- results -------------------------------------------------------------------------------
    def _emit(self, req: LiveRequest, events: list[StreamEvent]) -> bool:
        """Streams each sample's new tokens. False when a recomputed sample contradicts what
        it already streamed: the request has failed (`_fail`) and no token is streamed."""
        error = results.contradiction(req)
        if error is not None:
            self._fail(req, events, error)
            return False
        events += results.new_events(req)
        return True

    def _fail(self, req: LiveRequest, events: list[StreamEvent], error: str) -> None:
        """Ends a request with status "error": its pages return, and every sample whose
        stream is still open gets a last event naming the error."""
        self._release(req)
        events += results.closing_events(req, error)
        self._finish(req, status="error", error=error)

    def _retire_if_done(self, req: LiveRequest) -> None:
        if all(s.done for s in req.seqs):
            self._release(req)
            self._finish(req, status="finished")

    def _finish(self, req: LiveRequest, status: str, error: str | None = None) -> None:
        result = results.request_result(req, status, error, self.config.vocab_size,
                                        self.tokenizer)
        finish_request_stats(result.stats)
        self._results[req.id] = result
        self._counters[status] += 1
        self._stats_log.append(dict(result.stats, id=req.id, status=status))
        if "prompt_tokens" in req.stats:
            self._operator_log.append(req.operator_miss)
        del self._reqs[req.id]
