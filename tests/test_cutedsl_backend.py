"""The CuTe DSL MLA decode's host side on the CPU: planning, shape checks, the split combine, and the
refusals of the `cutedsl` kernel backend and the `cutedsl_mla` attention backend where no Hopper GPU (or
no `nvidia-cutlass-dsl`) is. CI does not install the DSL: nothing here imports it. The kernel itself
runs in tests/gpu/test_cutedsl_mla.py and scripts/cutedsl_check.py.
"""

import importlib

import pytest
import torch

from mlaserve import ops
from mlaserve.attention import registry
from mlaserve.attention.base import BackendConfig
from mlaserve.kernels import reference
from mlaserve.kernels.cutedsl.common import register_split_fits
from mlaserve.kernels.triton.mla_decode import combine_splits
from mlaserve.ops.registry import BACKENDS, PREFERENCE

cd = importlib.import_module("mlaserve.kernels.cutedsl.mla_decode")
decode_plan = importlib.import_module("mlaserve.kernels.cutedsl.decode_plan")
CPU = torch.device("cpu")


def _inputs(b=2, s_q=1, h=16, d=576, page=64, pages=4, dtype=torch.bfloat16, kv_dtype=None):
    q = torch.zeros(b, s_q, h, d, dtype=dtype)
    kv = torch.zeros(b * pages, page, 656 if kv_dtype == torch.uint8 else d, dtype=kv_dtype or dtype)
    bt = torch.arange(b * pages, dtype=torch.int32).view(b, pages)
    lens = torch.full((b,), page * pages, dtype=torch.int32)
    return q, kv, bt, lens


@pytest.mark.parametrize("b, s_q, h, max_pages, want", [
    (1, 1, 16, 64, 8),     # 1 CTA: one per SM of the CPU stand-in's 8
    (2, 1, 128, 64, 2),    # 4 CTAs (two 64-row tiles each): 2 splits fill the 8 SMs in one wave
    (3, 1, 16, 64, 2),     # 3 CTAs: 2 splits (6 CTAs); 3 would need a second wave
    (1, 1, 16, 2, 1),      # a 128-token block table: splits of at least 256 tokens leave one
    (1, 1, 16, 12, 3),     # 768 tokens: at most 3 such splits
    (7, 1, 16, 64, 1),     # 7 CTAs >= 80% of 8 SMs: no split
])
def test_split_count_fills_one_wave(b, s_q, h, max_pages, want):
    assert cd.choose_num_splits(b, s_q, h, max_pages, 64, CPU) == want


