#!/usr/bin/env bash
# The FP8 seesaw's timings in one device phase (bench/NOTES.md 154), for device_run.sh's script phase:
#   SCRIPT_CMD="bash scripts/fp8_seesaw_study.sh" PHASES=env,cutedsl2,pytest,script \
#   PYTEST_ARGS="-n 8 -rs tests/gpu/test_cutedsl_mla.py -k fp8_seesaw" bash scripts/device_run.sh
# Each decode_ab line times the 64-row FP8 kernel (off) against the seesaw (on) at its loader's defaults or the --set
# values, interleaved; the last line times bf16 against FP8 through the seesaw. ROUNDS (default 6) per shape.
set -u
cd "$(dirname "$0")/.." || exit 1
AB="python3 scripts/decode_ab.py --rounds ${ROUNDS:-6} --sustain-ms 20"
FOUR="b128 h64 sk4096 fp8,b128 h128 sk4096 fp8"
$AB --switch FP8_SEESAW --shapes "$FOUR,b128 h64 sk32768 fp8,b128 h64 sq2 sk4096 fp8"
# loads issued at a page's start, the page handed over whole: none in flight at a proxy fence
$AB --switch FP8_SEESAW --set FP8_SEESAW_PARTS=1 --set FP8_SEESAW_AHEAD=3 --set FP8_SEESAW_CARRY=0 --shapes "$FOUR"
$AB --switch FP8_SEESAW --set FP8_SEESAW_PARTS=1 --shapes "$FOUR"
$AB --switch FP8_SEESAW_PREFETCH --set FP8_SEESAW=1 --shapes "$FOUR"
python3 scripts/cutedsl_check.py --fp8 --bench-only --shapes 1x64,1x128,2x64 --set FP8_SEESAW=1
