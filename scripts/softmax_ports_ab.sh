#!/usr/bin/env bash
# The softmax switches ported from the bf16 seesaw (bench/NOTES.md 94-95), each on against off, at the shapes of the
# kernel each one changes: the sparse seesaw (bf16 DSA decode), the 64-row FP8 decode (h64/h128 over the FP8 cache)
# and the sparse FP8 kernel (DSA over the FP8 cache). Needs the CuTe DSL on the path (scripts/device_run.sh's phases
# cutedsl1, cutedsl2); run as the device script's "script" phase:
#   PHASES=env,cutedsl2,pytest,script PYTEST_ARGS="tests/gpu/test_cutedsl_sparse_gpu.py tests/gpu/test_cutedsl_mla.py
#     -k softmax_switches" T_PYTEST=240 SCRIPT_CMD="bash scripts/softmax_ports_ab.sh" T_SCRIPT=300 \
#     DEVICE_BUDGET_S=590 bash scripts/device_run.sh
# SEESAW_AB_ROUNDS and SEESAW_AB_T pass through to scripts/seesaw_ab.sh.
cd "$(dirname "$0")/.." || exit 1
SEESAW_AB_SWITCHES="FP8_LAZY_RESCALE FP8_TREE_MAX FP8_SOFTMAX" \
  SEESAW_AB_SHAPES="b128 h128 sk4096 fp8,b128 h128 sq2 sk4096 fp8,b128 h64 sk8192 fp8,b16 h128 sk32768 fp8" \
  bash scripts/seesaw_ab.sh
SEESAW_AB_SWITCHES="SPARSE_LAZY_RESCALE SPARSE_TREE_MAX SPARSE_SOFTMAX" \
  SEESAW_AB_SHAPES="sparse b128 h128,sparse b64 h128 sq2,sparse b128 h64" \
  bash scripts/seesaw_ab.sh
SEESAW_AB_SWITCHES="SPARSE_FP8_SOFTMAX" SEESAW_AB_SHAPES="sparse b128 h128 fp8,sparse b64 h128 sq2 fp8" \
  bash scripts/seesaw_ab.sh
