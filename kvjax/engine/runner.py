"""The step runner: the device work of a scheduling round, and applying what it returns.

Prefill of an admitted request (target, then draft) and its first token; then one call over
the batch slots, `decode_loop` or the speculative `spec_loop`: the runner assembles the
batch description (page table, lengths, last tokens, budgets, keys, sampling knobs), makes
the call, appends each sample's new tokens and rolls back pages past the kept history.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import numpy as np

from kvjax.cache.manager import KVCacheManager
from kvjax.cache.trie import history_digests
from kvjax.config import EngineConfig, ModelConfig
from kvjax.decode import steps
from kvjax.decode.batching import bucket, page_table, pages_for
from kvjax.decode.prefill import PrefillRow, open_rows, prefill_open_rows, prefill_rows
from kvjax.decode.sampling import sample_jit, sampling_rows
from kvjax.decode.state import decode_state
from kvjax.engine.numerics_policy import NumericsPolicy
from kvjax.engine.requests import MAX_STOP_TOKENS, LiveRequest, Request, Seq, salts_per_page
from kvjax.engine.stats import Timers
from kvjax.model.plan import FAST, NumericsPlan


def knobs(requests: list[Request | None]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Deprecated: `kvjax.decode.sampling.sampling_rows` of the requests' sampling."""
    warnings.warn("runner.knobs(requests) is sampling_rows([r.sampling ...])",
                  DeprecationWarning, stacklevel=2)
    return sampling_rows([r.sampling if r else None for r in requests])


def decode_context(ec: EngineConfig, max_seq_len: int) -> int:
    """Tokens every step's page table covers: `ec.min_context`, or when None the most a
    sequence can reach (the model's `max_seq_len`, at most the pool's tokens)."""
    if ec.min_context is not None:
        return ec.min_context
    return min(max_seq_len, ec.cache.num_pages * ec.cache.page_size)


LIVE_ROWS = 2  # the fewest rows a decode call of live samples alone runs (a lone row pads)


@dataclasses.dataclass
class TargetModel:
    """The target model as the steps take it."""

    params: Any  # on device (or placed on the mesh), stored as `plan` says
    config: ModelConfig
    plan: NumericsPlan = FAST  # how the steps run it (`kvjax.engine.plans.numerics_plans`)
    lora: Any = None  # the loaded adapters, stacked (`kvjax.model.lora.stack_adapters`)
    shardings: Any = None  # `kvjax.sharding.StepShardings` on a mesh
    kernel: Any = None  # the decode attention kernel (None: the reference)


