"""The MLA decode over the FP8 656-byte cache with FP8 tensor-core MMAs, for up to 16 query rows per request (h 16
s_q 1, h 8 s_q 2, ...), in Gluon for Hopper: no dequantized tile, the e4m3 bytes go into wgmma as they are. The
triton backend runs it where a KV split spans >= 32 pages (MLADecodeConfig.fp8_mma_min_pages).

Every other FP8 path dequantizes each page into bf16 first, and at <= 32 rows that dequantize, not HBM, bounds the
page chain (bench/NOTES.md items 37-43). Here:
- S^T = K Q^T per scale group g (keys on wgmma's M): K_g is the page's e4m3 [64, 128] box straight from the TMA
  ring (K-major, as FP8 wgmma needs); bf16 Q is split into two e4m3 parts, q * 2^a = hi + lo (a per row, so that
  the row's largest value lands in (128, 256]), which hold every bf16 q exactly but for values 2^-10 below the
  row's largest, stacked on N: one MMA per group reads K_g once for both, [64 keys, 32], and S^T =
  sum_g scale_g(key) * (hi part + lo part) / 2^a + k_pe q_pe^T (a bf16 MMA), in fresh fp32 accumulators.
- O^T_g = V^T_g P_g^T with P_g = P * scale_g(key) * 256 / max_page(scale_g) split into e4m3 hi + lo as well, all
  four groups stored by one shared-memory store, and V^T_g as wgmma's register A operand: a thread loads 4
  contiguous bytes of each of its 16 keys (32-bit loads, no bank conflicts under the 128-byte swizzle: lanes
  c = lane % 4 own keys 2c, 2c + 1 (+ 8 y), lanes r = lane // 4 own columns 4 r .. 4 r + 3 of their warp's 32), and
  byte permutes transpose them into wgmma's A fragments. The columns' order on M and the keys' order on K are
  permuted to make that so (P^T is stored in the same key order, in which a thread's two keys of a row are
  neighbours; the output is un-permuted when stored). Each page's P V lands in a fresh accumulator that is added
  to O in fp32 (FP8 wgmma accumulates with fewer bits than fp32).
- Two compute warpgroups take alternate pages of the split, each with its own softmax state and O, merged through
  shared memory at the end; a producer warp TMA-loads the pages into a 3-stage ring (c_kv in four [64, 128]
  boxes, the scales, k_pe), and a stage is free as soon as S^T is done and V^T is in registers. A scale warp
  takes each landed page's per-group maximum scale off the compute warpgroups' chain (its own barrier per stage).
  hi + lo of P_g are formed in fp16 (11 bits hold both parts' 4).

Values: these MMAs compute on e4m3 * scale exactly (DESIGN.md: value = fp8 * scale), with Q and P carried to
~2^-8 (about bf16's own rounding of P); the dequantizing kernels round each entry to bf16 first (fp8_format).
Rows past the request's end: their bytes are zeroed in the ring stage (0xFF is NaN in e4m3, and 0 * NaN is NaN)
and their scales taken as 0; their scores are masked.

Measured (H200, scripts/fp8mma_check.py, bench/NOTES.md items 48-49), h 16: b 128 s_k 4k/8k/32k 115/230/905 us =
1.12-1.15x the dequantizing warpgroup's FP8 and 1.16-1.22x the bf16 kernel, b 16 s_k 32768 1.10x / 1.20x; it loses
where a split is short (b 1 at s_k 32768, 8 pages a split: 0.80x). Still a page chain of ~1240 instructions per
compute warpgroup, latency-bound: cut-down copies (before the scale warp) ran 38 us faster without the V^T
transposes, 52 without building P^T, 12 without the scales' page maximum (b 128 s_k 8192, 241 us). A third compute
warpgroup (160 registers, spilling) and a fourth ring stage were slower. Nsight Compute then put a quarter of the
compute warps' samples on instruction fetch (bench/NOTES.md 88): each warpgroup runs its own copy of the page loop.
Zeroing a last page's tail in the stage once, instead of masking each group's V^T fragments (the loop 2310 -> 1260
instructions), and the fold in one FFMA: 1.06-1.08x at b 128, 1.13x at b 16."""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                               warpgroup_mma_wait)

