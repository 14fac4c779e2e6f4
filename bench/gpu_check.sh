#!/usr/bin/env bash
# On a GPU machine: build everything with CUDA, run the C++ and Python tests on CPU and GPU (parity), run the step
# benchmark and the micro-benchmarks, and write bench/results/<date>-<commit>.json and <date>-<commit>-micro.json
# (also to $OUT when set). Prints short tables last.
#   bash bench/gpu_check.sh [--quick]      (--quick: tests only, no benchmarks; SKIP_MICRO=1: no micro-benchmarks)
# The micro-benchmarks need Google Benchmark: the system's, or a copy in .device/benchmark made by
# bench/carry_benchmark.sh on a machine that has it (carry that ignored folder along).
set -uo pipefail
cd "$(dirname "$0")/.."
out_dir="${OUT:-bench/results}"
mkdir -p "$out_dir" bench/results
commit="${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
stamp="$(date -u +%Y-%m-%d)"
result="bench/results/${stamp}-${commit}.json"
jobs="$(nproc)"
status=0
step() { echo; echo "=== $* ==="; }

step "environment"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
nvcc --version | tail -1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

step "build (CMake, CUDA on, tests on)"
cutlass_arg=()  # the headers carried by bench/carry_cutlass.sh, where the machine has no nvidia-cutlass package
[ -d .device/cutlass/include/cute ] && cutlass_arg=("-DSHADOWKV_CUTLASS_INCLUDE_DIR=$PWD/.device/cutlass/include")
cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DSHADOWKV_CUDA=ON -DSHADOWKV_BUILD_TESTS=ON \
  ${cutlass_arg[@]+"${cutlass_arg[@]}"} \
  -DSHADOWKV_BUILD_PYTHON=ON -DSHADOWKV_BUILD_BENCHMARKS=OFF \
  >"$out_dir/cmake.log" 2>&1 && cmake --build build/gpu -j"$jobs" >>"$out_dir/cmake.log" 2>&1
build_rc=$?
tail -30 "$out_dir/cmake.log" | grep -E "error|Error|warning: |FAILED" | head -40
[ $build_rc -eq 0 ] || { echo "BUILD FAILED"; tail -60 "$out_dir/cmake.log"; exit 1; }

step "C++ tests (CPU and GPU kernels)"
ctest --test-dir build/gpu --output-on-failure -j"$jobs" >"$out_dir/ctest.log" 2>&1
ctest_rc=$?
grep -E "tests passed|tests failed|\*\*\*Failed|Failed|Skipped" "$out_dir/ctest.log" | head -40
[ $ctest_rc -eq 0 ] || { status=1; grep -B5 -A40 "Failure\|FAILED" "$out_dir/ctest.log" | head -150; }

step "Python package from the same build (no second compile)"
cp build/gpu/_core*.so python/shadowkv_core/
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
(cd /tmp && python3 -c "import shadowkv_core; print(shadowkv_core.build_info())")

step "pytest: CUDA vs CPU parity, then the whole suite on the CUDA backend (the CPU run is CI's)"
# One process per test file: a crash in one file cannot hide the results of the others.
pytest_rc=0
for file in tests/python/test_cuda_parity.py tests/python/test_*.py; do
  # eval/fidelity run the CPU backend on real-model captures (CI runs them); everything else runs on the GPU,
  # the transformers adapter included (the H200's transformers is 5.17).
  case "$file" in */test_eval.py|*/test_fidelity.py) continue ;; esac
  [ "$file" = tests/python/test_cuda_parity.py ] && [ -n "${seen_parity:-}" ] && continue
  seen_parity=1
  echo "--- $file" >>"$out_dir/pytest.log"
  (cd tests/python && SHADOWKV_TEST_DEVICES=cuda timeout 300 python3 -X faulthandler -m pytest -q -rf \
    -p no:cacheprovider "$(basename "$file")" >>"$out_dir/pytest.log" 2>&1) || { pytest_rc=1; echo "FAILED: $file"; }
done
grep -E "^--- |passed|failed|FAILED|Error|Segmentation" "$out_dir/pytest.log" | tail -40
[ $pytest_rc -eq 0 ] || status=1

