"""The paged KV cache: per-layer latent pools, the DSA indexer-key pool, and the page allocator.

Slot id = page * page_size + offset. Page 0 is never handed out: padded batch entries
(CUDA graphs) write there harmlessly.
"""

import torch

from mlaserve.kernels import fp8_format

KV_CACHE_DTYPES = ("auto", "fp8_e4m3")


class PageAllocator:
    """Free list with reference counts, so that the prefix cache can share full pages.

    Verbs: can_allocate / allocate, incref, free (decref; a page returns to the free list at zero).
    """

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))   # pop() hands out low ids first
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            if self._refs[p] <= 0:
                raise RuntimeError(f"incref of free page {p}")
            self._refs[p] += 1

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if self._refs[p] <= 0:
                raise RuntimeError(f"double free of page {p}")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def refcount(self, page: int) -> int:
        return self._refs[page]


class KVPool:
    """Per-layer latent KV `[num_pages, page_size, kv_lora_rank + rope_dim]` in the model dtype,
    or uint8 `[num_pages, page_size, 656]` with kv_cache_dtype="fp8_e4m3"; for DSA models also the
    indexer keys `[num_pages, page_size, index_head_dim]` in the model dtype."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_lora_rank: int, rope_dim: int,
                 dtype: torch.dtype, device: torch.device | str, kv_cache_dtype: str = "auto",
                 index_head_dim: int | None = None):
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.fp8 = kv_cache_dtype == "fp8_e4m3"
        if self.fp8 and (kv_lora_rank, rope_dim) != (fp8_format.KV_LORA_RANK, fp8_format.ROPE_DIM):
            raise ValueError(f"kv_cache_dtype=fp8_e4m3 needs kv_lora_rank={fp8_format.KV_LORA_RANK} and "
                             f"qk_rope_head_dim={fp8_format.ROPE_DIM}; this model has {kv_lora_rank} and {rope_dim}")
        self.page_size = page_size
        self.num_pages = num_pages
        self.kv_lora_rank = kv_lora_rank
        self.dtype = dtype
        self.allocator = PageAllocator(num_pages)
        width = fp8_format.PACKED_BYTES if self.fp8 else kv_lora_rank + rope_dim
        store = torch.uint8 if self.fp8 else dtype
        self._kv = [torch.zeros(num_pages, page_size, width, dtype=store, device=device)
                    for _ in range(num_layers)]
        self._index_k = [torch.zeros(num_pages, page_size, index_head_dim, dtype=dtype, device=device)
                         for _ in range(num_layers)] if index_head_dim else None

    @staticmethod
    def bytes_per_page(num_layers, page_size, kv_lora_rank, rope_dim, dtype, kv_cache_dtype="auto",
                       index_head_dim=None) -> int:
        """Device bytes one page costs across all layers (for sizing the pool from a memory budget)."""
        elem = torch.tensor([], dtype=dtype).element_size()
        per_token = fp8_format.PACKED_BYTES if kv_cache_dtype == "fp8_e4m3" else (kv_lora_rank + rope_dim) * elem
        if index_head_dim:
            per_token += index_head_dim * elem
        return num_layers * page_size * per_token

    def kv(self, layer: int) -> torch.Tensor:
        return self._kv[layer]

    def index_k(self, layer: int) -> torch.Tensor:
        if self._index_k is None:
            raise RuntimeError("this KV pool has no indexer-key pool (not a DSA model)")
        return self._index_k[layer]

    def store_kv(self, layer: int, slots: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor) -> None:
        """slots int64 [T]; ckv [T, kv_lora_rank]; kpe [T, rope_dim]."""
        rows = torch.cat([ckv, kpe], dim=-1)
        rows = fp8_format.quantize(rows) if self.fp8 else rows.to(self.dtype)
        self._kv[layer].view(-1, rows.shape[-1]).index_copy_(0, slots, rows)

    def store_index_k(self, layer: int, slots: torch.Tensor, k: torch.Tensor) -> None:
        """slots int64 [T]; k [T, index_head_dim]."""
        cache = self.index_k(layer)
        cache.view(-1, cache.shape[-1]).index_copy_(0, slots, k.to(cache.dtype))

    def gather_kv(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """slots int64 [n] -> [n, kv_lora_rank + rope_dim] in the model dtype (dequantized if FP8)."""
        cache = self._kv[layer]
        rows = cache.view(-1, cache.shape[-1])[slots]
        return fp8_format.dequantize(rows, self.dtype) if self.fp8 else rows
