#!/usr/bin/env bash
# Packs what the GPU device machine lacks into the git-ignored folder .peers/ of the repo root, which the
# lead names in `carry` (scripts/device_run.sh says the exact call):
#   .peers/flashinfer/  FlashInfer 0.7.2.post1, pruned to its MLA-relevant sources (~13 MB), + apache-tvm-ffi wheel,
#                       made by ../shared/tools/pack-flashinfer-for-device.sh
#   .peers/sglang/      the SGLang wheel (--no-deps, 6 MB); `bench kernels` extracts and imports only its Triton
#                       decode kernel (triton_ops/decode_attention.py) at run time — SGLang's code is never committed
#   .peers/flashmla/    the sgl-flash-mla wheel (FlashMLA as SGLang ships it, 10 MB; abi3, loaded through torch.ops,
#                       so torch 2.11 loads it although its metadata asks for a newer one: installed --no-deps)
#   .peers/GIT_COMMIT   the commit the results belong to (the device gets a copy of the tree without .git)
# The device image already has torch, triton, tqdm, matplotlib, pytest (KINDS.md): no other wheels are needed.
# Usage: scripts/pack_for_device.sh        (skips what is already packed; FORCE=1 packs again)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
sglang_version=${SGLANG_VERSION:-0.5.10.post1}
flashmla_version=${FLASHMLA_VERSION:-1.0.0}

tool=""
for cand in "$root/../shared/tools/pack-flashinfer-for-device.sh" "$root/shared/tools/pack-flashinfer-for-device.sh" \
            /work/shared/tools/pack-flashinfer-for-device.sh; do
  if [ -f "$cand" ]; then tool=$cand; break; fi
done

if [ "${FORCE:-0}" = 1 ]; then rm -rf .peers/flashinfer .peers/sglang .peers/flashmla; fi
mkdir -p .peers

if ls .peers/flashinfer/flashinfer-pruned.tar.xz .peers/flashinfer/apache_tvm_ffi-*.whl >/dev/null 2>&1; then
  echo "flashinfer: already packed"
elif [ -n "$tool" ]; then
  # the tool writes DEST/… after a cd, so it needs an absolute DEST
  bash "$tool" "$root/.peers/flashinfer"
else
  echo "flashinfer: pack-flashinfer-for-device.sh not found (looked in ../shared/tools); skipping" >&2
fi

if ls .peers/sglang/sglang-*.whl >/dev/null 2>&1; then
  echo "sglang: already packed"
else
  mkdir -p .peers/sglang
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform any --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    -d .peers/sglang "sglang==$sglang_version"
  python3 - <<'EOF'
import glob, zipfile
wheel = sorted(glob.glob(".peers/sglang/sglang-*.whl"))[-1]
member = "sglang/srt/layers/attention/triton_ops/decode_attention.py"
assert member in zipfile.ZipFile(wheel).namelist(), f"{wheel} has no {member}"
print(f"sglang: {wheel} holds {member}")
EOF
fi

if ls .peers/flashmla/sgl_flash_mla-*.whl >/dev/null 2>&1; then
  echo "flashmla: already packed"
else
  mkdir -p .peers/flashmla
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 -d .peers/flashmla "sgl-flash-mla==$flashmla_version"
fi

# the server's packages, which the device image lacks (its GPU tests start `mlaserve serve`)
server_wheels=(fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.13.4 pydantic-core==2.46.4
               annotated-types==0.7.0 typing-inspection==0.4.2 opentelemetry-api==1.45.2)
if ls .peers/wheels/uvicorn-*.whl >/dev/null 2>&1; then
  echo "server wheels: already packed"
else
  mkdir -p .peers/wheels
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform any --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .peers/wheels "${server_wheels[@]}"
fi

# CuTe DSL (issue 7), only when asked: CUTEDSL=1. Its compiler library is over one call's 64 MiB even
# compressed, so it lives apart in .cutedsl/, cut into CUTEDSL_PARTS parts (default 2) that travel one call each on
# a warm machine, the wheels with the last (scripts/device_run.sh's phases cutedsl1 and cutedsl2 say how). The
# shared packing tool cuts parts of 31 MB (two, and 1.5 MB over); they are joined and cut again here into equal
# parts, more of them (CUTEDSL_PARTS=3) if the working tree grows past ~30 MB. About 4 minutes of xz here the first
# time.
if [ "${CUTEDSL:-0}" = 1 ]; then
  if ls .cutedsl/part00 .cutedsl/wheels/*.whl >/dev/null 2>&1; then
    echo "cutedsl: already packed"
  else
    cutedsl_tool=""
    for cand in "$root/../shared/tools/pack-cutedsl-for-device.sh" /work/shared/tools/pack-cutedsl-for-device.sh; do
      if [ -f "$cand" ]; then cutedsl_tool=$cand; break; fi
    done
    if [ -z "$cutedsl_tool" ]; then echo "cutedsl: pack-cutedsl-for-device.sh not found" >&2; exit 1; fi
    bash "$cutedsl_tool" "$root/.cutedsl"
  fi
  want=${CUTEDSL_PARTS:-2}
  parts=(.cutedsl/part*)
  if [ "${#parts[@]}" -ne "$want" ]; then
    cat "${parts[@]}" > .cutedsl/joined.tmp
    rm -f "${parts[@]}"
    size=$(( ($(stat -c %s .cutedsl/joined.tmp) + want - 1) / want ))
    split -b "$size" -d -a 2 .cutedsl/joined.tmp .cutedsl/part
    rm .cutedsl/joined.tmp
  fi
  ls -l .cutedsl/part* | awk '{print "cutedsl: " $NF " " $5 " bytes"}'
fi

commit=$(git rev-parse HEAD 2>/dev/null || echo unknown)
if [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then commit="$commit-dirty"; fi
echo "$commit" > .peers/GIT_COMMIT
echo "packed for commit $commit:"
du -sh .peers/* | sed 's/^/  /'
total_mb=$(du -sm .peers | cut -f1)
if [ "$total_mb" -gt 48 ]; then
  echo "WARNING: .peers is ${total_mb} MB; with the working tree it must stay under the 64 MiB a device call" \
    "carries" >&2
fi
