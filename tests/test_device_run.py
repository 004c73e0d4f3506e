"""scripts/device_run.sh's CuTe DSL phases on the CPU: the library's compressed parts arrive one call each (cutedsl1
keeps each, cutedsl2 keeps the last and unpacks them all, then its wheels), as on the device, where a broken recipe
costs a machine start to find out. A small stand-in archive plays the library."""

import io
import os
import shutil
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("xz") is None, reason="tar -J needs the xz program")


def stand_in_parts(n: int) -> list[bytes]:
    """A tar.xz holding a package `cutlass` under nvidia_cutlass_dsl/dsl_packages (where the DSL keeps it), cut
    into n parts."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        body = b"STAND_IN = 'the CuTe DSL'\nPAD = '" + os.urandom(4096).hex().encode() * 8 + b"'\n"
        info = tarfile.TarInfo("nvidia_cutlass_dsl/dsl_packages/cutlass/__init__.py")
        info.size = len(body)
        tar.addfile(info, io.BytesIO(body))
    data = buf.getvalue()
    step = -(-len(data) // n)
    return [data[i * step:(i + 1) * step] for i in range(n)]


def stand_in_wheel(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr("stand_in_dsl_base/__init__.py", "")


def run_phases(repo: Path, tmp: Path, phases: str, call: int) -> str:
    env = dict(os.environ, PHASES=phases, OUT=str(tmp / f"out{call}"), DEVICE_SITE=str(tmp / "site"),
               DEVICE_STAGE=str(tmp / "stage"), DEVICE_BUDGET_S="200")
    proc = subprocess.run(["bash", str(repo / "scripts" / "device_run.sh")], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return (tmp / f"out{call}" / "device.log").read_text()


def carry(repo: Path, names: dict[str, bytes]) -> None:
    """What one call carries into .cutedsl (the earlier calls' parts are gone from the tree, as on a fresh copy)."""
    shutil.rmtree(repo / ".cutedsl", ignore_errors=True)
    (repo / ".cutedsl" / "wheels").mkdir(parents=True)
    for name, data in names.items():
        (repo / ".cutedsl" / name).write_bytes(data)


def make_repo(tmp: Path) -> Path:
    repo = tmp / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "device_run.sh", repo / "scripts" / "device_run.sh")
    return repo


def test_three_parts_in_three_calls_unpack_and_import(tmp_path):
    repo = make_repo(tmp_path)
    parts = stand_in_parts(3)
    for call, name in enumerate(("part00", "part01")):
        carry(repo, {name: parts[call]})
        log = run_phases(repo, tmp_path, "cutedsl1", call)
        assert "cutedsl-part: rc 0" in log, log
    carry(repo, {"part02": parts[2]})
    stand_in_wheel(repo / ".cutedsl" / "wheels" / "stand_in_dsl_base-1.0-py3-none-any.whl")
    log = run_phases(repo, tmp_path, "cutedsl2", 2)
    assert "cutedsl-unpack: rc 0" in log, log
    site = tmp_path / "site"
    init = site / "nvidia_cutlass_dsl" / "dsl_packages" / "cutlass" / "__init__.py"
    assert init.read_bytes().startswith(b"STAND_IN = 'the CuTe DSL'")
    assert (site / "stand_in_dsl_base" / "__init__.py").exists(), "the wheel was not unpacked"
    # the phase after puts the package on the path and imports it
    assert f"== cutedsl: on the path ({init})" in log, log


def test_a_missing_part_fails_the_unpack_by_name(tmp_path):
    repo = make_repo(tmp_path)
    parts = stand_in_parts(3)
    carry(repo, {"part00": parts[0]})
    run_phases(repo, tmp_path, "cutedsl1", 0)
    carry(repo, {"part02": parts[2]})        # part01's call never happened
    stand_in_wheel(repo / ".cutedsl" / "wheels" / "stand_in_dsl_base-1.0-py3-none-any.whl")
    log = run_phases(repo, tmp_path, "cutedsl2", 1)
    assert "cutedsl-unpack: rc 0" not in log and "cutedsl-unpack: rc" in log, log
    assert "== cutedsl: on the path" not in log, log