class StepRunner:
    """Runs the target's (and the draft's) device steps over the engine's pools."""

    def __init__(self, model: TargetModel, kv: KVCacheManager, engine_config: EngineConfig,
                 speculator, timers: Timers, probe_ok: bool = True):
        self.model = model
        # the context every step's page table covers (`decode_context`)
        self.context = decode_context(engine_config, model.config.max_seq_len)
        self.kv = kv  # every page and device cache, target's and draft's
        self.engine_config = engine_config
        self.spec = speculator  # a `kvjax.speculative.plugin.Speculator`, or None
        self.timers = timers
        self.probe_ok = probe_ok  # the start-up probe found invariant numerics holding

    @property
    def pool(self):
        """The target's pool (the pages are `self.kv`'s)."""
        return self.kv.target

    # -- admission -----------------------------------------------------------------------------
    @property
    def policy(self) -> NumericsPolicy:
        """What the numerics allow (`kvjax.engine.numerics_policy`); read when asked, since
        the engine's shardings are set after the runner is built."""
        return NumericsPolicy.for_engine(self.model.plan.mode,
                                         self.model.shardings is not None, self.probe_ok)

    @property
    def invariant(self) -> bool:
        """Whether a token's bits depend on its own history alone (`policy.invariant`)."""
        return self.policy.invariant

    def prefill_call(self, rows: list[PrefillRow], draft_rows: list[PrefillRow] = (),
                     widen: bool = False) -> tuple[list[np.ndarray | None], float]:
        """One prefill call: the next chunk of every row, together, then of every draft row
        with tokens left (advances each row's start). `widen` (invariant numerics only,
        where the width changes no bit): fewer rows take wider chunks, up to the tokens of
        `bucket(max_slots)` full rows, so a lone prompt does not crawl through one-row
        calls. Returns (the last token logits [V] of each row this call finished, else
        None; seconds of the target's call)."""
        kv = self.kv
        eagle = None if self.spec is None else self.spec.eagle
        width = self.call_width(len(rows), widen, longest_left(rows))
        before, starts = self.timers["prefill_s"], [r.start for r in rows]

        with self.timers("prefill_s"):
            logits = self.target_prefill(rows, width, features=eagle is not None)
            if eagle is not None:
                logits, features = logits
            logits = [None if x is None else np.asarray(x) for x in logits]
        seconds = self.timers["prefill_s"] - before
        _advance(rows, width)
        if eagle is not None:  # the pairs the call's features complete (`eagle_engine`)
            with self.timers("draft_prefill_s"):
                eagle.prefill(kv, rows, draft_rows, features, starts, self.min_pages(kv.draft))
            return logits, seconds
        left = [r for r in draft_rows if r.start < len(r.tokens)]
        if left:
            width = self.call_width(len(left), widen, longest_left(left))
            with self.timers("draft_prefill_s"):
                self.draft_prefill(left, width)
            _advance(left, width)
        return logits, seconds

    def target_prefill(self, rows: list[PrefillRow], width: int, features: bool = False):
        """One `prefill_rows` call of the target at `width` tokens per row (the rows'
        starts are not moved); returns each row's last logits (with `features`: (those,
        the final norm's output))."""
        m, kv = self.model, self.kv

        def step(cache):
            out = prefill_rows(
                m.params, m.config, cache, kv.target.cache_config, rows, m.lora, m.shardings,
                calls=1, width=width, plan=m.plan, min_pages=self.min_pages(kv.target),
                features=features)
            return (out[0], out[2]) if features else out[0], out[1]

        return kv.run(step)

    def draft_prefill(self, rows: list[PrefillRow], width: int | None = None) -> None:
        """One `prefill_rows` call of the draft model (the rows' starts are not moved;
        `width` None: the draft cache's chunk, as many calls as the rows need)."""
        spec, kv = self.spec, self.kv
        kv.run(lambda cache: prefill_rows(
            spec.params, spec.config, cache, kv.draft.cache_config, rows,
            sharding=spec.step_shardings, calls=None if width is None else 1, width=width,
            plan=spec.plan, min_pages=self.min_pages(kv.draft)), draft=True)

    def min_pages(self, pool) -> int:
        """The least page-table width of `pool`'s steps: `context` tokens."""
        return pages_for(self.context, pool.cache_config.page_size)

    def call_width(self, rows: int, widen: bool, longest: int) -> int:
        """Tokens per row of a prefill call of `rows` rows whose longest has `longest`
        tokens left: the cache's chunk, or when widened under invariant numerics up to the
        chunk x bucket(max_slots) / bucket(rows) (the tokens of `bucket(max_slots)` full
        rows), but no wider than the power of two (at least 16, or the chunk) that holds
        `longest` (a short warm tail in a call as wide as the cap costs the whole width).
        Widths are min(chunk, 16) times a power of two, or the cap: at most
        log2(chunk x bucket(max_slots) / min(chunk, 16)) + 2 shapes per row bucket."""
        chunk = self.kv.target.cache_config.prefill_chunk
        if not (widen and self.policy.widens_prefill_calls()):
            return chunk
        share = max(1, bucket(self.engine_config.max_slots) // bucket(rows))
        return min(chunk * share, bucket(longest, min(chunk, 16)))

    def cache_prompt(self, req: LiveRequest, pages: list[int]) -> int:
        """Inserts the context's full pages (the prompt's; a resumed request's answer
        tokens' too) into the trie; returns how many of its blocks an unbounded cache would
        have held (for `unbounded_reused_tokens`)."""
        ctx, unbounded = req.context, self.unbounded_blocks(req)
        with self.timers("host_s"):
            self.kv.commit(req, ctx.tokens, ctx.salts, ctx.digests, pages)
        return unbounded

    def unbounded_blocks(self, req: LiveRequest) -> int:
        """How many blocks of the context an unbounded cache would hold now."""
        with self.timers("host_s"):
            return self.kv.unbounded_blocks(req)

    def cache_written(self, req: LiveRequest, row: PrefillRow, draft: PrefillRow | None
                      ) -> None:
        """Inserts the full pages a prompt's prefill has written so far (up to each row's
        start) into the target's trie and the draft's."""
        ctx = req.context
        lead = 0 if draft is None else self.kv.draft.lead  # `PagePool.lead`
        with self.timers("host_s"):
            self.kv.commit(req, ctx.tokens[:row.start], ctx.salts, ctx.digests, row.pages,
                           None if draft is None else ctx.tokens[:draft.start + lead],
                           [] if draft is None else draft.pages)

    def cache_history(self, seq: Seq) -> None:
        """Inserts the full pages of a sample's cached history (its prompt and its answer so
        far, written by prefill, decode or verification) into the target's trie and the
        draft's. Only when `invariant`, where those pages hold the bits a prefill of the
        same history writes; otherwise a decode-written page differs in the last bits."""
        if not self.engine_config.prefix_cache or not self.policy.caches_written_pages():
            return
        req, ps = seq.req, self.kv.page_size
        history = (req.tokens + seq.generated)[: seq.length]
        with self.timers("host_s"):
            salts = salts_per_page(req.request, len(history), ps)
            digests = history_digests(history, ps)
            lead = 0 if self.kv.draft is None else self.kv.draft.lead  # `PagePool.lead`
            self.kv.commit(req, history, salts, digests, seq.pages,
                           history[: seq.draft_length + lead], seq.draft_pages)

    def prefill_draft(self, req: LiveRequest, row: PrefillRow) -> list[int]:
        """Prefills what is left of the draft's prompt (its row's pages, committed and
        written) and caches its full pages. Returns the pages."""
        spec, kv = self.spec, self.kv
        if row.start < len(row.tokens) and spec.eagle is None:  # a head's row is done: its
            # pairs came with the target's prefill and stop one token short
            with self.timers("draft_prefill_s"):
                self.draft_prefill([row])
            row.start = len(row.tokens)
        if self.engine_config.prefix_cache:
            ctx = req.context
            kv.commit(req, None, ctx.salts, ctx.digests, [], ctx.tokens, row.pages)
        return row.pages

    @staticmethod
    def first_tokens(req: LiveRequest, logits: np.ndarray) -> np.ndarray:
        """Each sample's next token from the context's last logits [V] (the first token, or
        the one after the answer tokens a resumed request prefilled)."""
        n = req.request.n
        position = req.request.position_base + len(req.context.tokens)
        return np.asarray(sample_jit(np.repeat(logits[None], n, 0),
                                     np.stack([s.key for s in req.seqs]),
                                     np.full(n, position, np.int32),
                                     *sampling_rows([req.request.sampling] * n)))

    # -- decode --------------------------------------------------------------------------------
    def decode(self, live: list[Seq], budgets: dict[int, int], gamma: int,
               occupied: list[Seq | None], fill: list[PrefillRow] = ()
               ) -> tuple[list[np.ndarray | None], float]:
        """One decode (or speculative) call over the samples of `live`; appends each
        sample's new tokens and, after a verification, releases pages past the kept
        history. Its rows are `decode_rows`: the live samples only, or every slot (then the
        page table holds every occupied slot's pages, `occupied`: the slots, live or not).

        `fill` (plain decoding only): prompts the same call prefills in packed steps (see
        `packed_fill`; advances each row's start). Returns, as `prefill_call` does, each
        fill row's last token logits [V] if this call finished it, and the seconds of the
        call charged to prefill (its share of the call's tokens, moved from decode_s to
        prefill_s)."""
        m, kv, ec = self.model, self.kv, self.engine_config
        kv.flush_poison()
        slots, row_of = self.decode_rows(live, occupied)
        if slots == len(occupied):  # a row per slot
            rows = [[] if s is None else s.pages for s in occupied]
        else:  # the live samples only
            rows = [[] for _ in range(slots)]
            for seq in live:
                rows[row_of[id(seq)]] = seq.pages
        lengths = np.zeros(slots, np.int32)
        last = np.zeros(slots, np.int32)
        budget = np.zeros(slots, np.int32)
        keys = np.zeros((slots, 2), np.uint32)
        offsets = np.zeros(slots, np.int32)
        adapters = np.zeros(slots, np.int32)
        stops = np.full((slots, MAX_STOP_TOKENS), -1, np.int32)
        samplings = [None] * slots
        for seq in live:
            i, r = row_of[id(seq)], seq.req.request
            lengths[i], last[i], budget[i], keys[i] = seq.length, seq.last, budgets[seq.slot], \
                seq.key
            offsets[i], adapters[i] = r.position_base, seq.req.adapter_index
            stops[i, : len(seq.req.stops)] = seq.req.stops
            samplings[i] = r.sampling
        if fill and self.spec is not None:
            raise ValueError("packed prefill is for plain decoding only")
        # one page-table width for the decode rows and the prompts: fewer shapes to compile
        # (attention visits no block past a row's end, so the width costs nothing)
        longest = max(len(p) for p in [*rows, *(r.pages for r in fill)])
        longest = max(longest, self.min_pages(kv.target))
        table = page_table(rows, slots, kv.target.cache_config.block_pages, longest)
        want_logits = any(s.req.request.return_logits for s in live)
        state = decode_state(table, lengths, last, budget, keys, samplings, stops, offsets,
                             adapters if m.lora is not None else None,
                             open_rows(kv.target.cache,
                                       {row_of[id(s)]: s.slot for s in live}, slots))
        packed, fill_tokens = self.packed_fill(list(fill), longest)
        before = self.timers["decode_s"]
        with self.timers("decode_s"):
            if self.spec is None:
                res = self.plain_decode(state, want_logits, packed)
                fill_logits = None if packed is None else np.asarray(res.fill_logits)  # [Bp, V]
            else:
                res = self.spec.decode(m, kv, ec.decode_steps, live, budgets, gamma, state,
                                       want_logits, self.context)
            out, logits, new_lengths = res.tokens, res.logits, res.lengths
            out, new_lengths = np.asarray(out), np.asarray(new_lengths)
            logits = np.asarray(logits) if want_logits else None
        for seq in live:
            i = row_of[id(seq)]
            self._apply(seq, out[i], None if logits is None else logits[i],
                        int(new_lengths[i]))
        if packed is None:
            return [], 0.0
        share = (self.timers["decode_s"] - before) * fill_tokens / (
            fill_tokens + sum(budgets.values()))
        self.timers["decode_s"] -= share
        self.timers["prefill_s"] += share
        _advance(fill, ec.decode_steps * packed.tokens.shape[2])
        return [fill_logits[i] if row.start == len(row.tokens) else None
                for i, row in enumerate(fill)], share

    def plain_decode(self, state, want_logits: bool, fill: steps.Fill | None = None
                     ) -> steps.DecodeResult:
        """One `decode_loop` call of `decode_steps` steps over `state` (`steps.decode`)."""
        m = self.model
        return steps.decode(self.kv, m.params, m.config, state, self.engine_config.decode_steps,
                            return_logits=want_logits, lora=m.lora, sharding=m.shardings,
                            kernel=m.kernel, fill=fill, plan=m.plan)

    def decode_rows(self, live: list[Seq], occupied: list[Seq | None]
                    ) -> tuple[int, dict[int, int]]:
        """(rows, each live sample's row) of a decode call. Under invariant numerics, where
        a row's bits do not depend on the call's other rows, plain decoding runs the live
        samples alone, in the next power of two of rows (at least 2) below `max_slots`
        (attention and the products cost per row, idle or not); as many as the slots'
        bucket, a row per slot. Otherwise (fast numerics, a mesh, speculative decoding)
        every slot is a row, live or not."""
        rows = self.decode_width(len(live))
        if rows == self.engine_config.max_slots:
            return rows, {id(s): s.slot for s in live}
        return rows, {id(s): i for i, s in enumerate(live)}

    def decode_width(self, live: int) -> int:
        """The rows of a decode call of `live` samples (`decode_rows`)."""
        slots = self.engine_config.max_slots
        rows = bucket(live, LIVE_ROWS)
        if (self.spec is not None or not self.policy.decodes_live_rows_only()
                or rows >= slots):
            return slots
        return rows

    def packed_fill(self, rows: list[PrefillRow], longest: int = 1
                    ) -> tuple[steps.Fill | None, int]:
        """The prompts a decode call prefills in its steps (`steps.Fill`): each step takes
        every row's next ceil(prefill_chunk / decode_steps) tokens, at least 16 (or the
        chunk): a call advances a prompt by at least one prefill chunk, as a prefill call
        per round would, without stalling the decoding sequences for it; the floor
        amortises a packed step's fixed cost over enough tokens. Rows are padded to a power
        of two; the page table is wide enough for `longest` pages.
        Returns (the fill or None, its real tokens)."""
        if not rows:
            return None, 0
        steps_, pool = self.engine_config.decode_steps, self.kv.target
        chunk = pool.cache_config.prefill_chunk
        width = max(-(-chunk // steps_), min(chunk, 16))
        n = bucket(len(rows))
        tokens = np.zeros((n, steps_ * width), np.int32)
        start, count, offsets, adapters = (np.zeros(n, np.int32) for _ in range(4))
        for i, row in enumerate(rows):
            part = row.tokens[row.start: row.start + steps_ * width]
            tokens[i, : len(part)] = part
            start[i], count[i] = row.start, len(part)
            offsets[i], adapters[i] = row.position_base, row.adapter_index
        table = page_table([r.pages for r in rows], n, pool.cache_config.block_pages, longest)
        fill = steps.Fill(tokens=tokens.reshape(n, steps_, width), page_table=table,
                          start=start, count=count, position_offset=offsets,
                          adapter_ids=adapters if self.model.lora is not None else None,
                          open_rows=prefill_open_rows(pool.cache, rows, n))
        return fill, int(count.sum())

    def _apply(self, seq: Seq, out: np.ndarray, logits: np.ndarray | None, length: int) -> None:
        """Appends a sample's new tokens (`out`: int32[steps], -1 past the last) and rolls
        its pages back to the kept history after a verification."""
        produced = out[out >= 0].tolist()
        seq.generated += produced
        if seq.req.request.return_logits:
            seq.logits.extend(logits[: len(produced)])
        seq.length = length
        if produced:
            seq.last = produced[-1]
        request = seq.req.request
        seq.done = len(seq.generated) >= request.max_new_tokens or seq.last in seq.req.stops
        if self.spec is not None:  # rollback: pages wholly past the kept history
            self.kv.rollback(seq)


def longest_left(rows: list[PrefillRow]) -> int:
    """The most tokens any of `rows` has left to prefill."""
    return max(len(r.tokens) - r.start for r in rows)


def _advance(rows: list[PrefillRow], chunk: int) -> None:
    """Moves each row's start past the chunk a prefill call just wrote."""
    for row in rows:
        row.start = min(row.start + chunk, len(row.tokens))
