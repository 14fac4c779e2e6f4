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
source bench/cuda_build.sh
: >"$out_dir/e2e-cmake.log"
if [ ! -f build/gpu/build.ninja ]; then
  cuda_configure build/gpu "$out_dir/e2e-cmake.log" -DSHADOWKV_BUILD_TESTS=OFF -DSHADOWKV_BUILD_PYTHON=ON ||
    { tail -30 "$out_dir/e2e-cmake.log"; exit 1; }
fi
cuda_build build/gpu "$out_dir/e2e-cmake.log" _core || { tail -30 "$out_dir/e2e-cmake.log"; exit 1; }
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
