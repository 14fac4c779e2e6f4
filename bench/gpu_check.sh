#!/usr/bin/env bash
# On a GPU machine: build everything with CUDA, run the C++ and Python tests on CPU and GPU (parity), run the step
# benchmark, and write bench/results/<date>-<commit>.json (also to $OUT when set). Prints a short table last.
#   bash bench/gpu_check.sh [--quick]      (--quick: tests only, no benchmark)
set -uo pipefail
cd "$(dirname "$0")/.."
out_dir="${OUT:-bench/results}"
mkdir -p "$out_dir" bench/results
commit="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
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
cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DSHADOWKV_CUDA=ON -DSHADOWKV_BUILD_TESTS=ON \
  >"$out_dir/cmake.log" 2>&1 && cmake --build build/gpu -j"$jobs" >>"$out_dir/cmake.log" 2>&1
build_rc=$?
tail -30 "$out_dir/cmake.log" | grep -E "error|Error|warning: |FAILED" | head -40
[ $build_rc -eq 0 ] || { echo "BUILD FAILED"; tail -60 "$out_dir/cmake.log"; exit 1; }

step "C++ tests (CPU and GPU kernels)"
ctest --test-dir build/gpu --output-on-failure -j"$jobs" >"$out_dir/ctest.log" 2>&1
ctest_rc=$?
grep -E "tests passed|tests failed|\*\*\*Failed|Failed|Skipped" "$out_dir/ctest.log" | head -40
[ $ctest_rc -eq 0 ] || { status=1; grep -B5 -A40 "Failure\|FAILED" "$out_dir/ctest.log" | head -150; }

step "Python package (pip, no build isolation)"
SHADOWKV_CUDA=ON python3 -m pip install --no-build-isolation --no-deps -q . >"$out_dir/pip.log" 2>&1 || {
  echo "PIP INSTALL FAILED"; tail -40 "$out_dir/pip.log"; exit 1; }
(cd /tmp && python3 -c "import shadowkv_core; print(shadowkv_core.build_info())")

step "pytest on cpu and cuda"
(cd tests/python && SHADOWKV_TEST_DEVICES=cpu,cuda python3 -m pytest -q -x --timeout=900 -p no:cacheprovider . \
  >"$out_dir/pytest.log" 2>&1)
pytest_rc=$?
tail -25 "$out_dir/pytest.log"
[ $pytest_rc -eq 0 ] || status=1

if [ "${1:-}" != "--quick" ]; then
  step "step benchmark"
  (cd /tmp && python3 "$OLDPWD/bench/step_benchmark.py" --json "$OLDPWD/$result") 2>&1 | tee "$out_dir/bench.log" | tail -14
  [ -f "$result" ] && cp "$result" "$out_dir/" 2>/dev/null
fi
echo
echo "gpu_check: build ok, ctest rc=$ctest_rc, pytest rc=$pytest_rc, result file: $result"
exit $status
