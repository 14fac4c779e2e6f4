#!/usr/bin/env bash
# On the GPU machine, when there is no time for gpu_check.sh: build only the Python module and the named test
# executables, run them (gtest, all of their tests), the named pytest files on the CUDA backend, then the step
# benchmark rows in STEP_CONFIGS. Writes $OUT/<date>-<commit>-focused.json: the step results plus `gpu` and `tests`
# (the counts of this run; say which tests ran when citing it).
# STEP_ARGS: more arguments for step_benchmark.py (e.g. "--graph-steps 8").
#   TESTS="test_store" PYTESTS="test_two_centroids.py" STEP_CONFIGS="24x122880x2048:host" COMMIT=<sha> \
#     bash bench/focused_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="$(cd "${OUT:-bench/results}" && pwd)"
commit="${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
export COMMIT="$commit"
targets=(_core)
for t in ${TESTS:-}; do targets+=("$t"); done
source bench/cuda_build.sh
cuda_configure build/focused "$out/cmake.log" -DSHADOWKV_BUILD_TESTS=ON -DSHADOWKV_BUILD_PYTHON=ON &&
  cuda_build build/focused "$out/cmake.log" "${targets[@]}" ||
  { tail -40 "$out/cmake.log"; exit 1; }
cp build/focused/_core*.so python/shadowkv_core/
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
: >"$out/tests.log"
for t in ${TESTS:-}; do
  exe=$(find build/focused/tests -name "$t" -type f -perm -u+x | head -1)
  timeout 300 "$exe" --gtest_brief=1 >>"$out/tests.log" 2>&1
  echo "gtest $t: rc $?"
done
for f in ${PYTESTS:-}; do
  (cd tests/python && SHADOWKV_TEST_DEVICES=cuda timeout 300 python3 -m pytest -q -rf -p no:cacheprovider "$f" \
    >>"$out/tests.log" 2>&1)
  echo "pytest $f: rc $?"
done
tests_json=$(python3 - "$out/tests.log" <<'PY'
import json, re, sys
log = open(sys.argv[1]).read()
gtest_ran = sum(int(x) for x in re.findall(r"\[==========\] (\d+) tests? from \d+ test suites? ran", log))
gtest_passed = sum(int(x) for x in re.findall(r"\[  PASSED  \] (\d+)", log))
gtest_failed = sum(int(x) for x in re.findall(r"\[  FAILED  \] (\d+) tests?, listed below", log))
py = {"passed": 0, "failed": 0, "skipped": 0}
for line in log.splitlines():
    if re.search(r" in [0-9.]+s", line):
        for n, k in re.findall(r"(\d+) (passed|failed|skipped)", line):
            py[k] += int(n)
print(json.dumps({"gtest": {"ran": gtest_ran, "passed": gtest_passed, "failed": gtest_failed}, "pytest_cuda": py}))
PY
)
echo "tests: $tests_json"
if [ -n "${STEP_CONFIGS:-}" ]; then
  timeout "${STEP_TIMEOUT_S:-300}" python3 bench/step_benchmark.py --config $STEP_CONFIGS --hit 0.0 0.6 --profile \
    ${STEP_ARGS:-} --json "$out/step.json" >"$out/step.log" 2>&1
  echo "step benchmark: rc $?"
  grep -E "^\|" "$out/step.log"
fi
python3 - "$out" "$commit" "$tests_json" <<'PY'
import json, os, sys, time
out, commit, tests = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
step = os.path.join(out, "step.json")
data = json.load(open(step)) if os.path.exists(step) else {"results": []}
data.update({"commit": commit, "tests": tests, "kind": "focused_check"})
if "gpu" not in data:
    import torch
    data["gpu"] = torch.cuda.get_device_name(0)
name = os.path.join(out, time.strftime("%Y-%m-%d") + f"-{commit}-focused.json")
json.dump(data, open(name, "w"), indent=1)
print("wrote", name)
PY
