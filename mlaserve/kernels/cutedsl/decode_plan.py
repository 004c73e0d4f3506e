"""Paged MLA decode for Hopper in CuTe DSL: the host work before a launch (shape checks, split counts, the
split workspace, the persistent launches' buffers). Nothing here imports the DSL or touches a GPU but the
buffers' allocation, so the `cutedsl_mla` backend plans (and tests/test_cutedsl_backend.py checks) without it.

Planning is the Triton kernel's (kernels/triton/mla_decode_plan.py): the split count from shapes only and the
same workspace layout, with this kernel's 64-row tiles, so a step planned on the host launches without host
work and can be captured in a CUDA graph. mla_decode.py, the launch, takes these names into its own namespace:
the `triton` attention backend's code calls them on it.
"""

import torch
import triton

from mlaserve.kernels import fp8_format
from mlaserve.kernels.cutedsl.common import D_QK, HEAD_DIM_V, check_query
from mlaserve.kernels.triton import stream_k
from mlaserve.kernels.triton.mla_decode_plan import MLADecodeConfig, MLADecodePlan
from mlaserve.kernels.triton.mla_decode_plan import _num_sms, balanced_splits, full_wave_splits
from mlaserve.kernels.triton.mla_decode_plan import plan_mla_decode as _plan_mla_decode

TILE_M = 64
PAGE_SIZE = 64
MAX_BATCH = 65535      # the batch rides on the grid's z axis

# What choose_num_splits needs to know of this kernel: 64-row tiles, one program per tile and split,
# splits of at least 256 tokens (num_warps/num_stages are the Triton kernel's knobs, unused here).
# fp8_mma_min_pages: the FP8-MMA kernel (mla_decode_fp8_mma_kernel.py) where each split spans >= 48 pages (triton's
# rule for its Gluon FP8-MMA kernel, uses_fp8_mma, with this kernel's bound: mla_decode.FP8_MMA's comment)
CONFIG = MLADecodeConfig(block_h=TILE_M, block_n=PAGE_SIZE, v_split=1, min_split_tokens=256, fp8_mma_min_pages=48)


def check_supported(q_shape, q_dtype: torch.dtype, kv_shape, kv_dtype: torch.dtype, head_dim_v: int) -> None:
    """Raise ValueError naming the values when this kernel cannot take these shapes/dtypes."""
    check_query("cutedsl MLA decode", q_shape, q_dtype, head_dim_v)
    if kv_dtype == torch.uint8:
        _check_fp8(q_dtype, kv_shape)
    else:
        if kv_dtype != q_dtype:
            raise ValueError(f"kv_cache dtype {kv_dtype} must match q dtype {q_dtype}")
        if len(kv_shape) != 3 or kv_shape[1] != PAGE_SIZE or kv_shape[2] != D_QK:
            raise ValueError(f"the cutedsl MLA decode needs kv_cache [pages, {PAGE_SIZE}, {D_QK}] (page size "
                             f"{PAGE_SIZE}), got shape {tuple(kv_shape)}")
    if q_shape[0] > MAX_BATCH:
        raise ValueError(f"the cutedsl MLA decode takes at most {MAX_BATCH} requests, got {q_shape[0]}")


# -- FP8 KV (the mla_decode_fp8_*_kernel.py kernels): uint8 [pages, 64, 656], bf16 q and out --

def _check_fp8(q_dtype: torch.dtype, kv_shape) -> None:
    """The FP8 kernel's own limits: bf16 q (the dequantized tile is bf16) and page size 64."""
    if q_dtype != torch.bfloat16:
        raise ValueError(f"the cutedsl MLA decode takes bf16 q with an FP8 KV cache, got {q_dtype}")
    if len(kv_shape) != 3 or kv_shape[1] != PAGE_SIZE or kv_shape[2] != fp8_format.PACKED_BYTES:
        raise ValueError(f"the cutedsl MLA decode needs an FP8 kv_cache uint8 [pages, {PAGE_SIZE}, "
                         f"{fp8_format.PACKED_BYTES}] (page size {PAGE_SIZE}), got shape {tuple(kv_shape)}")


