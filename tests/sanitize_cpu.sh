#!/usr/bin/env bash
# The CPU test suite under AddressSanitizer + UndefinedBehaviorSanitizer: a separate build (build/asan, CUDA off) of
# the library, the C++ tests and the Python extension compiled with -fsanitize=address,undefined, then CTest and
# pytest. pytest runs an uninstrumented python with the ASan runtime preloaded (LD_PRELOAD) and imports this build's
# extension from a copy of the package under the build folder (python/shadowkv_core is left alone).
#
#   bash tests/sanitize_cpu.sh
#
# Any ASan or UBSan report stops the process that hit it (halt_on_error, -fno-sanitize-recover), so it fails its test;
# the end prints the counts and the reports found in the logs (build/asan/sanitize-*.log). Leak checking is on for the
# C++ tests and off for Python (the interpreter and torch keep memory until exit by design).
# Environment: SHADOWKV_BUILD_DIR (default build/asan), PYTHON (default python3), CXX (the compiler: GCC or Clang),
# PYTEST_ARGS (extra pytest arguments, e.g. "-x -k reliability"). Needs what tests/run.sh needs, already installed
# (this script installs nothing). On 2 cores with GCC 12: 6.5 minutes from scratch (build ~3, ctest ~2.5, pytest ~1.7).
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
jobs="$(nproc 2>/dev/null || echo 2)"
python="$(command -v "${PYTHON:-python3}")"
build="${SHADOWKV_BUILD_DIR:-build/asan}"
cxx="$(command -v "${CXX:-c++}")"

# Through the environment (CMake reads CXXFLAGS/LDFLAGS at the first configure), so that the find_package example,
# which ctest configures as a project of its own against this build, is instrumented the same way.
export CFLAGS="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g"
export CXXFLAGS="$CFLAGS"
export LDFLAGS="-fsanitize=address,undefined"
export ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:strict_init_order=1:detect_stack_use_after_return=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"

echo "== configure and build ($build: -fsanitize=address,undefined, CUDA off) =="
mkdir -p "$(dirname "$build")"  # the configure log goes next to the build folder (a fresh clone has no build/)
generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
cmake -S . -B "$build" ${generator[@]+"${generator[@]}"} -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSHADOWKV_CUDA=OFF \
  -DSHADOWKV_BUILD_TESTS=ON -DSHADOWKV_BUILD_PYTHON=ON -Dnanobind_DIR="$("$python" -m nanobind --cmake_dir)" \
  -DPython_EXECUTABLE="$python" >"$build.configure.log" 2>&1 || { tail -40 "$build.configure.log"; exit 1; }
grep -q -- "-fsanitize=address" "$build/CMakeCache.txt" || {
  echo "$build was configured without the sanitizer flags (an older cache?): remove it and run again" >&2; exit 1; }
cmake --build "$build" -j"$jobs"

echo "== C++ tests (CTest) under ASan + UBSan =="
ctest_rc=0
ctest --test-dir "$build" --output-on-failure -j"$jobs" >"$build/sanitize-ctest.log" 2>&1 || ctest_rc=$?
grep -E "tests passed|tests failed" "$build/sanitize-ctest.log" || true

echo "== Python tests (pytest) under ASan + UBSan =="
# The ASan runtime first, and the C++ runtime with it: python is not linked against libstdc++, and ASan, initialised
# before the extension loads it, would otherwise find no __cxa_throw to forward to (every C++ exception then aborts:
# "CHECK failed: ... real___cxa_throw").
if "$cxx" --version | grep -qi clang; then
  runtime="$("$cxx" -print-file-name=libclang_rt.asan-x86_64.so)"
else
  runtime="$("$cxx" -print-file-name=libasan.so)"
fi
cxx_runtime="$("$cxx" -print-file-name=libstdc++.so.6)"
[ -f "$runtime" ] && [ -f "$cxx_runtime" ] || { echo "no ASan or C++ runtime found ($runtime, $cxx_runtime)" >&2; exit 1; }
package="$root/$build/python"
rm -rf "$package" && mkdir -p "$package"
cp -r python/shadowkv_core "$package/"
rm -f "$package"/shadowkv_core/_core*.so
cp "$build"/_core*.so "$package/shadowkv_core/"
pytest_rc=0
# shellcheck disable=SC2086
(cd tests/python && PYTHONPATH="$package" LD_PRELOAD="$runtime $cxx_runtime" \
  ASAN_OPTIONS="halt_on_error=1:detect_leaks=0:detect_stack_use_after_return=1" \
  "$python" -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-} .) >"$build/sanitize-pytest.log" 2>&1 || pytest_rc=$?
tail -3 "$build/sanitize-pytest.log"

echo "== summary =="
reports="$(cat "$build/sanitize-ctest.log" "$build/sanitize-pytest.log" |
  grep -cE "ERROR: AddressSanitizer|ERROR: LeakSanitizer|runtime error:" || true)"
echo "ctest: $(grep -E "tests passed" "$build/sanitize-ctest.log" || echo "no summary (rc $ctest_rc)")"
echo "pytest: $(grep -E "^[0-9]+ (passed|failed)|passed|failed" "$build/sanitize-pytest.log" | tail -1)"
echo "sanitizer reports in the logs: $reports"
cat "$build/sanitize-ctest.log" "$build/sanitize-pytest.log" |
  grep -E "ERROR: AddressSanitizer|ERROR: LeakSanitizer|runtime error:" | sort | uniq -c | head -20 || true
[ "$ctest_rc" -eq 0 ] && [ "$pytest_rc" -eq 0 ] && [ "$reports" -eq 0 ]