from mlaserve.kernels import fp8_format
from mlaserve.kernels.triton.mla_decode_gluon import finish_rows, split_and_visibility
from mlaserve.kernels.triton.mla_decode_gluon_narrow import (_load_partition, fp8_descriptors, softmax_keys_on_m,
                                                              store_columns)

PAGE = gl.constexpr(64)
D_V = gl.constexpr(512)
GROUP = gl.constexpr(128)     # columns per FP8 scale
D_PE = gl.constexpr(64)
ROW_BYTES = gl.constexpr(656)
BLOCK_R = gl.constexpr(16)    # query rows per request: the MMAs' N
LOG2E = gl.constexpr(1.4426950408889634)
Q_RANGE = gl.constexpr(256.0)   # a row of q * 2^a has its largest |value| in (128, 256] (e4m3 max 448)
P_RANGE = gl.constexpr(256.0)   # P_g lands in [0, 256]
STAGES = gl.constexpr(3)
MAX_ROWS = 16


@gluon.jit
def _v_fragments(kv, g: gl.constexpr, LD: gl.constexpr, AL: gl.constexpr):
    """V^T of scale group g of ring stage `kv` as wgmma's register A operand: e4m3 [128 columns, 64 keys], both
    in the permuted order (columns: logical m = 64 mt + 16 w + 8 h + r is column 32 w + 4 r + 2 mt + h of the
    group; keys: logical k = 32 ks + 16 j + 4 c + 2 x + i is key 8 (4 ks + 2 j + i) + 2 c + x, so that the two
    keys a thread holds per row of S^T, 8 apart, are neighbours in P^T). Keys past the request's end are 0 in
    the stage by now (_zero_tail)."""
    x = kv.slice(g * GROUP, GROUP, dim=1).load(LD).to(gl.uint8, bitcast=True)     # [64 keys, 128 columns]
    x = gl.reshape(x, [2, 2, 2, 4, 2, 4, 8, 2, 2])       # keys (ks, j, i, c, x), columns (w, r, mt, h)
    x = gl.permute(x, [7, 5, 8, 6, 0, 1, 3, 4, 2])       # (mt, w, h, r), (ks, j, c, x, i)
    x = gl.reshape(x, [GROUP, PAGE])
    return gl.convert_layout(x.to(gl.float8e4nv, bitcast=True), AL)


@gluon.jit
def _hi_lo(p, f):
    """P_g = p * f (per key) as e4m3 hi + lo, stacked on N: [64 keys, 32] (hi rows 0-15, lo 16-31)."""
    pg = (p * f[:, None]).to(gl.float16)          # 11 bits hold hi's 4 and lo's 4
    hi = pg.to(gl.float8e4nv)
    lo = (pg - hi.to(gl.float16)).to(gl.float8e4nv)
    return gl.reshape(gl.permute(gl.join(hi, lo), [0, 2, 1]), [PAGE, 2 * BLOCK_R])


@gluon.jit
def _store_p(p, s0, s1, s2, s3, g0, g1, g2, g3, dst):
    """The four groups' P_g = P * scale_g / max scale_g * 256, e4m3 hi + lo, into dst [128, 64] in one store (group
    g's hi in rows 32 g .. + 15, its lo in the next 16), the keys in _v_fragments' order."""
    x = gl.join(gl.join(_hi_lo(p, s0 * (P_RANGE / g0)), _hi_lo(p, s1 * (P_RANGE / g1))),
                gl.join(_hi_lo(p, s2 * (P_RANGE / g2)), _hi_lo(p, s3 * (P_RANGE / g3))))   # [64, 32, g0, g1]
    x = gl.reshape(x, [2, 2, 2, 4, 2, 2 * BLOCK_R, 2, 2])          # keys (ks, j, i, c, x), n, g bit 0, g bit 1
    x = gl.permute(x, [7, 6, 5, 0, 1, 3, 4, 2])                     # g, n, keys (ks, j, c, x, i)
    dst.store(gl.reshape(x, [8 * BLOCK_R, PAGE]))


