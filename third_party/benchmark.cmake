# Google Benchmark for the micro-benchmarks (README.md in this folder): the installed package (Debian/Ubuntu
# libbenchmark-dev), or another copy with -Dbenchmark_DIR=<its cmake folder> (or -Dbenchmark_ROOT=<prefix>).
# Defines the target benchmark::benchmark.
find_package(benchmark REQUIRED)
