#!/usr/bin/env bash
# On the GPU machine: build the Python module only (no tests), then Nsight Compute over one decode step of
# decode_kernels_probe.py for each configuration given as BATCH:VALUES (default 1:device 8:device 24:host). One log per
# configuration in $OUT (or bench/results), and a table of every kernel's duration, DRAM and SM throughput,
# occupancy, grid and registers printed last (ncu_summary.py). With NCU_STALLS=1, a second ncu run a configuration
# collects only the warps' stall reasons (smsp__average_warps_issue_stalled_<reason>_per_issue_active: warps stalled
# for that reason a cycle an instruction was issued) into ncu-B<batch>-<values>-stalls.log, its own run so that a
# metric this ncu lacks cannot cost the first run's log; ncu_summary.py prints each kernel's largest reasons.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-bench/results}"
source bench/cuda_build.sh
cuda_python_module build/profile "$out/cmake.log" || exit 1
sections=(--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
          --section MemoryWorkloadAnalysis)
logs=()
for config in "${@:-1:device 8:device 24:host}"; do
  for one in $config; do
    batch="${one%%:*}"; values="${one##*:}"
    log="$out/ncu-B${batch}-${values}.log"
    timeout "${NCU_TIMEOUT_S:-170}" ncu --profile-from-start off --clock-control none "${sections[@]}" \
      python3 bench/probes/decode_kernels_probe.py --batch "$batch" --values "$values" >"$log" 2>&1
    echo "B=$batch $values: rc $?; $(grep -m1 'a step (profiled)' "$log")"
    logs+=("$log")
    if [ "${NCU_STALLS:-0}" = 1 ]; then
      stalls="$out/ncu-B${batch}-${values}-stalls.log"
      timeout "${NCU_TIMEOUT_S:-170}" ncu --profile-from-start off --clock-control none \
        --metrics 'regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$' \
        python3 bench/probes/decode_kernels_probe.py --batch "$batch" --values "$values" >"$stalls" 2>&1
      echo "B=$batch $values stalls: rc $?"
      logs+=("$stalls")
    fi
  done
done
python3 bench/probes/ncu_summary.py "${logs[@]}"
