"""scripts/decode_ab.py's seesaw switches: SEESAW_SET turns the named mla_decode flags on together and every one of
them back off (a setter that left one on would compare two 'on' kernels)."""

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("decode_ab", Path(__file__).resolve().parents[1] / "scripts" /
                                               "decode_ab.py")
decode_ab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(decode_ab)
cd = importlib.import_module("mlaserve.kernels.cutedsl.mla_decode")
set_module_value = importlib.import_module("mlaserve.bench.switches").set_module_value


def test_the_seesaw_switches_are_the_kernels_boolean_flags():
    for name in decode_ab.SEESAW_SWITCHES:
        assert type(getattr(cd, name)) is bool, name


def test_seesaw_set_turns_the_named_switches_on_and_all_off(monkeypatch):
    for name in (*decode_ab.SEESAW_SWITCHES, "SPEC_EXP"):
        monkeypatch.setattr(cd, name, getattr(cd, name))      # restored after the test
    monkeypatch.setattr(cd, "SPEC_EXP", True)
    monkeypatch.setenv("DA_SEESAW", "FOLD_SCALE, TREE_MAX")
    _, switch = decode_ab.SWITCHES["SEESAW_SET"]
    switch(True)
    assert (cd.FOLD_SCALE, cd.TREE_MAX, cd.LAZY_RESCALE, cd.SPEC_EXP) == (True, True, False, False)
    switch(False)
    assert not any(getattr(cd, name) for name in (*decode_ab.SEESAW_SWITCHES, "SPEC_EXP"))
    monkeypatch.delenv("DA_SEESAW")
    switch(True)
    assert all(getattr(cd, name) for name in decode_ab.SEESAW_SWITCHES)
    monkeypatch.setenv("DA_SEESAW", "FOLD_SCALE,NO_SUCH_SWITCH")
    with pytest.raises(SystemExit, match="NO_SUCH_SWITCH"):
        switch(True)


def test_sparse_softmax_switches_set_the_sparse_modules_flags(monkeypatch):
    sp = importlib.import_module("mlaserve.kernels.cutedsl.sparse_mla")
    for name in decode_ab.SPARSE_SOFTMAX:
        monkeypatch.setattr(sp, name, getattr(sp, name))      # restored after the test
    _, switch = decode_ab.SWITCHES["SPARSE_SOFTMAX"]
    switch(True)
    assert all(getattr(sp, name) is True for name in decode_ab.SPARSE_SOFTMAX)
    _, one = decode_ab.SWITCHES["SPARSE_TREE_MAX"]
    one(False)
    assert (sp.LAZY_RESCALE, sp.TREE_MAX) == (True, False)
    switch(False)
    assert not any(getattr(sp, name) for name in decode_ab.SPARSE_SOFTMAX)


def test_kv_ring_switches_set_their_values_and_only_theirs(monkeypatch):
    """KV_SPLIT takes its threshold from DA_KV_SPLIT_MIN_ROWS (the module's when unset) and turns the ring off
    again; KV_PREFETCH sets DA_KV_PREFETCH tiles ahead (2 when unset) on both rings against none on either."""
    for name in ("KV_SPLIT", "KV_SPLIT_MIN_ROWS", "KV_PREFETCH", "KV_PARTS_PREFETCH"):
        monkeypatch.setattr(cd, name, getattr(cd, name))      # restored after the test
    default_rows = cd.KV_SPLIT_MIN_ROWS
    _, split = decode_ab.SWITCHES["KV_SPLIT"]
    monkeypatch.setenv("DA_KV_SPLIT_MIN_ROWS", "64")
    split(True)
    assert (cd.KV_SPLIT, cd.KV_SPLIT_MIN_ROWS) == (True, 64)
    assert cd.kv_ring(64) == (1, True, cd.KV_PREFETCH)
    split(False)
    assert cd.KV_SPLIT is False and cd.kv_ring(256) == (cd.KV_PARTS, False, cd.KV_PARTS_PREFETCH)
    monkeypatch.delenv("DA_KV_SPLIT_MIN_ROWS")
    split(True)
    assert cd.KV_SPLIT_MIN_ROWS == default_rows
    _, prefetch = decode_ab.SWITCHES["KV_PREFETCH"]
    prefetch(True)
    assert (cd.KV_PREFETCH, cd.KV_PARTS_PREFETCH) == (2, 2)
    monkeypatch.setenv("DA_KV_PREFETCH", "3")
    prefetch(True)
    assert (cd.KV_PREFETCH, cd.KV_PARTS_PREFETCH) == (3, 3)
    prefetch(False)
    assert (cd.KV_PREFETCH, cd.KV_PARTS_PREFETCH) == (0, 0)


def test_set_module_value_sets_bools_and_ints_and_refuses_what_it_cannot_set(monkeypatch):
    """decode_ab --set and cutedsl_sass --flag (mlaserve.bench.switches): an existing bool or int, else an exit
    naming the item."""
    for name in ("KV_PREFETCH", "KV_SPLIT"):
        monkeypatch.setattr(cd, name, getattr(cd, name))      # restored after the test
    set_module_value(cd.__name__, "KV_PREFETCH=2")
    set_module_value(cd.__name__, "KV_SPLIT=0")
    assert (cd.KV_PREFETCH, cd.KV_SPLIT) == (2, False)
    for bad in ("KV_PREFETCH", "NO_SUCH_VALUE=1", "KV_PREFETCH=two", "KV_SPLIT=maybe", "CONFIG=1"):
        with pytest.raises(SystemExit, match=re.escape(repr(bad))):
            set_module_value(cd.__name__, bad)
