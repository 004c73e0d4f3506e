"""The paged KV pool, its allocator, and the batch layout built over it."""

import pytest
import torch

from mlaserve.attention.batch import BatchLayout, ForwardMode
from mlaserve.engine.kv_pool import KVPool, PageAllocator
from mlaserve.kernels import fp8_format


def test_allocator_refcounts_and_reserved_page():
    alloc = PageAllocator(5)
    assert alloc.num_free == 4
    pages = alloc.allocate(3)
    assert 0 not in pages and len(set(pages)) == 3
    assert not alloc.can_allocate(2) and alloc.can_allocate(1)
    alloc.incref(pages[:1])
    alloc.free(pages)
    assert alloc.num_free == 3 and alloc.refcount(pages[0]) == 1
    alloc.free(pages[:1])
    assert alloc.num_free == 4
    with pytest.raises(RuntimeError, match="double free of page"):
        alloc.free(pages[:1])
    with pytest.raises(RuntimeError, match="asked for 5 KV pages, 4 free"):
        alloc.allocate(5)
    with pytest.raises(ValueError, match="at least 2 pages"):
        PageAllocator(1)


def test_store_and_gather_round_trip():
    pool = KVPool(num_layers=2, num_pages=6, page_size=4, kv_lora_rank=8, rope_dim=4, dtype=torch.float32,
                  device="cpu", index_head_dim=5)
    slots = torch.tensor([5, 6, 17])
    ckv, kpe, k = torch.randn(3, 8), torch.randn(3, 4), torch.randn(3, 5)
    pool.store_kv(1, slots, ckv, kpe)
    pool.store_index_k(1, slots, k)
    torch.testing.assert_close(pool.gather_kv(1, slots), torch.cat([ckv, kpe], -1))
    torch.testing.assert_close(pool.index_k(1).view(-1, 5)[slots], k)
    assert torch.all(pool.kv(0) == 0)


def test_fp8_pool_stores_the_fp8_format():
    pool = KVPool(1, 3, 2, 512, 64, torch.bfloat16, "cpu", kv_cache_dtype="fp8_e4m3")
    assert pool.kv(0).dtype == torch.uint8 and pool.kv(0).shape == (3, 2, fp8_format.PACKED_BYTES)
    ckv, kpe = torch.randn(2, 512), torch.randn(2, 64)
    pool.store_kv(0, torch.tensor([2, 3]), ckv, kpe)
    want = fp8_format.dequantize(fp8_format.quantize(torch.cat([ckv, kpe], -1)))
    torch.testing.assert_close(pool.gather_kv(0, torch.tensor([2, 3])), want)
    with pytest.raises(ValueError, match="needs kv_lora_rank=512 and qk_rope_head_dim=64; this model has 64 and 16"):
        KVPool(1, 3, 2, 64, 16, torch.bfloat16, "cpu", kv_cache_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        KVPool(1, 3, 2, 64, 16, torch.bfloat16, "cpu", kv_cache_dtype="fp8")


def test_bytes_per_page():
    bf16 = KVPool.bytes_per_page(61, 64, 512, 64, torch.bfloat16)
    fp8 = KVPool.bytes_per_page(61, 64, 512, 64, torch.bfloat16, "fp8_e4m3", index_head_dim=128)
    assert bf16 == 61 * 64 * 1152
    assert fp8 == 61 * 64 * (656 + 256)


def test_batch_layout_extend_and_decode():
    layout = BatchLayout.build(prefix_lens=[0, 5], extend_lens=[3, 2], block_tables=[[7], [2, 4]], page_size=4,
                               device="cpu")
    assert layout.mode is ForwardMode.EXTEND and layout.num_tokens == 5
    assert layout.positions.tolist() == [0, 1, 2, 5, 6]
    assert layout.slot_mapping.tolist() == [28, 29, 30, 17, 18]
    assert layout.cache_seqlens.tolist() == [3, 7]
    assert layout.token_seqlens.tolist() == [1, 2, 3, 6, 7]
    assert layout.token_block_table.tolist() == [[7, 0], [7, 0], [7, 0], [2, 4], [2, 4]]
    assert layout.cu_seqlens_q.tolist() == [0, 3, 5]
    assert layout.context_slots.tolist() == [28, 29, 30, 8, 9, 10, 11, 16, 17, 18]
    assert layout.cu_seqlens_k.tolist() == [0, 3, 10]
    decode = BatchLayout.build([3, 7], [1, 1], [[7], [2, 4]], 4, "cpu")
    assert decode.mode is ForwardMode.DECODE and decode.context_slots is None
    assert decode.slot_mapping.tolist() == [31, 19]
    with pytest.raises(ValueError, match="request 0: prefix 4, extend 1 and 1 pages of 4 do not fit"):
        BatchLayout.build([4], [1], [[7]], 4, "cpu")

