#!/usr/bin/env bash
# ONE command for the H200 device: install the carried peers, run the GPU tests, benchmark every kernel backend.
#
# The lead's call, after `scripts/pack_for_device.sh` here (it fills the git-ignored .peers/):
#   run(command="bash scripts/device_run.sh", carry=[".peers"], timeout_s=600)
# Tuning sweeps instead of tests + benchmark (the kernel engineers' scripts/tune_*.py):
#   run(command="PHASES=env,install,tune bash scripts/device_run.sh", carry=[".peers"], timeout_s=600)
# Tensor parallelism over NCCL (tests/gpu/test_tp_gpu.py skips below 2 GPUs), on the 2-GPU kind:
#   run(command="PHASES=env,install,pytest PYTEST_ARGS=tests/gpu/test_tp_gpu.py bash scripts/device_run.sh",
#       kind="nvidia-h200-x2", carry=[".peers"])
# Only some suites or backends, e.g.:
#   run(command="BENCH_SUITES=dense BENCH_BACKENDS=triton,flashinfer bash scripts/device_run.sh", carry=[".peers"])
#
# Every phase is time-bounded (`timeout`) and independent of the others' success; the whole script keeps
# inside DEVICE_BUDGET_S (default 560 s, under the 600 s a call may run). Knobs (environment):
#   PHASES            env,install,pytest,bench (default); "tune" runs the sweeps; MLASERVE_TUNE=1 means
#                     PHASES=env,install,tune (a sweep and the benchmark do not both fit in one 600 s call)
#   BENCH_SUITES      "dense sparse indexer"      one `bench kernels` process each (a kernel fault in one
#                                                 suite cannot lose the others' rows: they merge in kernels.json)
#   BENCH_BACKENDS    all                          comma list: torch,triton,cutedsl,flashinfer,flashmla,sglang
#   BENCH_SHAPES      ""                           comma list of substrings of shape keys ("sq1 sk8192", "decode b128")
#   BENCH_ARGS        ""                           more `bench kernels` flags, e.g. "--rounds 15 --rep-ms 150" (more
#                                                 interleaved rounds: the SM clock moves +-10% from round to round)
#   PYTEST_ARGS       tests/gpu                    what the pytest phase runs
#   phase "cutedsl"   scripts/cutedsl_check.py and scripts/cutedsl_sparse_check.py (the CuTe DSL kernels against
#                     the reference, then their timings) into cutedsl.log / cutedsl_sparse.log; needs the DSL on
#                     the machine (phases cutedsl1 + cutedsl2 below); T_CUTEDSL 150 each, CUTEDSL_ARGS passed on
#                     (CUTEDSL_SPARSE_ARGS, when set, to the sparse script instead: e.g. CUTEDSL_ARGS=--clusters
#                     CUTEDSL_SPARSE_ARGS="" times the dense cluster sizes and runs every sparse check)
#   phase "gluon"     scripts/gluon_check.py and scripts/gluon_narrow_check.py (the Gluon decodes, bf16 and FP8 KV,
#                     against the reference, timed beside the tl kernel) into gluon.log; T_GLUON 200 each
#   phase "script"    bash -c "$SCRIPT_CMD" after the tests, before the benchmark, into script.log; T_SCRIPT 150
#   phase "ncu"       Nsight Compute (--set NCU_SET, default full; clocks left alone) over one call of each of
#                     NCU_RUNS (scripts/ncu_profile.py: "BACKEND SHAPE,..."), into ncu.log, ncu_details.csv,
#                     ncu_raw.csv.gz and ncu_source.csv.gz (per SASS instruction), scripts/ncu_summary.py's
#                     table printed; T_NCU 240
#   phase "splits"    scripts/split_sweep.py (small-batch KV split counts, timed as the benchmark) for triton, then for
#                     cutedsl where the DSL is on the machine, into splits.log; T_SPLITS 120 each
#   T_TEST 180, or the pytest phase's limit less 20 s where lower (pytest-timeout's limit per test: a test that
#                     hangs then fails by name instead of the phase being killed with nothing said)
#   T_PYTEST 150  T_SPARSE 90  T_INDEXER 45  T_TUNE 250 (per tuning script)   seconds; T_DENSE defaults to
#                     what is left after reserving the later suites (about 200 s when the GPU tests take 150 s)
# Files back in $OUT (at most 8, flat): device.log pytest.log bench.log kernels.json kernels.png cutedsl.log
#   cutedsl_sparse.log splits.log gluon.log script.log
#   and with tune: tune.log tune_mla_decode.json tune_sparse.json
# The last thing printed is a short table (phases, then the headline kernel shapes).

cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
OUT=${OUT:-$ROOT/out}
mkdir -p "$OUT"
LOG=$OUT/device.log
BUDGET=${DEVICE_BUDGET_S:-560}
# MLASERVE_TUNE=1 is shorthand for PHASES=env,install,tune (the sweeps need the whole call)
if [ "${MLASERVE_TUNE:-0}" = 1 ] && [ -z "${PHASES:-}" ]; then PHASES=env,install,tune; fi
PHASES=",${PHASES:-env,install,pytest,bench},"
SUMMARY=()

export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# where carried packages are unpacked, and where the DSL's parts wait for the last (tests/test_device_run.py moves them)
export DEVICE_SITE=${DEVICE_SITE:-/tmp/site} DEVICE_STAGE=${DEVICE_STAGE:-/tmp/cutedsl}
# the commit scripts/pack_for_device.sh recorded (run it right before each call): results carry it
if [ -f .peers/GIT_COMMIT ]; then export MLASERVE_GIT_COMMIT=$(cat .peers/GIT_COMMIT); fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-16}
# NVLink multicast stays off (KINDS.md); single-GPU work here, but keep the machine's rule explicit.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

say() { echo "$*" | tee -a "$LOG"; }
has_phase() { case "$PHASES" in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
# seconds a phase may take: its own limit, clipped to what the whole budget has left (minus 15 s to finish)
limit() { local left=$((BUDGET - SECONDS - 15)); if [ "$1" -lt "$left" ]; then echo "$1"; else echo "$left"; fi; }
# run NAME LIMIT_S LOGFILE CMD...: time-bounded, logged, its exit status recorded in the summary
run_phase() {
  local name=$1 lim=$2 logfile=$3; shift 3
  if [ "$lim" -lt 20 ]; then
    say "== $name: skipped, only ${lim}s of the budget left"; SUMMARY+=("$name: skipped (budget)"); return 0
  fi
  say "== $name (limit ${lim}s): $*"
  local t0=$SECONDS
  timeout -k 10 "$lim" "$@" >>"$logfile" 2>&1
  local rc=$?
  local what="rc $rc"
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then what="TIMED OUT after ${lim}s"; fi
  say "== $name: $what in $((SECONDS - t0))s (log: $(basename "$logfile"))"
  SUMMARY+=("$name: $what, $((SECONDS - t0))s")
  return 0
}

say "device_run.sh: phases ${PHASES//,/ } budget ${BUDGET}s, OUT=$OUT, $(date -u +%FT%TZ)"

# -- env --
if has_phase env; then
  {
    echo "== nvidia-smi"; timeout 30 nvidia-smi
    echo "== versions"
    timeout 60 python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], '| torch', \
torch.__version__, 'cuda', torch.version.cuda, '| triton', triton.__version__, '| gpu', \
torch.cuda.get_device_name(0) if torch.cuda.is_available() \
else None, torch.cuda.device_count(), 'devices')"
    echo "== commit: $(cat .peers/GIT_COMMIT 2>/dev/null || echo unknown)"
  } >>"$LOG" 2>&1
  grep -E "^== versions" -A1 "$LOG" | tail -1
fi

