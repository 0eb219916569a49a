"""What a request returns: its stream events, checked against what it already streamed, and
its final `RequestResult`. Host code: plain Python + numpy."""

from __future__ import annotations

import numpy as np

from kvjax.engine.requests import LiveRequest, RequestResult, StreamEvent


def contradiction(req: LiveRequest) -> str | None:
    """Why a sample recomputed after a preemption contradicts what it streamed, or None
    (the samples' `checked` marks advance over what agrees)."""
    for seq in req.seqs:
        upto = min(len(seq.generated), len(seq.streamed))
        for i in range(seq.checked, upto):
            if seq.generated[i] != seq.streamed[i]:
                return (f"sample {seq.index} recomputed after a preemption gave token "
                        f"{seq.generated[i]} at index {i}, where {seq.streamed[i]} was streamed")
        seq.checked = upto
    return None


def new_events(req: LiveRequest) -> list[StreamEvent]:
    """Each sample's tokens not streamed yet, as events (marked streamed)."""
    events = []
    for seq in req.seqs:
        new = seq.generated[len(seq.streamed):]
        if new:
            events.append(StreamEvent(req.id, seq.index, tuple(new), seq.done))
            seq.streamed += new
            seq.checked = len(seq.streamed)
            seq.closed = seq.done
    return events


def closing_events(req: LiveRequest, error: str) -> list[StreamEvent]:
    """A last event naming `error` for every sample whose stream is still open."""
    events = []
    for seq in req.seqs:
        if not seq.closed:
            events.append(StreamEvent(req.id, seq.index, (), True, error))
            seq.closed = True
    return events


def request_result(req: LiveRequest, status: str, error: str | None, vocab_size: int,
                   tokenizer=None) -> RequestResult:
    """The result: each sample's tokens are the ones it streamed (a cancelled request may
    have streamed more than it has recomputed since a preemption); logits only where every
    token has its logits (so none after an error)."""
    single = req.request.n == 1
    tokens = [list(s.streamed) for s in req.seqs]
    logits = None
    if req.request.return_logits and status != "error" and all(
            len(s.logits) == len(s.streamed) for s in req.seqs):
        logits = [np.stack(s.logits) if s.logits else np.zeros((0, vocab_size))
                  for s in req.seqs]
    text = None
    if tokenizer is not None:
        decoded = [tokenizer.decode(t) for t in tokens]
        text = decoded[0] if single else decoded
    return RequestResult(
        id=req.id, tokens=tokens[0] if single else tokens,
        logits=(logits[0] if single else logits) if logits is not None else None,
        stats=req.stats.as_dict(), status=status, prompt_ids=list(req.tokens), text=text,
        error=error)
