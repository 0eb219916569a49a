"""A prefix-trie node, the path keys that name blocks, and the eviction policies' keys.
Plain Python: no JAX."""

from __future__ import annotations

import collections
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
    __slots__ = ("blocked", "blocked_kids", "by_first", "children", "created", "hits", "key",
                 "last_used", "namespace", "page", "parent", "pinned", "resident",
                 "restored_from", "salt", "salt_kids", "tokens")

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
        self.restored_from: str | None = None  # a lower tier, until an admission reuses it
        # For miss causes without scanning every child (a system prompt may be continued by
        # thousands): children per (salt, first token) and per salt; made with the first child.
        self.by_first: dict[tuple[str | None, int], list[Node]] | None = None
        self.salt_kids: collections.Counter | None = None

    def child_list(self) -> list[Node]:
        return [c for bucket in self.children.values() for c in bucket]

    def add_child(self, key: int, child: Node) -> None:
        """Adds `child` under its hash `key` and to the miss-cause indexes."""
        self.children.setdefault(key, []).append(child)
        if self.by_first is None:
            self.by_first, self.salt_kids = {}, collections.Counter()
        self.by_first.setdefault((child.salt, child.tokens[0]), []).append(child)
        self.salt_kids[child.salt] += 1

    def drop_child(self, key: int, child: Node) -> None:
        for index, k in ((self.children, key), (self.by_first, (child.salt, child.tokens[0]))):
            index[k].remove(child)
            if not index[k]:
                del index[k]
        self.salt_kids[child.salt] -= 1
        if not self.salt_kids[child.salt]:
            del self.salt_kids[child.salt]

    def closest(self, salt: str | None, tokens: Sequence[int]) -> tuple[bool, tuple | None]:
        """(whether a child continues this node under `salt`, and the (child, length) of
        the one sharing the longest token prefix with `tokens`, first added on a tie, or
        None when no child shares a first token). Only children with the same first token
        are compared."""
        if self.by_first is None or not self.salt_kids.get(salt):
            return False, None
        same_start = self.by_first.get((salt, tokens[0]), ()) if tokens else ()
        best = max(((c, common_prefix(c.tokens, tokens)) for c in same_start),
                   key=lambda x: x[1], default=None)
        return True, best


def common_prefix(a: Block, b: Sequence[int]) -> int:
    """Length of the common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


EVICTION_POLICIES: dict[str, Callable[[Node], tuple]] = {
    "lru": lambda n: (n.last_used, n.created),
    "lfu": lambda n: (n.hits, n.last_used, n.created),
    "fifo": lambda n: (n.created,),
}