@gluon.jit
def _group_scores(kv, q8_smem, z, g: gl.constexpr, zero):
    """Scale group g's K_g [hi; lo]^T ([64 keys, 32]) in a fresh accumulator (z = 0, opaque to the compiler)."""
    return warpgroup_mma(kv.slice(g * GROUP, GROUP, dim=1), q8_smem.index(z).slice(g * GROUP, GROUP, dim=1).permute(
        (1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def _hi_plus_lo(acc, L: gl.constexpr):
    """[64, 32] (hi columns 0-15, lo 16-31) -> their sum [64, 16] in L."""
    hi, lo = gl.split(gl.permute(gl.reshape(acc, [PAGE, 2, BLOCK_R]), [0, 2, 1]))
    return gl.convert_layout(hi + lo, L)


@gluon.jit
def _columns(x):
    """[64, 4] -> its four columns."""
    a, b = gl.split(gl.reshape(x, [PAGE, 2, 2]))
    c0, c2 = gl.split(a)
    c1, c3 = gl.split(b)
    return c0, c1, c2, c3


@gluon.jit
def _page_scales(sc_stage, gm, n_valid, KEY: gl.constexpr, SC2: gl.constexpr, G4: gl.constexpr):
    """The page's scales (0 past the request's end): per group g, the per-key scales in KEY, and their page
    maxima from the scale warp (gm, [4])."""
    keys = gl.arange(0, PAGE, gl.SliceLayout(1, SC2))
    x = gl.where((keys < n_valid)[:, None], sc_stage.load(SC2), 0.0)
    s0, s1, s2, s3 = _columns(x)
    g = gm.load(G4)
    i = gl.arange(0, 4, G4)
    return (gl.convert_layout(s0, KEY), gl.convert_layout(s1, KEY), gl.convert_layout(s2, KEY),
            gl.convert_layout(s3, KEY), gl.sum(gl.where(i == 0, g, 0.0), 0), gl.sum(gl.where(i == 1, g, 0.0), 0),
            gl.sum(gl.where(i == 2, g, 0.0), 0), gl.sum(gl.where(i == 3, g, 0.0), 0))


@gluon.jit
def _scale_partition(sc_smem, gm_smem, ready, gready, seqlens_ptr, b, num_splits, H, S_Q, CAUSAL: gl.constexpr):
    """The scale warp: each page's per-group maximum scale (keys past the request's end left out) into gm_smem,
    once the page has landed; its own barrier tells the compute warpgroups."""
    SCL: gl.constexpr = gl.BlockedLayout([2, 4], [32, 1], [1, 1], [1, 0])
    split = gl.program_id(1)
    rows = gl.arange(0, BLOCK_R, gl.SliceLayout(0, SCL))
    seqlen, start, n_tiles, _, _ = split_and_visibility(seqlens_ptr, b, split, num_splits, rows, H, S_Q, CAUSAL)
    keys = gl.arange(0, PAGE, gl.SliceLayout(1, SCL))
    for t in range(n_tiles):
        s = t % STAGES
        mbarrier.wait(ready.index(s), (t // STAGES) & 1)
        x = gl.where((keys < seqlen - (start + t * PAGE))[:, None], sc_smem.index(s).load(SCL), 0.0)
        gm_smem.index(s).store(gl.max(x, 0))
        gl.thread_barrier()
        mbarrier.arrive(gready.index(s))


@gluon.jit
def _zero_tail(kv, n_valid):
    """Rows n_valid .. 63 of a stage's e4m3 c_kv [64, 512] set to 0 (an unused slot's byte may be 0xFF, NaN in
    e4m3, and P V multiplies it by 0). The 128-byte swizzle moves 16-byte pieces within a row, so the stage is
    four column blocks of 64 whole rows of 128 bytes each: read here as int32 [4, 64, 32]."""
    ZL: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 4, 8], [1, 4, 1], [2, 1, 0])
    flat = kv._reinterpret(gl.int32, [D_V // GROUP, PAGE, GROUP // 4], gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
    keep = (gl.arange(0, PAGE, gl.SliceLayout(0, gl.SliceLayout(2, ZL))) < n_valid)[None, :, None]
    x = flat.load(ZL)
    flat.store(gl.where(keep, x, 0))


@gluon.jit
def _pv_pair(v0, v1, pt, g: gl.constexpr, zero):
    """Groups g and g + 1 of this page's P V (P^T from pt [128, 64], _store_p's rows), each in a fresh
    accumulator."""
    a = warpgroup_mma(v0, pt.slice(2 * BLOCK_R * g, BLOCK_R, dim=0).permute((1, 0)), zero, use_acc=False,
                      is_async=True)
    a = warpgroup_mma(v0, pt.slice(2 * BLOCK_R * g + BLOCK_R, BLOCK_R, dim=0).permute((1, 0)), a, is_async=True)
    c = warpgroup_mma(v1, pt.slice(2 * BLOCK_R * (g + 1), BLOCK_R, dim=0).permute((1, 0)), zero, use_acc=False,
                      is_async=True)
    c = warpgroup_mma(v1, pt.slice(2 * BLOCK_R * (g + 1) + BLOCK_R, BLOCK_R, dim=0).permute((1, 0)), c,
                      is_async=True)
    return warpgroup_mma_wait(0, deps=[a, c])


@gluon.jit
def _consumer(q8_smem, qpe_smem, qa_smem, ckv_smem, sc_smem, gm_smem, kpe_smem, pt_smem, xo_smem, xm_smem,
              ready, gready, empty, done, seqlens_ptr, b, out_ptr, lse_ptr, po_ptr, pl_ptr, qk_scale, num_splits,
              H, S_Q, ROWS, stride_pob, stride_pos, CAUSAL: gl.constexpr, IS_SPLIT: gl.constexpr, W: gl.constexpr):
    """Compute warpgroup W: pages W, W + 2, ... of the split; warpgroup 1 hands its state to warpgroup 0, which
    merges and stores."""
    L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 32])
    L16: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    L32: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 32, 32])
    KEY: gl.constexpr = gl.SliceLayout(1, L)
    ROW: gl.constexpr = gl.SliceLayout(0, L)
    AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=L, k_width=4)
    LD: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [1, 0], [8, 0], [16, 0], [32, 0]],
        lane_bases=[[2, 0], [4, 0], [0, 4], [0, 8], [0, 16]],
        warp_bases=[[0, 32], [0, 64]], block_bases=[], shape=[PAGE, GROUP])
    # a page's [64, 4] scales: SC2 puts a key where KEY (S^T's rows) has it, the 4 groups in registers; SCW gives
    # every warp all 64 keys (2 per lane), so the page maximum needs no cross-warp step
    SC2: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [8, 0]], lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[PAGE, 4])
    G4: gl.constexpr = gl.BlockedLayout([4], [32], [4], [0])
    split = gl.program_id(1)
    rows = gl.arange(0, BLOCK_R, ROW)
    seqlen, start, n_tiles, vis, min_vis = split_and_visibility(seqlens_ptr, b, split, num_splits, rows, H, S_Q,
                                                                CAUSAL)
    q_scale = qa_smem.load(ROW) * qk_scale          # 2^-a * softmax scale * log2(e), per row
    m_i = gl.full([BLOCK_R], float("-inf"), gl.float32, ROW)
    l_acc = gl.zeros([PAGE, BLOCK_R], gl.float32, L)
    zero_pe = gl.zeros([PAGE, BLOCK_R], gl.float32, L16)
    zero_s = gl.zeros([PAGE, 2 * BLOCK_R], gl.float32, L32)
    zero_o = gl.zeros([GROUP, BLOCK_R], gl.float32, L)
    o0 = zero_o
    o1 = zero_o
    o2 = zero_o
    o3 = zero_o
    # o_g holds O_g / k_g with k_g the last page's max scale_g (see the fold below); o_g is 0 before the first page
    k0 = 1.0
    k1 = 1.0
    k2 = 1.0
    k3 = 1.0
    for t in range(W, n_tiles, 2):
        s = t % STAGES
        mbarrier.wait(ready.index(s), (t // STAGES) & 1)
        tok0 = start + t * PAGE
        n_valid = seqlen - tok0
        kv = ckv_smem.index(s)
        # 0, but not to the compiler: the MMAs' shared-memory descriptors are then formed in the loop instead of
        # being hoisted out of it into ~100 registers for the whole loop
        z = t >> 30
        a0 = _group_scores(kv, q8_smem, z, 0, zero_s)
        a1 = _group_scores(kv, q8_smem, z, 1, zero_s)
        a2 = _group_scores(kv, q8_smem, z, 2, zero_s)
        a3 = _group_scores(kv, q8_smem, z, 3, zero_s)
        pe = warpgroup_mma(kpe_smem.index(s), qpe_smem.permute((1, 0)), zero_pe, use_acc=False, is_async=True)
        mbarrier.wait(gready.index(s), (t // STAGES) & 1)
        s0, s1, s2, s3, g0, g1, g2, g3 = _page_scales(sc_smem.index(s), gm_smem.index(s), n_valid, KEY, SC2, G4)
        a0, a1, a2, a3, pe = warpgroup_mma_wait(0, deps=[a0, a1, a2, a3, pe])
        sco = ((_hi_plus_lo(a0, L) * s0[:, None] + _hi_plus_lo(a1, L) * s1[:, None] + _hi_plus_lo(a2, L) * s2[:, None]
                + _hi_plus_lo(a3, L) * s3[:, None]) * q_scale[None, :]
               + gl.convert_layout(pe, L) * qk_scale)
        if n_valid < PAGE:
            # one branch a page here, not one per scale group in _v_fragments: a smaller page loop, and the two
            # compute warpgroups' copies of it compete for the instruction cache (bench/NOTES.md 88)
            _zero_tail(kv, n_valid)
            gl.thread_barrier()
        v0 = _v_fragments(kv, 0, LD, AL)
        v1 = _v_fragments(kv, 1, LD, AL)
        v2 = _v_fragments(kv, 2, LD, AL)
        v3 = _v_fragments(kv, 3, LD, AL)
        gl.thread_barrier()
        mbarrier.arrive(empty.index(s))           # S^T done and V^T in registers: the stage is free
        p, alpha, m_i, l_acc = softmax_keys_on_m(sco, m_i, l_acc, tok0, min_vis, vis, KEY)
        # -- P_g = P * scale_g / max scale_g * 256 as e4m3 hi + lo; O_g += (V^T_g P_g^T) * max scale_g / 256 --
        _store_p(p, s0, s1, s2, s3, g0, g1, g2, g3, pt_smem.index(W))
        fence_async_shared()
        gl.thread_barrier()
        # -- P_g = P * scale_g / k_g * 256 (k_g = max scale_g of the page) as e4m3 hi + lo; O_g += V^T_g P_g^T *
        # k_g / 256, kept as o_g = O_g / k_g * 256: o_g = o_g * alpha * k_g(last page) / k_g + V^T_g P_g^T, one FFMA
        # an element --
        c0, c1 = _pv_pair(v0, v1, pt_smem.index(W + z), 0, zero_o)
        o0 = o0 * (alpha * (k0 / g0))[None, :] + c0
        o1 = o1 * (alpha * (k1 / g1))[None, :] + c1
        c2, c3 = _pv_pair(v2, v3, pt_smem.index(W + z), 2, zero_o)
        o2 = o2 * (alpha * (k2 / g2))[None, :] + c2
        o3 = o3 * (alpha * (k3 / g3))[None, :] + c3
        k0 = g0
        k1 = g1
        k2 = g2
        k3 = g3
        gl.thread_barrier()                       # P^T is free for this warpgroup's next page

    l_i = gl.sum(l_acc, 0)
    o0 = o0 * (k0 / P_RANGE)
    o1 = o1 * (k1 / P_RANGE)
    o2 = o2 * (k2 / P_RANGE)
    o3 = o3 * (k3 / P_RANGE)
    if W == 1:
        xo_smem.index(0).store(o0)
        xo_smem.index(1).store(o1)
        xo_smem.index(2).store(o2)
        xo_smem.index(3).store(o3)
        xm_smem.index(0).store(m_i)
        xm_smem.index(1).store(l_i)
        gl.thread_barrier()
        mbarrier.arrive(done)
    else:
        mbarrier.wait(done, 0)
        m_o = xm_smem.index(0).load(ROW)
        l_o = xm_smem.index(1).load(ROW)
        m_new = gl.maximum(m_i, m_o)
        m_base = gl.where(m_new == float("-inf"), 0.0, m_new)
        c_me = gl.exp2(m_i - m_base)
        c_ot = gl.exp2(m_o - m_base)
        inv_l, lse = finish_rows(m_new, l_i * c_me + l_o * c_ot, ROW)
        row_ok = rows < ROWS
        _store_group(o0 * c_me[None, :] + xo_smem.index(0).load(L) * c_ot[None, :], 0, inv_l, rows, row_ok, b, split,
                     ROWS, out_ptr, po_ptr, stride_pob, stride_pos, IS_SPLIT, L)
        _store_group(o1 * c_me[None, :] + xo_smem.index(1).load(L) * c_ot[None, :], 1, inv_l, rows, row_ok, b, split,
                     ROWS, out_ptr, po_ptr, stride_pob, stride_pos, IS_SPLIT, L)
        _store_group(o2 * c_me[None, :] + xo_smem.index(2).load(L) * c_ot[None, :], 2, inv_l, rows, row_ok, b, split,
                     ROWS, out_ptr, po_ptr, stride_pob, stride_pos, IS_SPLIT, L)
        _store_group(o3 * c_me[None, :] + xo_smem.index(3).load(L) * c_ot[None, :], 3, inv_l, rows, row_ok, b, split,
                     ROWS, out_ptr, po_ptr, stride_pob, stride_pos, IS_SPLIT, L)
        if IS_SPLIT:
            gl.store(pl_ptr + b * (num_splits * ROWS) + split * ROWS + rows, lse, mask=row_ok)
        else:
            gl.store(lse_ptr + b * ROWS + rows, lse, mask=row_ok)


@gluon.jit
def _second_consumer(q8_smem, qpe_smem, qa_smem, ckv_smem, sc_smem, gm_smem, kpe_smem, pt_smem, xo_smem,
                     xm_smem, ready, gready, empty, done, seqlens_ptr, b, out_ptr, lse_ptr, po_ptr, pl_ptr,
                     qk_scale, num_splits, H, S_Q, ROWS, stride_pob, stride_pos, CAUSAL: gl.constexpr,
                     IS_SPLIT: gl.constexpr):
    """The worker partition's entry: _consumer as warpgroup 1."""
    _consumer(q8_smem, qpe_smem, qa_smem, ckv_smem, sc_smem, gm_smem, kpe_smem, pt_smem, xo_smem, xm_smem, ready,
              gready, empty, done, seqlens_ptr, b, out_ptr, lse_ptr, po_ptr, pl_ptr, qk_scale, num_splits, H, S_Q,
              ROWS, stride_pob, stride_pos, CAUSAL, IS_SPLIT, 1)


@gluon.jit
def _store_group(o, g: gl.constexpr, inv_l, rows, row_ok, b, split, ROWS, out_ptr, po_ptr, stride_pob, stride_pos,
                 IS_SPLIT: gl.constexpr, O_LAYOUT: gl.constexpr):
    """O^T_g [128 permuted columns, 16 rows] normalized into out [.., row, 128 g + column] (or the fp32 split
    partials); logical m = 64 mt + 16 w + 8 h + r is column 32 w + 4 r + 2 mt + h."""
    m = gl.arange(0, GROUP, gl.SliceLayout(1, O_LAYOUT))
    cols = g * GROUP + 32 * ((m // 16) % 4) + 4 * (m % 8) + 2 * (m // 64) + (m // 8) % 2
    store_columns(o, cols, inv_l, rows, row_ok, b, split, ROWS, out_ptr, po_ptr, stride_pob, stride_pos, IS_SPLIT)


@gluon.jit
def _mla_decode_fp8mma_kernel(ckv_desc, sc_desc, kpe_desc, q_ptr, bt_ptr, seqlens_ptr, out_ptr, lse_ptr, po_ptr,
                              pl_ptr, order_ptr, qk_scale, num_splits, H, S_Q, ROWS, stride_qb, stride_btb,
                              stride_pob, stride_pos, CAUSAL: gl.constexpr, IS_SPLIT: gl.constexpr,
                              ORDERED: gl.constexpr):
    """Grid (b, num_splits); 4 + 4 compute warps + the producer warp. q [b, ROWS, 576] bf16 (row = token j * H +
    head, ROWS <= 16); the FP8 cache behind three descriptors over its [pages * 64, 656] bytes. out [b * ROWS,
    512] bf16, lse [b * ROWS]; with splits po [b, splits, ROWS, 512] / pl [b, splits, ROWS] fp32 instead.
    ORDERED: the request axis runs through order_ptr (work_order.grid_order: longest first); the partitions get
    the request from here."""
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    b = gl.program_id(0)
    if ORDERED:
        b = gl.load(order_ptr + b)
    split = gl.program_id(1)
    qr = gl.arange(0, BLOCK_R, gl.SliceLayout(1, QL))
    _, start, n_tiles, _, _ = split_and_visibility(seqlens_ptr, b, split, num_splits, qr, H, S_Q, CAUSAL)

    SMEM8: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    SMEM16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    PT_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([8 * BLOCK_R, PAGE], gl.float8e4nv)
    SC_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    FLAT1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    q8_smem = gl.allocate_shared_memory(gl.float8e4nv, [1, 2 * BLOCK_R, D_V], SMEM8)      # [hi; lo]
    qpe_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_R, D_PE], SMEM16)
    qa_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_R], FLAT1)
    # -- Q: q * 2^a = hi + lo in e4m3 (a per row), 2^-a kept for the scores --
    q_rows = q_ptr + b.to(gl.int64) * stride_qb + qr * (D_V + D_PE)
    qn = gl.load(q_rows[:, None] + gl.arange(0, D_V, gl.SliceLayout(0, QL))[None, :], mask=(qr < ROWS)[:, None],
                 other=0.0).to(gl.float32)
    amax = gl.maximum(gl.max(gl.abs(qn), 1), 1e-30)
    pow2 = gl.exp2(gl.floor(gl.log2(Q_RANGE / amax)))
    qs = qn * pow2[:, None]
    qhi = qs.to(gl.float8e4nv)
    q8_smem.index(0).slice(0, BLOCK_R, dim=0).store(qhi)
    q8_smem.index(0).slice(BLOCK_R, BLOCK_R, dim=0).store((qs - qhi.to(gl.float32)).to(gl.float8e4nv))
    qa_smem.store(1.0 / pow2)
    qpe_smem.store(gl.load(q_rows[:, None] + D_V + gl.arange(0, D_PE, gl.SliceLayout(0, QL))[None, :],
                           mask=(qr < ROWS)[:, None], other=0.0))

    ckv_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, PAGE, D_V], SMEM8)
    sc_smem = gl.allocate_shared_memory(gl.float32, [STAGES, PAGE, 4], SC_SMEM)
    kpe_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, PAGE, D_PE], SMEM16)
    pt_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, 8 * BLOCK_R, PAGE], PT_SMEM)   # one per warpgroup
    xo_smem = gl.allocate_shared_memory(gl.float32, [4, GROUP, BLOCK_R], FLAT)
    xm_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_R], FLAT1)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    gready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    gm_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 4], FLAT1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
        mbarrier.init(gready.index(i), count=1)
    mbarrier.init(done, count=1)
    fence_async_shared()
    gl.thread_barrier()

    bt_row = bt_ptr + b.to(gl.int64) * stride_btb
    gl.warp_specialize(
        [(_consumer, (q8_smem, qpe_smem, qa_smem, ckv_smem, sc_smem, gm_smem, kpe_smem, pt_smem, xo_smem, xm_smem,
                      ready, gready, empty, done, seqlens_ptr, b, out_ptr, lse_ptr, po_ptr, pl_ptr, qk_scale,
                      num_splits, H, S_Q, ROWS, stride_pob, stride_pos, CAUSAL, IS_SPLIT, 0)),
         (_second_consumer, (q8_smem, qpe_smem, qa_smem, ckv_smem, sc_smem, gm_smem, kpe_smem, pt_smem, xo_smem,
                             xm_smem, ready, gready, empty, done, seqlens_ptr, b, out_ptr, lse_ptr, po_ptr, pl_ptr,
                             qk_scale, num_splits, H, S_Q, ROWS, stride_pob, stride_pos, CAUSAL, IS_SPLIT)),
         (_load_partition, (ckv_desc, sc_desc, kpe_desc, bt_row, ckv_smem, sc_smem, kpe_smem, ready, empty, ready,
                            empty, start // PAGE, n_tiles, STAGES, True, False, 2)),
         (_scale_partition, (sc_smem, gm_smem, ready, gready, seqlens_ptr, b, num_splits, H, S_Q, CAUSAL))],
        [4, 1, 1], [240, 24, 48])


def supports(q: torch.Tensor, kv_cache: torch.Tensor, head_dim_v: int) -> bool:
    """Whether this kernel takes the call: a Hopper GPU, a contiguous page-64 FP8 cache, <= 16 query rows per
    request, bf16 q with d_qk 576, d_v 512."""
    b, s_q, h, d_qk = q.shape
    return (q.device.type == "cuda" and torch.cuda.get_device_capability(q.device)[0] == 9
            and kv_cache.dtype == torch.uint8 and kv_cache.dim() == 3 and kv_cache.shape[2] == ROW_BYTES.value
            and kv_cache.is_contiguous() and kv_cache.shape[1] == PAGE.value and s_q * h <= MAX_ROWS
            and q.dtype == torch.bfloat16 and d_qk == D_V.value + D_PE.value and head_dim_v == D_V.value)


def mla_decode_gluon_fp8mma(q, kv_cache, block_table, cache_seqlens, softmax_scale, causal, plan, out, lse,
                            order: torch.Tensor | None = None) -> None:
    """ops.mla_decode's semantics for the calls `supports` takes, into out [b, s_q, h, 512] and lse [b, s_q, h]
    (contiguous, b > 0); `plan` from mla_decode_plan.plan_mla_decode with 16-row programs. `order`: int32 [b],
    the order in which the grid takes the requests (work_order.grid_order), or None for batch order."""
    from mlaserve.kernels.triton.mla_decode import combine_splits
    assert fp8_format.PACKED_BYTES == ROW_BYTES.value
    b, s_q, h, _ = q.shape
    rows = s_q * h
    ckv_desc, sc_desc, kpe_desc = fp8_descriptors(kv_cache)
    qc = q.contiguous()
    split = plan.num_splits > 1
    po, pl = (plan.partial_out, plan.partial_lse) if split else (out, lse)
    _mla_decode_fp8mma_kernel[(b, plan.num_splits)](
        ckv_desc, sc_desc, kpe_desc, qc, block_table, cache_seqlens, out, lse, po, pl,
        cache_seqlens if order is None else order, softmax_scale * LOG2E.value, plan.num_splits, h, s_q, rows,
        qc.stride(0), block_table.stride(0), po.stride(0), po.stride(1), CAUSAL=causal, IS_SPLIT=split,
        ORDERED=order is not None, num_warps=4)
    if split:
        combine_splits(plan, out, lse)