# Test counts of this run, recorded in the result files next to the numbers they vouch for.
tests_json="$(python3 - "$out_dir/ctest.log" "$out_dir/pytest.log" <<'PY'
import json, re, sys
ctest = open(sys.argv[1]).read() if sys.argv[1] else ""
pytest = open(sys.argv[2]).read()
m = re.search(r"(\d+)% tests passed(?:, (\d+) tests? failed)? out of (\d+)", ctest)
failed = int(m.group(2) or 0) if m else 0
skipped = len(re.findall(r"\(Skipped\)", ctest.split("tests passed")[-1])) if m else 0
counts = {"ctest": {"passed": int(m.group(3)) - failed - skipped, "failed": failed, "skipped": skipped} if m else None}
total = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
for line in pytest.splitlines():  # pytest's closing line of each file, e.g. "12 passed, 1 skipped in 3.2s"
    if re.search(r"\d+ (passed|failed|skipped|errors?)\b", line) and re.search(r" in [\d.]+s", line):
        for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", line):
            total["errors" if kind.startswith("error") else kind] += int(n)
counts["pytest_cuda"] = total
print(json.dumps(counts))
PY
)"
echo "tests: $tests_json"

if [ "${1:-}" != "--quick" ]; then
  step "step benchmark"
  COMMIT="$commit" timeout 400 python3 bench/step_benchmark.py --profile --json "$result" 2>&1 | tee "$out_dir/bench.log" | tail -16
  if [ -f "$result" ]; then
    python3 - "$result" "$tests_json" <<'PY'
import json, sys
data = json.load(open(sys.argv[1]))
data["tests"] = json.loads(sys.argv[2])
json.dump(data, open(sys.argv[1], "w"), indent=1)
PY
    cp "$result" "$out_dir/" 2>/dev/null
  fi

fi
if [ "${1:-}" != "--quick" ] && [ -z "${SKIP_MICRO:-}" ]; then
  step "micro-benchmarks (Google Benchmark, bench/micro: one op at a time, the value-fetch comparison)"
  micro_result="bench/results/${stamp}-${commit}-micro.json"
  carried="$PWD/.device/benchmark/usr/lib/x86_64-linux-gnu"
  benchmark_dir_arg=()
  if [ -d "$carried/cmake/benchmark" ]; then
    benchmark_dir_arg=("-Dbenchmark_DIR=$carried/cmake/benchmark")
    export LD_LIBRARY_PATH="$carried${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
  # Same build folder: only the benchmark executable is new.
  cmake -S . -B build/gpu -G Ninja -DSHADOWKV_BUILD_BENCHMARKS=ON ${benchmark_dir_arg[@]+"${benchmark_dir_arg[@]}"} \
    >"$out_dir/cmake-micro.log" 2>&1 && cmake --build build/gpu -j"$jobs" --target decode_ops_bench \
    >>"$out_dir/cmake-micro.log" 2>&1
  micro_rc=$?
  if [ $micro_rc -ne 0 ]; then
    echo "MICRO-BENCHMARK BUILD FAILED"; tail -30 "$out_dir/cmake-micro.log"
  else
    rm -f "$micro_result"
    timeout 300 build/gpu/bench/decode_ops_bench --benchmark_out="$micro_result" --benchmark_out_format=json \
      >"$out_dir/micro.log" 2>&1
    micro_rc=$?
    tail -4 "$out_dir/micro.log"
    [ -f "$micro_result" ] && cp "$micro_result" "$out_dir/" 2>/dev/null
    [ -f "$micro_result" ] && python3 bench/micro/summarize.py "$micro_result"
  fi
  [ $micro_rc -eq 0 ] || { status=1; echo "micro-benchmarks: rc=$micro_rc (log: $out_dir/micro.log)"; }
fi
echo
echo "gpu_check: build ok, ctest rc=$ctest_rc, pytest rc=$pytest_rc, micro rc=${micro_rc:-skipped}, result files:" \
  "$result ${micro_result:-}"
exit $status
