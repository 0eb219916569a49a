"""Stop strings: an answer ends with the token that completes the first stop string in its
decoded text, wherever the token boundaries fall (host code).

The device loops stop at ids only; text is checked after each call, on the tokens the call
added. A sample that stops is cut back (`cut`): its tokens, logits and cached length end at
the completing token, so nothing past it is streamed, returned or cached.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvjax.engine.requests import Seq


def stop_end(decode, generated: Sequence[int], checked: int,
             strings: Sequence[str]) -> int | None:
    """How many tokens the answer keeps: the smallest m > `checked` for which
    `decode(generated[:m])` contains one of `strings`, or None. `generated[:checked]`
    contains none (it was checked before)."""
    if not any(s in decode(generated) for s in strings):
        return None
    for m in range(max(checked, 0) + 1, len(generated) + 1):
        text = decode(generated[:m])
        if any(s in text for s in strings):
            return m
    return None  # pragma: no cover - the whole text contains one


def cut(seq: Seq, keep: int) -> None:
    """Ends a sample after its first `keep` generated tokens. The cache holds the history
    before the newest token (`Seq.length`), so at most prompt + keep - 1 tokens of it."""
    del seq.generated[keep:]
    del seq.logits[keep:]
    seq.last = seq.generated[-1]
    seq.length = min(seq.length, len(seq.req.tokens) + keep - 1)
    seq.draft_length = min(seq.draft_length, seq.length)
    seq.done = True


def apply(seq: Seq, tokenizer, checked: int) -> None:
    """Cuts `seq` at its request's first stop string, if its tokens past `checked` complete
    one (requests with stop strings are served only by engines with a tokenizer)."""
    strings = seq.req.request.stop_strings
    if strings and seq.generated:
        keep = stop_end(tokenizer.decode, seq.generated, checked, strings)
        if keep is not None:
            cut(seq, keep)
