"""Conversations and questions as chat messages, the form an engine request takes
(`kvjax.engine.requests.Request(messages=...)`). Host code: plain Python."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Conversation:
    """A recorded conversation: turns alternate user, assistant, user, ...; it starts with
    the user and may end with either. `category` is MT-Bench's (None for ShareGPT)."""

    id: str
    turns: tuple[tuple[str, str], ...]  # (role, text) in order
    category: str | None = None

    @property
    def messages(self) -> list[dict]:
        """The turns as chat messages ({"role", "content"})."""
        return [{"role": role, "content": text} for role, text in self.turns]

    @property
    def user_turns(self) -> list[str]:
        return [text for role, text in self.turns if role == "user"]

    @property
    def answers(self) -> list[str]:
        """The recorded assistant turns (none for MT-Bench's questions)."""
        return [text for role, text in self.turns if role == "assistant"]


@dataclasses.dataclass(frozen=True)
class Loaded:
    """What a loader read: the complete, well-formed records, in file order, and how many
    it dropped for each reason ("truncated": the file ends inside one; "malformed": a
    record of the wrong shape; "filtered": outside the caller's limits)."""

    source: str
    conversations: tuple[Conversation, ...]
    dropped: dict[str, int]

    def __len__(self) -> int:
        return len(self.conversations)

    def __iter__(self):
        return iter(self.conversations)

    def __getitem__(self, i):
        return self.conversations[i]
