cd "$(dirname "$0")"
export CUDA_LAUNCH_BLOCKING=1
for be in triton flashinfer; do
  echo "=== b1 $be (blocking launches)"
  timeout 60 python3 -m mlaserve.cli bench kernels --suite dense --backends $be --shapes "b1 sq1" --out /tmp/b1_$be --disable-tqdm 2>&1 | grep -v "^\s*$" | tail -8
done
unset CUDA_LAUNCH_BLOCKING
echo "=== the rest of the dense suite (var, s_q 2, b4, b16)"
timeout 330 python3 -m mlaserve.cli bench kernels --suite dense --backends triton,flashinfer --shapes "var,sq2,b4 ,b16 " --out $OUT --disable-tqdm --time-budget 310 > $OUT/bench.log 2>&1
echo "bench rc $?"; tail -5 $OUT/bench.log