# -- CuTe DSL, in one call per part on a warm machine (its library is larger than one call may carry) --
#   run(command="PHASES=env,cutedsl1 bash scripts/device_run.sh", carry=[".cutedsl/part00", ".peers/GIT_COMMIT"])
#   run(command="PHASES=env,cutedsl2,... bash scripts/device_run.sh",
#       carry=[".cutedsl/part01", ".cutedsl/wheels", ".peers/GIT_COMMIT"])
# each within 30 s of the last; later calls on that machine find it in /tmp/site and put it on the path. A call
# carries 64 MiB with the working tree (~20 MB, most of it bench/results, whose large JSON files are kept gzipped
# for this): the compressed library (~63.5 MB) goes in as many parts as scripts/pack_for_device.sh cut
# (CUTEDSL_PARTS, default 2; 3 while the tree was past 32 MB), cutedsl1 keeping each carried part (and the wheels,
# wherever they travel) in /tmp/cutedsl, cutedsl2 keeping the last and unpacking them all in order. The first
# part's call has room for .peers/flashmla (~9.5 MB; PHASES=env,cutedsl1,install puts it in /tmp/site, where a later
# PHASES=env,install,bench call on the machine finds it); the last part's has ~11 MB.
keep_parts() {
  mkdir -p "$DEVICE_STAGE"
  for f in .cutedsl/part*; do if [ -f "$f" ]; then cp "$f" "$DEVICE_STAGE/"; fi; done
  if ls .cutedsl/wheels/*.whl >/dev/null 2>&1; then cp .cutedsl/wheels/*.whl "$DEVICE_STAGE/"; fi
  ls "$DEVICE_STAGE"
}
if has_phase cutedsl1; then
  run_phase cutedsl-part "$(limit 120)" "$LOG" bash -c "$(declare -f keep_parts); keep_parts"
fi
if has_phase cutedsl2; then
  run_phase cutedsl-unpack "$(limit 240)" "$LOG" bash -c \
    "$(declare -f keep_parts); rm -f $DEVICE_SITE/.cutedsl-unpacked; keep_parts && mkdir -p $DEVICE_SITE && \
     cat $DEVICE_STAGE/part* | tar -xJf - -C $DEVICE_SITE && \
     for w in $DEVICE_STAGE/*.whl; do python3 -m zipfile -e \"\$w\" $DEVICE_SITE || exit 1; done && \
     touch $DEVICE_SITE/.cutedsl-unpacked"
fi
# only a whole unpack goes on the path: a part missing leaves a half-written tree that would import as garbage
if [ -f "$DEVICE_SITE/.cutedsl-unpacked" ]; then
  # the package adds these through a .pth file, which --target installs do not read
  export PYTHONPATH="$PYTHONPATH:$DEVICE_SITE:$DEVICE_SITE/nvidia_cutlass_dsl/dsl_packages"
  where=$(python3 -c 'import cutlass, sys; sys.stdout.write(cutlass.__file__)' 2>&1 | tail -c 200)
  say "== cutedsl: on the path ($where)"
fi

# -- install: FlashInfer (pruned package + tvm-ffi wheel) and any carried wheels into /tmp/site --
if has_phase install; then
  mkdir -p "$DEVICE_SITE"
  if [ -f .peers/flashinfer/flashinfer-pruned.tar.xz ]; then
    run_phase install-flashinfer "$(limit 120)" "$LOG" bash -c \
      "tar -xJf .peers/flashinfer/flashinfer-pruned.tar.xz -C $DEVICE_SITE && python3 -m pip install -q --no-index \
       --no-deps --no-compile --no-cache-dir --target $DEVICE_SITE .peers/flashinfer/apache_tvm_ffi-*.whl"
  else
    say "== install-flashinfer: .peers/flashinfer not carried (run scripts/pack_for_device.sh, carry .peers)"
  fi
  if ls .peers/flashmla/sgl_flash_mla-*.whl >/dev/null 2>&1; then
    # --no-deps: its metadata asks for torch >= 2.14.1, but it loads through torch's stable ABI (peers.py)
    run_phase install-flashmla "$(limit 60)" "$LOG" python3 -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --target $DEVICE_SITE .peers/flashmla/sgl_flash_mla-*.whl
  fi
  if ls .peers/wheels/*.whl >/dev/null 2>&1; then
    run_phase install-wheels "$(limit 120)" "$LOG" python3 -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --target $DEVICE_SITE .peers/wheels/*.whl
  fi
  export PYTHONPATH="$PYTHONPATH:$DEVICE_SITE"
  if [ -d "$DEVICE_SITE/flashinfer" ] && has_phase bench; then
    # JIT-build FlashInfer's MLA modules (bf16, fp8) while the GPU tests run; the bench reuses its disk cache
    say "== flashinfer warm-up started in the background (log /tmp/fi_warm.log, copied into device.log)"
    timeout -k 10 "$(limit 300)" python3 -c "from mlaserve.bench.peers import warm_flashinfer; warm_flashinfer()" \
      >/tmp/fi_warm.log 2>&1 &
    WARM_PID=$!
  fi
fi

# -- the CuTe DSL kernels' own checks (PASS/FAIL per shape, then timings beside Triton), one log each --
if has_phase cutedsl; then
  if python3 -c "import cutlass" >/dev/null 2>&1; then
    for script in scripts/cutedsl_check.py scripts/cutedsl_sparse_check.py; do
      [ -f "$script" ] || continue
      name=$(basename "$script" .py)
      logfile=$OUT/${name/_check/}.log
      args=${CUTEDSL_ARGS:-}
      if [ "$name" = cutedsl_sparse_check ]; then args=${CUTEDSL_SPARSE_ARGS-$args}; fi
      run_phase "$name" "$(limit "${T_CUTEDSL:-150}")" "$logfile" python3 "$script" $args
      grep -E "^(PASS|FAIL)" "$logfile" | awk '{print $1}' | sort | uniq -c | tee -a "$LOG"
      tail -n 8 "$logfile" | tee -a "$LOG"
    done
  else
    say "== cutedsl-check: the DSL is not on this machine (phases cutedsl1, cutedsl2 first)"
  fi
fi

# -- the Gluon decodes (mla_decode_gluon.py, mla_decode_gluon_narrow.py): odd shapes against the reference, then
#    timed --
if has_phase gluon; then
  run_phase gluon-check "$(limit "${T_GLUON:-200}")" "$OUT/gluon.log" python3 scripts/gluon_check.py
  run_phase gluon-narrow-check "$(limit "${T_GLUON:-200}")" "$OUT/gluon.log" python3 scripts/gluon_narrow_check.py
  grep -E "^(PASS|FAIL)" "$OUT/gluon.log" | awk '{print $1, $2}' | sort | uniq -c | tee -a "$LOG"
  grep -E "^b[0-9]+ s_q[0-9]+ h[0-9]+ s_k[0-9]+:" "$OUT/gluon.log" | tee -a "$LOG"
fi

# -- small-batch split-count sweeps (is the planner's pick the fastest?) --
if has_phase splits; then
  for backend in triton cutedsl; do
    if [ "$backend" = cutedsl ] && ! python3 -c "import cutlass" >/dev/null 2>&1; then
      say "== split-sweep-cutedsl: the DSL is not on this machine (phases cutedsl1, cutedsl2 first)"; continue
    fi
    run_phase "split-sweep-$backend" "$(limit "${T_SPLITS:-120}")" "$OUT/splits.log" \
      python3 scripts/split_sweep.py --backend "$backend"
    grep "^BEST $backend" "$OUT/splits.log" | tee -a "$LOG"
  done
fi

# -- pytest tests/gpu --
if has_phase pytest; then
  if [ -d tests/gpu ]; then
    extra=()
    lim=$(limit "${T_PYTEST:-150}")
    # a test that hangs (a kernel deadlock) fails by name before the phase's own limit kills pytest unheard
    t_test=${T_TEST:-$((lim - 20 < 180 ? lim - 20 : 180))}
    if [ "$t_test" -lt 30 ]; then t_test=30; fi
    if python3 -c "import pytest_timeout" >/dev/null 2>&1; then extra=(--timeout "$t_test"); fi
    run_phase pytest "$lim" "$OUT/pytest.log" python3 -m pytest -q -p no:cacheprovider \
      --durations=10 "${extra[@]}" ${PYTEST_ARGS:-tests/gpu}
    tail -n 15 "$OUT/pytest.log" | tee -a "$LOG"
  else
    say "== pytest: no tests/gpu folder"
  fi
fi

# -- one more command of the caller's (an A/B script, a sweep) after the tests, before the benchmark --
if has_phase script; then
  if [ -n "${SCRIPT_CMD:-}" ]; then
    run_phase script "$(limit "${T_SCRIPT:-150}")" "$OUT/script.log" bash -c "$SCRIPT_CMD"
    tail -n 20 "$OUT/script.log" | tee -a "$LOG"
  else
    say "== script: SCRIPT_CMD is empty"
  fi
fi

# -- Nsight Compute's counters for one call of each of NCU_RUNS (scripts/ncu_profile.py), its pages as CSV --
if has_phase ncu; then
  rm -f /tmp/prof.ncu-rep
  run_phase ncu-profile "$(limit "${T_NCU:-240}")" "$OUT/ncu.log" ncu --clock-control none --profile-from-start off \
    --set "${NCU_SET:-full}" --import-source no -f -o /tmp/prof python3 scripts/ncu_profile.py \
    --runs "${NCU_RUNS:-cutedsl b128 h128 sq2 sk4096,flashinfer b128 h128 sq2 sk4096}"
  if [ -f /tmp/prof.ncu-rep ]; then
    ncu --import /tmp/prof.ncu-rep --page details --csv >"$OUT/ncu_details.csv" 2>>"$OUT/ncu.log"
    ncu --import /tmp/prof.ncu-rep --page raw --csv 2>>"$OUT/ncu.log" | gzip >"$OUT/ncu_raw.csv.gz"
    ncu --import /tmp/prof.ncu-rep --page source --csv --print-source sass 2>>"$OUT/ncu.log" \
      | gzip >"$OUT/ncu_source.csv.gz"
    say "== ncu: report $(du -h /tmp/prof.ncu-rep | cut -f1), details $(wc -l <"$OUT/ncu_details.csv") lines"
  fi
  tail -n 20 "$OUT/ncu.log" | tee -a "$LOG"
  if [ -s "$OUT/ncu_raw.csv.gz" ]; then python3 scripts/ncu_summary.py "$OUT/ncu_raw.csv.gz" 2>&1 | tee -a "$LOG"; fi
fi

if [ -n "${WARM_PID:-}" ]; then
  wait "$WARM_PID"; rc=$?
  say "== flashinfer warm-up: rc $rc"; cat /tmp/fi_warm.log | tail -n 30 >>"$LOG"; tail -n 3 /tmp/fi_warm.log
  SUMMARY+=("flashinfer warm-up: rc $rc")
fi

# -- bench kernels, one process per suite, merging into $OUT/kernels.json --
if has_phase bench; then
  first=1
  for suite in ${BENCH_SUITES:-dense sparse indexer}; do
    # dense (140 shapes, in priority order) takes what the later suites and the final report do not need
    reserve=$(( ${T_SPARSE:-90} + ${T_INDEXER:-45} + 25 ))
    case $suite in
      dense) t=${T_DENSE:-$((BUDGET - SECONDS - 15 - reserve))}; if [ "$t" -gt 400 ]; then t=400; fi ;;
      sparse) t=${T_SPARSE:-90} ;; indexer) t=${T_INDEXER:-45} ;; *) t=60 ;;
    esac
    lim=$(limit "$t")
    # shapes may start until 35 s before the limit (the last one and the JSON need that); at least 5 s
    budget=$((lim - 35)); if [ "$budget" -lt 5 ]; then budget=5; fi
    flags=(--suite "$suite" --backends "${BENCH_BACKENDS:-all}" --out "$OUT" --disable-tqdm --time-budget "$budget")
    if [ -n "${BENCH_SHAPES:-}" ]; then flags+=(--shapes "$BENCH_SHAPES"); fi
    # shellcheck disable=SC2206  # BENCH_ARGS is words on purpose, e.g. "--rounds 15 --rep-ms 150"
    if [ -n "${BENCH_ARGS:-}" ]; then flags+=($BENCH_ARGS); fi
    if [ $first = 0 ]; then flags+=(--no-limits); fi   # limits measured once, kept by the merge
    backends=${BENCH_BACKENDS:-all}
    if [ "$backends" = all ]; then
      backends=$(python3 -c "from mlaserve.bench import peers; from mlaserve.ops.registry import BACKENDS; \
print(','.join([*BACKENDS, *peers.PEERS]))" 2>/dev/null || echo all)
    fi
    others=$(tr ',' '\n' <<<"$backends" | grep -v -x flashmla | paste -sd, -)
    if [ "$others" != "$backends" ] && [ -n "$others" ]; then
      # FlashMLA's FP8 sparse decode faulted in every process where other backends had run the shape's bf16 rows
      # first, and ran clean in one of its own (bench/NOTES.md 106); its dense bf16 decode faulted (illegal
      # address) on the first shape after cutedsl and FlashInfer had run it (NOTES 130), and after cutedsl alone
      # (NOTES 181): its rows come from a second process
      lim1=$((lim * 2 / 3)); lim2=$((lim - lim1))
      flags[3]=$others; flags[8]=$(( lim1 > 40 ? lim1 - 35 : 5 ))       # --backends, --time-budget
      run_phase "bench-$suite" "$lim1" "$OUT/bench.log" python3 -m mlaserve.cli bench kernels "${flags[@]}"
      flags[3]=flashmla; flags[8]=$(( lim2 > 25 ? lim2 - 15 : 10 ))   # one light process: ~10 s a suite
      run_phase "bench-$suite-flashmla" "$(limit "$lim2")" "$OUT/bench.log" \
        python3 -m mlaserve.cli bench kernels "${flags[@]}" --no-limits
    else
      run_phase "bench-$suite" "$lim" "$OUT/bench.log" python3 -m mlaserve.cli bench kernels "${flags[@]}"
    fi
    first=0
  done
fi

# -- tuning sweeps (scripts/tune_*.py of the kernel engineers), each writing JSON into $OUT --
if has_phase tune; then
  for script in scripts/tune_mla_decode.py scripts/tune_sparse.py; do
    name=$(basename "$script" .py)
    if [ ! -f "$script" ]; then say "== $name: $script not in the tree"; continue; fi
    help=$(timeout 60 python3 "$script" --help 2>&1)
    if grep -q -- "--output" <<<"$help"; then outflag=(--output "$OUT/$name.json")
    elif grep -q -- "--out" <<<"$help"; then outflag=(--out "$OUT/$name.json")
    else outflag=("$OUT/$name.json"); fi
    run_phase "$name" "$(limit "${T_TUNE:-250}")" "$OUT/tune.log" python3 "$script" "${outflag[@]}"
    tail -n 25 "$OUT/tune.log" | tee -a "$LOG"
  done
fi

# -- finish: only plain files, at most 8, stay in $OUT --
rm -f "$OUT"/*.tmp
say ""
say "== phases"
for line in "${SUMMARY[@]}"; do say "  $line"; done
say "== files in OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
if [ -f "$OUT/kernels.json" ]; then
  say "== kernels (headline shapes; every row is in kernels.json, every table line in bench.log)"
  timeout 60 python3 -m mlaserve.cli bench kernels --report --brief --out "$OUT" 2>&1 | grep -v "^wrote " \
    | tee -a "$LOG"
fi
