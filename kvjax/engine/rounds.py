"""A scheduling round over the engine's pools: admit, grow, decode, stream, retire.

The engine facade (`engine.py`) builds the parts and holds this; here the parts meet: the
scheduler picks (`scheduler.py`), the cache manager plans admissions and gives pages
(`kvjax.cache.manager`), the step runner makes the device calls (`runner.py`), and what a
request returns is checked and recorded (`results.py`, `stats.py`). Host code: plain
Python + numpy.
"""

from __future__ import annotations

import collections
import dataclasses

from kvjax.cache.admission import Admission
from kvjax.config import EngineConfig, ModelConfig
from kvjax.decode.prefill import PrefillRow
from kvjax.engine import results, scheduler, stop_strings, warmup
from kvjax.engine.requests import LiveRequest, RequestResult, Seq, StreamEvent, context
from kvjax.engine.runner import StepRunner
from kvjax.engine.stats import Timers, record_admission, record_dropped
from kvjax.speculative.eagle_engine import HeadState


@dataclasses.dataclass(eq=False)
class Prefill:
    """A seated request whose prompt is being prefilled, chunk by chunk."""

    req: LiveRequest
    adm: Admission
    row: PrefillRow  # its pages; its next chunk starts at row.start
    draft: PrefillRow | None  # the draft's, committed with the target's, prefilled alongside
    seconds: float = 0.0  # its shares of the prefill calls it took part in
    packed: bool = False  # a decode call's steps prefilled some of it (it stays packed)