def default_config(rows: int, kv_fp8: bool) -> MLADecodeConfig:
    """The one config (the triton backend asks per row count and KV kind)."""
    return CONFIG


def decode_config(b: int, s_q: int, h: int, max_pages: int, page_size: int, kv_fp8: bool,
                  device: torch.device) -> MLADecodeConfig:
    """The config of a step (the triton backend asks per step's shapes): the one config."""
    return CONFIG


def choose_num_splits(b: int, s_q: int, h: int, max_pages: int, page_size: int, device: torch.device,
                      config: MLADecodeConfig = CONFIG) -> int:
    """KV splits per request from shapes only (CUDA-graph safe): `full_wave_splits` over pages (one CTA fits
    an SM: 227 KB of smem), every split at least 4 pages of the block table's capacity for requests of <= 32
    query rows and 8 pages for the 64-row tiles.

    scripts/split_sweep.py --backend cutedsl on the H200 (b 1/4/16 x h 16/64/128, s_k 32768, bench/NOTES.md
    item 22): this count, or one with the same runs of pages, was the fastest at all nine shapes; e.g. b 1
    h 128 took 40.0 us at 64 splits of 8 pages and 42.8 us at the 66 of the previous rule (as many as fit
    one wave: 64 runs of 8 pages and 2 empty splits); b 1 h 64 34.1 us at 8 pages a split, 36.5 at 4.
    """
    rows = s_q * h
    min_pages = triton.cdiv(CONFIG.min_split_tokens * (1 if rows <= 32 else 2), PAGE_SIZE)
    return full_wave_splits(b * triton.cdiv(rows, TILE_M), _num_sms(device), max_pages * page_size // PAGE_SIZE,
                            min_pages)


# Variable lengths at <= 64 rows a request: b <= the SMs' requests are a grid of one wave (no persistent launch, so
# no stream-K), and the longest request sets the step. With the step's host lengths, two KV splits a request where
# triton's estimate says the halves balance the SMs (mla_decode_plan.balanced_splits, bench/NOTES.md 86: 1.10-1.46x
# for triton's kernels, whose split grids also take the requests longest first; these kernels' split grids run in
# request order unless GRID_ORDER_ALL), for requests of at most BALANCE_SPLITS_MAX_ROWS rows (0: never). On the H200
# (bench/NOTES.md 104-105; decode_ab, b128, lengths 8192 +- 50%): in request order h16 1.035x bf16, 1.054x FP8, h64
# 1.003x, FP8 1.012x, h32 FP8 32k 0.986x; taken longest first (GRID_ORDER_ALL) 1.24-1.34x at h16-h64, bf16 and FP8
BALANCE_SPLITS_MAX_ROWS = 64


