"""`mlaserve bench kernels` on the CPU: the quick run end to end, its counting rules, its checks, and the
FlashInfer peer's adapter pieces that need no GPU."""

import json
import sys
import time

import pytest
import torch

from mlaserve import ops
from mlaserve.attention import flashinfer_backend as fb
from mlaserve.attention import registry
from mlaserve.attention.base import BackendConfig
from mlaserve.bench import kernels, peers, report, runners
from mlaserve.bench.shapes import DenseShape, IndexerShape, SparseShape, dense_shapes, sparse_shapes
from mlaserve.kernels import fp8_format


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    code = kernels.main(["--quick", "--backends", "torch", "--out", str(out), "--disable-tqdm", "--fresh",
                         "--rep-ms", "1"])
    return code, out


def test_quick_run_writes_json_and_png(quick_run, capsys):
    code, out = quick_run
    assert code == 0
    data = json.loads((out / "kernels.json").read_text())
    assert data["schema"] == report.SCHEMA
    for key in ("date", "torch", "triton", "git_commit", "gpu"):
        assert key in data["env"]
    assert data["limits"]["copy_tbps"] is None and "not measured" in data["limits"]["note"]
    assert data["backends"]["torch"]["kind"] == "mlaserve"
    suites = {r["suite"] for r in data["rows"]}
    assert suites == {"dense", "sparse", "indexer"}
    for row in data["rows"]:
        assert row["backend"] == "torch" and row["status"] == "ok", row
        assert row["time_us"] > 0 and row["bytes"] > 0 and row["flops"] > 0
        # timed in 3 interleaved rounds (the default), the row's time their median
        assert len(row["time_rounds_us"]) == 3 and row["time_us"] == sorted(row["time_rounds_us"])[1]
        assert row["check"]["ok"]
        assert row["tbps"] == pytest.approx(row["bytes"] / row["time_us"] / 1e6)
    assert any(r["kv"] == "fp8" for r in data["rows"])
    png = (out / "kernels.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_report_mode_reprints_the_table(quick_run, capsys):
    _, out = quick_run
    capsys.readouterr()
    assert kernels.main(["--report", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "not measured" in text
    assert "dense   b2 sq1 sk256 h4 fix " in text and "indexer prefill" in text


def test_a_shape_no_backend_can_run_is_recorded_as_skipped(tmp_path, monkeypatch):
    """Every backend available yet each one declining the shape at its check call (as FlashMLA declines a bf16 sparse
    decode): the rows say why, and the run goes on to the next shape (it once divided by the zero backends left)."""
    real = runners.prepare_ops

    def declines_dense(name, shape, inputs):
        if isinstance(shape, DenseShape):
            raise runners.Unsupported("no dense here")
        return real(name, shape, inputs)

    monkeypatch.setattr(runners, "prepare_ops", declines_dense)
    assert kernels.main(["--quick", "--suite", "dense,sparse", "--backends", "torch", "--out", str(tmp_path),
                         "--disable-tqdm", "--fresh", "--rep-ms", "1"]) == 0
    rows = json.loads((tmp_path / "kernels.json").read_text())["rows"]
    dense = [r for r in rows if r["suite"] == "dense"]
    assert dense and all(r["status"] == "skipped" and r["reason"] == "no dense here" for r in dense)
    assert any(r["suite"] == "sparse" and r["status"] == "ok" for r in rows)


def test_unknown_backend_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="unknown backend"):
        kernels.main(["--quick", "--backends", "nope", "--out", str(tmp_path)])


def test_standard_shapes_need_a_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    assert kernels.main(["--out", str(tmp_path)]) == 2


# -- counting rules --

def test_dense_counts_match_the_brief_and_kernel_notes():
    s = DenseShape(128, 1, 4096, 16)
    total_k = 128 * 4096
    assert s.flops(total_k) == 2 * 128 * 1 * 16 * 4096 * (576 + 512)
    q, kv, o = 128 * 16 * 576 * 2, total_k * 576 * 2, 128 * 16 * 512 * 2
    assert s.bytes(total_k) == q + kv + o          # DESIGN.md: Q + KV + O
    # KERNEL-NOTES: FlashInfer at b128 s_q1 h16 s_k 4k, 159 µs = 3.82 TB/s; h128, 297 µs = 491 TFLOP/s
    assert s.bytes(total_k) / 159e-6 / 1e12 == pytest.approx(3.82, abs=0.02)
    assert DenseShape(128, 1, 4096, 128).flops(total_k) / 297e-6 / 1e12 == pytest.approx(491, abs=2)
    fp8 = DenseShape(128, 2, 4096, 16, "fp8")
    assert fp8.bytes(total_k) - fp8.bytes(total_k, row_bytes=576 * 2) == total_k * (656 - 1152)
    assert fp8.flops(total_k) == 2 * s.flops(total_k)


def test_sparse_and_indexer_counts():
    s = SparseShape("prefill", 1, 4096, 32768, 128)
    assert s.flops() == 2 * 4096 * 128 * 2048 * 1088
    assert s.flops() / 4349e-6 / 1e12 == pytest.approx(537, abs=2)       # KERNEL-NOTES' sparse peer figure
    t = 4096
    assert s.bytes() == t * 128 * 576 * 2 + t * 2048 * 1152 + t * 128 * 512 * 2
    assert SparseShape("decode", 128, 2, 32768, 64, kv="fp8").bytes() - \
        SparseShape("decode", 128, 2, 32768, 64).bytes() == 256 * 2048 * (656 - 1152)
    i = IndexerShape("decode", 128, 1, 32768)
    assert i.flops() == 2 * 128 * 64 * 128 * 32768
    assert i.bytes() == 128 * 64 * 128 * 2 + 128 * 64 * 4 + 128 * 32768 * 128 * 2 + 128 * 2048 * 4


def test_standard_shape_lists():
    dense = dense_shapes()
    assert len(dense) == 140 and len({(s.key, s.kv) for s in dense}) == 140
    assert {s.h for s in dense} == {16, 32, 64, 128} and {s.b for s in dense} == {1, 4, 16, 128}
    assert len(sparse_shapes()) == 19


# -- checks --

def test_check_catches_wrong_and_nonfinite_outputs():
    shape = DenseShape(2, 1, 64, 4)
    ref = (torch.randn(2, 1, 4, 512), torch.randn(2, 1, 4))
    assert runners.check(shape, (ref[0].to(torch.bfloat16), ref[1]), ref)["ok"]
    wrong = ref[0] + 0.05 * torch.randn_like(ref[0])
    res = runners.check(shape, (wrong, ref[1]), ref)
    assert not res["ok"] and "rel err" in res["reason"]
    nan = ref[0].clone()
    nan[1, 0, 2, 7] = float("nan")
    assert "non-finite" in runners.check(shape, (nan, ref[1]), ref)["reason"]
    assert "lse" in runners.check(shape, (ref[0], ref[1] + 0.1), ref)["reason"]


def test_topk_check_measures_recall():
    shape = IndexerShape("decode", 1, 2, 512, topk=100)
    ref = torch.stack([torch.randperm(512)[:100], torch.randperm(512)[:100]]).to(torch.int32)[None]
    assert runners.check(shape, ref.flip(-1), ref)["recall"] == 1.0
    got = ref.clone()
    got[0, 0, :5] = -1
    res = runners.check(shape, got, ref)
    assert res["recall"] == pytest.approx(195 / 200) and not res["ok"]


def test_subset_reference_equals_the_full_problem_rows():
    """The reference subset must be a problem of its own: same rows as the full reference."""
    from mlaserve.bench import inputs
    shape = DenseShape(5, 2, 100, 3, varlen=True, d_qk=80, d_v=64)
    di = inputs.make_dense(shape, torch.device("cpu"), seed=1, rotate_bytes=0)
    full = ops.mla_decode(di.q[0], di.kv[0], di.paging.block_table, di.paging.seqlens, di.scale, head_dim_v=64,
                          backend="torch")
    subset = runners.pick_subset(shape.b, shape.s_q, torch.device("cpu"))
    part = runners.reference(shape, di, subset)
    got = runners.take_subset(shape, full, subset)
    assert torch.equal(got[0], part[0]) and torch.equal(got[1], part[1])
    ishape = IndexerShape("prefill", 2, 70, 300, heads=2, dim=16, topk=40)
    ii = inputs.make_indexer(ishape, torch.device("cpu"), seed=2, rotate_bytes=0)
    full = ops.indexer_topk(ii.q[0], ii.weights[0], ii.k_cache[0], ii.paging.block_table, ii.paging.seqlens, 40,
                            backend="torch")
    subset = runners.pick_subset(2, 70, torch.device("cpu"))
    assert subset.rows == 64
    assert runners.check(ishape, runners.take_subset(ishape, full, subset),
                         runners.reference(ishape, ii, subset))["recall"] == 1.0


# -- report --

def test_derive_rates_roofline_and_peer_ratios():
    base = {"suite": "dense", "key": "k", "shape": {}, "bytes": 4e9, "flops": 1e12}
    data = {"limits": {"copy_tbps": 4.0, "matmul_tflops": 800.0}, "rows": [
        dict(base, kv="bf16", backend="triton", status="ok", time_us=2000.0),
        dict(base, kv="bf16", backend="flashinfer", status="ok", time_us=1600.0),
        dict(base, kv="fp8", backend="triton", status="ok", time_us=1000.0),
        dict(base, kv="bf16", backend="sglang", status="error", reason="boom")]}
    report.derive(data)
    tri, fi, tri8, _ = data["rows"]
    assert tri["tbps"] == pytest.approx(2.0) and tri["tflops"] == pytest.approx(500.0)
    # roofline time: max(4e9 B / 4 TB/s = 1000 µs, 1e12 FLOP / 800 TFLOP/s = 1250 µs)
    assert tri["roofline_frac"] == pytest.approx(1250 / 2000)
    assert tri["bw_frac"] == pytest.approx(0.5) and tri["flop_frac"] == pytest.approx(500 / 800)
    assert tri["vs"] == {"flashinfer": pytest.approx(0.8), "triton@fp8": pytest.approx(0.5)}
    assert tri8["vs"]["flashinfer@bf16"] == pytest.approx(1.6)
    text = report.table(data)
    assert "sglang ERROR" in text and "flashinfer 1600.0 (0.80x)" in text
    fp8_line = next(line for line in text.splitlines() if " fp8 " in line)
    assert "2.00x its bf16" in fp8_line          # the FP8 row's speed-up over the same backend's bf16 row
    assert "its bf16" not in next(line for line in text.splitlines() if " bf16 " in line)


def test_merge_keeps_other_rows_and_replaces_same_ids():
    row = {"suite": "dense", "key": "a", "kv": "bf16", "backend": "triton", "status": "ok", "time_us": 1.0}
    old = {"rows": [row, dict(row, key="b")], "backends": {"triton": {}}, "notes": ["x"], "limits": {}}
    new = {"rows": [dict(row, time_us=2.0)], "backends": {"flashinfer": {}}, "notes": ["y"], "limits": {}}
    merged = report.merge(old, new)
    assert sorted((r["key"], r["time_us"]) for r in merged["rows"]) == [("a", 2.0), ("b", 1.0)]
    assert set(merged["backends"]) == {"triton", "flashinfer"} and merged["notes"] == ["x", "y"]


# -- the FlashInfer peer without a GPU --

def _config(**kw):
    base = dict(num_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16, kv_cache_dtype="auto",
                device=torch.device("cpu"))
    return BackendConfig(**{**base, **kw})


def test_flashinfer_reports_why_it_cannot_run_here(monkeypatch):
    reason = registry.unavailable_reason("flashinfer", _config())
    assert reason is not None
    if fb.importlib.util.find_spec("flashinfer") is None:
        assert "pip install flashinfer-python" in reason
    with pytest.raises(ValueError, match="flashinfer"):
        registry.create("flashinfer", _config())
    # past the package check: each remaining reason names the offending value
    monkeypatch.setattr(fb.importlib.util, "find_spec", lambda name: object())
    assert "CUDA" in fb.unavailable_reason("cpu", torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "SM80" in fb.unavailable_reason("cuda", torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert "FP8" in fb.unavailable_reason("cuda", torch.bfloat16, "fp8_e4m3")
    assert "float32" in fb.unavailable_reason("cuda", torch.float32)
    assert "rope" in fb.unavailable_reason("cuda", torch.bfloat16, "auto", 256, 32)
    assert "CUDA" in peers.unavailable_reason("sglang", torch.device("cpu"))


def test_csr_paging_from_block_table_and_sparse_indices():
    table = torch.tensor([[7, 3, 9], [4, 0, 0]], dtype=torch.int32)
    csr = fb.CsrPaging.from_block_table(table, torch.tensor([130, 64], dtype=torch.int32),
                                        torch.tensor([2, 1], dtype=torch.int32), page_size=64)
    assert csr.qo_indptr.tolist() == [0, 2, 3] and csr.kv_indptr.tolist() == [0, 3, 4]
    assert csr.kv_indices.tolist() == [7, 3, 9, 4] and csr.kv_lens.tolist() == [130, 64]
    idx = torch.tensor([[5, -1, 8], [-1, -1, -1], [1, 2, 3]], dtype=torch.int32)
    sp = fb.CsrPaging.from_sparse_indices(idx)
    assert sp.qo_indptr.tolist() == [0, 1, 2, 3] and sp.kv_indptr.tolist() == [0, 2, 2, 5]
    assert sp.kv_indices.tolist() == [5, 8, 1, 2, 3] and sp.kv_lens.tolist() == [2, 0, 3]
    assert all(t.dtype == torch.int32 for t in (sp.qo_indptr, sp.kv_indptr, sp.kv_indices, sp.kv_lens))


def test_flashinfer_fp8_layout_converts_mlaserve_rows():
    kv = torch.randn(3, 8, 576)
    packed = fp8_format.quantize(kv)
    ckv, scales, kpe8, kpe_scale = peers.flashinfer_fp8_cache(packed)
    assert ckv.shape == (3, 8, 512) and ckv.dtype == torch.float8_e4m3fn
    assert scales.shape == (3, 8, 4) and kpe8.shape == (3, 8, 64)
    mine = fp8_format.dequantize(packed, torch.float32)
    theirs = peers.flashinfer_fp8_dequant(ckv, scales, kpe8, kpe_scale)
    # same bytes, same scales: mlaserve's value of an entry is the bf16 nearest FlashInfer's float32 one
    assert torch.equal(theirs[..., :512].bfloat16().float(), mine[..., :512])
    kpe = mine[..., 512:]
    assert (theirs[..., 512:] - kpe).abs().max() <= kpe.abs().max() / 16      # e4m3 keeps 3 mantissa bits


def test_flashmla_fp8_layout_converts_mlaserve_rows():
    """FlashMLA's dense FP8 layout: every entry one e4m3 byte under one scale for the whole cache, converted in chunks
    (a chunk smaller than the cache, so that the per-tensor amax must span chunks)."""
    kv = torch.randn(3, 8, 576)
    kv[2, 5, 17] = 40.0                        # the cache's largest entry sits in the last chunk
    packed = fp8_format.quantize(kv)
    kv8, scale = peers.flashmla_fp8_cache(packed, chunk_rows=5)
    assert kv8.shape == (3, 8, 576) and kv8.dtype == torch.float8_e4m3fn and scale.shape == (1,)
    mine = fp8_format.dequantize(packed, torch.float32, exact=True)
    assert float(scale) == pytest.approx(float(mine.abs().amax()) / 448.0)
    theirs = kv8.float() * scale
    assert float(theirs.abs().amax()) == pytest.approx(float(mine.abs().amax()), rel=1e-6)
    # e4m3 keeps 3 mantissa bits: within 2^-4 of an entry, or of the format's smallest steps near zero
    assert ((theirs - mine).abs() <= mine.abs() / 16 + 2 ** -9 * float(scale)).all()
    q = torch.randn(2, 1, 4, 576, dtype=torch.bfloat16)
    q8, q_scale = peers.flashmla_fp8_q(q)
    assert q8.dtype == torch.float8_e4m3fn and q8.shape == q.shape
    assert ((q8.float() * q_scale - q.float()).abs() <= q.float().abs() / 16 + 2 ** -9 * float(q_scale)).all()


def test_flashmla_peer_says_why_it_cannot_run(monkeypatch):
    assert "CUDA" in peers.unavailable_reason("flashmla", torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert "sm_100" in peers.unavailable_reason("flashmla", torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setitem(sys.modules, "flash_mla", None)       # an import of it fails, as where it is not installed
    assert "sgl-flash-mla" in peers.unavailable_reason("flashmla", torch.device("cuda"))


def test_sglang_splits_follow_its_heuristic():
    splits = peers.sglang_num_kv_splits([4096] * 128, num_heads=16, sm_count=132)
    assert len(set(splits)) == 1 and 1 <= splits[0] <= 8
    small = peers.sglang_num_kv_splits([32768], num_heads=128, sm_count=132)
    assert small == [8]                                          # one request fills the GPU only by splitting
    mixed = peers.sglang_num_kv_splits([1000, 8000], num_heads=16, sm_count=132)
    assert mixed[1] > mixed[0] and max(mixed) <= 8


def test_interleaved_rounds_take_turns_and_compare_per_round():
    """limits.interleaved_us: every run once a round, rotating among its calls, the order rotating from round to
    round; ratio_median divides round by round (CPU: wall clock)."""
    from mlaserve.bench.limits import interleaved_us, ratio_median
    calls = []

    def make(name, k, seconds):
        def fn():
            calls.append((name, k))
            time.sleep(seconds)
        return fn
    runs = {"fast": [make("fast", 0, 0.001), make("fast", 1, 0.001)], "slow": [make("slow", 0, 0.004)]}
    times = interleaved_us(runs, torch.device("cpu"), rounds=4)
    assert [len(v) for v in times.values()] == [4, 4]
    assert calls == [("fast", 0), ("slow", 0), ("slow", 0), ("fast", 1), ("fast", 0), ("slow", 0), ("slow", 0),
                     ("fast", 1)]
    assert all(t >= 1000 for t in times["fast"]) and all(t >= 4000 for t in times["slow"])
    assert ratio_median(times, "slow", "fast") > 1.5
    assert ratio_median(times, "fast", "fast") == 1.0


def test_ratio_quartiles_spread_the_per_round_ratios():
    """limits.ratio_quartiles: the quartiles of the rounds' ratios (round by round, not of each run's times), with
    the median between them; one round gives its ratio twice."""
    from mlaserve.bench.limits import ratio_median, ratio_quartiles
    times = {"on": [100.0, 200.0, 100.0, 100.0, 50.0], "off": [101.0, 206.0, 98.0, 104.0, 51.0]}
    q1, q3 = ratio_quartiles(times, "off", "on")
    assert (q1, q3) == pytest.approx((1.01, 1.03))
    assert q1 <= ratio_median(times, "off", "on") <= q3
    assert ratio_quartiles({"a": [3.0], "b": [2.0]}, "a", "b") == (1.5, 1.5)


def test_sustained_rounds_time_back_to_back_calls_in_turns():
    """interleaved_us(sustain_ms=...): each turn is several back-to-back calls (limits.time_us), the runs still
    taking turns with the order rotating, one time per run a round."""
    from mlaserve.bench.limits import interleaved_us, ratio_median
    calls = []

    def make(name, seconds):
        def fn():
            calls.append(name)
            time.sleep(seconds)
        return fn
    runs = {"a": [make("a", 0.001)], "b": [make("b", 0.003)], "c": [make("c", 0.001)]}
    times = interleaved_us(runs, torch.device("cpu"), rounds=2, sustain_ms=5)
    assert [len(v) for v in times.values()] == [2, 2, 2]
    turns = [name for i, name in enumerate(calls) if i == 0 or calls[i - 1] != name]
    assert turns == ["a", "b", "c", "b", "c", "a"]
    assert len(calls) >= 6 * 3          # time_us on the CPU: at least 3 calls a turn
    assert ratio_median(times, "b", "a") > 1.5


def test_peer_ratio_is_the_median_of_per_round_ratios_where_rounds_were_interleaved():
    """Rows of one shape and KV timed in the same rounds compare round by round (the clock drifts between rounds);
    rows without rounds, or of another KV, by their medians."""
    base = {"suite": "dense", "key": "k", "shape": {}, "bytes": 4e9, "flops": 1e12, "status": "ok"}
    data = {"limits": {}, "rows": [
        dict(base, kv="bf16", backend="cutedsl", time_rounds_us=[900.0, 1000.0, 1000.0], time_us=1000.0),
        dict(base, kv="bf16", backend="flashinfer", time_rounds_us=[990.0, 990.0, 1010.0], time_us=990.0),
        dict(base, kv="fp8", backend="cutedsl", time_rounds_us=[500.0, 500.0, 500.0], time_us=500.0),
        dict(base, kv="bf16", backend="triton", time_us=1250.0)]}
    report.derive(data)
    cu, fi, cu8, tri = data["rows"]
    # per round 1.1, 0.99, 1.01: median 1.01 (the medians' ratio would say 0.99)
    assert cu["vs"]["flashinfer"] == pytest.approx(1.01)
    assert fi["vs"]["cutedsl"] == pytest.approx(1 / 1.01)
    assert cu["vs"]["cutedsl@fp8"] == pytest.approx(0.5) and cu["vs"]["triton"] == pytest.approx(1.25)
    assert tri["vs"]["cutedsl"] == pytest.approx(0.8)
