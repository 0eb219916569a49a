"""Requests, results and stream events of the engine; a live request's state; rendering and
validation (host code: plain Python + numpy).

Bad input is refused here, before anything is queued or allocated: every check the engine
makes on a request is in `render` and `validate`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvjax.cache.identity import CacheNamespace
from kvjax.cache.trie import history_digests
from kvjax.config import CacheConfig, ModelConfig, SamplingConfig
from kvjax.decode.batching import pages_for
from kvjax.decode.prompts import check_token_ids
from kvjax.engine.request_stats import RequestStats
from kvjax.errors import InvalidRequestError


def check_field_types(request: Request) -> None:
    """InvalidRequestError naming the first field of the wrong type (before any arithmetic
    on it could raise a bare TypeError)."""
    def integer(x) -> bool:
        return isinstance(x, (int, np.integer)) and not isinstance(x, bool)

    checks = [("max_new_tokens", integer, "an int"), ("n", integer, "an int"),
              ("position_base", integer, "an int"), ("public_prefix", integer, "an int"),
              ("stop_token", lambda x: x is None or integer(x), "an int or None"),
              ("stop_tokens", lambda x: isinstance(x, (list, tuple)) and all(
                  integer(t) for t in x), "a list of ints"),
              ("ignore_eos", lambda x: isinstance(x, bool), "a bool"),
              ("stop_strings", lambda x: isinstance(x, (list, tuple)) and all(
                  isinstance(t, str) and t for t in x), "a list of non-empty strs"),
              ("text", lambda x: x is None or isinstance(x, str), "a str or None"),
              ("tenant", lambda x: x is None or isinstance(x, str), "a str or None"),
              ("adapter", lambda x: x is None or isinstance(x, str), "a str or None"),
              ("return_logits", lambda x: isinstance(x, bool), "a bool"),
              ("sampling", lambda x: isinstance(x, SamplingConfig), "a SamplingConfig")]
    for name, ok, what in checks:
        value = getattr(request, name)
        if not ok(value):
            raise InvalidRequestError(f"{name} must be {what}, got {type(value).__name__} "
                                      f"{value!r}")


@dataclasses.dataclass(frozen=True)
class Request:
    """One prompt to continue: token ids, or `text` / chat `messages` that the engine's
    tokenizer and chat template render to ids (the cache identity is always the ids).

    `tenant` salts the cache: requests of different tenants never share pages, except the
    first `public_prefix` tokens (a shared system prompt), whose full pages stay public.
    `position_base` is the position of the first token. `n` samples share the prompt's
    pages and copy on write.
    """

    tokens: Sequence[int] | None = None
    max_new_tokens: int = 16
    sampling: SamplingConfig = SamplingConfig()
    adapter: str | None = None
    tenant: str | None = None
    public_prefix: int = 0
    n: int = 1
    return_logits: bool = False
    position_base: int = 0
    stop_token: int | None = None
    stop_tokens: Sequence[int] = ()  # more ids that end the answer (with stop_token)
    ignore_eos: bool = False  # do not stop at the engine's `eos_tokens` (the checkpoint's)
    # texts that end the answer, found in its decoded text wherever token boundaries fall:
    # the answer ends with the token that completes the first one (needs a tokenizer)
    stop_strings: Sequence[str] = ()
    text: str | None = None  # encoded as the tokenizer specifies (BOS included if it adds one)
    messages: Sequence[dict] | None = None
    tools: Sequence[dict] | None = None  # JSON schemas the chat template lists (messages only)


@dataclasses.dataclass
class RequestResult:
    id: int
    tokens: list[int] | list[list[int]]  # a list of lists when n > 1
    logits: np.ndarray | list[np.ndarray] | None  # [num_generated, vocab] per sample
    stats: dict
    status: str = "finished"  # "finished" | "cancelled" | "error" (see `error`)
    prompt_ids: list[int] | None = None  # the rendered prompt the cache identity is made of
    text: str | list[str] | None = None  # the generated tokens decoded, with a tokenizer
    error: str | None = None  # why a request ended with status "error" (tokens: as streamed)


@dataclasses.dataclass(frozen=True)
class StreamEvent:
    """New tokens of one sample of one request; `finished` on its last event, which names
    the `error` when the request failed."""

    request_id: int
    sample: int
    tokens: tuple[int, ...]
    finished: bool
    error: str | None = None


@dataclasses.dataclass(eq=False)
class Seq:
    """One sample of a live request: a batch slot, its pages and its progress."""

    req: LiveRequest
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
    head: Any = None  # an EAGLE head's side (`eagle_engine.HeadState`); its pairs cached:
    # `draft_length` (one behind `length`, and the pending ones)


@dataclasses.dataclass(frozen=True)
class Context:
    """The ids an admission matches in the trie and prefills, with each page's salt and
    chained digest: a request's prompt, or after a preemption its prompt and the answer
    tokens its sample had cached (`Rounds._preempt`)."""

    tokens: list[int]
    salts: list[str | None]
    digests: list[bytes]


def context(request: Request, tokens: list[int], page_size: int) -> Context:
    return Context(tokens, salts_per_page(request, len(tokens), page_size),
                   history_digests(tokens, page_size))


@dataclasses.dataclass
class Dropped:
    """What prefills dropped before their last chunk (preemption) did, for the admission
    that completes (`kvjax.engine.stats.record_dropped`)."""

    prefill_s: float = 0.0
    recomputed: int = 0  # tokens they computed that had been computed before
    end: int = 0  # the end of what they computed
    first: tuple | None = None  # the first one's (match, reuse, start, copied, unbounded)


@dataclasses.dataclass(eq=False)
class LiveRequest:
    """A validated request from submission to result: its rendered ids, namespace, what its
    next admission prefills (`context`), samples and statistics."""

    id: int
    request: Request
    tokens: list[int]  # the rendered prompt
    namespace: CacheNamespace
    context: Context
    adapter_index: int
    submitted: float
    stops: tuple[int, ...] = ()  # every id that ends this request's answers
    seqs: list[Seq] = dataclasses.field(default_factory=list)
    stats: RequestStats = dataclasses.field(default_factory=RequestStats)
    admitted_order: int = -1
    operator_miss: tuple[str | None, tuple[str, ...]] = (None, ())  # metrics() only
    gammas: list[int] = dataclasses.field(default_factory=list)  # each call's size (γ, nodes)
    calls: int = 0  # decode calls since its (latest) admission
    prefilling: bool = False  # seated, its prompt not fully prefilled yet
    dropped: Dropped = dataclasses.field(default_factory=lambda: Dropped())

    @property
    def replaying(self) -> bool:
        """Whether it was recomputed after a preemption and has not caught up with its
        stream."""
        return self.calls < len(self.gammas) and any(
            len(s.generated) < len(s.streamed) for s in self.seqs)


def salts_per_page(request: Request, num_tokens: int, page_size: int) -> list[str | None]:
    """Each page's salt: the tenant's, except the full pages inside `public_prefix`."""
    return [None if request.tenant is None or (i + 1) * page_size <= request.public_prefix
            else request.tenant for i in range(pages_for(num_tokens, page_size))]


def render(request: Request, tokenizer=None, chat_template=None):
    """The prompt's token ids: given, or rendered from text or chat messages."""
    check_field_types(request)
    given = [x is not None for x in (request.tokens, request.text, request.messages)]
    if sum(given) != 1:
        raise InvalidRequestError("give exactly one of tokens, text or messages")
    if request.tools is not None and request.messages is None:
        raise InvalidRequestError("tools are listed by a chat template: give messages")
    if request.stop_strings and tokenizer is None:
        raise InvalidRequestError("stop_strings need an engine with a tokenizer")
    if request.tokens is not None:
        return request.tokens
    if request.text is not None:
        if tokenizer is None:
            raise InvalidRequestError("a text request needs an engine with a tokenizer")
        return tokenizer.encode_prompt(request.text)
    if chat_template is None:
        raise InvalidRequestError("a messages request needs an engine with a chat template")
    try:
        return chat_template.render(request.messages, tools=request.tools)
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None


