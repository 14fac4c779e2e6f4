#!/usr/bin/env bash
# Copies this machine's Google Benchmark (Debian/Ubuntu libbenchmark-dev: headers, shared library, CMake package)
# into .device/benchmark/usr/..., keeping the /usr tree, so that a machine without it (the GPU machine) can build
# bench/micro with -Dbenchmark_DIR=$PWD/.device/benchmark/usr/lib/x86_64-linux-gnu/cmake/benchmark
# (bench/gpu_check.sh does that when the folder exists). .device/ is git-ignored; carry it along to that machine.
# Links are copied as plain files (-L): the copy must survive transports that drop symbolic links.
#   bash bench/carry_benchmark.sh [SOURCE_PREFIX]      (default /usr)
set -euo pipefail
cd "$(dirname "$0")/.."
source_prefix="${1:-/usr}"
lib="lib/x86_64-linux-gnu"
target=".device/benchmark/usr"
for required in "$source_prefix/include/benchmark/benchmark.h" "$source_prefix/$lib/cmake/benchmark/benchmarkConfig.cmake"; do
  [ -e "$required" ] || { echo "carry_benchmark: $required not found (apt-get install libbenchmark-dev)" >&2; exit 1; }
done
rm -rf .device/benchmark
mkdir -p "$target/include" "$target/$lib/cmake"
cp -rL "$source_prefix/include/benchmark" "$target/include/"
cp -rL "$source_prefix/$lib/cmake/benchmark" "$target/$lib/cmake/"
# The shared library under every name the CMake package and the loader use, and the (tiny) benchmark_main archive
# that the package's import check expects to exist.
cp -L "$source_prefix/$lib"/libbenchmark.so* "$target/$lib/"
cp -L "$source_prefix/$lib"/libbenchmark_main.a "$target/$lib/"
echo "carry_benchmark: wrote $(du -sh .device/benchmark | cut -f1) to .device/benchmark:"
find .device/benchmark -type f | sort
