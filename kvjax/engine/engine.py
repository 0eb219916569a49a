"""The serving engine: prefix reuse on admission, continuous batching, exact by construction.

Host code (plain Python + numpy) that calls the jitted device steps. One scheduling round:
admit waiting requests into free batch slots (prefix match, allocate, prefill only the
unmatched suffix, sample the first token, cache the prompt's full pages), then decode every
running sequence `decode_steps` tokens on device, then retire finished requests.

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
import dataclasses
import json
import time
import warnings
from collections.abc import Iterator

import jax
import numpy as np

from kvjax import sharding
from kvjax.cache.allocator import PageAllocator
from kvjax.cache.identity import (
    CacheNamespace,
    adapter_identity,
    attention_signature,
    model_fingerprint,
)
from kvjax.cache.paged import (
    cache_bytes,
    copy_pages,
    init_cache,
    padded_ids,
    poison_pages,
)
from kvjax.cache.trie import EVICTION_POLICIES, Match, PrefixTrie, history_digests
from kvjax.config import ConfigError, EngineConfig, ModelConfig, SpecConfig
from kvjax.decode import steps
from kvjax.decode.batching import free_past, page_table, pages_for
from kvjax.decode.prefill import prefill
from kvjax.decode.prompts import check_token_ids
from kvjax.decode.sampling import sample, sequence_keys
from kvjax.engine.requests import (
    InvalidRequestError,
    Request,
    RequestResult,
    StreamEvent,
    check_field_types,
)
from kvjax.errors import NonCausalCacheError
from kvjax.model.kernels import AttentionKernel, resolve_backend
from kvjax.model.lora import stack_adapters
from kvjax.speculative.plugin import Speculator, finish_request_stats

_sample = jax.jit(sample)


@dataclasses.dataclass(eq=False)
class _Seq:
    """One sample of a request: a batch slot, its pages and its progress."""

    req: _Req
    index: int
    key: np.ndarray  # uint32[2]
    pages: list[int] = dataclasses.field(default_factory=list)
    slot: int | None = None
    length: int = 0  # tokens in the cache
    last: int = -1  # the newest token, not yet cached
    generated: list[int] = dataclasses.field(default_factory=list)
    logits: list[np.ndarray] = dataclasses.field(default_factory=list)
    streamed: list[int] = dataclasses.field(default_factory=list)  # survives preemption
    checked: int = 0  # generated[:checked] is known to equal streamed[:checked]
    closed: bool = False  # its finished event was streamed
    done: bool = False
    draft_pages: list[int] = dataclasses.field(default_factory=list)
    draft_length: int = 0  # tokens in the draft's cache: `length` or `length - 1`
    prev: int = -1  # the token at index length - 1, when the draft lags one behind


@dataclasses.dataclass(eq=False)
class _Req:
    id: int
    request: Request
    tokens: list[int]
    namespace: CacheNamespace
    salts: list[str | None]
    digests: list[bytes]
    adapter_index: int
    submitted: float
    seqs: list[_Seq] = dataclasses.field(default_factory=list)
    stats: dict = dataclasses.field(default_factory=dict)
    admitted_order: int = -1
    operator_miss: tuple[str | None, tuple[str, ...]] = (None, ())  # metrics() only
    gammas: list[int] = dataclasses.field(default_factory=list)  # γ of each decode call
    calls: int = 0  # decode calls since its (latest) admission


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
        self._lora = (stack_adapters(config, list(self.adapters.values()))
                      if self.adapters else None)
        self._adapter_ids = {name: adapter_identity(name, a) for name, a in self.adapters.items()}
        mesh = sharding.resolve_mesh(ec.mesh)
        self.sharding = None if mesh is None else sharding.ShardingPlan(mesh, config)
        if self.sharding is not None and self._lora is not None:
            self._lora = self.sharding.place_replicated(self._lora)
        self.load_params(params)
        self.cache = (init_cache(config, ec.cache) if self.sharding is None
                      else self.sharding.init_cache(ec.cache))
        self.allocator = PageAllocator(ec.cache.num_pages, track_freed=ec.poison_freed)
        if ec.eviction not in EVICTION_POLICIES:
            raise ConfigError("engine.eviction", f"{ec.eviction!r} is not one of "
                              f"{', '.join(map(repr, EVICTION_POLICIES))}")
        trie_kwargs = {} if hash_fn is None else {"hash_fn": hash_fn}
        self.trie = PrefixTrie(ec.cache.page_size, self.allocator, ec.eviction,
                               evicted_record=ec.evicted_record, **trie_kwargs)
        self._waiting: collections.deque[_Req] = collections.deque()
        self._slots: list[_Seq | None] = [None] * ec.max_slots
        self._reqs: dict[int, _Req] = {}
        self._results: dict[int, RequestResult] = {}  # finished, not yet collected
        self._next_id = 0
        self._admissions = 0
        self._counters = collections.Counter()
        self._timers = collections.Counter()
        self._stats_log: list[dict] = []
        self._operator_log: list[tuple[str | None, tuple[str, ...]]] = []  # (cause, fields)
        self._backlog: list[StreamEvent] = []
        if ec.poison_freed:
            self.cache = poison_pages(self.cache, np.arange(ec.cache.num_pages, dtype=np.int32))
        if draft is not None and spec is None:
            spec = SpecConfig()
        self.spec = None if spec is None else Speculator(spec, draft, config, ec, hash_fn, mesh)
        self._draft = None if self.spec is None else self.spec.pool
        if self.spec is not None and spec.adaptive and not self.spec.calibrated \
                and jax.process_count() > 1:
            raise ConfigError("spec.adaptive", "with several processes every process must "
                              "choose the same γ: pin spec.cost_ratio and spec.verify_slope "
                              "(timings measured in each process differ)")
        backend = resolve_backend(ec.attention, config, cache=ec.cache,
                                  poison_freed=ec.poison_freed)
        self.attention = backend
        self._kernel = (None if backend == "reference"
                        else AttentionKernel(backend, ec.attention_interpret))
        self._shardings = None
        if self.sharding is not None:
            draft_plan = None if self._draft is None else self._draft.sharding
            self._shardings = self.sharding.steps(draft_plan)
            for note in self.sharding.notes + ([] if draft_plan is None else draft_plan.notes):
                warnings.warn(f"kvjax mesh: {note}", stacklevel=2)

    # -- public API ---------------------------------------------------------------------------
    def load_params(self, params) -> None:
        """(Re)loads weights; the model fingerprint, and so the namespace, follows them.

        Refused while requests are live: their namespaces name the weights they started with.
        """
        if getattr(self, "_reqs", None):
            raise RuntimeError(f"load_params with {len(self._reqs)} live requests: finish or "
                               f"cancel them first")
        # Host arrays would be copied at every step: weights live on the device(s).
        self.params = (jax.device_put(params) if self.sharding is None
                       else self.sharding.place_params(params))
        self.fingerprint = model_fingerprint(self.config, params)

    def namespace(self, request: Request) -> CacheNamespace:
        """The namespace (without salt) a request's cached states live under."""
        return CacheNamespace(
            model=self.fingerprint,
            adapter=self._adapter_ids.get(request.adapter, "none"),
            position_base=request.position_base,
            attention=attention_signature(self.config),
            kv_dtype=self.cache_config.dtype,
        )

    def submit(self, request: Request) -> int:
        """Queues a request; returns its id. Bad input raises before anything changes."""
        return self._enqueue(self._prepare(request))

    def _prepare(self, request: Request) -> _Req:
        """A validated request, not queued yet (its id is given when it is)."""
        tokens = self._validate(request, self._render(request))
        ps = self.cache_config.page_size
        num_blocks = pages_for(len(tokens), ps)
        salts = [None if request.tenant is None or (i + 1) * ps <= request.public_prefix
                 else request.tenant for i in range(num_blocks)]
        req = _Req(id=-1, request=request, tokens=tokens, namespace=self.namespace(request),
                   salts=salts, digests=history_digests(tokens, ps),
                   adapter_index=self._adapter_index.get(request.adapter, 0),
                   submitted=0.0)  # set when queued
        keys = np.asarray(sequence_keys(request.sampling.seed, request.n))
        req.seqs = [_Seq(req=req, index=j, key=keys[j]) for j in range(request.n)]
        return req

    def _enqueue(self, req: _Req) -> int:
        req.id = self._next_id
        self._next_id += 1
        req.submitted = time.perf_counter()
        self._reqs[req.id] = req
        self._waiting.append(req)
        return req.id

    def cancel(self, request_id: int) -> None:
        """Stops a request; its pages return to the allocator."""
        req = self._reqs.get(request_id)
        if req is None:
            raise KeyError(f"no live request {request_id}")
        if req in self._waiting:
            self._waiting.remove(req)
        self._release(req)
        self._finish(req, status="cancelled")

    def step(self) -> list[StreamEvent]:
        """One scheduling round: admit, decode, retire. Returns the new tokens."""
        events: list[StreamEvent] = []
        self._admit(events)
        if any(s is not None for s in self._slots):
            self._decode(events)
        elif self._waiting:  # validation makes every request fit an empty cache
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
                        (self._waiting or any(s is not None for s in self._slots))):
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
            state = "waiting" if self._reqs[request_id] in self._waiting else "running"
            raise KeyError(f"request {request_id} is not finished ({state})")
        if isinstance(request_id, int) and 0 <= request_id < self._next_id:
            raise KeyError(f"the result of request {request_id} was already collected")
        raise KeyError(f"no request {request_id}")

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len({s.req.id for s in self._slots if s is not None})

    # -- validation ---------------------------------------------------------------------------
    def _render(self, request: Request):
        """The prompt's token ids: given, or rendered from text or chat messages."""
        check_field_types(request)
        given = [x is not None for x in (request.tokens, request.text, request.messages)]
        if sum(given) != 1:
            raise InvalidRequestError("give exactly one of tokens, text or messages")
        if request.tokens is not None:
            return request.tokens
        if request.text is not None:
            if self.tokenizer is None:
                raise InvalidRequestError("a text request needs an engine with a tokenizer")
            return self.tokenizer.encode(request.text)
        if self.chat_template is None:
            raise InvalidRequestError("a messages request needs an engine with a chat template")
        try:
            return self.chat_template.render(request.messages)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None

    def _validate(self, request: Request, tokens) -> list[int]:
        cfg, cc = self.config, self.cache_config
        ids = np.asarray(check_token_ids(tokens, cfg.vocab_size))
        if isinstance(request.max_new_tokens, bool) or request.max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be >= 1, got "
                                      f"{request.max_new_tokens}")
        if request.n < 1 or request.n > self.engine_config.max_slots:
            raise InvalidRequestError(f"n={request.n} must be in [1, max_slots="
                                      f"{self.engine_config.max_slots}]")
        if request.adapter is not None and request.adapter not in self.adapters:
            known = ", ".join(sorted(self.adapters)) or "none loaded"
            raise InvalidRequestError(f"unknown adapter {request.adapter!r} (known: {known})")
        if request.position_base < 0:
            raise InvalidRequestError(f"position_base must be >= 0, got {request.position_base}")
        end = request.position_base + ids.size + request.max_new_tokens
        if end > cfg.max_seq_len:
            raise InvalidRequestError(
                f"position_base {request.position_base} + {ids.size} prompt tokens + "
                f"{request.max_new_tokens} new tokens exceed max_seq_len={cfg.max_seq_len}")
        draft_len = None if self.spec is None else self.spec.max_seq_len
        if draft_len is not None and end > draft_len:
            raise InvalidRequestError(
                f"position_base {request.position_base} + {ids.size} prompt tokens + "
                f"{request.max_new_tokens} new tokens exceed the draft's max_seq_len={draft_len}")
        if not 0 <= request.public_prefix <= ids.size:
            raise InvalidRequestError(f"public_prefix must be in [0, {ids.size}]")
        if request.stop_token is not None and not 0 <= request.stop_token < cfg.vocab_size:
            raise InvalidRequestError(f"stop_token {request.stop_token} is outside the vocabulary")
        shared = ids.size // cc.page_size
        slack = 0 if self.spec is None else self.spec.spec.gamma  # verify writes ahead
        need = shared + request.n * (pages_for(ids.size + request.max_new_tokens + slack,
                                               cc.page_size) - shared)
        if need > cc.num_pages:
            raise InvalidRequestError(
                f"the request needs {need} pages of {cc.page_size} tokens, more than the whole "
                f"cache ({cc.num_pages} pages)")
        return ids.tolist()

    # -- admission ----------------------------------------------------------------------------
    def _match(self, req: _Req, touch: bool) -> Match:
        if not self.engine_config.prefix_cache:
            return Match([], "prefix_cache_off")
        return self.trie.match(req.namespace, req.tokens, req.salts, req.digests, touch=touch)

    def _pick(self) -> _Req:
        if self.engine_config.schedule == "fcfs" or len(self._waiting) == 1:
            return self._waiting[0]
        t_host = time.perf_counter()
        best = max(self._waiting, key=lambda r: (len(self._match(r, touch=False).nodes), -r.id))
        self._timers["host_s"] += time.perf_counter() - t_host
        return best

    def _admit(self, events: list[StreamEvent]) -> None:
        while self._waiting:
            req = self._pick()
            free_slots = [i for i, s in enumerate(self._slots) if s is None]
            if len(free_slots) < req.request.n or not self._try_admit(req, free_slots, events):
                return

    def _try_admit(self, req: _Req, free_slots: list[int], events) -> bool:
        t_host = time.perf_counter()
        cc, ps = self.cache_config, self.cache_config.page_size
        n_tok = len(req.tokens)
        match = self._match(req, touch=False)
        reuse = min(len(match.nodes), (n_tok - 1) // ps)  # at least one token is computed
        reused_pages = match.pages[:reuse]
        copy_from, copied = None, 0
        if self.engine_config.partial_page_copy:
            room = n_tok - 1 - reuse * ps
            if reuse < len(match.nodes):
                copy_from, copied = match.nodes[reuse], min(ps, room)
            elif match.partial is not None:
                copy_from, copied = match.partial[0], min(match.partial[1], room)
            copied = max(copied, 0)
            if copied == 0:
                copy_from = None
        fresh_needed = pages_for(n_tok, ps) - reuse
        draft_plan = self._plan_draft(req)
        if draft_plan is False:  # the draft's pool cannot hold the prompt yet
            self._timers["host_s"] += time.perf_counter() - t_host
            return False
        for page in reused_pages:
            self.allocator.share(page)  # ours now: not evictable while we allocate
        if copy_from is not None:
            self.allocator.share(copy_from.page)
        room = self.allocator.num_free + self.trie.num_evictable()
        if copy_from is not None and room < fresh_needed:
            self.allocator.free([copy_from.page])  # the copy does not fit: recompute
            copy_from, copied = None, 0
            room = self.allocator.num_free + self.trie.num_evictable()
        if room < fresh_needed:
            self.allocator.free(reused_pages)  # wait for running requests to finish
            if draft_plan is not None:
                self._draft.allocator.free(draft_plan[1])
            self._timers["host_s"] += time.perf_counter() - t_host
            return False
        self._reserve(fresh_needed)
        self.trie.touch(match.nodes)
        fresh = self.allocator.allocate(fresh_needed)
        pages = reused_pages + fresh
        self._timers["host_s"] += time.perf_counter() - t_host
        self._flush_poison()
        if copy_from is not None:
            self.cache = copy_pages(self.cache, padded_ids([copy_from.page], 0),
                                    padded_ids([fresh[0]], cc.num_pages))
            self.allocator.free([copy_from.page])
            self._counters["partial_copies"] += 1
        start = reuse * ps + copied

        t0 = time.perf_counter()
        logits = self._prefill(req, pages, start)
        first_logits = np.asarray(logits)  # [V]
        prefill_s = time.perf_counter() - t0
        self._timers["prefill_s"] += prefill_s
        unbounded = 0
        if self.engine_config.prefix_cache:
            t_host = time.perf_counter()
            unbounded = self.trie.unbounded_blocks(req.namespace, req.tokens, req.salts)
            self.trie.insert(req.namespace, req.tokens, req.salts, req.digests, pages)
            self._timers["host_s"] += time.perf_counter() - t_host

        draft_pages, draft_reused = (self._admit_draft(req, draft_plan)
                                     if draft_plan is not None else ([], 0))
        n = req.request.n
        position = req.request.position_base + n_tok
        knobs = _knobs([req.request] * n)
        first = np.asarray(_sample(np.repeat(first_logits[None], n, 0),
                                   np.stack([s.key for s in req.seqs]),
                                   np.full(n, position, np.int32), *knobs))
        for j, seq in enumerate(req.seqs):
            seq.pages = list(pages)
            if j > 0:
                for page in pages:
                    self.allocator.share(page)
            seq.length, seq.last, seq.generated = n_tok, int(first[j]), [int(first[j])]
            seq.logits = [first_logits] if req.request.return_logits else []
            seq.done = (req.request.max_new_tokens == 1 or seq.last == req.request.stop_token)
            seq.slot = free_slots[j]
            self._slots[seq.slot] = seq
            seq.draft_pages, seq.draft_length, seq.prev = list(draft_pages), n_tok, -1
            if j > 0:
                for page in draft_pages:
                    self._draft.allocator.share(page)
        self._waiting.remove(req)
        for seq in req.seqs:
            if seq.done:
                self._release_seq(seq)
        self._admissions += 1
        req.admitted_order = self._admissions
        self._record_admission(req, match, reuse, start, copied, prefill_s, unbounded)
        if self._draft is not None:
            req.stats.setdefault("draft_reused_tokens", draft_reused)
        if self._emit(req, events):
            self._retire_if_done(req)
        return True

    def _plan_draft(self, req: _Req):
        """The draft's reusable prompt pages (shared now), None without a draft model, or
        False when its pool cannot hold the prompt (nothing is changed then)."""
        pool = self._draft
        if pool is None:
            return None
        ps, n_tok = self.cache_config.page_size, len(req.tokens)
        ns = pool.namespace(req.request.position_base)
        match = (pool.trie.match(ns, req.tokens, req.salts, req.digests, touch=False)
                 if self.engine_config.prefix_cache else Match([], "prefix_cache_off"))
        reused = match.pages[: n_tok // ps]
        for page in reused:
            pool.allocator.share(page)
        if pool.allocator.num_free + pool.trie.num_evictable() < pages_for(n_tok, ps) - len(reused):
            pool.allocator.free(reused)
            return False
        return match.nodes[: len(reused)], reused

    def _admit_draft(self, req: _Req, plan) -> tuple[list[int], int]:
        """Allocates and prefills the draft's prompt pages; caches its full pages. Returns
        (pages, reused tokens)."""
        pool, ps = self._draft, self.cache_config.page_size
        nodes, reused = plan
        n_tok = len(req.tokens)
        fresh_needed = pages_for(n_tok, ps) - len(reused)
        self._reserve(fresh_needed, pool=pool)
        pool.trie.touch(nodes)
        pages = reused + pool.allocator.allocate(fresh_needed)
        self._flush_poison(pool)
        start = len(reused) * ps
        t0 = time.perf_counter()
        _, pool.cache = prefill(pool.params, pool.config, pool.cache, pool.cache_config,
                                req.tokens, pages, start, req.request.position_base,
                                sharding=pool.step_shardings)
        self._timers["draft_prefill_s"] += time.perf_counter() - t0
        if self.engine_config.prefix_cache:
            pool.trie.insert(pool.namespace(req.request.position_base), req.tokens, req.salts,
                             req.digests, pages)
        return pages, start

    def _prefill(self, req: _Req, pages: list[int], start: int):
        """Prefills tokens[start:] in fixed chunks; returns the last token's logits [V]."""
        logits, self.cache = prefill(self.params, self.config, self.cache, self.cache_config,
                                     req.tokens, pages, start, req.request.position_base,
                                     self._lora, req.adapter_index, self._shardings)
        return logits

    def _record_admission(self, req: _Req, match: Match, reuse: int, start: int, copied: int,
                          prefill_s: float, unbounded_blocks: int) -> None:
        ps = self.cache_config.page_size
        n_tok = len(req.tokens)
        cause, operator_cause = match.cause, match.operator_cause
        if reuse < len(match.nodes):
            cause = operator_cause = None  # all cached; the last page is recomputed for logits
        if req.stats:  # re-admitted after a preemption: the first admission's reuse stands
            req.stats["recomputed_tokens"] += n_tok - start
            req.stats["prefill_s"] += prefill_s
            return
        unbounded = min(unbounded_blocks, (n_tok - 1) // ps) * ps
        stats = {
            "prompt_tokens": n_tok,
            "reused_tokens": start,
            "computed_tokens": n_tok - start,
            "reused_pages": reuse,
            "copied_tokens": copied,
            "miss_cause": cause,
            "miss_position": match.position if cause in ("divergence", "partial_page") else None,
            "miss_fields": match.fields if cause == "namespace" else [],
            "prefill_s": prefill_s,
            "unbounded_reused_tokens": max(unbounded, start),
            "preemptions": 0,
            "recomputed_tokens": 0,
            "ttft_s": time.perf_counter() - req.submitted,
        }
        req.stats = stats
        req.operator_miss = (operator_cause,
                             tuple(match.operator_fields) if operator_cause == "namespace" else ())

    # -- pages ---------------------------------------------------------------------------------
    def _reserve(self, num_pages: int, requester: _Req | None = None, pool=None) -> bool:
        """Makes `num_pages` free by evicting cached leaves, then (for a running `requester`)
        by preempting running requests admitted after it, youngest first. `pool` is the
        target's (the engine itself, the default) or the draft's."""
        pool = pool or self
        while pool.allocator.num_free < num_pages:
            if pool.trie.evict(num_pages - pool.allocator.num_free):
                continue
            if requester is None:
                return False
            younger = {s.req for s in self._slots
                       if s is not None and s.req.admitted_order > requester.admitted_order}
            if not younger:
                return False
            self._preempt(max(younger, key=lambda r: r.admitted_order))
        return True

    def _preempt(self, req: _Req) -> None:
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
        self._waiting.appendleft(req)

    def _release(self, req: _Req) -> None:
        for seq in req.seqs:
            self._release_seq(seq)

    def _release_seq(self, seq: _Seq) -> None:
        if seq.pages:
            self.allocator.free(seq.pages)
        if seq.draft_pages:
            self._draft.allocator.free(seq.draft_pages)
        seq.pages, seq.draft_pages = [], []
        if seq.slot is not None:
            self._slots[seq.slot] = None
            seq.slot = None

    def _flush_poison(self, pool=None) -> None:
        pool = pool or self
        if pool.allocator.freed:
            freed = [p for p in pool.allocator.freed if pool.allocator.refcount(p) == 0]
            pool.allocator.freed.clear()
            if freed:
                pool.cache = poison_pages(pool.cache, padded_ids(freed,
                                                                 self.cache_config.num_pages))

    def _grow(self, seq: _Seq, tokens: int) -> bool:
        """Gives `seq` pages it may write for its next `tokens` cache slots, in the target's
        pool and the draft's (copy on write)."""
        end = seq.length + tokens
        ok = self._grow_pages(self, seq.pages, seq.length, end, seq.req)
        if ok and self._draft is not None:
            ok = self._grow_pages(self._draft, seq.draft_pages, seq.draft_length, end, seq.req)
        return ok

    def _grow_pages(self, pool, pages: list[int], write_from: int, end: int,
                    requester: _Req) -> bool:
        """Extends `pages` (in place) to cover slots [0, end) of which [write_from, end) may
        be written: shared pages in that range are copied first."""
        ps = self.cache_config.page_size
        end = pages_for(end, ps)
        shared = [i for i in range(write_from // ps, min(end, len(pages)))
                  if pool.allocator.refcount(pages[i]) > 1]
        need = max(end - len(pages), 0)
        t_host = time.perf_counter()
        ok = self._reserve(need + len(shared), requester=requester, pool=pool)
        self._timers["host_s"] += time.perf_counter() - t_host
        if not ok:
            return False
        pages += pool.allocator.allocate(need)
        for i in shared:
            fresh = pool.allocator.copy_on_write(pages[i])
            self._flush_poison(pool)
            pool.cache = copy_pages(pool.cache, padded_ids([pages[i]], 0),
                                    padded_ids([fresh], self.cache_config.num_pages))
            pages[i] = fresh
        return True

    # -- decode --------------------------------------------------------------------------------
    def _decode(self, events: list[StreamEvent]) -> None:
        ec = self.engine_config
        gamma = 0
        if self.spec is not None:
            if self.spec.spec.adaptive and not self.spec.calibrated:
                self.spec.calibrate(self)
            replay = self._replay_gamma()
            gamma = self.spec.next_gamma() if replay is None else replay
        budgets = {}
        for seq in sorted((s for s in self._slots if s is not None),
                          key=lambda s: s.req.admitted_order):
            if seq.slot is None or seq.done:
                continue  # preempted while growing another sequence
            if self.spec is not None and _replaying(seq.req) and \
                    seq.req.gammas[seq.req.calls] != gamma:
                continue  # recomputing under another γ: it waits for a call with its own
            budget = min(ec.decode_steps, seq.req.request.max_new_tokens - len(seq.generated))
            if self._grow(seq, budget + gamma):  # a verify writes up to γ slots ahead
                budgets[seq.slot] = budget
            elif self.num_running > 1:
                self._preempt(seq.req)  # nothing younger to preempt: wait for the others
        live = [s for s in self._slots if s is not None and s.slot in budgets]
        if not live:
            return
        live_reqs = list({s.req.id: s.req for s in live}.values())
        self._flush_poison()
        slots = ec.max_slots
        rows = [self._slots[i].pages if self._slots[i] is not None else [] for i in range(slots)]
        table = page_table(rows, slots, self.cache_config.block_pages)
        lengths = np.zeros(slots, np.int32)
        last = np.zeros(slots, np.int32)
        budget = np.zeros(slots, np.int32)
        keys = np.zeros((slots, 2), np.uint32)
        offsets = np.zeros(slots, np.int32)
        adapters = np.zeros(slots, np.int32)
        stops = np.full(slots, -1, np.int32)
        requests = [None] * slots
        for seq in live:
            i = seq.slot
            lengths[i], last[i], budget[i], keys[i] = seq.length, seq.last, budgets[i], seq.key
            offsets[i] = seq.req.request.position_base
            adapters[i] = seq.req.adapter_index
            stops[i] = -1 if seq.req.request.stop_token is None else seq.req.request.stop_token
            requests[i] = seq.req.request
        knobs = _knobs(requests)
        want_logits = any(s.req.request.return_logits for s in live)
        adapter_ids = adapters if self._lora is not None else None
        t0 = time.perf_counter()
        if self.spec is None:
            out, logits, self.cache, new_lengths = steps.decode_loop(
                self.params, self.config, self.cache, table, lengths, last, budget, keys,
                *knobs, stops, max_steps=ec.decode_steps, return_logits=want_logits,
                position_offset=offsets, lora=self._lora, adapter_ids=adapter_ids,
                sharding=self._shardings, kernel=self._kernel)
        else:
            if self._draft is not None:
                self._flush_poison(self._draft)
            res = self.spec.decode(self, live, budgets, gamma, dict(
                table=table, lengths=lengths, last=last, budget=budget, keys=keys,
                knobs=knobs, stops=stops, offsets=offsets, adapters=adapter_ids,
                want_logits=want_logits))
            out, logits, new_lengths = res["tokens"], res["logits"], res["lengths"]
            for req in live_reqs:
                if req.calls == len(req.gammas):
                    req.gammas.append(gamma)
                req.calls += 1
        out, new_lengths = np.asarray(out), np.asarray(new_lengths)
        logits = np.asarray(logits) if want_logits else None
        self._timers["decode_s"] += time.perf_counter() - t0
        for seq in live:
            i = seq.slot
            produced = out[i][out[i] >= 0].tolist()
            seq.generated += produced
            if seq.req.request.return_logits:
                seq.logits.extend(logits[i, : len(produced)])
            seq.length = int(new_lengths[i])
            if produced:
                seq.last = produced[-1]
            seq.done = (len(seq.generated) >= seq.req.request.max_new_tokens
                        or seq.last == seq.req.request.stop_token)
            if self.spec is not None:  # rollback: pages wholly past the kept history
                ps = self.cache_config.page_size
                free_past(self.allocator, seq.pages, seq.length, ps)
                if self._draft is not None:
                    free_past(self._draft.allocator, seq.draft_pages, seq.draft_length, ps)
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
        replaying = [s.req for s in self._slots if s is not None and _replaying(s.req)]
        if not replaying:
            return None
        oldest = min(replaying, key=lambda r: r.admitted_order)
        return oldest.gammas[oldest.calls]

    # -- results -------------------------------------------------------------------------------
    def _emit(self, req: _Req, events: list[StreamEvent]) -> bool:
        """Streams each sample's new tokens. False when a recomputed sample contradicts what
        it already streamed: the request has failed (`_fail`) and no token is streamed."""
        for seq in req.seqs:
            upto = min(len(seq.generated), len(seq.streamed))
            for i in range(seq.checked, upto):
                if seq.generated[i] != seq.streamed[i]:
                    self._fail(req, events, f"sample {seq.index} recomputed after a "
                                            f"preemption gave token {seq.generated[i]} at "
                                            f"index {i}, where {seq.streamed[i]} was streamed")
                    return False
            seq.checked = upto
        for seq in req.seqs:
            new = seq.generated[len(seq.streamed):]
            if new:
                events.append(StreamEvent(req.id, seq.index, tuple(new), seq.done))
                seq.streamed += new
                seq.checked = len(seq.streamed)
                seq.closed = seq.done
        return True

    def _fail(self, req: _Req, events: list[StreamEvent], error: str) -> None:
        """Ends a request with status "error": its pages return, and every sample whose
        stream is still open gets a last event naming the error."""
        self._release(req)
        for seq in req.seqs:
            if not seq.closed:
                events.append(StreamEvent(req.id, seq.index, (), True, error))
                seq.closed = True
        self._finish(req, status="error", error=error)

    def _retire_if_done(self, req: _Req) -> None:
        if all(s.done for s in req.seqs):
            self._release(req)
            self._finish(req, status="finished")

    def _finish(self, req: _Req, status: str, error: str | None = None) -> None:
        """Records the result: each sample's tokens are the ones it streamed (a cancelled
        request may have streamed more than it has recomputed since a preemption); logits
        only where every token has its logits (so none after an error)."""
        single = req.request.n == 1
        tokens = [list(s.streamed) for s in req.seqs]
        logits = None
        if req.request.return_logits and status != "error" and all(
                len(s.logits) == len(s.streamed) for s in req.seqs):
            logits = [np.stack(s.logits) if s.logits else np.zeros((0, self.config.vocab_size))
                      for s in req.seqs]
        text = None
        if self.tokenizer is not None:
            decoded = [self.tokenizer.decode(t) for t in tokens]
            text = decoded[0] if single else decoded
        self._results[req.id] = RequestResult(
            id=req.id, tokens=tokens[0] if single else tokens,
            logits=(logits[0] if single else logits) if logits is not None else None,
            stats=dict(req.stats), status=status, prompt_ids=list(req.tokens), text=text,
            error=error)
        self._counters[status] += 1
        finish_request_stats(self._results[req.id].stats)
        self._stats_log.append(dict(self._results[req.id].stats, id=req.id, status=status))
        if "prompt_tokens" in req.stats:
            self._operator_log.append(req.operator_miss)
        del self._reqs[req.id]

    # -- metrics -------------------------------------------------------------------------------
    def metrics(self) -> dict:
        """Aggregates over every finished or cancelled request so far."""
        log = [s for s in self._stats_log if "prompt_tokens" in s]
        prompt = sum(s["prompt_tokens"] for s in log)
        reused = sum(s["reused_tokens"] for s in log)
        ps = self.cache_config.page_size
        full_pages = sum((s["prompt_tokens"] - 1) // ps for s in log)
        causes = collections.Counter(cause for cause, _ in self._operator_log if cause)
        fields = collections.Counter(f for cause, fs in self._operator_log
                                     if cause == "namespace" for f in fs)
        unbounded = sum(s["unbounded_reused_tokens"] for s in log)
        resident = self.trie.num_nodes
        page_bytes = cache_bytes(self.cache) // self.cache_config.num_pages
        return {
            "requests": len(log),
            "request_hit_rate": _ratio(sum(s["reused_tokens"] > 0 for s in log), len(log)),
            "token_reuse_rate": _ratio(reused, prompt),
            "page_reuse_rate": _ratio(sum(s["reused_pages"] for s in log), full_pages),
            "prompt_tokens": prompt,
            "reused_tokens": reused,
            "computed_tokens": prompt - reused,
            "recomputed_tokens": sum(s["recomputed_tokens"] for s in log),
            "misses_by_cause": dict(causes),  # the operator's view (see the module docstring)
            "namespace_misses_by_field": dict(fields),
            "errors": self._counters["error"],
            "evictions": self.trie.evictions,
            "cow_copies": self.allocator.copies,
            "partial_copies": self._counters["partial_copies"],
            "preemptions": self._counters["preemptions"],
            "resident_pages": resident,
            "resident_bytes": resident * page_bytes,
            "free_pages": self.allocator.num_free,
            "unbounded_request_hit_rate": _ratio(
                sum(s["unbounded_reused_tokens"] > 0 for s in log), len(log)),
            "unbounded_token_reuse_rate": _ratio(unbounded, prompt),
            "mean_ttft_s": _ratio(sum(s["ttft_s"] for s in log), len(log)),
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


def _replaying(req: _Req) -> bool:
    """Whether a request recomputed after a preemption has not caught up with its stream."""
    return req.calls < len(req.gammas) and any(
        len(s.generated) < len(s.streamed) for s in req.seqs)


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def _knobs(requests: list[Request | None]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """temperature, top_k, top_p per row (greedy for empty rows)."""
    temperature = np.array([r.sampling.temperature if r else 0.0 for r in requests], np.float32)
    top_k = np.array([r.sampling.top_k if r else 0 for r in requests], np.int32)
    top_p = np.array([r.sampling.top_p if r else 1.0 for r in requests], np.float32)
    return temperature, top_k, top_p

