"""scripts/cutedsl_sass.py compiles the 16-bit kernels that mla_decode launches: the rows a request has pick the KV
ring (mla_decode.kv_ring) and, for grids, the cluster, so the tool passes them on (checked here without the DSL:
the compile call itself is recorded)."""

import importlib
import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("cutedsl_sass", Path(__file__).resolve().parents[1] / "scripts" /
                                               "cutedsl_sass.py")
cutedsl_sass = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cutedsl_sass)
cd = importlib.import_module("mlaserve.kernels.cutedsl.mla_decode")


@pytest.mark.parametrize("kind, split, rows, want", [
    ("bf16", False, 0, dict(split=False, cluster=1, rows=64)),
    ("bf16", True, 128, dict(split=True, cluster=2, rows=128)),       # a split grid of 128-row requests
    ("bf16-pairs", False, 0, dict(split=False, cluster=2, rows=128, persistent=True)),
    ("bf16-pairs", False, 256, dict(split=False, cluster=2, rows=256, persistent=True)),
])
def test_16bit_kinds_compile_for_the_rows_they_name(monkeypatch, kind, split, rows, want):
    calls = []
    monkeypatch.setattr(cd, "_kernel", lambda dtype, causal, split, **kw: calls.append(dict(split=split, **kw)))
    cutedsl_sass.compile_kernel(kind, split, [], rows=rows)
    (got,) = calls
    assert {k: got.get(k, False) for k in want} == want


def test_fp8_seesaw_kind_compiles_the_seesaw_on_fp8_pages(monkeypatch):
    calls = []
    monkeypatch.setattr(cd, "_kernel", lambda dtype, causal, split, **kw: calls.append(dict(split=split, **kw)))
    cutedsl_sass.compile_kernel("fp8-seesaw", True, [])
    (got,) = calls
    assert got["kv_fp8"] and got["split"] and not got.get("narrow") and not got.get("fp8_mma") \
        and not got.get("fp8_f16")


def test_bf16_pairs_refuses_a_split():
    with pytest.raises(SystemExit, match="unsplit only"):
        cutedsl_sass.compile_kernel("bf16-pairs", True, [])
