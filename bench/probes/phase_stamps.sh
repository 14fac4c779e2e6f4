#!/usr/bin/env bash
# On the GPU machine: builds the Python module with -DSHADOWKV_PHASE_STAMPS (cuda/kernels/common/phase_stamps.cuh:
# the select, rebuild, landmark-logits and attention kernels print clock64 stamps of one CTA, and the last three when
# each of their CTAs started and ended), runs the step benchmark for each of CONFIGS at HIT (one process a config, no
# profiler), and sums the stamps and the CTA spans of each (bench/probes/phase_stamps.py).
# Writes $OUT/phase-stamps-<config>.log and .txt. Leaves python/shadowkv_core/_core*.so stamped: rebuild after.
#   CONFIGS="1x122880x2048:device 8x122880x2048:device" HIT=0.6 bash bench/probes/phase_stamps.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
out="$(cd "${OUT:-bench/results}" && pwd)"
source bench/cuda_build.sh
cuda_python_module build/stamps "$out/stamps-cmake.log" -DCMAKE_CUDA_FLAGS=-DSHADOWKV_PHASE_STAMPS || exit 1
for config in ${CONFIGS:-1x122880x2048:device}; do
  name=$(echo "$config" | tr ':+' '__')
  timeout "${STEP_TIMEOUT_S:-120}" python3 bench/step_benchmark.py --config "$config" --hit "${HIT:-0.6}" \
    >"$out/phase-stamps-$name.log" 2>&1
  echo "== $config (rc $?)"
  grep -E "^\| [0-9]" "$out/phase-stamps-$name.log"
  python3 bench/probes/phase_stamps.py "$out/phase-stamps-$name.log" | tee "$out/phase-stamps-$name.txt"
done
