#!/usr/bin/env bash
# On the GPU machine: builds test_store and runs its StoreErrors twin tests' CUDA instances (two stores fed the same
# calls must agree bit for bit) in PROCS processes at once, REPEAT times each (several processes on the GPU, as under
# ctest -j, is where they failed now and then), first with SHADOWKV_TEST_UNSYNCED_INPUTS=1 (the test helper does not
# wait for its cudaMemcpy of an input to land, as before the fix), then as the tests run; then the whole test_store the
# same way. Prints one line per batch: processes that failed, failing cases.
#   PROCS=12 REPEAT=3 [BATCHES="unsynced synced all-synced"] bash bench/probes/twin_store_repro.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
out="$(cd "${OUT:-bench/results}" && pwd)"
source bench/cuda_build.sh
cuda_configure build/gpu "$out/twin-cmake.log" -DSHADOWKV_BUILD_TESTS=ON -DSHADOWKV_BUILD_PYTHON=OFF &&
  cuda_build build/gpu "$out/twin-cmake.log" test_store ||
  { tail -40 "$out/twin-cmake.log"; exit 1; }
exe=build/gpu/tests/cpp/test_store
procs="${PROCS:-12}"
repeat="${REPEAT:-3}"
batch() {  # batch(label, filter, env...): PROCS processes at once
  local label="$1" filter="$2"; shift 2
  local started=$SECONDS
  mkdir -p "$out/twin-$label"
  for i in $(seq 1 "$procs"); do
    timeout "${BATCH_TIMEOUT_S:-120}" env "$@" "$exe" --gtest_filter="$filter" --gtest_repeat="${repeat}" >"$out/twin-$label/$i.log" 2>&1 &
  done
  wait
  local failed
  failed=$(grep -l "^\[  FAILED  \]" "$out"/twin-"$label"/*.log | wc -l)
  printf '%-12s %2d of %d processes failed (%d s); failing cases: %s\n' "$label" "$failed" "$procs" $((SECONDS - started)) \
    "$(cat "$out"/twin-"$label"/*.log | grep -oE '[a-z][a-z_ +.]* seed=[0-9]+' | sort | uniq -c | tr -s ' ' | tr '\n' ';')"
  tar czf "$out/twin-$label.tgz" -C "$out" "twin-$label" && rm -rf "$out/twin-$label"
}
errors='Backends/StoreErrors.*/cuda'
for name in ${BATCHES:-unsynced synced unsynced2 synced2 all-synced}; do
  case "$name" in
    unsynced*) batch "$name" "$errors" SHADOWKV_TEST_UNSYNCED_INPUTS=1 ;;
    synced*) batch "$name" "$errors" ;;
    all-synced) repeat=1 batch "$name" '*/cuda' ;;
  esac
done
