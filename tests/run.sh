#!/usr/bin/env bash
# Builds once and runs every test: ONE CMake build holds the library, the C++ tests and the Python extension
# (shadowkv_core._core), so the CUDA sources, where a CUDA compiler is present, are compiled once. Then CTest (GoogleTest
# and the find_package example), then pytest against that build's extension (copied into python/shadowkv_core and
# imported through PYTHONPATH; nothing is pip-installed). GPU tests skip themselves where no GPU is present.
#
#   bash tests/run.sh
#
# Environment: SHADOWKV_CUDA=AUTO|ON|OFF (default AUTO: CUDA when a compiler is found), SHADOWKV_CUDA_ARCHITECTURES
# (see README.md), SHADOWKV_BUILD_DIR (default build/tests), PYTHON (default python3), SHADOWKV_NO_PIP=1 (install
# nothing: the build requirements and the test dependencies must already be there).
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
jobs="$(nproc 2>/dev/null || echo 2)"
python="$(command -v "${PYTHON:-python3}")"
build="${SHADOWKV_BUILD_DIR:-build/tests}"
cuda="${SHADOWKV_CUDA:-AUTO}"

# A CUDA compiler where CMake's AUTO would find one (PATH, CUDACXX, the toolkit's usual place).
have_nvcc=0
if [ "$cuda" != "OFF" ] && { [ -n "${CUDACXX:-}" ] || command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; }; then
  have_nvcc=1
fi

echo "== requirements (pip) =="
if [ -z "${SHADOWKV_NO_PIP:-}" ]; then
  # The build needs nanobind; the tests need the "test" extra of pyproject.toml (read from there, one list).
  mapfile -t test_deps < <("$python" - <<'PY'
import re
text = open("pyproject.toml").read()
try:
    import tomllib
    deps = tomllib.loads(text)["project"]["optional-dependencies"]["test"]
except ImportError:  # Python < 3.11: the extra is one line, test = ["...", ...]
    deps = re.findall(r'"([^"]+)"', re.search(r"^test\s*=\s*\[(.*)\]", text, re.M).group(1))
print("\n".join(deps))
PY
)
  # Already-satisfied requirements are left alone (no upgrades).
  "$python" -m pip install -q --disable-pip-version-check "nanobind>=2.4" "${test_deps[@]}"
  if [ "$have_nvcc" = 1 ] && [ -z "${SHADOWKV_CUTLASS_INCLUDE_DIR:-}" ] &&
     ! "$python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('cutlass_library') is None)"; then
    # Only its headers are used (cuda/CMakeLists.txt finds them without importing it). --no-deps: its dependencies
    # (cuda-python, which pins cuda-bindings, numpy, scipy, ...) are not needed for the headers and could move
    # packages torch pins (torch 2.15 requires cuda-bindings>=13.0.3,<14; a future cuda-python would pull 14).
    "$python" -m pip install -q --disable-pip-version-check --no-deps "nvidia-cutlass>=4.2,<5"
  fi
fi

echo "== build (one CMake build: library, C++ tests, Python extension) =="
generator=()
[ -z "${CMAKE_GENERATOR:-}" ] && [ ! -f "$build/CMakeCache.txt" ] && command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
cutlass_arg=()
[ -n "${SHADOWKV_CUTLASS_INCLUDE_DIR:-}" ] && cutlass_arg=("-DSHADOWKV_CUTLASS_INCLUDE_DIR=$SHADOWKV_CUTLASS_INCLUDE_DIR")
cmake -S . -B "$build" ${generator[@]+"${generator[@]}"} -DCMAKE_BUILD_TYPE=Release \
  -DSHADOWKV_CUDA="$cuda" -DSHADOWKV_BUILD_TESTS=ON -DSHADOWKV_BUILD_PYTHON=ON \
  -DPython_EXECUTABLE="$python" -Dnanobind_DIR="$("$python" -m nanobind --cmake_dir)" \
  ${cutlass_arg[@]+"${cutlass_arg[@]}"}
cmake --build "$build" -j"${jobs}"

echo "== C++ tests (CTest) =="
ctest --test-dir "$build" --output-on-failure -j"${jobs}"

echo "== Python tests (pytest, the extension of this build) =="
shopt -s nullglob
rm -f python/shadowkv_core/_core*.so python/shadowkv_core/_core*.pyd
modules=("$build"/_core*.so)
[ ${#modules[@]} -eq 1 ] || { echo "expected one _core*.so in $build, found: ${modules[*]:-none}" >&2; exit 1; }
cp "${modules[0]}" python/shadowkv_core/
export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"
cd tests/python && "$python" -m pytest -q .
