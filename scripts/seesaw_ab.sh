#!/usr/bin/env bash
# The CuTe seesaw's switches (bench/NOTES.md 92-93), each on against off in scripts/decode_ab.py at the 128-row shapes,
# on a Hopper GPU with the CuTe DSL on the path (scripts/device_run.sh's phases cutedsl1, cutedsl2). Run as the device
# script's "script" phase, e.g.
#   PHASES=env,cutedsl2,pytest,script PYTEST_ARGS="tests/gpu/test_cutedsl_mla.py -k seesaw_switches" \
#     SCRIPT_CMD="bash scripts/seesaw_ab.sh" T_SCRIPT=330 DEVICE_BUDGET_S=590 bash scripts/device_run.sh
# SEESAW_AB_SWITCHES picks the switches (default below; SEESAW_SET takes DA_SEESAW), SEESAW_AB_SHAPES the shapes,
# SEESAW_AB_ROUNDS the rounds (10), SEESAW_AB_T the seconds each switch may take (60), SEESAW_AB_ARGS more decode_ab
# flags (e.g. "--sustain-ms 20": turns of back-to-back calls at the clock a sustained benchmark holds; the benchmark
# read s_q2 h128 4k at 529 us against decode_ab's 480-493 us single calls, and the switches' 2.7% there did not show
# in it: bench/NOTES.md 61, 93).
set -o pipefail
cd "$(dirname "$0")/.." || exit 1
SWITCHES=${SEESAW_AB_SWITCHES:-LAZY_RESCALE FOLD_SCALE TREE_MAX SEESAW_SET}
DEFAULT_SHAPES="b128 h128 sk4096,b128 h128 sq2 sk4096,b128 h64 sq2 sk8192,b128 h128 sk32768,b4 h128 sk32768"
SHAPES=${SEESAW_AB_SHAPES:-$DEFAULT_SHAPES}
for sw in $SWITCHES; do
  echo "=== $sw (DA_SEESAW=${DA_SEESAW:-} SEESAW_AB_ARGS=${SEESAW_AB_ARGS:-})"
  # shellcheck disable=SC2086  # SEESAW_AB_ARGS is words on purpose
  timeout "${SEESAW_AB_T:-60}" python3 scripts/decode_ab.py --switch "$sw" --rounds "${SEESAW_AB_ROUNDS:-10}" \
    --shapes "$SHAPES" ${SEESAW_AB_ARGS:-} 2>&1 | grep -v -i "warning"
  echo "=== $sw: rc $?"
done
