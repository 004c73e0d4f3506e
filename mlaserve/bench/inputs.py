"""Random inputs for the benchmark shapes, with several input sets where they are small.

Every input set shares the paging metadata (block table, lengths, indices) and has its own q and
cache, so that timing rotates through memory the L2 cannot hold. Data are random normal (never
zeros, which run faster); pages are handed out in a random order, as a long-running pool would.
"""

import math
from dataclasses import dataclass

import torch

from mlaserve import ops
from mlaserve.bench.shapes import DenseShape, IndexerShape, SparseShape, kv_row_bytes

# DeepSeek's softmax scale: (qk_nope_head_dim + qk_rope_head_dim)^-0.5 = 192^-0.5.
SOFTMAX_SCALE = 192 ** -0.5
# Random top-k draws are made this many query rows at a time, to bound the [rows, s_kv] random matrix.
_TOPK_DRAW_ELEMS = 1 << 28


@dataclass
class Paging:
    """A paged pool: request i's token p lives in slot block_table[i, p // page_size] * page_size + p % page_size."""
    block_table: torch.Tensor   # on device, int32 [b, max_pages]
    seqlens: torch.Tensor       # on device, int32 [b]
    seqlens_cpu: torch.Tensor   # on cpu, int32 [b]
    num_pages: int
    page_size: int

    @property
    def total_tokens(self) -> int:
        return int(self.seqlens_cpu.sum())

    def slots(self, i: int, positions: torch.Tensor) -> torch.Tensor:
        """int64 slot ids of request i's token positions (int64 tensor on the pool's device)."""
        pages = self.block_table[i, positions // self.page_size].long()
        return pages * self.page_size + positions % self.page_size


@dataclass
class DenseInputs:
    q: list[torch.Tensor]        # per set: [b, s_q, h, d_qk] bf16
    kv: list[torch.Tensor]       # per set: [pages, page_size, d_qk] bf16 or uint8 [pages, page_size, 656]
    paging: Paging
    scale: float


@dataclass
class SparseInputs:
    q: list[torch.Tensor]        # per set: [b, s_q, h, d_qk] bf16
    kv: list[torch.Tensor]       # per set: the pool, as in DenseInputs
    indices: torch.Tensor        # int32 [b, s_q, topk] slot ids
    scale: float


@dataclass
class IndexerInputs:
    q: list[torch.Tensor]        # per set: [b, s_q, H_I, D_I] bf16
    weights: list[torch.Tensor]  # per set: float32 [b, s_q, H_I]
    k_cache: list[torch.Tensor]  # per set: [pages, page_size, D_I] bf16
    paging: Paging


def num_sets(set_bytes: float, rotate_bytes: float, max_sets: int = 4) -> int:
    """Input sets needed so that together they cover `rotate_bytes` (1 when one set already does)."""
    if rotate_bytes <= 0 or set_bytes >= rotate_bytes:
        return 1
    return max(1, min(max_sets, math.ceil(rotate_bytes / set_bytes)))


def make_paging(lens: list[int], page_size: int, device: torch.device, gen: torch.Generator) -> Paging:
    """Pages for requests of `lens` tokens, in random order; page 0 is left unused (as the KV pool does)."""
    pages = [math.ceil(n / page_size) for n in lens]
    num_pages = sum(pages) + 1
    order = (torch.randperm(num_pages - 1, generator=gen) + 1).to(torch.int32)
    table = torch.zeros(len(lens), max(max(pages), 1), dtype=torch.int32)
    start = 0
    for i, n in enumerate(pages):
        table[i, :n] = order[start:start + n]
        start += n
    seqlens = torch.tensor(lens, dtype=torch.int32)
    return Paging(table.to(device), seqlens.to(device), seqlens, num_pages, page_size)


def _randn(shape, device, gen, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(shape, device=device, generator=gen, dtype=dtype)


def make_cache(num_pages: int, page_size: int, d: int, kv: str, device, gen, chunk_pages: int = 4096):
    """A random latent cache, bf16 [pages, page_size, d] or FP8 uint8 [pages, page_size, 656] (quantized in chunks)."""
    if kv == "bf16":
        return _randn((num_pages, page_size, d), device, gen)
    out = torch.empty(num_pages, page_size, kv_row_bytes("fp8"), dtype=torch.uint8, device=device)
    for start in range(0, num_pages, chunk_pages):
        n = min(chunk_pages, num_pages - start)
        out[start:start + n] = ops.quantize_kv_fp8(_randn((n, page_size, d), device, gen))
    return out


def make_dense(shape: DenseShape, device: torch.device, seed: int, rotate_bytes: float) -> DenseInputs:
    gen_cpu = torch.Generator().manual_seed(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    if shape.varlen:
        lens = torch.randint(shape.s_k // 2, shape.s_k * 3 // 2 + 1, (shape.b,), generator=gen_cpu)
        lens = lens.clamp_min(shape.s_q).tolist()
    else:
        lens = [shape.s_k] * shape.b
    paging = make_paging(lens, shape.page_size, device, gen_cpu)
    q_bytes = shape.b * shape.s_q * shape.h * shape.d_qk * 2
    sets = num_sets(paging.num_pages * shape.page_size * kv_row_bytes(shape.kv, shape.d_qk) + q_bytes, rotate_bytes)
    return DenseInputs(
        q=[_randn((shape.b, shape.s_q, shape.h, shape.d_qk), device, gen) for _ in range(sets)],
        kv=[make_cache(paging.num_pages, shape.page_size, shape.d_qk, shape.kv, device, gen) for _ in range(sets)],
        paging=paging, scale=SOFTMAX_SCALE)


def random_topk_positions(rows: int, visible: int, topk: int, device, gen) -> torch.Tensor:
    """int64 [rows, topk]: distinct random positions in [0, visible) per row (all of them when visible <= topk)."""
    k = min(topk, visible)
    step = max(1, _TOPK_DRAW_ELEMS // visible)
    parts = [torch.rand(min(step, rows - r), visible, device=device, generator=gen).topk(k, dim=1).indices
             for r in range(0, rows, step)]
    return torch.cat(parts)


def make_sparse(shape: SparseShape, device: torch.device, seed: int, rotate_bytes: float) -> SparseInputs:
    """Each request owns a pool of s_kv tokens; each of its query tokens picks topk distinct slots of it."""
    gen_cpu = torch.Generator().manual_seed(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    paging = make_paging([shape.s_kv] * shape.b, shape.page_size, device, gen_cpu)
    indices = torch.full((shape.b, shape.s_q, shape.topk), -1, dtype=torch.int32, device=device)
    for i in range(shape.b):
        pos = random_topk_positions(shape.s_q, shape.s_kv, shape.topk, device, gen)     # [s_q, k]
        indices[i, :, :pos.shape[1]] = paging.slots(i, pos).to(torch.int32)
    set_bytes = paging.num_pages * shape.page_size * kv_row_bytes(shape.kv, shape.d_qk) \
        + shape.tokens * shape.h * shape.d_qk * 2
    sets = num_sets(set_bytes, rotate_bytes)
    return SparseInputs(
        q=[_randn((shape.b, shape.s_q, shape.h, shape.d_qk), device, gen) for _ in range(sets)],
        kv=[make_cache(paging.num_pages, shape.page_size, shape.d_qk, shape.kv, device, gen) for _ in range(sets)],
        indices=indices, scale=SOFTMAX_SCALE)


def make_indexer(shape: IndexerShape, device: torch.device, seed: int, rotate_bytes: float) -> IndexerInputs:
    """Requests of s_k cached tokens (the s_q new ones included), keys paged like the latent cache."""
    gen_cpu = torch.Generator().manual_seed(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    paging = make_paging([shape.s_k] * shape.b, shape.page_size, device, gen_cpu)
    set_bytes = paging.num_pages * shape.page_size * shape.dim * 2 + shape.b * shape.s_q * shape.heads * shape.dim * 2
    sets = num_sets(set_bytes, rotate_bytes)
    return IndexerInputs(
        q=[_randn((shape.b, shape.s_q, shape.heads, shape.dim), device, gen) for _ in range(sets)],
        weights=[_randn((shape.b, shape.s_q, shape.heads), device, gen, torch.float32) * shape.heads ** -0.5
                 for _ in range(sets)],
        k_cache=[_randn((paging.num_pages, shape.page_size, shape.dim), device, gen) for _ in range(sets)],
        paging=paging)