MAX_STOP_TOKENS = 8  # stop ids a request may have in all (the device loops' fixed width)


def stop_ids(request: Request, eos: Sequence[int] = ()) -> tuple[int, ...]:
    """Every id that ends `request`'s answers: its `stop_token` and `stop_tokens`, and the
    engine's `eos` (the checkpoint's end-of-sequence ids) unless it sets `ignore_eos`."""
    ids = [] if request.stop_token is None else [request.stop_token]
    ids += list(request.stop_tokens) + ([] if request.ignore_eos else list(eos))
    out = tuple(dict.fromkeys(int(t) for t in ids))
    if len(out) > MAX_STOP_TOKENS:
        with_eos = "" if request.ignore_eos else f" (with the engine's eos_tokens {list(eos)})"
        raise InvalidRequestError(f"{len(out)} stop ids{with_eos}: at most {MAX_STOP_TOKENS}")
    return out


def validate(request: Request, tokens, config: ModelConfig, cache: CacheConfig,
             max_slots: int, adapters, draft_max_seq_len: int | None = None,
             write_ahead: int = 0) -> list[int]:
    """The prompt's ids as ints, or InvalidRequestError naming what cannot be served.

    `adapters`: the loaded adapter names; `draft_max_seq_len`: the draft model's context,
    if any; `write_ahead`: cache slots a decode call may write past the kept history
    (`kvjax.speculative.plugin.write_ahead`: γ, or a tree's nodes past the root).
    """
    ids = np.asarray(check_token_ids(tokens, config.vocab_size))
    if isinstance(request.max_new_tokens, bool) or request.max_new_tokens < 1:
        raise InvalidRequestError(f"max_new_tokens must be >= 1, got "
                                  f"{request.max_new_tokens}")
    if request.n < 1 or request.n > max_slots:
        raise InvalidRequestError(f"n={request.n} must be in [1, max_slots={max_slots}]")
    if request.n > 1 and cache.dtype == "int4_kivi":
        raise InvalidRequestError(f"n={request.n} with int4_kivi pages: the samples would "
                                  f"share the prompt's open page (not forked yet)")
    if request.adapter is not None and request.adapter not in adapters:
        known = ", ".join(sorted(adapters)) or "none loaded"
        raise InvalidRequestError(f"unknown adapter {request.adapter!r} (known: {known})")
    if request.position_base < 0:
        raise InvalidRequestError(f"position_base must be >= 0, got {request.position_base}")
    end = request.position_base + ids.size + request.max_new_tokens
    if end > config.max_seq_len:
        raise InvalidRequestError(
            f"position_base {request.position_base} + {ids.size} prompt tokens + "
            f"{request.max_new_tokens} new tokens exceed max_seq_len={config.max_seq_len}")
    if draft_max_seq_len is not None and end > draft_max_seq_len:
        raise InvalidRequestError(
            f"position_base {request.position_base} + {ids.size} prompt tokens + "
            f"{request.max_new_tokens} new tokens exceed the draft's "
            f"max_seq_len={draft_max_seq_len}")
    if not 0 <= request.public_prefix <= ids.size:
        raise InvalidRequestError(f"public_prefix must be in [0, {ids.size}]")
    if request.stop_token is not None and not 0 <= request.stop_token < config.vocab_size:
        raise InvalidRequestError(f"stop_token {request.stop_token} is outside the vocabulary")
    bad = [t for t in request.stop_tokens if not 0 <= t < config.vocab_size]
    if bad:
        raise InvalidRequestError(f"stop_tokens {bad} are outside the vocabulary")
    shared = ids.size // cache.page_size
    need = shared + request.n * (pages_for(ids.size + request.max_new_tokens + write_ahead,
                                           cache.page_size) - shared)
    if need > cache.num_pages:
        raise InvalidRequestError(
            f"the request needs {need} pages of {cache.page_size} tokens, more than the whole "
            f"cache ({cache.num_pages} pages)")
    return ids.tolist()
