# Sourced by the scripts that build on the GPU machine (gpu_check.sh, focused_check.sh, e2e_gpu.sh and the probes):
# the one CMake configuration they share, from the repository root.
#   source bench/cuda_build.sh
#   cuda_configure <build dir> <log> [-DOPTION=value ...]   (Release, CUDA on, Ninja, no micro-benchmarks; the options
#                                                             given come last, so they override these)
#   cuda_build <build dir> <log> [target ...]               (all targets when none is named; appends to the log)
#   cuda_python_module <build dir> <log> [-DOPTION=value ...] (the Python module alone, no tests: configured, built,
#                                                             copied into python/shadowkv_core/ and put on PYTHONPATH;
#                                                             on failure the log's tail is shown)
# Both return CMake's status and leave its output in the log, for the caller to show.
# The CUTLASS headers: the nvidia-cutlass package's, found by CMake, or where the machine has none (the device
# machine), the copy that bench/carry_cutlass.sh made in .device/cutlass (carry that ignored folder along).

cuda_configure() {
  local dir="$1" log="$2"
  shift 2
  local cutlass=()
  [ -d .device/cutlass/include/cute ] && cutlass=("-DSHADOWKV_CUTLASS_INCLUDE_DIR=$PWD/.device/cutlass/include")
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSHADOWKV_CUDA=ON -DSHADOWKV_BUILD_BENCHMARKS=OFF \
    ${cutlass[@]+"${cutlass[@]}"} "$@" >"$log" 2>&1
}

cuda_build() {
  local dir="$1" log="$2"
  shift 2
  local targets=()
  (($#)) && targets=(--target "$@")
  cmake --build "$dir" -j"$(nproc)" ${targets[@]+"${targets[@]}"} >>"$log" 2>&1
}

cuda_python_module() {
  local dir="$1" log="$2"
  shift 2
  cuda_configure "$dir" "$log" -DSHADOWKV_BUILD_TESTS=OFF -DSHADOWKV_BUILD_PYTHON=ON "$@" && cuda_build "$dir" "$log" _core ||
    { tail -40 "$log"; return 1; }
  cp "$dir"/_core*.so python/shadowkv_core/ && export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
}
