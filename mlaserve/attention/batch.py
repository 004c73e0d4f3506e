"""What one model step attends over: the batch layout every backend plans from.

The runner describes a step by, per request, how many tokens are already cached,
how many new tokens it brings and its block table. `BatchLayout.build` turns that
into the device tensors all backends share; a backend's `plan` adds its own.
Two kinds of step exist: DECODE (every request brings exactly one new token) and
EXTEND (prefill, chunked prefill, or prefix-cache continuation: any counts).
"""

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

import torch


class ForwardMode(Enum):
    EXTEND = "extend"
    DECODE = "decode"


class KVCache(Protocol):
    """What models and backends need of the paged KV pool (engine/kv_pool.py implements it)."""
    page_size: int

    def kv(self, layer: int) -> torch.Tensor: ...            # [pages, page_size, 576] or uint8 [.., 656]
    def index_k(self, layer: int) -> torch.Tensor: ...       # [pages, page_size, D_I]
    def store_kv(self, layer: int, slots: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor) -> None: ...
    def store_index_k(self, layer: int, slots: torch.Tensor, k: torch.Tensor) -> None: ...
    def gather_kv(self, layer: int, slots: torch.Tensor) -> torch.Tensor: ...  # [n, 576] model dtype


@dataclass
class BatchLayout:
    """Host lists (# on cpu) and the device tensors derived from them (# on device).

    Tokens are laid out request by request: T = sum(extend_lens).
    """
    mode: ForwardMode
    page_size: int
    prefix_lens: list[int]          # on cpu: tokens already cached before this step, per request
    extend_lens: list[int]          # on cpu: new tokens this step, per request
    block_tables: list[list[int]]   # on cpu: page ids per request, covering prefix + new tokens
    positions: torch.Tensor         # on device, int64 [T]: position of each new token
    slot_mapping: torch.Tensor      # on device, int64 [T]: cache slot each new token is written to
    block_table: torch.Tensor       # on device, int32 [b, max_pages]
    cache_seqlens: torch.Tensor     # on device, int32 [b]: prefix + new tokens
    token_block_table: torch.Tensor  # on device, int32 [T, max_pages]: each new token's request's block table
    token_seqlens: torch.Tensor     # on device, int32 [T]: position + 1 (what each token sees, causally)
    cu_seqlens_q: torch.Tensor      # on device, int32 [b + 1]: offsets of each request's tokens
    # EXTEND only (None in DECODE): every request's whole context, for the MHA form of prefill
    context_slots: torch.Tensor | None = None   # on device, int64 [sum(seq_lens)]: slots of prefix + new tokens
    cu_seqlens_k: torch.Tensor | None = None    # on device, int32 [b + 1]: offsets into context_slots

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]

    @staticmethod
    def build(prefix_lens: list[int], extend_lens: list[int], block_tables: list[list[int]],
              page_size: int, device: torch.device | str, mode: ForwardMode | None = None) -> "BatchLayout":
        if not (len(prefix_lens) == len(extend_lens) == len(block_tables)):
            raise ValueError(f"prefix_lens ({len(prefix_lens)}), extend_lens ({len(extend_lens)}) and "
                             f"block_tables ({len(block_tables)}) must have one entry per request")
        for i, (p, e, bt) in enumerate(zip(prefix_lens, extend_lens, block_tables)):
            if e < 1 or p < 0 or len(bt) * page_size < p + e:
                raise ValueError(f"request {i}: prefix {p}, extend {e} and {len(bt)} pages of {page_size} "
                                 f"do not fit")
        if mode is None:
            mode = ForwardMode.DECODE if all(e == 1 for e in extend_lens) else ForwardMode.EXTEND
        max_pages = max((len(bt) for bt in block_tables), default=0)
        table = torch.zeros(len(block_tables), max(max_pages, 1), dtype=torch.int32)
        for i, bt in enumerate(block_tables):
            table[i, :len(bt)] = torch.tensor(bt, dtype=torch.int32)
        positions = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix_lens, extend_lens)]) \
            if extend_lens else torch.zeros(0, dtype=torch.int64)
        req_of_token = torch.repeat_interleave(torch.arange(len(extend_lens)),
                                               torch.tensor(extend_lens, dtype=torch.int64))
        pages = table[req_of_token, positions // page_size].long()
        slot_mapping = pages * page_size + positions % page_size
        seqlens = torch.tensor([p + e for p, e in zip(prefix_lens, extend_lens)], dtype=torch.int32)
        cu = torch.zeros(len(extend_lens) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(extend_lens, dtype=torch.int32), 0)
        to = dict(device=device, non_blocking=True)
        context_slots = cu_k = None
        if mode is ForwardMode.EXTEND:
            ctx = [torch.arange(n) for n in seqlens.tolist()]
            ctx_req = torch.repeat_interleave(torch.arange(len(ctx)), seqlens.long())
            ctx_pos = torch.cat(ctx) if ctx else torch.zeros(0, dtype=torch.int64)
            context_slots = (table[ctx_req, ctx_pos // page_size].long() * page_size + ctx_pos % page_size).to(**to)
            cu_k = torch.zeros(len(ctx) + 1, dtype=torch.int32)
            cu_k[1:] = torch.cumsum(seqlens, 0)
            cu_k = cu_k.to(**to)
        return BatchLayout(
            mode=mode, page_size=page_size, prefix_lens=list(prefix_lens), extend_lens=list(extend_lens),
            block_tables=[list(bt) for bt in block_tables],
            positions=positions.to(**to), slot_mapping=slot_mapping.to(**to), block_table=table.to(**to),
            cache_seqlens=seqlens.to(**to), token_block_table=table[req_of_token].to(**to),
            token_seqlens=(positions + 1).to(torch.int32).to(**to), cu_seqlens_q=cu.to(**to),
            context_slots=context_slots, cu_seqlens_k=cu_k)


@dataclass
class ForwardBatch:
    """Everything a model's forward needs besides its weights, passed explicitly to every layer."""
    input_ids: torch.Tensor          # on device, int64 [T]
    layout: BatchLayout
    kv_cache: KVCache
    dense: Any                       # the AttentionBackend for MLA over the whole cache
    sparse: Any = None               # the AttentionBackend for DSA (indexer + sparse MLA); None for dense models
    dense_meta: Any = None           # what dense.plan(layout) returned
    sparse_meta: Any = None          # what sparse.plan(layout) returned
    extras: dict = field(default_factory=dict)

    @property
    def positions(self) -> torch.Tensor:
        return self.layout.positions
