#!/usr/bin/env bash
# The f16-register FP8 kernel's four untimed switches (bench/NOTES.md 169-174: FP8_F16_OPEN_END, FP8_F16_PAIRS,
# FP8_F16_STAGGER, FP8_F16_ONE_BLOCK_32), each timed against its default on the shapes it is meant for, then their
# same-bits GPU tests. Run on the device after the CuTe DSL's install calls, in device_run.sh's script phase:
#   PHASES=env,cutedsl2,script T_SCRIPT=480 SCRIPT_CMD="bash scripts/fp8_f16_switches_ab.sh" bash scripts/device_run.sh
# decode_ab prints each shape's on / off medians and their per-round ratio, and OUTPUTS DIFFER if the bits move.
# AB_ROUNDS (10) and AB_SUSTAIN_MS (20) pass through; AB_ONLY=NAME runs one switch's A/B.
set -u
cd "$(dirname "$0")/.." || exit 1
rounds=${AB_ROUNDS:-10}
sustain=${AB_SUSTAIN_MS:-20}
ab() {
  local switch=$1 shapes=$2; shift 2
  if [ -n "${AB_ONLY:-}" ] && [ "$AB_ONLY" != "$switch" ]; then return 0; fi
  echo "== decode_ab --switch $switch $* on '$shapes'"
  python3 scripts/decode_ab.py --switch "$switch" "$@" --shapes "$shapes" --rounds "$rounds" --sustain-ms "$sustain"
}
# the page's start and drain under its last products (h16 and h32; b64 h16: the H200's other chain-bound shape)
ab FP8_F16_OPEN_END 'b128 h16 sk8192 fp8,b128 h32 sk8192 fp8,b64 h16 sk8192 fp8'
# two pages an iteration (16 rows), against open ends alone
ab FP8_F16_PAIRS 'b128 h16 sk4096 fp8,b128 h16 sk8192 fp8' --set FP8_F16_OPEN_END=1
# the second pages asked for once the first have landed: a fixed part of the call, so the shortest contexts
ab FP8_F16_STAGGER 'b128 h16 sk4096 fp8,b128 h32 sk4096 fp8'
# one K block a wgmma group at 32 rows (fewer spills)
ab FP8_F16_ONE_BLOCK_32 'b128 h32 sk8192 fp8'
if [ -z "${AB_ONLY:-}" ]; then
  echo "== same-bits tests"
  python3 -m pytest -q -n 8 -p no:cacheprovider tests/gpu/test_cutedsl_mla.py -k same_bits
fi
