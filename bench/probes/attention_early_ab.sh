#!/usr/bin/env bash
# On the GPU machine, after bench/focused_check.sh built the module: the B = 1 device step at hit 0.6 with the
# attention released early by the key rebuild (SHADOWKV_ATTENTION_EARLY=on) or not, at the default split count and at
# SHADOWKV_ATTENTION_CTAS CTAs (few enough to sit beside the rebuild's CTAs), one process a combination, with the
# kernels' profile and one graph replay's timeline. Writes $OUT/attention-early-<combination>.log.
#   CTAS="264 136" bash bench/probes/attention_early_ab.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
out="$(cd "${OUT:-bench/results}" && pwd)"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
for ctas in ${CTAS:-264 136}; do
  for early in off on; do
    name="early-$early-ctas-$ctas"
    SHADOWKV_ATTENTION_EARLY=$early SHADOWKV_ATTENTION_CTAS=$ctas timeout 180 python3 bench/step_benchmark.py \
      --config "${CONFIG:-1x122880x2048:device}" --hit 0.6 --profile --graph-steps 8 --graph-timeline \
      >"$out/attention-early-$name.log" 2>&1
    echo "== $name (rc $?)"
    grep -E "^\| [0-9]" "$out/attention-early-$name.log" | tail -1
    grep -E "sparse_attention|rebuild_keys" "$out/attention-early-$name.log" | head -3
  done
done
