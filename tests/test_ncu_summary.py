"""scripts/ncu_summary.py on small exports written here in Nsight Compute's CSV shapes (the device's ncu phase
writes the real ones): the table's columns and scaling, and the hottest instructions in program order."""

import csv
import gzip
import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "ncu_summary", Path(__file__).resolve().parents[1] / "scripts" / "ncu_summary.py")
ncu_summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ncu_summary)


def _write(path: Path, rows: list[list[str]]) -> str:
    with gzip.open(path, "wt", newline="") as f:
        csv.writer(f).writerows(rows)
    return str(path)


def test_raw_page_table_has_a_scaled_column_per_kernel(tmp_path):
    header = ["ID", "Kernel Name", "gpc__cycles_elapsed.max", "sm__cycles_active.max", "dram__bytes_read.sum"]
    units = ["", "", "cycle", "cycle", "Gbyte"]
    kernels = [["0", "kernel_cutlass_kernel_mlaservekernelscutedslmla_decode", "866,536", "849892", "0.6427"],
               ["1", "void flashinfer::mla::hopper::BatchMLAPageAttentionHopperKernel<>", "856736", "851166", "0.6419"],
               ["2", "_longest_first_kernel", "9901", "7218", "n/a"]]
    lines = ncu_summary.summary(_write(tmp_path / "raw.csv.gz", [header, units, *kernels])).splitlines()
    assert lines[0].split()[1:] == ["cutedsl", "flashinfer", "_longest_first"]
    table = {line[:24].strip(): line[24:].split() for line in lines[1:]}
    assert table["elapsed k cycles"] == ["866.5", "856.7", "9.901"]
    assert table["SM active max k"] == ["849.9", "851.2", "7.218"]
    assert table["DRAM read GB"] == ["0.6427", "0.6419", "n/a"]    # an unreadable value is shown as it is
    assert "time us" not in table                                    # metrics the export lacks are left out


def test_source_page_lists_the_hottest_instructions_in_program_order(tmp_path):
    cols = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed"]
    rows = [["Kernel Name", "first"], cols,
            ["0x0", "  LDC R1, c[0x0][0x28]", "5", "132"],
            ["0x10", "  HGMMA.64x64x16.F32.BF16 R152", "40", "131072"],
            ["0x20", "  SYNCS.PHASECHK.TRANS64.TRYWAIT P0", "50", "129024"],
            ["0x30", "  EXIT", "5", "132"],
            ["Kernel Name", "second"], cols,
            ["0x0", "  NOP", "7", "1"]]
    path = _write(tmp_path / "source.csv.gz", rows)
    assert [name for name, _, _ in ncu_summary.source_kernels(path)] == ["first", "second"]
    lines = ncu_summary.stalls(path, 0, 2).splitlines()
    assert lines[0].startswith("first: 4 instructions, 100 samples")
    assert [line.split()[0] for line in lines[1:]] == ["1", "2"]    # the two hottest, in program order
    assert "40.0%" in lines[1] and "TRYWAIT" in lines[2]


def test_partitions_split_the_stall_reasons_at_each_register_reallocation(tmp_path):
    cols = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_barrier",
            "stall_no_inst", "stall_barrier (Not Issued)"]
    rows = [["Kernel Name", "k"], cols,
            ["0x0", "  USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0", "0", "8", "0", "0", "0"],
            ["0x10", "  FFMA R1, R2, R3, R4", "30", "1000", "0", "30", "0"],
            ["0x20", "  BAR.SYNC.DEFER_BLOCKING 0x1", "10", "8", "10", "0", "10"],
            ["0x30", "  USETMAXREG.DEALLOC.CTAPOOL 0x18", "1", "4", "0", "1", "0"],
            ["0x40", "  SYNCS.PHASECHK.TRANS64.TRYWAIT P0", "59", "4000", "59", "0", "59"],
            ["0x50", "  EXIT", "0", "4", "0", "0", "0"]]
    lines = ncu_summary.partitions(_write(tmp_path / "source.csv.gz", rows), 0).splitlines()
    assert lines[0] == "k: 6 instructions, 100 samples"
    assert "barrier 69%" in lines[1] and "no_inst 31%" in lines[1]           # the whole kernel
    assert lines[2].startswith("  [0, 3):  40% of the samples") and "no_inst 75%" in lines[2]
    assert lines[3].startswith("  [3, 5):  60% of the samples") and "barrier 98%" in lines[3]
    assert len(lines) == 4          # the last range ([5, 6): EXIT, no samples) is under the 5% shown
    assert all("(Not Issued)" not in line for line in lines)
