"""Prefix cache: requests that share leading FULL pages of tokens share those KV pages.

A cached page is a node keyed by (parent node id, the page's token ids): the chain of keys
from the root spells the whole prefix, so a page's KV (which depends on every earlier token)
is reused only after the same prefix. Node ids are never reused, so a key cannot match a
stale chain.

Ownership through PageAllocator reference counts: the cache holds one reference to every
cached page, each request using it holds one more. A page referenced by the cache alone is
*evictable*; evictable pages sit in LRU order (released most recently = last) and are freed
when an allocation needs room. A request releases its pages deepest first, so within one
release children are evicted before their parents, and a parent is never older than its
children (any use of a child walks through the parent): chains are evicted from the tail.
"""

from collections import OrderedDict
from dataclasses import dataclass

from mlaserve.engine.kv_pool import PageAllocator

ROOT = 0


@dataclass(slots=True)
class _Node:
    node_id: int
    key: tuple            # (parent node id, tuple of page_size token ids)
    page: int


class PrefixCache:
    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator = allocator
        self.page_size = page_size
        self._nodes: dict[tuple, _Node] = {}
        self._by_page: dict[int, _Node] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._next_id = ROOT + 1
        self.lookup_tokens = 0      # prompt tokens looked up (first admissions)
        self.hit_tokens = 0         # of which served from the cache

    @property
    def num_cached(self) -> int:
        return len(self._by_page)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    def holds(self, page: int) -> bool:
        return page in self._by_page

    def match(self, tokens: list[int], max_pages: int) -> tuple[list[int], list[int]]:
        """The cached pages of the longest cached prefix of `tokens`, at most max_pages of them.

        Returns (pages, node ids), without taking references: call `acquire` before any allocation.
        """
        pages, node_ids, parent = [], [], ROOT
        ps = self.page_size
        for i in range(min(max_pages, len(tokens) // ps)):
            node = self._nodes.get((parent, tuple(tokens[i * ps:(i + 1) * ps])))
            if node is None:
                break
            pages.append(node.page)
            node_ids.append(node.node_id)
            parent = node.node_id
        return pages, node_ids

    def acquire(self, pages: list[int]) -> None:
        """A request starts using these cached pages."""
        for p in pages:
            self._evictable.pop(p, None)
        self.allocator.incref(pages)

    def num_evictable_in(self, pages: list[int]) -> int:
        return sum(p in self._evictable for p in pages)

    def insert(self, parent_id: int, page_tokens: list[int], page: int) -> int:
        """Offer a request's full, computed page; returns the node id that continues its chain.

        When the same prefix is cached already (another request computed it at the same time),
        the existing node is kept and the request's page stays private.
        """
        key = (parent_id, tuple(page_tokens))
        node = self._nodes.get(key)
        if node is None:
            if page in self._by_page:
                raise RuntimeError(f"page {page} is cached already under another prefix")
            node = _Node(self._next_id, key, page)
            self._next_id += 1
            self._nodes[key] = node
            self._by_page[page] = node
            self.allocator.incref([page])
        return node.node_id

    def release(self, pages: list[int]) -> None:
        """A request stops using its pages (given in block-table order): drop its references;
        cached pages left with only the cache's reference become evictable, deepest first."""
        self.allocator.free(pages)
        for p in reversed(pages):
            if p in self._by_page and self.allocator.refcount(p) == 1:
                self._evictable[p] = None
                self._evictable.move_to_end(p)

    def evict(self, n: int) -> int:
        """Free up to n evictable pages, least recently released first. Returns how many."""
        freed = 0
        while freed < n and self._evictable:
            page, _ = self._evictable.popitem(last=False)
            node = self._by_page.pop(page)
            del self._nodes[node.key]
            self.allocator.free([page])
            freed += 1
        return freed

    def clear(self) -> None:
        """Evict everything evictable (pages in use stay cached)."""
        self.evict(len(self._evictable))
