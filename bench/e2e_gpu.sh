#!/usr/bin/env bash
# On a GPU machine: build the Python extension with CUDA (reusing build/gpu when bench/gpu_check.sh made it), then
# run bench/e2e_benchmark.py for each context length given, writing bench/results/<date>-<commit>-e2e-<S>.json and
# its plot (also to $OUT when set).
#   COMMIT=<sha> bash bench/e2e_gpu.sh 122880 [65536 ...] [-- extra e2e_benchmark.py arguments]
set -uo pipefail
cd "$(dirname "$0")/.."
out_dir="${OUT:-bench/results}"
commit="${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
stamp="$(date -u +%Y-%m-%d)"
lengths=(); extra=()
while (($#)); do
  if [ "$1" = "--" ]; then shift; extra=("$@"); break; fi
  lengths+=("$1"); shift
done
cutlass_arg=()
[ -d .device/cutlass/include/cute ] && cutlass_arg=("-DSHADOWKV_CUTLASS_INCLUDE_DIR=$PWD/.device/cutlass/include")
if [ ! -f build/gpu/build.ninja ]; then
  cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DSHADOWKV_CUDA=ON -DSHADOWKV_BUILD_TESTS=OFF \
    -DSHADOWKV_BUILD_PYTHON=ON ${cutlass_arg[@]+"${cutlass_arg[@]}"} >"$out_dir/e2e-cmake.log" 2>&1 || { tail -30 "$out_dir/e2e-cmake.log"; exit 1; }
fi
cmake --build build/gpu -j"$(nproc)" --target _core >>"$out_dir/e2e-cmake.log" 2>&1 || { tail -30 "$out_dir/e2e-cmake.log"; exit 1; }
cp build/gpu/_core*.so python/shadowkv_core/
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 COMMIT="$commit"
status=0
for s in "${lengths[@]}"; do
  result="bench/results/${stamp}-${commit}-e2e-${s}.json"
  python3 bench/e2e_benchmark.py --seq-len "$s" --json "$result" --plot "${result%.json}.png" \
    ${extra[@]+"${extra[@]}"} 2>&1 | tee "$out_dir/e2e-${s}.log" || status=1
  cp "$result" "${result%.json}.png" "$out_dir/" 2>/dev/null
done
exit $status