def test_host_lengths_split_one_wave_of_few_rows(monkeypatch):
    """With the step's host lengths, requests of <= decode_plan.BALANCE_SPLITS_MAX_ROWS rows (64 by default, and at
    most) that vary enough are split in two (triton's balanced_splits estimate, as on an H200's 132 SMs); fixed
    lengths, more rows, 128-row requests and steps without lengths keep the count from shapes; plan_mla_decode
    takes it."""
    monkeypatch.setattr(decode_plan, "_num_sms", lambda device: 132)
    gen = torch.Generator().manual_seed(87)
    var = (8192 + (torch.rand(128, generator=gen) * 2 - 1) * 4096).long().tolist()
    pages = -(-max(var) // 64)

    def splits(h, seqlens, s_q=1):
        return cd.plan_num_splits(128, s_q, h, pages, 64, False, CPU, seqlens=seqlens)

    assert decode_plan.BALANCE_SPLITS_MAX_ROWS == 64
    assert splits(16, var) == 2 and splits(32, var, s_q=2) == 2 and splits(64, var) == 2
    monkeypatch.setattr(decode_plan, "BALANCE_SPLITS_MAX_ROWS", 16)
    assert splits(16, var) == 2 and splits(8, var, s_q=2) == 2
    assert splits(32, var) == 1 == splits(64, var) == splits(16, var, s_q=2), "more rows than the bound"
    monkeypatch.setattr(decode_plan, "BALANCE_SPLITS_MAX_ROWS", 0)
    assert splits(16, var) == 1
    monkeypatch.setattr(decode_plan, "BALANCE_SPLITS_MAX_ROWS", 128)
    assert cd.plan_mla_decode(128, 1, 16, 512, pages, 64, False, CPU, seqlens=var).num_splits == 2
    assert splits(64, var) == 2
    assert splits(16, [8192] * 128) == 1, "fixed lengths"
    assert splits(128, var) == 1 and splits(64, var, s_q=2) == 1, "two row tiles a request: persistent"
    assert splits(16, None) == 1
    with pytest.raises(ValueError, match="seqlens must have b = 128 entries, got 2"):
        splits(16, [1, 2])


@pytest.mark.parametrize("rows, kv_fp8, want", [
    (16, False, 1), (64, False, 1),      # one 64-row tile: nothing to share a page's load with
    (128, False, 2), (384, False, 2),    # h 128 s_q 1; s_q 3 (6 tiles: pairs)
    (256, False, 2), (512, False, 2),    # h 128 s_q 2 and 4: pairs too (clusters of 4 measured slower)
    (192, False, 1),                     # 3 tiles: no even grouping
    (256, True, 1),                      # FP8: its loader gathers with cp.async, no multicast
])
def test_cluster_size_groups_the_row_tiles_of_a_request(rows, kv_fp8, want):
    assert cd.cluster_size(rows, kv_fp8) == want


@pytest.mark.parametrize("rows, kv_split, want", [
    (16, True, (3, False, 0)), (64, True, (3, False, 0)), (128, True, (1, True, 2)),
    (256, True, (1, True, 2)), (512, True, (1, True, 2)), (256, False, (3, False, 0))])
def test_kv_ring_splits_pages_by_consumer_from_128_rows(monkeypatch, rows, kv_split, want):
    """By default KV_SPLIT's ring, prefetching KV_PREFETCH pages ahead, where a request has 128 rows or more
    (KV_SPLIT_MIN_ROWS), KV_PARTS column parts with KV_PARTS_PREFETCH below it."""
    monkeypatch.setattr(cd, "KV_SPLIT", kv_split)
    monkeypatch.setattr(cd, "KV_PARTS", 3)
    monkeypatch.setattr(cd, "KV_PREFETCH", 2)
    monkeypatch.setattr(cd, "KV_PARTS_PREFETCH", 0)
    assert cd.KV_SPLIT_MIN_ROWS == 128
    assert cd.kv_ring(rows) == want


@pytest.mark.parametrize("rows, want", [(1, 16), (16, 16), (17, 32), (32, 32), (33, 0), (128, 0)])
def test_fp8_requests_of_few_rows_take_the_keys_on_m_kernel(rows, want):
    assert cd.fp8_narrow_cols(rows) == want


@pytest.mark.parametrize("rows, max_pages, num_splits, want", [
    (16, 128, 1, True), (16, 96, 2, True), (8, 768, 16, True),     # splits of >= 48 pages at <= 16 rows
    (16, 512, 11, False), (16, 47, 1, False), (16, 32, 1, False),  # shorter splits: the bf16-tile kernel
    (17, 512, 1, False), (32, 512, 1, False), (64, 512, 1, False),  # more rows than the FP8-MMA kernel takes
])
def test_fp8_mma_kernel_only_at_16_rows_with_long_splits(monkeypatch, rows, max_pages, num_splits, want):
    assert cd.uses_fp8_mma(True, rows, max_pages, num_splits) is want
    assert cd.uses_fp8_mma(False, rows, max_pages, num_splits) is False      # 16-bit KV
    monkeypatch.setattr(cd, "FP8_MMA", False)
    assert cd.uses_fp8_mma(True, rows, max_pages, num_splits) is False


@pytest.mark.parametrize("rows, max_pages, num_splits, narrow_kernel", [
    (16, 128, 1, True), (32, 96, 2, True), (20, 768, 16, True),    # splits of >= 48 pages at <= 32 rows
    (16, 512, 11, False), (32, 47, 1, False),                      # shorter splits: FP8-MMA or bf16 tiles
])
def test_fp8_f16_kernel_at_32_rows_with_long_splits(monkeypatch, rows, max_pages, num_splits, narrow_kernel):
    """mla_decode.uses_fp8_f16: FP8 KV at <= 32 rows where each split spans >= 48 pages (FP8_F16); never at more
    rows (its wide form measured slower than the 64-row kernel and was taken out: bench/NOTES.md 129)."""
    monkeypatch.setattr(cd, "FP8_F16", True)
    assert cd.uses_fp8_f16(True, rows, max_pages, num_splits) is narrow_kernel
    assert cd.uses_fp8_f16(False, rows, max_pages, num_splits) is False      # 16-bit KV
    assert cd.uses_fp8_f16(True, 64, max_pages, num_splits) is False
    assert cd.uses_fp8_f16(True, 128, 1, 1) is False
    monkeypatch.setattr(cd, "FP8_F16", False)
    assert cd.uses_fp8_f16(True, rows, max_pages, num_splits) is False


def test_plan_splits_small_batches_and_sizes_the_workspace():
    plan = cd.plan_mla_decode(2, 1, 16, 512, 64, 64, False, CPU)
    want = cd.choose_num_splits(2, 1, 16, 64, 64, CPU)
    assert plan.num_splits == want > 1          # 2 CTAs cannot fill the (CPU stand-in's 8) SMs
    assert plan.config == cd.CONFIG and plan.rows == 16
    assert cd.decode_config(2, 1, 16, 64, 64, False, CPU) == cd.CONFIG    # the graph workspace's sizing asks this
    assert tuple(plan.partial_out.shape) == (2, want, 16, 512) and tuple(plan.partial_lse.shape) == (2, want, 16)
    full = cd.plan_mla_decode(128, 1, 128, 512, 64, 64, False, CPU)
    assert full.num_splits == 1 and full.partial_out is None
    assert cd.plan_mla_decode(2, 1, 16, 512, 64, 64, False, CPU, num_splits=3).num_splits == 3
    need = cd.workspace_numel(2, 16, 512, want)
    shared = torch.empty(need, dtype=torch.float32)
    assert cd.plan_mla_decode(2, 1, 16, 512, 64, 64, False, CPU, workspace=shared).partial_out.data_ptr() == \
        shared.data_ptr()
    with pytest.raises(ValueError, match=f">= {need} elements"):
        cd.plan_mla_decode(2, 1, 16, 512, 64, 64, False, CPU, workspace=shared[:need - 1])


@pytest.mark.parametrize("kwargs, says", [
    (dict(page_size=32), "page_size 32"),
    (dict(head_dim_v=256), "head_dim_v 256"),
])
def test_plan_refuses_what_the_kernel_cannot_take(kwargs, says):
    args = dict(b=2, s_q=1, h=16, head_dim_v=512, max_pages=8, page_size=64, kv_fp8=False, device=CPU) | kwargs
    with pytest.raises(ValueError, match=says):
        cd.plan_mla_decode(**args)
    with pytest.raises(ValueError, match="one config"):
        cd.plan_mla_decode(2, 1, 16, 512, 8, 64, False, CPU, config=cd.MLADecodeConfig(block_h=32))


@pytest.mark.parametrize("change, says", [
    (dict(dtype=torch.float32), "bf16/fp16 q, got torch.float32"),
    (dict(dtype=torch.float16, kv_dtype=torch.uint8), "bf16 q with an FP8 KV cache, got torch.float16"),
    (dict(kv_dtype=torch.float16), "kv_cache dtype torch.float16 must match q dtype torch.bfloat16"),
    (dict(d=512), r"q shape \(2, 1, 16, 512\)"),
    (dict(page=32), r"page size 64\), got shape \(8, 32, 576\)"),
])
def test_unsupported_inputs_raise_naming_the_values(change, says):
    q, kv, bt, lens = _inputs(**change)
    with pytest.raises(ValueError, match=says):
        cd.mla_decode(q, kv, bt, lens, 0.1)


def test_supported_shapes_on_the_cpu_say_it_needs_cuda():
    q, kv, bt, lens = _inputs(s_q=3, h=128)
    with pytest.raises(ValueError, match="head_dim_v 512"):
        cd.mla_decode(q, kv, bt, lens, 0.1, head_dim_v=448)
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        cd.mla_decode(q, kv, bt, lens, 0.1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks about CUDA on a machine without it")
def test_kernel_backends_refuse_cuda_where_torch_has_none():
    # a reason, not torch's "not compiled with CUDA" assertion from the capability query
    assert "torch sees no CUDA GPU" in BACKENDS["cutedsl"].unavailable_reason(torch.device("cuda"))
    assert "torch sees none" in BACKENDS["triton"].unavailable_reason(torch.device("cuda"))


def test_kernel_backend_refuses_the_cpu_naming_package_and_gpu():
    reason = BACKENDS["cutedsl"].unavailable_reason(CPU)
    assert "nvidia-cutlass-dsl" in reason and "Hopper" in reason and "9.x" in reason
    assert "cutedsl" not in ops.available("mla_decode", CPU)
    assert PREFERENCE == ("triton", "torch")       # cutedsl joins only once the device proves it
    q, kv, bt, lens = _inputs()
    with pytest.raises(ValueError, match="backend 'cutedsl' cannot run mla_decode here: .*nvidia-cutlass-dsl"):
        ops.mla_decode(q, kv, bt, lens, 0.1, backend="cutedsl")


def test_attention_backend_refuses_without_hopper():
    config = BackendConfig(num_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16,
                           kv_cache_dtype="auto", device=CPU)
    assert "cutedsl_mla" in registry.names() and "cutedsl_mla" in registry.names(dsa=True)
    reason = registry.unavailable_reason("cutedsl_mla", config)
    assert "nvidia-cutlass-dsl" in reason and "Hopper" in reason
    for dsa in (False, True):
        with pytest.raises(ValueError, match="'cutedsl_mla' cannot run here: .*nvidia-cutlass-dsl"):
            registry.create("cutedsl_mla", config, dsa=dsa)


@pytest.mark.parametrize("change,why", [
    (dict(page_size=16), "needs --page-size 64, got 16"),
    (dict(kv_cache_dtype="fp8_e4m3", dtype=torch.float16), "FP8 KV cache with bf16 activations"),
    (dict(dtype=torch.float32), "bf16/fp16 activations"),
    (dict(kv_lora_rank=256), "kv_lora_rank 512"),
])
def test_attention_backend_says_what_it_cannot_run(monkeypatch, change, why):
    """Past the GPU and package checks (faked here), each unsupported setting stops start-up with its reason."""
    from mlaserve.attention.cutedsl_backend import CuteDSLBackend
    from mlaserve.ops import registry as ops_registry
    for name in ("cutedsl", "triton"):
        monkeypatch.setitem(ops_registry._REASONS, name, lambda device: None)
    base = dict(num_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16, kv_cache_dtype="auto",
                device=torch.device("cuda"), page_size=64)
    assert CuteDSLBackend.unavailable_reason(BackendConfig(**base)) is None
    assert CuteDSLBackend.unavailable_reason(BackendConfig(**{**base, "kv_cache_dtype": "fp8_e4m3"})) is None
    assert why in CuteDSLBackend.unavailable_reason(BackendConfig(**{**base, **change}))


def test_serve_with_cutedsl_mla_stops_startup_with_the_reason(tmp_path, monkeypatch, capsys):
    import uvicorn

    from mlaserve.server import launch

    monkeypatch.setenv("MLASERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("started a server"))
    assert launch.main(["--attention-backend", "cutedsl_mla"]) == 2
    err = capsys.readouterr().err
    assert "cannot start" in err and "cutedsl_mla" in err and "nvidia-cutlass-dsl" in err, err


def test_combine_merges_split_partials_into_the_reference(monkeypatch):
    """The partials the kernel writes per split (softmax over its token run, lse; out 0 and lse -inf
    where a row sees no key of the split) combine into the one-pass result. Triton's interpreter runs it."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(0)
    b, s_q, h, page = 2, 2, 4, 64
    lens = [150, 1]                     # request 1: one token, so its later splits see nothing
    pages = [(n + page - 1) // page for n in lens]
    kv = torch.randn(sum(pages), page, 576, generator=gen)
    bt = torch.zeros(b, max(pages), dtype=torch.int32)
    bt[0, :pages[0]] = torch.arange(pages[0])
    bt[1, :pages[1]] = torch.arange(pages[0], pages[0] + pages[1])
    seqlens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(b, s_q, h, 576, generator=gen)
    scale = 576 ** -0.5
    plan = cd.plan_mla_decode(b, s_q, h, 512, bt.shape[1], page, False, CPU, num_splits=3)
    for i, n in enumerate(lens):
        split_len = -(-(-(-n // 3)) // page) * page      # the kernel's rule: whole pages per split
        for s in range(3):
            lo, hi = s * split_len, min((s + 1) * split_len, n)
            vis = torch.arange(n)[None, :] <= (n - s_q + torch.arange(s_q))[:, None]   # [s_q, n] causal
            vis[:, :lo] = False
            vis[:, max(hi, lo):] = False
            logits = torch.einsum("jhd,td->jht", q[i].double(), kv[bt[i].long()].reshape(-1, 576)[:n].double())
            logits = (logits * scale).masked_fill(~vis[:, None, :], float("-inf"))
            lse = torch.logsumexp(logits, -1)                                               # [s_q, h]
            o = torch.einsum("jht,td->jhd", torch.exp(logits - lse[..., None]).nan_to_num(0.0),
                             kv[bt[i].long()].reshape(-1, 576)[:n, :512].double())
            assert torch.isinf(lse).any() or i == 0    # request 1 has splits that see nothing
            plan.partial_out[i, s] = o.reshape(s_q * h, 512).float()
            plan.partial_lse[i, s] = lse.reshape(s_q * h).float()
    out = torch.empty(b, s_q, h, 512, dtype=torch.float16)
    lse = torch.empty(b, s_q, h)
    combine_splits(plan, out, lse)
    ref_out, ref_lse = reference.mla_decode(q, kv, bt, seqlens, scale)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-3, rtol=1e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("b, rows, kv_fp8, split, cluster, want", [
    (9, 16, False, False, 1, 8),      # 9 items > 8 SMs (the CPU stand-in): one CTA per SM
    (8, 16, False, False, 1, 0),      # one wave: an ordinary grid
    (5, 128, False, False, 2, 4),     # 5 pairs of row tiles > 4 pairs of SMs
    (4, 128, False, False, 2, 0),
    (9, 16, False, True, 1, 0),       # split steps fill one wave by construction
    (9, 16, True, False, 1, 0),       # FP8 KV: the FP8 kernels have no persistent form
])
def test_persistent_launch_only_where_items_outnumber_the_sms(b, rows, kv_fp8, split, cluster, want):
    assert cd.persistent_clusters(b, rows, kv_fp8, split, cluster, CPU) == want


@pytest.mark.parametrize("items, slots, max_pages, want", [
    (128, 66, 512, True),     # b 128 h 128 s_q 1 s_k 32768: 0.06 of an item idle = 31 tiles a slot
    (256, 66, 512, True),     # s_q 2: 0.12 = 62 tiles
    (128, 66, 64, False),     # s_k 4096: 4 tiles, less than a cut costs
    (256, 66, 64, False),     # 8 tiles
    (256, 66, 128, True),     # s_k 8192, s_q 2: 15.5 tiles
    (132, 66, 4096, False),   # whole rounds: no slot idles
    (67, 66, 20, True),       # a second round of one item: 0.98 of an item idle
])
def test_stream_k_only_where_whole_items_leave_slots_idle(items, slots, max_pages, want):
    assert cd.stream_k_pays(items, slots, max_pages) is want


@pytest.mark.parametrize("cluster", [1, 2, 4])
def test_stream_k_buffers_hold_every_launch_the_device_takes(cluster):
    """A stream-K launch of S = SMs // cluster slots writes its schedule and flags (3 S + 2 + 3 S cluster int32)
    and two 64-row partials of O and lse a slot and CTA into the device's buffers (the CPU stand-in: 8 SMs)."""
    sched, partials = cd.stream_k_buffers(CPU)
    slots = cd.persistent_clusters(100, 64 * cluster, False, False, cluster, CPU)
    assert slots == 8 // cluster
    assert sched.dtype == torch.int32 and sched.numel() >= 3 * slots + 2 + 3 * slots * cluster
    assert partials.dtype == torch.float32 and partials.numel() >= slots * 2 * cluster * 64 * (512 + 1)
    assert cd.stream_k_buffers(CPU)[0] is sched       # one pair per device


def test_register_split_fits_the_launch_allocation():
    """setmaxnreg trades registers within the CTA's launch allocation (384 threads x 168): the kernels' splits
    assert this at import; 128 x 112 + 256 x 200 asks 1024 more, and its consumers' setmaxnreg.inc hung."""
    assert register_split_fits((128, 104), (256, 200))
    assert register_split_fits((128, 112), (256, 192))
    assert not register_split_fits((128, 112), (256, 200))
    assert register_split_fits((128, 24), (256, 240))
    assert not register_split_fits((128, 24), (128, 240), (128, 248))
    assert register_split_fits((128, 128), (128, 368))      # 256 threads launch at 248 registers at most
    assert not register_split_fits((128, 136), (128, 368))
