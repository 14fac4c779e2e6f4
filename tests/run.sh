#!/usr/bin/env bash
# Builds and runs every test: the C++ suite through CTest (GoogleTest and the find_package example), then installs
# the Python package and runs pytest. GPU tests skip themselves where no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs="$(nproc 2>/dev/null || echo 2)"

echo "== C++ tests (CTest) =="
cmake -S . -B build/tests -DSHADOWKV_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Release
cmake --build build/tests -j"${jobs}"
ctest --test-dir build/tests --output-on-failure -j"${jobs}"

echo "== Python tests (pytest) =="
python3 -m pip install -q ".[test]"
# Run from outside the source tree so that the installed package, not python/, is imported.
cd tests/python && python3 -m pytest -q .