class Rounds:
    """The engine's live requests and finished results, and the round that moves them."""

    def __init__(self, config: ModelConfig, engine_config: EngineConfig, runner: StepRunner,
                 timers: Timers, tokenizer=None):
        self.config = config
        self.engine_config = engine_config
        self.runner = runner
        self.kv, self.spec = runner.kv, runner.spec
        self.tokenizer = tokenizer
        self.scheduler = scheduler.Scheduler(engine_config.max_slots, engine_config.schedule)
        self.live: dict[int, LiveRequest] = {}  # waiting or running
        self.results: dict[int, RequestResult] = {}  # finished, not yet collected
        self.counters = collections.Counter()
        self.timers = timers
        self.stats_log: list[dict] = []
        self.prefilling: list[Prefill] = []  # seated, prompt not fully prefilled yet
        self.operator_log: list[tuple[str | None, tuple[str, ...]]] = []  # (cause, fields)
        self.admitted_log: list[dict] = []  # the entries of stats_log that were admitted
        self.first_call = True  # the next prefill call is the engine's first (`warmup.ahead`)

    def enqueue(self, req: LiveRequest) -> None:
        self.live[req.id] = req
        self.scheduler.waiting.append(req)

    def step(self) -> list[StreamEvent]:
        """One scheduling round: admit, decode, retire. Returns the new tokens."""
        events: list[StreamEvent] = []
        self._admit(events)
        if self.scheduler.running:
            self._decode(events)
        elif self.scheduler.waiting:  # validation makes every request fit an empty cache
            raise RuntimeError("the engine cannot admit a request into an idle cache")
        return events

    def cancel(self, req: LiveRequest) -> None:
        if req in self.scheduler.waiting:
            self.scheduler.waiting.remove(req)
        self._release(req)
        self._finish(req, status="cancelled")

    # -- admission -----------------------------------------------------------------------------
    def _admit(self, events: list[StreamEvent]) -> None:
        """Admits waiting requests while slots and pages allow and prefills them in fixed
        chunks: each call takes one chunk of every prompt being prefilled (of the first one
        only when a token's bits may depend on its batch). While other sequences decode,
        at most `prefill_calls_per_round` calls run before their decode call (0: no limit),
        so a long prompt does not stall them, and with packed steps (`_packing`) only for
        the prompts a call finishes (`_one_call_left`): longer ones are prefilled in the
        decode call's steps. When none decodes, prefill runs to the end, in wider chunks
        when fewer prompts share a call (`StepRunner.call_width`)."""
        limit, calls = self.engine_config.prefill_calls_per_round, 0
        while True:
            self._plan_group()
            if not self.prefilling:
                return
            rows = list(self.prefilling if self.runner.policy.shares_prefill_calls()
                        else self.prefilling[:1])
            if self._decoding():
                if self._packing():  # long prompts ride in the decode call's steps
                    rows = [e for e in rows if self._one_call_left(e)]
                if not rows or (limit and calls >= limit):
                    return  # the decode call prefills them in its steps, or the next round
            draft_rows = [e.draft for e in rows if e.draft is not None]
            widen = not self._decoding()  # wider calls stall no one
            if self.first_call:  # its prefill, sampler and decode programs side by side
                self.first_call = False
                warmup.ahead(self.runner, [e.row for e in rows], draft_rows, widen,
                             [e.req.request for e in self.prefilling])
            logits, seconds = self.runner.prefill_call([e.row for e in rows], draft_rows, widen)
            calls += 1
            self._prefilled(rows, logits, seconds, events)

    def _prefilled(self, rows: list[Prefill], logits: list, seconds: float,
                   events: list[StreamEvent]) -> None:
        """After a call that prefilled `rows`: each takes its share of the call's prefill
        seconds; a row whose last chunk it wrote (logits not None) starts decoding."""
        for entry, last in zip(rows, logits, strict=True):
            entry.seconds += seconds / len(rows)
            if last is not None:  # its last chunk: the prompt is cached
                self.prefilling.remove(entry)
                entry.req.prefilling = False
                self._start(entry, last, events)

    def _one_call_left(self, entry: Prefill) -> bool:
        """Whether a prompt not yet in packed steps has at most one prefill call (one chunk)
        left: it takes a call before the decode call (one chunk's stall for the others)
        rather than packed steps, which gather its cached pages again at every step (a short
        tail behind a long cached prefix costs several times its ideal time packed).
        A prompt packed once stays packed while others decode."""
        left = len(entry.row.tokens) - entry.row.start
        return not entry.packed and left <= self.engine_config.cache.prefill_chunk

    def _decoding(self) -> bool:
        return any(not s.req.prefilling for s in self.scheduler.running)

    def _packing(self) -> bool:
        """Whether decode calls prefill the prompts in their steps (`packed_prefill`): only
        where a token's bits do not depend on what shares its step, in plain decoding."""
        return (self.engine_config.packed_prefill and self.runner.policy.packs_prefill()
                and self.spec is None)

    def _plan_group(self) -> None:
        """Adds waiting requests to `prefilling` in the scheduler's order, seated and with
        their pages committed and written. Stops at the first request that finds no slot or
        no room, or that shares an uncached full page with one being prefilled: that one
        waits, to reuse the page once it is cached. When a token's bits may depend on its
        batch, a request is added only when none is being prefilled."""
        sched, ec = self.scheduler, self.engine_config
        while sched.waiting and (not self.prefilling
                                 or self.runner.policy.shares_prefill_calls()):
            with self.timers("host_s"):
                req = sched.pick(lambda r: len(self.kv.match(r).nodes))
                free = sched.free_slots()
                if len(free) < req.request.n:
                    return
                adm = self.kv.admit(req)
                if adm is None:
                    return
                others = [e.req for e in self.prefilling]
                if ec.prefix_cache and scheduler.shares_uncached(
                        req, adm.reuse, others, self.kv.page_size):
                    adm.abort()
                    return
                pages = adm.target.commit()
                draft_pages = [] if adm.draft is None else adm.draft.commit()
                sched.seat(req, free)
            adm.target.write(pages)
            if adm.draft is not None:
                adm.draft.write(draft_pages)
            if adm.target.copy_from is not None:
                self.counters["partial_copies"] += 1
            req.prefilling = True
            base = req.request.position_base
            tokens = req.context.tokens
            draft = None if adm.draft is None else PrefillRow(
                tokens, draft_pages, adm.draft.reused_tokens, base)
            self.prefilling.append(Prefill(
                req, adm, PrefillRow(tokens, pages, adm.start, base, req.adapter_index,
                                     req.seqs[0].slot),
                draft))

    def _drop_prefill(self, req: LiveRequest) -> None:
        """Ends a prefill before its last chunk (preemption, cancellation): the full pages
        its chunks wrote enter the tries (they hold what any prefill of that prefix writes,
        so a recompute reuses them), then its pages go back, in the target's pool and the
        draft's. What it did counts in the stats of the admission that completes."""
        entry = next(e for e in self.prefilling if e.req is req)
        self.prefilling.remove(entry)
        req.prefilling = False
        adm = entry.adm
        record_dropped(req, adm.match, adm.reuse, adm.start, adm.target.copied,
                       self.runner.unbounded_blocks(req) if self.engine_config.prefix_cache
                       else 0, entry.row.start, entry.seconds)
        if self.engine_config.prefix_cache:
            self.runner.cache_written(req, entry.row, entry.draft)
        self.kv.release(entry.row.pages, [] if entry.draft is None else entry.draft.pages)

    def _start(self, entry: Prefill, logits, events: list[StreamEvent]) -> None:
        """After its prefill: caches the context, finishes the draft's prefill (chunks it
        has left when it reused less than the target), samples each sample's first token
        (a resumed sample holds its next one already), records the admission and
        streams."""
        ec = self.engine_config
        req, adm, pages, prefill_s = entry.req, entry.adm, entry.row.pages, entry.seconds
        unbounded = self.runner.cache_prompt(req, pages) if ec.prefix_cache else 0
        draft_pages, draft_reused = ([], 0) if entry.draft is None else \
            (self.runner.prefill_draft(req, entry.draft), adm.draft.reused_tokens)
        n_tok = len(req.context.tokens)
        fresh = [len(s.generated) == n_tok - len(req.tokens) for s in req.seqs]  # not resumed
        first = self.runner.first_tokens(req, logits) if any(fresh) else None
        for j, seq in enumerate(req.seqs):
            seq.pages, seq.draft_pages = list(pages), list(draft_pages)
            if j > 0:  # the samples share the prompt's pages (copy on write)
                self.kv.share(pages, draft_pages)
            if fresh[j]:
                seq.generated.append(int(first[j]))
                if req.request.return_logits:
                    seq.logits.append(logits)
            seq.length, seq.last = n_tok, seq.generated[-1]
            seq.done = (len(seq.generated) == req.request.max_new_tokens
                        or seq.last in req.stops)
            seq.draft_length, seq.prev = n_tok, -1
            if self.spec is not None and self.spec.eagle is not None:  # one pair behind
                seq.draft_length = n_tok - 1
                seq.head = HeadState.start(entry.draft.feature, self.spec.eagle.width)
            if fresh[j]:  # a resumed answer's stop strings were checked as it was generated
                stop_strings.apply(seq, self.tokenizer, 0)
        for seq in req.seqs:
            if seq.done:
                self._release_seq(seq)
        record_admission(req, adm.match, adm.reuse, adm.start, adm.target.copied, prefill_s,
                         unbounded, self.kv.page_size)
        if self.kv.draft is not None and req.stats.draft_reused_tokens is None:
            req.stats.draft_reused_tokens = draft_reused  # the first admission's
        if self.kv.target.tiers is not None and req.stats.restored_tokens is None:
            req.stats.restored_tokens = dict(adm.target.restored)  # the first admission's
        if self._emit(req, events):
            self._retire_if_done(req)

    # -- pages ---------------------------------------------------------------------------------
    def _grow(self, seq: Seq, tokens: int) -> bool:
        """Gives `seq` pages it may write for its next `tokens` cache slots, in the target's
        pool and the draft's (copy on write), preempting younger requests if it must."""
        def preempt() -> bool:
            victim = self.scheduler.victim(seq.req)
            if victim is not None:
                self._preempt(victim)
            return victim is not None

        return self.kv.grow(seq, tokens, preempt, lambda: self.timers("host_s"))

    def _preempt(self, req: LiveRequest) -> None:
        """Returns a running request's pages and queues it first. A resumable one (`_resumes`)
        keeps its answer (tokens and logits): its next admission prefills the tokens its
        cache held after the prompt (teacher-forced, reusing the pages its release cached:
        the same bits as decoding them) and continues from the last one. Another is
        recomputed from its prompt; what it streamed stays, and the regenerated tokens are
        checked against it."""
        resumes = self._resumes(req)
        if resumes and not req.prefilling:
            seq = req.seqs[0]
            history = (req.tokens + seq.generated)[: max(seq.length, len(req.tokens))]
            req.context = context(req.request, history, self.kv.page_size)
        cached = len(req.context.tokens) - len(req.tokens)  # answer tokens it prefills
        self._release(req)
        for seq in req.seqs:
            keep = min(len(seq.generated), cached + 1) if resumes else 0  # + the next one
            seq.generated, seq.logits = seq.generated[:keep], seq.logits[:keep]
            seq.done, seq.length, seq.checked = False, 0, min(seq.checked, keep)
            seq.draft_length, seq.prev, seq.head = 0, -1, None
        if not resumes:  # it decodes its answer again, replaying its calls' γ
            req.calls = 0
            req.stats.spec = None  # counts the tokens it returns, not discarded work
        req.stats.preemptions += 1
        self.counters["preemptions"] += 1
        self.scheduler.waiting.appendleft(req)

    def _resumes(self, req: LiveRequest) -> bool:
        """Whether a preempted `req` resumes from the answer tokens it had cached instead of
        decoding them again (`EngineConfig.preemption`): one sample (samples share one
        context) and invariant numerics (a prefill writes those tokens' decode-written
        bits). A speculative one keeps its counters (they count the rounds that emitted
        the answer it keeps) and its call count: it never replays a γ. (Its next token is
        kept, not sampled again from the prefill: a sampled verification's token need not
        be the plain sample at its position.)"""
        return (self.engine_config.preemption == "resume" and req.request.n == 1
                and self.runner.policy.resumes_preempted())

    def _release(self, req: LiveRequest, cache: bool = True) -> None:
        if req.prefilling:
            self._drop_prefill(req)
        for seq in req.seqs:
            self._release_seq(seq, cache)

    def _release_seq(self, seq: Seq, cache: bool = True) -> None:
        """Returns a sample's pages; with `cache`, its history's full pages enter the trie
        first (`StepRunner.cache_history`), so a later turn or request reuses them."""
        if cache:
            self.runner.cache_history(seq)
        self.kv.release(seq.pages, seq.draft_pages)
        seq.pages, seq.draft_pages = [], []
        self.scheduler.vacate(seq)

    # -- decode --------------------------------------------------------------------------------
    def _decode(self, events: list[StreamEvent]) -> None:
        ec, spec = self.engine_config, self.spec
        gamma, replay = 0, None
        if spec is not None:
            if spec.spec.adaptive and not spec.calibrated:
                model = self.runner.model
                spec.calibrate(model.params, model.config, model.plan, ec.max_slots)
            replay = self._replay_gamma() if spec.replays else None
            gamma = spec.next_gamma() if replay is None else replay
        budgets = {}
        for seq in self.scheduler.decode_order():
            if seq.slot is None or seq.done or seq.req.prefilling:
                continue  # preempted while growing another sequence, or not prefilled yet
            if replay is not None and seq.req.replaying and seq.req.gammas[seq.req.calls] != gamma:
                continue  # recomputing under another γ: it waits for a call with its own
            budget = min(ec.decode_steps, seq.req.request.max_new_tokens - len(seq.generated))
            if self._grow(seq, budget + (0 if spec is None else spec.write_ahead(gamma))):
                budgets[seq.slot] = budget
            elif self.scheduler.num_running > 1:
                self._preempt(seq.req)  # nothing younger to preempt: wait for the others
        live = [s for s in self.scheduler.slots if s is not None and s.slot in budgets]
        if not live:
            return
        live_reqs = list({s.req.id: s.req for s in live}.values())
        fill = ([e for e in self.prefilling if not self._one_call_left(e)]
                if self._packing() else [])  # the others wait for the next round's call
        for entry in fill:
            entry.packed = True
        checked = {seq.slot: len(seq.generated) for seq in live}
        logits, seconds = self.runner.decode(live, budgets, gamma, self.scheduler.slots,
                                             [e.row for e in fill])
        for seq in live:
            stop_strings.apply(seq, self.tokenizer, checked[seq.slot])
        self._prefilled(fill, logits, seconds, events)
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
        replaying = [s.req for s in self.scheduler.running
                     if s.req.replaying and not s.req.prefilling]
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
        self._release(req, cache=False)
        events += results.closing_events(req, error)
        self._finish(req, status="error", error=error)

    def _retire_if_done(self, req: LiveRequest) -> None:
        if all(s.done for s in req.seqs):
            self._release(req)
            self._finish(req, status="finished")

    def _finish(self, req: LiveRequest, status: str, error: str | None = None) -> None:
        result = results.request_result(req, status, error, self.config.vocab_size,
                                        self.tokenizer)
        self.results[req.id] = result
        self.counters[status] += 1
        self.stats_log.append(dict(result.stats, id=req.id, status=status))
        if req.stats.admitted:
            self.admitted_log.append(self.stats_log[-1])
            self.operator_log.append(req.operator_miss)
        del self.live[req.id]

