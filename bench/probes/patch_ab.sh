#!/usr/bin/env bash
# On the GPU machine: the tree as it is (A) against a copy with PATCH applied (B, e.g. `git diff main branch -- cuda/`
# saved under the carried .device/), in one call. Builds A's and B's module and test executables TESTS side by side
# (and B's phase-stamp build, niced, when STAMP_CONFIGS is set), runs the gtest TESTS and the pytest files PYTESTS on
# the CUDA backend in both trees, then the step benchmark's STEP_CONFIGS rows at hits 0.0 and 0.6 (STEP_ARGS added)
# in A, B, and A again (the second A run says how much of an A/B difference is the run's own spread), and B again with
# the environment settings B2_ENV (as b2) when set: only for settings step_benchmark.py does not set itself, since it
# sets or unsets every knob it knows for each row (session 25's b2 with SHADOWKV_SELECT_RELEASE=off ran with it on);
# a knob it knows goes into STEP_CONFIGS as the config's suffix instead. Then B's phase
# stamps for STAMP_CONFIGS at hit STAMP_HIT (default 0.6) when time is left (DEADLINE_S after the start, default 560).
# With PATCH_C set, a third tree C = A + PATCH_C is built beside them, tested alike and timed after B (runs a, b, c,
# a2): two branches against main in one call, one start and one build time for both.
# Writes $OUT/a/ and $OUT/b/ (and $OUT/c/; tests.log, step-*.log/json, cmake.log, the stamps), packed at the end into
# $OUT/ab.tgz (a device call returns 8 files at most), and $OUT/ab-summary.txt (the tests' counts, the step rows, and
# bench/probes/ab_table.py's table of every run side by side).
#   PATCH=.device/lanes.patch TESTS="test_chunk_rebuild" PYTESTS="test_cuda_parity.py" \
#     STEP_CONFIGS="1x122880x2048:device+fm" STAMP_CONFIGS="1x122880x2048:device+fm" COMMIT=<sha> \
#     bash bench/probes/patch_ab.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
started=$SECONDS
out="$(mkdir -p "${OUT:-bench/results}" && cd "${OUT:-bench/results}" && pwd)"
mkdir -p "$out/a" "$out/b"
[ -f "${PATCH:-}" ] || { echo "PATCH=${PATCH:-} is not a file"; exit 1; }
[ -z "${PATCH_C:-}" ] || [ -f "$PATCH_C" ] || { echo "PATCH_C=$PATCH_C is not a file"; exit 1; }
a="$PWD"
b=/tmp/patch-ab-b
c=/tmp/patch-ab-c
trees="a b"
[ -n "${PATCH_C:-}" ] && trees="a b c"
root_of() {  # <tree letter>: its root
  case "$1" in a) echo "$a" ;; b) echo "$b" ;; c) echo "$c" ;; esac
}
copy_and_patch() {  # <tree letter> <patch>
  local tree="$1" root
  root=$(root_of "$1")
  mkdir -p "$out/$tree"
  rm -rf "$root" && mkdir -p "$root"
  tar --exclude=./build --exclude=./.git -cf - . | (cd "$root" && tar xf -)
  (cd "$root" && { patch -p1 --forward <"$a/$2" || git apply --verbose "$a/$2"; } >"$out/$tree/patch.log" 2>&1) ||
    { cat "$out/$tree/patch.log"; exit 1; }
  echo "${tree^^} = A + $2: $(tr '\n' ' ' <"$out/$tree/patch.log")"
}
copy_and_patch b "$PATCH"
[ -n "${PATCH_C:-}" ] && copy_and_patch c "$PATCH_C"
targets=(_core ${TESTS:-})
jobs=$(nproc)
build() {  # <tree> <build dir> <log> [cmake options...]: configure and build the targets
  local tree="$1" dir="$2" log="$3"
  shift 3
  (cd "$tree" && source bench/cuda_build.sh && cuda_configure "$dir" "$log" "$@" &&
    cmake --build "$dir" -j"$jobs" --target "${targets[@]}" >>"$log" 2>&1)
}
build "$a" build/ab "$out/a/cmake.log" -DSHADOWKV_BUILD_TESTS=ON -DSHADOWKV_BUILD_PYTHON=ON &
pid_a=$!
build "$b" build/ab "$out/b/cmake.log" -DSHADOWKV_BUILD_TESTS=ON -DSHADOWKV_BUILD_PYTHON=ON &
pid_b=$!
pid_c=
if [ -n "${PATCH_C:-}" ]; then
  build "$c" build/ab "$out/c/cmake.log" -DSHADOWKV_BUILD_TESTS=ON -DSHADOWKV_BUILD_PYTHON=ON &
  pid_c=$!
