"""A prefix-trie node, the path keys that name blocks, and the eviction policies' keys.
Plain Python: no JAX."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

from kvjax.cache.identity import CacheNamespace

Block = tuple[int, ...]


def default_hash(salt: str | None, tokens: Block) -> int:
    return hash((salt, tokens))


def child_key(parent_key: bytes, salt: str | None, tokens: Block) -> bytes:
    """The path key of a block: its parent's key extended by (salt, tokens)."""
    return hashlib.blake2b(parent_key + repr((salt, tokens)).encode(),
                           digest_size=16).digest()


def history_digests(tokens: Sequence[int], page_size: int) -> list[bytes]:
    """Digest of the whole history up to the end of each full block (for statistics only)."""
    out, h = [], hashlib.blake2b(digest_size=16)
    for start in range(0, len(tokens) - page_size + 1, page_size):
        h.update(repr(tuple(tokens[start:start + page_size])).encode())
        out.append(h.copy().digest())
    return out


class Node:
    __slots__ = ("blocked", "blocked_kids", "children", "created", "hits", "key", "last_used",
                 "namespace", "page", "parent", "pinned", "resident", "salt", "tokens")

    def __init__(self, tokens: Block, salt: str | None, page: int, parent: Node | None,
                 namespace: CacheNamespace, clock: int):
        self.tokens = tokens
        self.salt = salt
        self.page = page
        self.parent = parent
        self.key = b"" if parent is None else child_key(parent.key, salt, tokens)
        self.namespace = namespace  # the full namespace (with this block's salt)
        self.children: dict[int, list[Node]] = {}
        self.created = self.last_used = clock
        self.hits = 0
        # Eviction state, kept current as references change (`PrefixTrie._pin`): `pinned`,
        # a sequence holds the page too; `blocked`, this node or a node below it is pinned
        # (it cannot be freed by evicting leaves); `blocked_kids`, children that are blocked.
        self.pinned = self.blocked = False
        self.blocked_kids = 0
        self.resident = True

    def child_list(self) -> list[Node]:
        return [c for bucket in self.children.values() for c in bucket]


EVICTION_POLICIES: dict[str, Callable[[Node], tuple]] = {
    "lru": lambda n: (n.last_used, n.created),
    "lfu": lambda n: (n.hits, n.last_used, n.created),
    "fifo": lambda n: (n.created,),
}