def plan_num_splits(b: int, s_q: int, h: int, max_pages: int, page_size: int, kv_fp8: bool,
                    device: torch.device | str, seqlens=None) -> int:
    """The split count plan_mla_decode takes (without making its workspace): from shapes (`choose_num_splits`),
    and, where that is one split of requests of <= BALANCE_SPLITS_MAX_ROWS rows and the host lengths are given,
    `balanced_splits`."""
    device = torch.device(device)
    if seqlens is not None and len(seqlens) != b:
        raise ValueError(f"seqlens must have b = {b} entries, got {len(seqlens)}")
    num_splits = choose_num_splits(b, s_q, h, max_pages, page_size, device)
    if num_splits == 1 and seqlens is not None and s_q * h <= min(BALANCE_SPLITS_MAX_ROWS, TILE_M):
        num_splits = balanced_splits(1, _num_sms(device), [-(-int(n) // page_size) for n in seqlens])
    return num_splits


def plan_mla_decode(b: int, s_q: int, h: int, head_dim_v: int, max_pages: int, page_size: int, kv_fp8: bool,
                    device: torch.device | str, num_splits: int | None = None,
                    config: MLADecodeConfig | None = None, workspace: torch.Tensor | None = None,
                    seqlens=None) -> MLADecodePlan:
    """Host work for a decode step (split count, split workspace), as mla_decode_plan.plan_mla_decode.

    `config` must be None or this kernel's CONFIG (the signature is the Triton planner's). `seqlens` (host lengths):
    two splits a request where they balance a one-wave grid of requests of <= BALANCE_SPLITS_MAX_ROWS rows
    (plan_num_splits); otherwise the split count comes from shapes, and variable lengths are balanced on the GPU
    where a step is persistent (requests taken longest first, stream-K).
    """
    if page_size != PAGE_SIZE or head_dim_v != HEAD_DIM_V:
        raise ValueError(f"the cutedsl MLA decode plans page_size {PAGE_SIZE}, head_dim_v {HEAD_DIM_V}; "
                         f"got page_size {page_size}, head_dim_v {head_dim_v}")
    if config is not None and config != CONFIG:
        raise ValueError(f"the cutedsl MLA decode has one config {CONFIG}, got {config}")
    if num_splits is None:
        num_splits = plan_num_splits(b, s_q, h, max_pages, page_size, kv_fp8, device, seqlens=seqlens)
    if torch.device(device).type == "cuda":
        scheduler_counters(device)
        stream_k_buffers(device)
    return _plan_mla_decode(b, s_q, h, head_dim_v, max_pages, page_size, kv_fp8, device,
                            num_splits=num_splits, config=CONFIG, workspace=workspace)


def cluster_size(rows: int, kv_fp8: bool) -> int:
    """CTAs per cluster: 2 where a request's 64-row tiles pair up (h 128; h 64 with s_q 2), each of the pair
    loading half of every page into both CTAs' smem by TMA multicast; 1 for an odd number of row tiles and
    for FP8 KV (the FP8 kernels load and convert each page per CTA; pairing them is not built).

    A pair reads a page from L2 once instead of twice and runs in step. Measured on the H200 (b 128, s_k
    4k-32k, scripts/cutedsl_check.py --clusters): h 128 s_q 1 +3-5% over unpaired CTAs, s_q 2 +2%, h 64 s_q 2
    +4%; clusters of 4 (h 128 s_q 2) were 7-9% slower than pairs.
    """
    tiles = triton.cdiv(rows, TILE_M)
    return 2 if not kv_fp8 and tiles % 2 == 0 else 1


# the persistent kernel's work-item counters (next ticket, clusters done), int32 [2] per device, zero between
# launches (the last cluster of a launch resets them). Decode steps on one device must not run concurrently on
# two streams: their launches would share the counters.
_counters: dict[torch.device, torch.Tensor] = {}


def scheduler_counters(device: torch.device) -> torch.Tensor:
    """The device's counters, allocated (zeroed) on first use; plan_mla_decode asks for them on the host, so that
    a launch captured in a CUDA graph finds them allocated."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    t = _counters.get(device)
    if t is None:
        t = _counters[device] = torch.zeros(2, dtype=torch.int32, device=device)
    return t


# stream-K launches' buffers per device: the schedule and its flags (int32), the pieces' fp32 partials
_stream_k: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def stream_k_buffers(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(schedule int32, partials fp32) for any persistent launch on the device: room for as many slots as SMs,
    their flags (3 a slot and CTA) and two 64-row partials of O and lse a slot and CTA (35 MB on an H200).
    Allocated on first use; plan_mla_decode asks for them on the host, so that a launch captured in a CUDA
    graph finds them allocated."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    bufs = _stream_k.get(device)
    if bufs is None:
        sms = _num_sms(device)
        bufs = _stream_k[device] = (
            torch.zeros(stream_k.schedule_numel(sms, 3 * sms), dtype=torch.int32, device=device),
            torch.empty(2 * sms * TILE_M * (HEAD_DIM_V + 1), dtype=torch.float32, device=device))
    return bufs
