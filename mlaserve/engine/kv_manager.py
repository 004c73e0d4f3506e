"""Pages for requests: admission with prefix-cache hits, growth, release, and leak accounting.

Verbs: `plan_admission` / `admit`, `can_grow` / `grow`, `cache_computed`, `release`.
Allocation evicts unreferenced cached pages (LRU) when the free list runs short, so
"available" pages are the free ones plus the evictable ones.
"""

from dataclasses import dataclass

from mlaserve.engine.kv_pool import PageAllocator
from mlaserve.engine.prefix_cache import ROOT, PrefixCache
from mlaserve.engine.request import Request


@dataclass
class AdmissionPlan:
    hit_pages: list[int]        # cached pages for the request's leading tokens
    hit_nodes: list[int]
    new_pages: int              # pages to allocate for the rest of its tokens


class KVManager:
    def __init__(self, allocator: PageAllocator, page_size: int, enable_prefix_caching: bool):
        self.allocator = allocator
        self.page_size = page_size
        self.cache = PrefixCache(allocator, page_size) if enable_prefix_caching else None

    @property
    def capacity_pages(self) -> int:
        return self.allocator.num_pages - 1       # page 0 is reserved

    @property
    def num_available(self) -> int:
        """Pages an allocation can get: free plus cached-but-unreferenced (evictable)."""
        return self.allocator.num_free + (self.cache.num_evictable if self.cache else 0)

    @property
    def num_used(self) -> int:
        """Pages that requests hold (cached-but-unreferenced pages count as free)."""
        return self.capacity_pages - self.num_available

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def plan_admission(self, req: Request, use_cache: bool) -> tuple[AdmissionPlan, int]:
        """What admitting `req` would take -> (plan, pages it would consume from `num_available`)."""
        hit_pages, hit_nodes = [], []
        if self.cache is not None and use_cache:
            # Leave at least one token to compute: its logits give the next token.
            hit_pages, hit_nodes = self.cache.match(req.tokens, (len(req.tokens) - 1) // self.page_size)
        new_pages = self.pages_for(len(req.tokens)) - len(hit_pages)
        revived = self.cache.num_evictable_in(hit_pages) if self.cache is not None else 0
        return AdmissionPlan(hit_pages, hit_nodes, new_pages), new_pages + revived

    def admit(self, req: Request, plan: AdmissionPlan) -> None:
        """Give `req` its cached prefix and fresh pages for all its other tokens."""
        if self.cache is not None and plan.hit_pages:
            self.cache.acquire(plan.hit_pages)
        req.pages = plan.hit_pages + self._allocate(plan.new_pages)
        req.cache_nodes = list(plan.hit_nodes)
        req.num_computed = len(plan.hit_pages) * self.page_size

    def can_grow(self, req: Request, num_tokens: int) -> bool:
        return self.pages_for(num_tokens) - len(req.pages) <= self.num_available

    def grow(self, req: Request, num_tokens: int) -> None:
        """Make `req`'s pages cover `num_tokens` tokens."""
        need = self.pages_for(num_tokens) - len(req.pages)
        if need > 0:
            req.pages += self._allocate(need)

    def _allocate(self, n: int) -> list[int]:
        short = n - self.allocator.num_free
        if short > 0 and self.cache is not None:
            self.cache.evict(short)
        return self.allocator.allocate(n)

    def cache_computed(self, req: Request) -> None:
        """Offer `req`'s full pages whose KV is computed to the prefix cache."""
        if self.cache is None:
            return
        ps = self.page_size
        for i in range(len(req.cache_nodes), req.num_computed // ps):
            parent = req.cache_nodes[-1] if req.cache_nodes else ROOT
            req.cache_nodes.append(self.cache.insert(parent, req.tokens[i * ps:(i + 1) * ps], req.pages[i]))

    def release(self, req: Request) -> None:
        """`req` gives up all its pages (finished, aborted or preempted)."""
        if self.cache is not None:
            self.cache.release(req.pages)
        else:
            self.allocator.free(req.pages)
        req.pages, req.cache_nodes, req.num_computed = [], [], 0

    def leaked_pages(self) -> list[int]:
        """When no request holds pages: pages neither free nor held by the prefix cache alone."""
        def owners_allowed(p):     # the cache's own reference, for a page it holds
            return 1 if self.cache is not None and self.cache.holds(p) else 0
        return [p for p in range(1, self.allocator.num_pages) if self.allocator.refcount(p) > owners_allowed(p)]
