#!/usr/bin/env bash
# On the GPU machine: build the Python module only, then time the decode step at B=8 device values (S=122880, budget
# 2048, hit ~0 and ~0.6) with each rebuild variant of SHADOWKV_PROBE_REBUILD_VARIANT (a temporary probe switch in
# chunk_rebuild.cu: 1 = no RoPE, 2 = float sincosf after a float64 range reduction, 4 = no main loop), kernel times per
# step from the step benchmark's --profile; then Nsight Compute's warp-state and source counters of the rebuild kernel.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-bench/results}"
cutlass_arg=()
[ -d .device/cutlass/include/cute ] && cutlass_arg=("-DSHADOWKV_CUTLASS_INCLUDE_DIR=$PWD/.device/cutlass/include")
cmake -S . -B build/profile -G Ninja -DCMAKE_BUILD_TYPE=Release -DSHADOWKV_CUDA=ON -DSHADOWKV_BUILD_TESTS=OFF \
  -DSHADOWKV_BUILD_PYTHON=ON -DSHADOWKV_BUILD_BENCHMARKS=OFF ${cutlass_arg[@]+"${cutlass_arg[@]}"} >"$out/cmake.log" 2>&1 &&
  cmake --build build/profile -j"$(nproc)" --target _core >>"$out/cmake.log" 2>&1 || { tail -40 "$out/cmake.log"; exit 1; }
cp build/profile/_core*.so python/shadowkv_core/
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
for variant in ${VARIANTS:-0 1 2 4}; do
  SHADOWKV_PROBE_REBUILD_VARIANT=$variant timeout 150 python3 bench/step_benchmark.py --config 8x122880x2048:device \
    --hit 0.0 0.6 --steps 10 --profile --json "$out/rebuild-variant-$variant.json" >"$out/rebuild-variant-$variant.log" 2>&1
  echo "variant $variant: rc $?"
done
timeout "${NCU_TIMEOUT_S:-150}" ncu --profile-from-start off --clock-control none -k regex:rebuild \
  --section WarpStateStats --section SourceCounters --section SpeedOfLight --section Occupancy \
  python3 bench/probes/decode_kernels_probe.py --batch 8 --values device >"$out/ncu-rebuild-B8.log" 2>&1
echo "ncu rc $?"
for variant in ${VARIANTS:-0 1 2 4}; do
  echo "== variant $variant"
  grep -E "^\| 8 |rebuild|\.[0-9]+  (fetch|select|landmark|sparse)" "$out/rebuild-variant-$variant.log" | head -20
done
grep -E "Stall|stall|Warp Cycles|Issued|Duration|Achieved Occupancy" "$out/ncu-rebuild-B8.log" | head -60
