"""Host-side planning of the Triton MLA decode (kernels/triton/mla_decode.py): launch configs,
the KV split count from shapes (CUDA-graph safe) or, where the caller has them on the host, from the requests'
lengths too (`balanced_splits`), and the split workspace."""

import functools
import heapq
from dataclasses import dataclass
from typing import Sequence

import torch
import triton

_MAX_SPLITS = 128


@dataclass(frozen=True)
class MLADecodeConfig:
    """Kernel knobs (all compile-time except min_split_tokens and max_splits)."""
    block_h: int = 64            # query rows (heads x new tokens) per program: 16, 32, 64; 128 with v_split=2
    block_n: int = 64            # cached tokens per step
    v_split: int = 1             # programs per query block, each owning 1/v_split of V: 1 or 2
    num_warps: int = 8
    num_stages: int = 2          # software pipelining: KV tiles in flight (wgmma: num_stages, mma.sync: - 1)
    min_split_tokens: int = 256  # a KV split streams at least this many tokens (caps the split count)
    max_splits: int = _MAX_SPLITS  # at most this many KV splits per request (the combine loads up to 128 at once)
    lazy_rescale: bool = False   # rescale the accumulators only when a row's max grows by > 2^8
    gluon: bool = False          # a Gluon kernel (TMA, wgmma, a producer warp) where one runs on Hopper with
                                 # page-64 caches: mla_decode_gluon.py in 64-row blocks (bf16 or FP8 KV),
                                 # mla_decode_gluon_narrow.py for <= 32 rows in 16/32-row blocks; else tl
    fp8_mma_min_pages: int = 0   # FP8 KV, <= 16 rows, gluon: FP8 tensor-core MMAs on the e4m3 bytes
                                 # (mla_decode_gluon_fp8mma.py) when each split spans at least this many pages
                                 # (block_table columns / splits); 0 = never

    def __post_init__(self):
        for name in ("block_h", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        if self.v_split not in (1, 2):
            raise ValueError(f"v_split must be 1 or 2, got {self.v_split}")
        if self.gluon and (self.block_h not in (16, 32, 64)
                           or (self.block_n, self.v_split, self.num_warps) != (64, 1, 8)):
            raise ValueError(f"gluon takes block_h 16, 32 or 64, block_n 64, v_split 1, num_warps 8 (its tl fallback "
                             f"launches the same grid), got {self}")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1 or self.min_split_tokens < 1:
            raise ValueError(f"bad num_warps/num_stages/min_split_tokens in {self}")
        if self.fp8_mma_min_pages < 0:
            raise ValueError(f"fp8_mma_min_pages must be >= 0, got {self.fp8_mma_min_pages}")
        if not 1 <= self.max_splits <= _MAX_SPLITS:
            raise ValueError(f"max_splits must be in [1, {_MAX_SPLITS}], got {self.max_splits}")


# Default configs by (query rows per request = s_q * h, rounded up to a bucket; KV kind): the winners of
# scripts/tune_mla_decode.py's H200 sweep (bench/results/tune-mla-decode-h200-2026-11-30.json) for the tl
# kernel, and the Gluon kernels where they measured faster (bench/NOTES.md items 27, 35, 37):
# - 17-32 rows, bf16 and FP8 KV: the same keys-on-M kernel with N = 32, bf16 1.25-1.39x the tl kernel and
#   1.14x the 64-row Gluon kernel it replaced at h 32 (b 128 s_k 32768: 1235 against 1411 us), FP8 0.80-0.92x
#   its bf16 over the check script and the bench (the tl kernel's FP8 ran at 0.45x); bf16 steps whose splits
#   span >= 32 pages take the 64-row seesaw instead (decode_config, SEESAW_32_MIN_PAGES);
# - up to 16 rows, bf16 and FP8 KV: the keys-on-M Gluon kernel (mla_decode_gluon_narrow.py), 1.06-1.14x the
#   tl kernel's 87-96% of copy bandwidth with bf16 KV (scripts/gluon_narrow_check.py), FP8 KV (a third
#   warpgroup dequantizing into two bf16 tiles) 1.02-1.10x its bf16; the tl config below is its fallback off
#   Hopper. With bf16 KV at most 64 splits: b 1 h 16 s_k 32768 ran 30.8 us with 64
#   against 34.0 with 128 (scripts/split_sweep.py); b 4/16 and FP8 KV keep their one-wave counts. FP8 KV where
#   a split spans >= 32 pages: the FP8-MMA kernel (mla_decode_gluon_fp8mma.py, no dequantize), 1.10-1.15x the
#   dequantizing warpgroup at b 128 s_k 4k-32k and b 16 s_k 32k (1.29-1.39x bf16 in the 67b218e benchmark); at
#   8 pages a split (b 1 at s_k 32768) its fixed cost loses (0.80x), so short steps keep the dequantizing
#   warpgroup (scripts/fp8mma_check.py, bench/NOTES.md items 48-49, 88), as do split steps of < 32 pages a split
#   and s_q > 1 (uses_fp8_mma);
# - from 33 rows, bf16 KV: the 64-row Gluon kernel (TMA ring, producer warp, wgmma), 1.24-1.64x the tl kernel
#   at h 64/128 (scripts/gluon_check.py), as the seesaw of mla_decode_gluon_seesaw.py (two warpgroups on
#   alternate pages, 1.07-1.19x the serial page chain; bench/NOTES.md item 80);
# - from 33 rows, FP8 KV: the 64-row Gluon kernel too, each page dequantized into one bf16 tile before S
#   (bench/NOTES.md item 42); the tl kernel ran FP8 there at 0.44x its bf16.
_ROW_BUCKETS = (16, 32, 64, 128, 256)
DEFAULT_CONFIGS: dict[tuple[int, str], MLADecodeConfig] = {
    (16, "bf16"): MLADecodeConfig(block_h=16, block_n=64, v_split=1, num_warps=8, num_stages=3, gluon=True,
                                  max_splits=64),
    (32, "bf16"): MLADecodeConfig(block_h=32, block_n=64, v_split=1, num_warps=8, num_stages=3, gluon=True),
    (64, "bf16"): MLADecodeConfig(block_h=64, block_n=64, v_split=1, num_warps=8, num_stages=2, gluon=True),
    (128, "bf16"): MLADecodeConfig(block_h=64, block_n=64, v_split=1, num_warps=8, num_stages=2, gluon=True),
    (256, "bf16"): MLADecodeConfig(block_h=64, block_n=64, v_split=1, num_warps=8, num_stages=2, gluon=True),
    (16, "fp8"): MLADecodeConfig(block_h=16, block_n=64, v_split=1, num_warps=8, num_stages=2, gluon=True,
                                 fp8_mma_min_pages=16),
    (32, "fp8"): MLADecodeConfig(block_h=32, block_n=64, v_split=1, num_warps=8, num_stages=2, gluon=True),
    (64, "fp8"): MLADecodeConfig(block_h=64, block_n=64, v_split=1, num_warps=8, num_stages=2, gluon=True),
    (128, "fp8"): MLADecodeConfig(block_h=64, block_n=64, v_split=1, num_warps=8, num_stages=2, gluon=True),
    (256, "fp8"): MLADecodeConfig(block_h=64, block_n=64, v_split=1, num_warps=8, num_stages=2, gluon=True),
}


def uses_fp8_mma(config: MLADecodeConfig, kv_fp8: bool, max_pages: int, num_splits: int, s_q: int = 1) -> bool:
    """Whether a <= 16-row Gluon decode over an FP8 cache takes the FP8-MMA kernel: one new token per request, and
    the step unsplit over at least config.fp8_mma_min_pages pages or split into runs of at least twice that
    (max_pages = the block table's columns; host shapes only, no sync). decode_ab's TRITON_FP8_MMA_OFF on the H200
    against the dequantizing warpgroup beside one compute warpgroup (bench/NOTES.md 84): the FP8-MMA kernel
    1.01-1.03x at b 128 h 16 unsplit from 32 pages, 1.19x at s_k 8192 with variable lengths, level at b 16 (splits of
    64 pages); 0.96x at b 8 (splits of 32), 0.95-0.96x at h 8 s_q 2. After 22d25fa made it 6-13% faster (NOTES 88),
    decode_ab TRITON_FP8_MMA_MIN_PAGES (8 against 32): b 128 s_k 1024 (16 pages) 1.021x, b 8 s_k 32768 and b 32 s_k
    8192 (splits of 32) 1.080/1.077x, b 4 s_k 32768 (splits of 16) 1.017x, b 64 s_k 2048 (2 splits of 16) 0.992x:
    16 takes the first three."""
    need = config.fp8_mma_min_pages * (1 if num_splits == 1 else 2 * num_splits)
    return kv_fp8 and config.fp8_mma_min_pages > 0 and s_q == 1 and max_pages >= need


def default_config(rows: int, kv_fp8: bool) -> MLADecodeConfig:
    """The table's config for `rows` = s_q * h query rows per request."""
    bucket = next((r for r in _ROW_BUCKETS if rows <= r), _ROW_BUCKETS[-1])
    return DEFAULT_CONFIGS[(bucket, "fp8" if kv_fp8 else "bf16")]


# bf16 KV at 17-32 rows per request on Hopper with page-64 caches: the 64-row seesaw (its rows padded) where each
# of its KV splits spans at least this many pages, the table's keys-on-M kernel (N 32) elsewhere. decode_ab's
# SEESAW_32_ROWS on the H200 (bench/NOTES.md 83): the seesaw 1.02-1.03x at b 128 h 32 s_k 4k-32k unsplit, 1.11x
# at variable lengths, 1.04x at h 16 s_q 2 s_k 4k, 1.03-1.04x at b 16 / b 32 h 32 (8 / 4 splits of 64 pages),
# 1.00-1.02x at 32-page splits (b 8 s_k 32k, b 64 s_k 4k, b 128 s_k 2k) and at 16 pages unsplit; 0.97x at b 4
# (32 splits of 16 pages) and 0.88x at b 1 (128 of 4; both kernels split alike at 17-32 rows), where a split's
# fixed cost weighs more in the seesaw.
SEESAW_32_MIN_PAGES = 32


def decode_config(b: int, s_q: int, h: int, max_pages: int, page_size: int, kv_fp8: bool,
                  device: torch.device) -> MLADecodeConfig:
    """The config `plan_mla_decode` takes for a step of b requests (host shapes only): `default_config`'s, but for
    bf16 steps of 17-32 rows on Hopper that the 64-row seesaw runs faster (SEESAW_32_MIN_PAGES)."""
    rows = s_q * h
    config = default_config(rows, kv_fp8)
    if kv_fp8 or not 16 < rows <= 32 or page_size != 64 or not _is_hopper(device):
        return config
    wide = DEFAULT_CONFIGS[(64, "bf16")]
    splits = choose_num_splits(b, s_q, h, max_pages, page_size, device, wide)
    return wide if max_pages >= SEESAW_32_MIN_PAGES * splits else config


@functools.lru_cache(maxsize=None)
def _is_hopper(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # the CPU interpreter: small, so that tests see splitting happen


def full_wave_splits(programs: int, sms: int, units: int, min_units: int, max_splits: int = _MAX_SPLITS) -> int:
    """KV splits per request for `programs` programs per split, a request's KV being `units` split units
    (the kernel's granularity: KV tiles or pages) of the block table's capacity.

    One split when the programs come near filling the SMs. Otherwise the fewest units per split, at least
    `min_units` (and at most units // min_units splits, so that the last one is not a sliver, and at most
    `max_splits`), that keep every program in one wave (programs x splits <= sms), and then the fewest
    splits of that size, so that no split is left empty: 512 pages at one program -> 128 splits of 4
    pages, at 2 programs 64 of 8 (66 splits would also fit the 132 SMs, but 512 pages cut into 66 runs of
    whole pages are 64 runs of 8 and 2 empty ones). scripts/split_sweep.py on the H200 (b 1/4/16 x
    h 16/64/128, s_k 32768, bench/NOTES.md item 22) measured this count the fastest at all nine shapes for
    the Triton kernel, where the rule it replaces (the smallest count within 85% of the best wave
    efficiency) picked 57, 109 and 29 splits at b 1 h 128, b 1 h 16/64 and b 4 h 16/64, 6-12% slower.
    """
    if programs == 0 or programs >= 0.8 * sms:
        return 1
    cap = min(max_splits, units // max(1, min_units))
    for per in range(max(1, min_units), units + 1):
        n = -(-units // per)
        if n <= cap and programs * n <= sms:
            return n
    return 1


@functools.lru_cache(maxsize=4096)
def choose_num_splits(b: int, s_q: int, h: int, max_pages: int, page_size: int, device: torch.device,
                      config: MLADecodeConfig) -> int:
    """KV splits per request, from shapes only (CUDA-graph safe): `full_wave_splits` over KV tiles of
    `config.block_n` tokens, every split at least `config.min_split_tokens` of the block table's capacity
    (so that pipeline warm-up and the partial outputs the combine reads stay small against the KV) and at most
    `config.max_splits`."""
    programs = b * triton.cdiv(s_q * h, config.block_h) * config.v_split
    return full_wave_splits(programs, _num_sms(device), triton.cdiv(max_pages * page_size, config.block_n),
                            triton.cdiv(config.min_split_tokens, config.block_n), config.max_splits)


# Variable lengths at about one wave of programs (bench/NOTES.md 86): b 128 requests of 16-64 rows run one program
# each, one wave on the H200's 132 SMs, so the longest request sets the step's time (~1.5x the mean with lengths
# uniform in [s/2, 3s/2]) while the SMs of short ones idle. Two KV splits a request and the grid taking the
# requests longest first (work_order.grid_order) let the halves fill those SMs: decode_ab on the H200, s_k 8192
# variable, 1.39x (FP8 h 32 and h 64), 1.34x (FP8 h 16 s_q 2), 1.26x / 1.21x (bf16 h 32 / h 64), 1.20x (FP8 h 16),
# 1.10x (bf16 h 16; 1.45x at FP8 h 64 s_k 32768); at fixed lengths the same splits cost 0.90-0.95x. So the plan
# splits where a list-scheduling estimate of the step says so: the longest-first makespan over the SMs of the
# items (requests, or their halves) in pages, each plus BALANCE_ITEM_PAGES for its start and end, the split
# step's charged BALANCE_SPLIT_COST more for the partials and their combine (which puts fixed lengths at the
# measured 0.92x), and the split taken where it gains BALANCE_MIN_GAIN by that estimate.
BALANCE_SPLITS = True
BALANCE_ITEM_PAGES = 2
BALANCE_SPLIT_COST = 1.08
BALANCE_MIN_GAIN = 1.05
BALANCE_MIN_PAGES = 48    # mean pages a request: below it (unmeasured) no balancing


def lpt_makespan(items: Sequence[float], slots: int) -> float:
    """The time of `items` on `slots` identical workers taken longest first, each to the least loaded worker
    (what a grid of more programs than SMs, ordered longest first, does)."""
    if len(items) <= slots:
        return max(items, default=0)
    loads = [0.0] * slots
    for w in sorted(items, reverse=True):
        heapq.heapreplace(loads, loads[0] + w)
    return max(loads)


def balanced_splits(programs_per_request: int, sms: int, pages: Sequence[int]) -> int:
    """KV splits a request (1 or 2) for a step of requests of `pages` pages each (host lengths) whose programs fit
    one wave (programs <= sms; grids of several waves are ordered longest first instead): 2 where the
    list-scheduling estimate (module comment above) says that halves run the step BALANCE_MIN_GAIN faster."""
    return _balanced_splits(programs_per_request, sms, tuple(pages), BALANCE_SPLITS, BALANCE_ITEM_PAGES,
                            BALANCE_SPLIT_COST, BALANCE_MIN_GAIN, BALANCE_MIN_PAGES)


@functools.lru_cache(maxsize=16)
def _balanced_splits(programs_per_request: int, sms: int, pages: tuple[int, ...], on: bool, item_pages: int,
                     split_cost: float, min_gain: float, min_pages: int) -> int:
    """balanced_splits with its module constants as arguments, cached: the requests' pages stay the same over the
    64 decode steps a page lasts (the estimate is ~0.1 ms of Python at b 128)."""
    b = len(pages)
    if not on or b * programs_per_request > sms or sum(pages) < min_pages * b:
        return 1
    whole = lpt_makespan([p + item_pages for p in pages for _ in range(programs_per_request)], sms)
    halves = [-(-p // 2) + item_pages for p in pages for _ in range(2 * programs_per_request)]
    return 2 if lpt_makespan(halves, sms) * split_cost * min_gain < whole else 1


def plan_num_splits(b: int, s_q: int, h: int, max_pages: int, page_size: int, kv_fp8: bool,
                    device: torch.device | str, seqlens: Sequence[int] | None = None,
                    config: MLADecodeConfig | None = None) -> int:
    """The split count plan_mla_decode takes (without making its workspace): from shapes (`choose_num_splits`),
    and where that is one split and the host lengths are given, `balanced_splits`."""
    device = _plan_device(device)
    config = config or decode_config(b, s_q, h, max_pages, page_size, kv_fp8, device)
    if seqlens is not None and len(seqlens) != b:
        raise ValueError(f"seqlens must have b = {b} entries, got {len(seqlens)}")
    num_splits = choose_num_splits(b, s_q, h, max_pages, page_size, device, config)
    if num_splits == 1 and seqlens is not None:
        per = triton.cdiv(s_q * h, config.block_h) * config.v_split
        num_splits = balanced_splits(per, _num_sms(device), [-(-int(n) // page_size) for n in seqlens])
    return num_splits


def _plan_device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())   # so that "cuda" equals "cuda:0" in caches
    return device


@dataclass
class MLADecodePlan:
    """What one `mla_decode` launch needs besides its inputs; built on the host by `plan_mla_decode`."""
    config: MLADecodeConfig
    num_splits: int
    max_batch: int                       # the batch sizes this plan serves: 0 < b <= max_batch
    rows: int                            # s_q * h
    head_dim_v: int
    partial_out: torch.Tensor | None     # on device, fp32 [max_batch, num_splits, rows, head_dim_v]; None if 1 split
    partial_lse: torch.Tensor | None     # on device, fp32 [max_batch, num_splits, rows]


def workspace_numel(b: int, rows: int, head_dim_v: int, num_splits: int) -> int:
    """float32 elements of the split workspace (0 with one split)."""
    return 0 if num_splits == 1 else b * num_splits * rows * (head_dim_v + 1)


def plan_mla_decode(b: int, s_q: int, h: int, head_dim_v: int, max_pages: int, page_size: int, kv_fp8: bool,
                    device: torch.device | str, num_splits: int | None = None, config: MLADecodeConfig | None = None,
                    workspace: torch.Tensor | None = None, seqlens: Sequence[int] | None = None) -> MLADecodePlan:
    """Host work for a decode step: config, split count and the split workspace.

    `workspace` (fp32, flat, at least `workspace_numel` elements) lets several plans share one
    static buffer (CUDA graphs); without it the workspace is allocated here. `seqlens`: the b requests' cached
    tokens (new ones included) on the host, where the caller has them (as FlashInfer's plan takes them): the
    split count may then balance variable lengths (`balanced_splits`); the plan then serves steps of those
    lengths (or as varied), not a CUDA graph replayed over any.
    """
    device = _plan_device(device)
    rows = s_q * h
    config = config or decode_config(b, s_q, h, max_pages, page_size, kv_fp8, device)
    if num_splits is None:
        num_splits = plan_num_splits(b, s_q, h, max_pages, page_size, kv_fp8, device, seqlens, config)
    if not 1 <= num_splits <= 4 * _MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {4 * _MAX_SPLITS}], got {num_splits}")
    partial_out = partial_lse = None
    need = workspace_numel(b, rows, head_dim_v, num_splits)
    if need:
        if workspace is None:
            workspace = torch.empty(need, dtype=torch.float32, device=device)
        elif workspace.dtype != torch.float32 or workspace.numel() < need or workspace.device != device:
            raise ValueError(f"workspace must be float32 on {device} with >= {need} elements, got "
                             f"{workspace.dtype} on {workspace.device} with {workspace.numel()}")
        n_out = b * num_splits * rows * head_dim_v
        partial_out = workspace[:n_out].view(b, num_splits, rows, head_dim_v)
        partial_lse = workspace[n_out:need].view(b, num_splits, rows)
    return MLADecodePlan(config, num_splits, b, rows, head_dim_v, partial_out, partial_lse)