fi
if [ -n "${STAMP_CONFIGS:-}" ]; then
  (renice -n 19 $BASHPID >/dev/null; targets=(_core); build "$b" build/stamps "$out/b/stamps-cmake.log" \
    -DSHADOWKV_BUILD_TESTS=OFF -DSHADOWKV_BUILD_PYTHON=ON -DCMAKE_CUDA_FLAGS=-DSHADOWKV_PHASE_STAMPS) &
  pid_stamps=$!
fi
wait $pid_a || { echo "A's build failed"; tail -40 "$out/a/cmake.log"; exit 1; }
wait $pid_b || { echo "B's build failed"; tail -40 "$out/b/cmake.log"; exit 1; }
if [ -n "$pid_c" ]; then wait $pid_c || { echo "C's build failed"; tail -40 "$out/c/cmake.log"; exit 1; }; fi
echo "built $trees at $((SECONDS - started)) s"
: >"$out/ab-summary.txt"
# Registers and stack (spills) of every kernel that the patch changed: a branch's speed can hang on them.
for tree in b c; do
  [[ " $trees " == *" $tree "* ]] || continue
  resources=$(python3 bench/probes/resource_diff.py "$a/build/ab/cuda" "$(root_of $tree)/build/ab/cuda" 2>&1)
  { echo "== ${tree^^} against A: $(head -1 <<<"$resources")"; tail -n +2 <<<"$resources" | head -40; } |
    tee -a "$out/ab-summary.txt"
done
for tree in $trees; do
  root=$(root_of $tree)
  cp "$root"/build/ab/_core*.so "$root/python/shadowkv_core/"
  : >"$out/$tree/tests.log"
  for t in ${TESTS:-}; do
    exe=$(find "$root/build/ab/tests" -name "$t" -type f -perm -u+x | head -1)
    timeout 300 "$exe" --gtest_brief=1 >>"$out/$tree/tests.log" 2>&1
    echo "$tree gtest $t: rc $?" | tee -a "$out/ab-summary.txt"
  done
  for f in ${PYTESTS:-}; do
    (cd "$root/tests/python" && PYTHONPATH="$root/python" SHADOWKV_TEST_DEVICES=cuda timeout 300 \
      python3 -m pytest -q -rf -p no:cacheprovider "$f" >>"$out/$tree/tests.log" 2>&1)
    echo "$tree pytest $f: rc $? ($(grep -E ' in [0-9.]+s' "$out/$tree/tests.log" | tail -1))" |
      tee -a "$out/ab-summary.txt"
  done
  grep -E "^\[  (PASSED|FAILED)  \]" "$out/$tree/tests.log" | sed "s/^/$tree /" | tee -a "$out/ab-summary.txt"
done
echo "tests done at $((SECONDS - started)) s"
if [ -n "${STEP_CONFIGS:-}" ]; then
  runs="a b a2"
  [ -n "${PATCH_C:-}" ] && runs="a b c a2"
  [ -n "${B2_ENV:-}" ] && runs="$runs b2"
  for run in $runs; do
    tree=${run:0:1}
    root=$(root_of $tree)
    run_env=()
    [ $run = b2 ] && read -ra run_env <<<"$B2_ENV"
    (cd "$root" && env "${run_env[@]}" PYTHONPATH="$root/python" timeout "${STEP_TIMEOUT_S:-200}" python3 bench/step_benchmark.py \
      --config $STEP_CONFIGS --hit 0.0 0.6 --profile ${STEP_ARGS:-} --json "$out/$tree/step-$run.json" \
      >"$out/$tree/step-$run.log" 2>&1)
    echo "== step $run (rc $?, at $((SECONDS - started)) s)" | tee -a "$out/ab-summary.txt"
    grep -E "^\| [0-9]" "$out/$tree/step-$run.log" | tee -a "$out/ab-summary.txt"
  done
  echo "== the runs side by side" | tee -a "$out/ab-summary.txt"
  python3 bench/probes/ab_table.py "$out" | tee -a "$out/ab-summary.txt"
fi
if [ -n "${STAMP_CONFIGS:-}" ]; then
  if ! wait $pid_stamps; then
    echo "B's stamps build failed"
    tail -20 "$out/b/stamps-cmake.log"
  elif ((SECONDS - started > ${DEADLINE_S:-560} - 90)); then
    echo "no time left for the stamps ($((SECONDS - started)) s)"
  else
    left=$((${DEADLINE_S:-560} - SECONDS + started - 10))
    (cd "$b" && OUT="$out/b" CONFIGS="$STAMP_CONFIGS" HIT="${STAMP_HIT:-0.6}" STEP_TIMEOUT_S=$left \
      bash bench/probes/phase_stamps.sh >"$out/b/stamps.log" 2>&1)
    echo "stamps (rc $?, at $((SECONDS - started)) s)"
    grep -vE "^(--|$)" "$out/b/stamps.log" | tail -40
  fi
fi
echo "== summary"
cat "$out/ab-summary.txt"
tar -C "$out" -czf "$out/ab.tgz" $trees && (cd "$out" && rm -rf $trees)
