"""Host prefix trie over page-sized token blocks. Plain Python + numpy: no JAX.

Each node is one full page of tokens under a namespace; its children continue the history.
A hash of (salt, tokens) indexes a node's children, but every match compares the tokens
and the salt exactly, so a hash collision can never return another history. The trie
holds one allocator reference on every page it caches; eviction removes least-recently
used (or by another policy) leaves that no live sequence references.

Miss causes, for the first block that was not reused:
  capacity   - this very block (same namespace, same salts and tokens before it) was cached
               and has been evicted
  namespace  - the same token history is cached under another namespace (fields named)
  divergence - the request shares some history with the cache, which then continues
               differently; the tokens differ at `position`
  partial_page - the request's remaining tokens are fewer than a page and a cached page
                 continues them (only a partial-page copy could reuse them)
  cold       - never seen

What a request is told depends only on what its own namespace can see: another tenant's
private blocks do not exist for it (a namespace miss names only namespaces that are public,
salt None, or the request's own tenant's). `Match.operator_cause` / `operator_fields` keep
the unfiltered cause for operator-level aggregates, which never name requests.

Records are keyed so that they cannot collide: a block's identity is its root namespace and
its path key, a digest of every (salt, tokens) block from the root to it; the "same tokens
elsewhere" index counts nodes per (token-history digest, namespace), so evicting one of two
nodes that share both keeps the other's record.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
from collections.abc import Callable, Sequence

from kvjax.cache.allocator import PageAllocator
from kvjax.cache.identity import CacheNamespace
from kvjax.cache.node import (  # noqa: F401  (history_digests: re-exported)
    EVICTION_POLICIES,
    Block,
    Node,
    child_key,
    default_hash,
    history_digests,
)


@dataclasses.dataclass
class Match:
    """The longest cached prefix of a request, and why the next block was not reused."""

    nodes: list[Node]
    cause: str | None = None  # None: every full block matched
    position: int | None = None  # divergence: first differing token position
    fields: list[str] = dataclasses.field(default_factory=list)  # namespace: differing fields
    partial: tuple[Node, int] | None = None  # a cached page sharing the next n tokens
    # Fields in which other tenants' private namespaces holding the same tokens differ:
    # the operator's view only (None: there are none).
    hidden_fields: list[str] | None = None

    @property
    def operator_cause(self) -> str | None:
        return self.cause if self.hidden_fields is None else "namespace"

    @property
    def operator_fields(self) -> list[str]:
        return sorted({*self.fields, *(self.hidden_fields or ())})

    @property
    def pages(self) -> list[int]:
        return [n.page for n in self.nodes]


def _fields(namespace: CacheNamespace, others: list[CacheNamespace]) -> list[str]:
    return sorted({f for ns in others for f in namespace.differing_fields(ns)})


class PrefixTrie:
    """Radix structure over page-sized blocks, one root per namespace (salt aside)."""

    def __init__(self, page_size: int, allocator: PageAllocator, policy: str = "lru",
                 hash_fn: Callable[[str | None, Block], int] = default_hash,
                 evicted_record: int = 1 << 16):
        if policy not in EVICTION_POLICIES:
            raise ValueError(f"unknown eviction policy {policy!r} "
                             f"(known: {', '.join(EVICTION_POLICIES)})")
        self.page_size = page_size
        self.allocator = allocator
        self.policy = policy
        self.priority = EVICTION_POLICIES[policy]
        self.hash_fn = hash_fn
        self._roots: dict[CacheNamespace, Node] = {}
        self._clock = 0
        # (root namespace, path key) of evicted blocks, oldest first; of every block ever cached
        self._evicted: collections.OrderedDict = collections.OrderedDict()
        self._evicted_cap = evicted_record
        self._ever: set[tuple[CacheNamespace, bytes]] = set()
        # token-history digest -> resident nodes per full namespace (with salt)
        self._resident: dict[bytes, collections.Counter] = collections.defaultdict(
            collections.Counter)
        self._digest_of: dict[int, bytes] = {}  # id(node) -> history digest
        self.num_nodes = 0
        self.evictions = 0
        # Eviction without walking the trie: each cached page's node, how many nodes are
        # blocked (num_evictable = the others), and a heap of (policy key, order, node) over
        # leaves that were evictable when pushed; an entry is checked when popped (still
        # cached, a leaf, unpinned, same key) and a node is pushed again whenever its key
        # changes (touch, insert) or it becomes an evictable leaf.
        self._node_of: dict[int, Node] = {}
        self._num_blocked = 0
        self._heap: list[tuple[tuple, int, Node]] = []
        self._order = itertools.count()
        allocator.listener = self._refcount_changed
        # Told of the leaves each `evict` call dropped, before it returns: their pages still
        # hold their K/V (nothing can write a page before the caller gets it back) and
        # their parent links still name their histories (the pool's lower tiers keep them).
        self.on_evict: Callable[[list[Node]], None] | None = None

    # -- queries ----------------------------------------------------------------------------
    def _root(self, base: CacheNamespace, create: bool) -> Node | None:
        base = base.with_salt(None)
        if base not in self._roots and create:
            self._roots[base] = Node((), None, -1, None, base, 0)
        return self._roots.get(base)

    def _find_child(self, node: Node, salt: str | None, tokens: Block) -> Node | None:
        for child in node.children.get(self.hash_fn(salt, tokens), ()):
            if child.salt == salt and child.tokens == tokens:  # exact, never by hash alone
                return child
        return None

    def match(self, base: CacheNamespace, tokens: Sequence[int], salts: Sequence[str | None],
              digests: Sequence[bytes], touch: bool = True) -> Match:
        """Longest exact prefix of full blocks. `salts[i]` is block i's salt."""
        ps = self.page_size
        node = self._root(base, create=False)
        nodes: list[Node] = []
        num_blocks = len(tokens) // ps
        while node is not None and len(nodes) < num_blocks:
            i = len(nodes)
            child = self._find_child(node, salts[i], tuple(tokens[i * ps:(i + 1) * ps]))
            if child is None:
                break
            nodes.append(child)
            node = child
        if touch:
            self.touch(nodes)
        return self._explain(base, tokens, salts, digests, nodes, node)

    def touch(self, nodes: list[Node]) -> None:
        """Marks matched nodes as used now (for the eviction policy)."""
        self._clock += 1
        for n in nodes:
            n.last_used = self._clock
            n.hits += 1
            self._offer(n)

    def _explain(self, base, tokens, salts, digests, nodes, node) -> Match:
        ps = self.page_size
        i = len(nodes)
        start = i * ps
        salt = salts[i] if i < len(salts) else None
        if i >= len(tokens) // ps:  # every full block matched; a tail shorter than a page
            tail = tuple(tokens[start:])
            if not tail:
                return Match(nodes, None)
            continued, best = node.closest(salt, tail) if node else (False, None)
            shared = best[1] if best else 0
            partial = best if shared > 0 else None
            if partial is not None and shared == len(tail):
                return Match(nodes, "partial_page", position=start + shared, partial=partial)
            if continued and (nodes or partial):
                return Match(nodes, "divergence", position=start + shared, partial=partial)
            # Nothing continues this history: a hit if any page matched, else never seen.
            return Match(nodes, None if nodes else "cold")
        namespace = base.with_salt(salts[i])
        block = tuple(tokens[start:start + ps])
        continued, best = node.closest(salt, block) if node else (False, None)
        shared = best[1] if best else 0
        partial = best if shared > 0 else None
        parent_key = b"" if node is None else node.key
        if (base.with_salt(None), child_key(parent_key, salts[i], block)) in self._evicted:
            return Match(nodes, "capacity", partial=partial)
        elsewhere = [ns for ns in self._resident.get(digests[i], ()) if ns != namespace]
        tenant = next((s for s in salts if s is not None), None)
        visible = [ns for ns in elsewhere if ns.salt in (None, tenant)]
        private = [ns for ns in elsewhere if ns.salt not in (None, tenant)]
        hidden = _fields(namespace, private) if private else None
        if visible:
            return Match(nodes, "namespace", fields=_fields(namespace, visible),
                         partial=partial, hidden_fields=hidden)
        if continued and (nodes or partial):  # shared some history, then went elsewhere
            return Match(nodes, "divergence", position=start + shared, partial=partial,
                         hidden_fields=hidden)
        return Match(nodes, "cold", partial=partial, hidden_fields=hidden)

    def unbounded_blocks(self, base: CacheNamespace, tokens: Sequence[int],
                         salts: Sequence[str | None]) -> int:
        """Blocks an unbounded cache would have matched (everything ever inserted)."""
        root, key = base.with_salt(None), b""
        for i in range(len(tokens) // self.page_size):
            key = child_key(key, salts[i], tuple(tokens[i * self.page_size:
                                                        (i + 1) * self.page_size]))
            if (root, key) not in self._ever:
                return i
        return len(tokens) // self.page_size

    # -- updates ----------------------------------------------------------------------------
    def insert(self, base: CacheNamespace, tokens: Sequence[int], salts: Sequence[str | None],
               digests: Sequence[bytes], pages: Sequence[int]) -> int:
        """Caches the full blocks of `tokens` held in `pages`; returns blocks newly added.

        Blocks already cached keep their page; a new block takes one reference on its page.
        """
        ps = self.page_size
        node = self._root(base, create=True)
        root = base.with_salt(None)
        added = 0
        self._clock += 1
        for i in range(min(len(tokens) // ps, len(pages))):
            block = tuple(tokens[i * ps:(i + 1) * ps])
            namespace = base.with_salt(salts[i])
            child = self._find_child(node, salts[i], block)
            if child is None:
                if pages[i] in self._node_of:
                    raise ValueError(f"page {pages[i]} already holds a cached block")
                child = Node(block, salts[i], pages[i], node, namespace, self._clock)
                node.add_child(self.hash_fn(salts[i], block), child)
                self.allocator.share(pages[i])
                self._node_of[pages[i]] = child
                self._pin(child, self.allocator.refcount(pages[i]) > 1)
                self._resident[digests[i]][namespace] += 1
                self._digest_of[id(child)] = digests[i]
                self._ever.add((root, child.key))
                self._evicted.pop((root, child.key), None)
                self.num_nodes += 1
                added += 1
            else:  # a cached block used again: a new key (a new node was offered by _pin)
                child.last_used = self._clock
                self._offer(child)
            node = child
        return added

    # -- eviction state -----------------------------------------------------------------------
    def _refcount_changed(self, page: int, count: int) -> None:
        """The allocator's listener: a cached page is pinned while a sequence shares it."""
        node = self._node_of.get(page)
        if node is not None:
            self._pin(node, count > 1)

    def _pin(self, node: Node, pinned: bool) -> None:
        """Sets `node.pinned` and the blocked state of it and its ancestors, stopping at the
        first ancestor whose state does not change (a sequence pins its path from the root
        down, so this is O(1) per page in the usual case)."""
        node.pinned = pinned
        self._offer(node)
        while node.parent is not None:
            blocked = node.pinned or node.blocked_kids > 0
            if blocked == node.blocked:
                break
            node.blocked = blocked
            self._num_blocked += 1 if blocked else -1
            node = node.parent
            if node.parent is not None:
                node.blocked_kids += 1 if blocked else -1

    def _offer(self, node: Node) -> None:
        """Pushes `node` with its current key if it is an evictable leaf."""
        if node.parent is not None and node.resident and not node.children and not node.pinned:
            heapq.heappush(self._heap, (self.priority(node), next(self._order), node))

    def _leaves(self) -> list[Node]:
        out, stack = [], list(self._roots.values())
        while stack:
            node = stack.pop()
            kids = node.child_list()
            if not kids and node.parent is not None:
                out.append(node)
            stack.extend(kids)
        return out

    def num_evictable(self) -> int:
        """Pages eviction could free now: nodes whose whole subtree only the trie holds
        (kept current as references change: O(1))."""
        return self.num_nodes - self._num_blocked

    def walk_evictable(self) -> int:
        """`num_evictable()` by its definition, walking every node post-order (what the
        room check cost before the count was kept; tests and `kvjax bench trie` check the
        kept count against it)."""
        total, free = 0, {}
        stack = [(root, False) for root in self._roots.values()]
        while stack:
            node, done = stack.pop()
            kids = node.child_list()
            if not done:
                stack.append((node, True))
                stack.extend((kid, False) for kid in kids)
                continue
            ok = True
            for kid in kids:
                ok = free.pop(id(kid)) and ok
            if node.parent is not None:
                ok = ok and self.allocator.refcount(node.page) == 1
                total += ok
            free[id(node)] = ok
        return total

    def evictable(self) -> list[Node]:
        """Leaves that only the trie references (walks the trie: for inspection)."""
        return [n for n in self._leaves() if not n.pinned]

    def evict(self, num_pages: int) -> int:
        """Frees up to `num_pages` pages, one evictable leaf at a time in policy order (a
        parent whose last child goes competes from then on)."""
        freed, evicted = 0, []
        while freed < num_pages and self._heap:
            key, _, node = heapq.heappop(self._heap)
            if not node.resident or node.children or node.pinned:
                continue  # no longer an evictable leaf: pushed again if it becomes one
            if key != self.priority(node):
                self._offer(node)  # its key changed since: back in at the current one
                continue
            self._remove(node)
            evicted.append(node)
            freed += 1
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        if len(self._heap) > 2 * self.num_nodes + 64:  # drop the stale entries
            self._heap = [e for e in self._heap if e[2].resident]
            heapq.heapify(self._heap)
        return freed

    def _remove(self, node: Node) -> None:
        """Drops a leaf and the trie's reference to its page."""
        parent = node.parent
        parent.drop_child(self.hash_fn(node.salt, node.tokens), node)
        node.resident = False
        del self._node_of[node.page]
        if node.blocked:  # clear() drops pinned leaves too
            self._pin(node, False)
        self._offer(parent)
        digest = self._digest_of.pop(id(node))
        resident = self._resident[digest]
        resident[node.namespace] -= 1
        if not resident[node.namespace]:
            del resident[node.namespace]
        if not resident:
            del self._resident[digest]
        self._evicted[(node.namespace.with_salt(None), node.key)] = True
        while len(self._evicted) > self._evicted_cap:
            self._evicted.popitem(last=False)
        self.allocator.free([node.page])
        self.num_nodes -= 1
        self.evictions += 1

    def clear(self) -> None:
        """Drops every cached block (returns the trie's references)."""
        while self.num_nodes:
            leaves = self._leaves()
            for node in leaves:
                self._remove(node)

    def pages(self) -> list[int]:
        """Every page the trie holds."""
        out, stack = [], list(self._roots.values())
        while stack:
            node = stack.pop()
            if node.parent is not None:
                out.append(node.page)
            stack.extend(node.child_list())
        return out

    def nodes(self) -> list[Node]:
        """Every cached block's node."""
        return list(self._node_of.values())

    def entries(self) -> list[tuple[CacheNamespace, list[int], int]]:
        """(namespace root, full token history, page) for every cached block."""
        out = []
        for base, root in self._roots.items():
            stack = [(root, [])]
            while stack:
                node, history = stack.pop()
                for child in node.child_list():
                    h = history + list(child.tokens)
                    out.append((base, h, child.page))
                    stack.append((child, h))
        return out
