"""Prefix cache: a radix tree from token sequences to the KV pages that hold them.

Granularity is one page: a node's key is a whole number of pages of tokens, and its value
the pages holding their K/V. A request starts from the longest cached prefix of its
prompt (its first pages are the tree's, shared, never written again: a request only
writes slots after its cached length, which is page-aligned); its prompt's whole pages
join the tree once its prefill has computed them, the rest of its pages when it ends.
Nodes in use by a running request are locked; unlocked leaves are evicted, least recently
(lru) or least frequently (lfu) used first, when the pool needs pages.

A request's `cache_key` (SGLang's extra_key, vLLM's cache_salt) names a tree of its own:
requests share cached prefixes only with requests of the same key, so a tenant cannot
learn from another's time to first token what prompts the server has seen. A LoRA
adapter's requests (runtime/lora.py) have trees of their own too: their K/V are not the
base model's.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kiln.runtime.kv_cache import PagePool

# A tree's name: a request's cache key, or (LoRA adapter slot, cache key) (runtime/request.py
# `prefix_space`); None, the shared tree.
Space = str | tuple[int, str | None] | None


@dataclass(eq=False)
class Node:
    key: tuple[int, ...] = ()
    pages: list[int] = field(default_factory=list)
    parent: Node | None = None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    locks: int = 0
    last_used: int = 0
    hits: int = 0


class RadixCache:
    def __init__(self, pool: PagePool, policy: str = "lru") -> None:
        if policy not in ("lru", "lfu"):
            raise ValueError(f"unknown eviction policy {policy!r}")
        self.pool = pool
        self.page = pool.page_size
        self.policy = policy
        self.root = Node()  # the tree of requests without a cache key
        self.root.locks = 1  # never evicted
        # one tree a cache key (or adapter), dropped once empty
        self._roots: dict[str | tuple[int, str | None], Node] = {}
        self._clock = itertools.count(1)
        self.cached_pages = 0
        # Called with (tree, the tokens from the root to a leaf, their pages) before the
        # leaf's pages go back to the pool: the disk tier's write-back
        # (runtime/kv_store.py, --hicache-write-policy write_back).
        self.on_evict: Callable[[Space, list[int], list[int]], None] | None = None

    # -- lookups ---------------------------------------------------------------------------
    def _first(self, tokens: Sequence[int], at: int) -> tuple[int, ...]:
        return tuple(tokens[at : at + self.page])

    def _root(self, space: Space, make: bool = False) -> Node | None:
        if space is None:
            return self.root
        root = self._roots.get(space)
        if root is None and make:
            root = self._roots[space] = Node(locks=1)
        return root

    def match(self, tokens: Sequence[int], space: Space = None) -> tuple[list[int], int, Node]:
        """Longest cached prefix of `tokens` in whole pages in the tree of cache key
        `space`: (pages, length, last node). Splits a node when the match ends inside it,
        so the returned node covers exactly the match (and can be locked)."""
        root = self._root(space)
        if root is None:  # no tree for this key yet (a root locks nothing)
            return [], 0, self.root
        node, at, pages = root, 0, []
        now = next(self._clock)
        while at + self.page <= len(tokens):
            child = node.children.get(self._first(tokens, at))
            if child is None:
                break
            n = self._common_pages(child.key, tokens, at)
            if n < len(child.pages):
                child = self._split(child, n)
            child.last_used, child.hits = now, child.hits + 1
            pages += child.pages
            at += len(child.key)
            node = child
        return pages, at, node

    def prefix_len(self, tokens: Sequence[int], space: Space = None) -> int:
        """Length of the longest cached prefix, without touching the tree (no splits, no
        use counts): for ranking requests, which must not skew eviction order."""
        node, at = self._root(space), 0
        if node is None:
            return 0
        while at + self.page <= len(tokens):
            child = node.children.get(self._first(tokens, at))
            if child is None:
                break
            n = self._common_pages(child.key, tokens, at)
            at += n * self.page
            if n < len(child.pages):
                break
            node = child
        return at

    def _common_pages(self, key: tuple[int, ...], tokens: Sequence[int], at: int) -> int:
        """Whole pages of `key` that `tokens` repeats from `at`. One slice comparison when
        all of the overlap matches (the usual case: a shared prefix); else the first
        differing token, found by a scan that stops there."""
        span = min(len(key), len(tokens) - at)
        theirs = tuple(tokens[at : at + span])
        if key[:span] == theirs:
            same = span
        else:
            same = next(i for i, (a, b) in enumerate(zip(key, theirs, strict=False)) if a != b)
        return same // self.page

    def _split(self, node: Node, n_pages: int) -> Node:
        """Cut `node` after `n_pages` pages; returns the new upper part."""
        cut = n_pages * self.page
        assert node.parent is not None
        upper = Node(
            node.key[:cut],
            node.pages[:n_pages],
            node.parent,
            {},
            node.locks,
            node.last_used,
            node.hits,
        )
        node.parent.children[self._first(node.key, 0)] = upper
        node.key, node.pages, node.parent = node.key[cut:], node.pages[n_pages:], upper
        upper.children[self._first(node.key, 0)] = node
        return upper

    # -- ownership -------------------------------------------------------------------------
    def lock(self, node: Node) -> None:
        while node.parent is not None:  # up to its tree's root
            node.locks += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node.parent is not None:
            node.locks -= 1
            node = node.parent

    def insert(self, tokens: Sequence[int], pages: Sequence[int], space: Space = None) -> list[int]:
        """Give the tree of cache key `space` `pages` holding `tokens` (whole pages only).
        Returns the pages the caller still owns and must free: copies of segments the tree
        already had."""
        assert len(tokens) == len(pages) * self.page
        if not tokens:
            return []
        node, at = self._root(space, make=True), 0
        assert node is not None
        leftover: list[int] = []
        now = next(self._clock)
        while at < len(tokens):
            child = node.children.get(self._first(tokens, at))
            if child is None:
                new = Node(tuple(tokens[at:]), list(pages[at // self.page :]), node, last_used=now)
                node.children[self._first(tokens, at)] = new
                self.cached_pages += len(new.pages)
                return leftover
            n = self._common_pages(child.key, tokens, at)
            if n < len(child.pages):
                child = self._split(child, n)
            mine = pages[at // self.page : at // self.page + n]
            leftover += [p for p, theirs in zip(mine, child.pages, strict=True) if p != theirs]
            child.last_used = now
            at += len(child.key)
            node = child
        return leftover

    # -- eviction --------------------------------------------------------------------------
    def evictable_pages(self) -> int:
        return sum(len(n.pages) for n in self._nodes() if n.locks == 0)

    def _nodes(self) -> list[Node]:
        roots = [self.root, *self._roots.values()]
        out, stack = [], [c for r in roots for c in r.children.values()]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def evict(self, pages: int) -> int:
        """Free at least `pages` pages from unlocked leaves, if there are that many;
        returns how many were freed."""

        def rank(n: Node) -> tuple[int, int]:
            return (n.hits, n.last_used) if self.policy == "lfu" else (n.last_used, 0)

        heap = [(rank(n), id(n), n) for n in self._nodes() if not n.children and n.locks == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < pages:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[self._first(leaf.key, 0)]
            if self.on_evict is not None:
                self.on_evict(*self._path(leaf))
            self.pool.free(leaf.pages)
            freed += len(leaf.pages)
            self.cached_pages -= len(leaf.pages)
            if parent.parent is not None and not parent.children and parent.locks == 0:
                heapq.heappush(heap, (rank(parent), id(parent), parent))
        for space in [k for k, r in self._roots.items() if not r.children]:
            del self._roots[space]
        return freed

    def _path(self, node: Node) -> tuple[Space, list[int], list[int]]:
        """The tree `node` is in, and the tokens and pages from its root to `node` (its own
        last)."""
        parts = []
        while node.parent is not None:
            parts.append(node)
            node = node.parent
        space = next((k for k, r in self._roots.items() if r is node), None)
        parts.reverse()
        return space, [t for n in parts for t in n.key], [p for n in parts for p in n.pages]

    def reset(self) -> int:
        """Drop every unlocked entry (flush_cache); returns pages freed."""
        return self.evict(self.cached_pages)
