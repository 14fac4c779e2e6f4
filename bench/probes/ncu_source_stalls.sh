#!/usr/bin/env bash
# On the GPU machine: where each warp stalls, instruction by instruction. Builds the Python module (as
# profile_decode_kernels.sh), then for each BATCH:VALUES configuration (default 8:device 1:device) Nsight Compute's PC
# sampling (SourceCounters) over one decode step of decode_kernels_probe.py, for the kernels whose names match
# NCU_KERNELS (a regex; default the logits, select, rebuild and attention kernels), and prints each profiled kernel's SASS with its warp
# stall samples as CSV (ncu --page source). ncu_source_summary.py then lists, per kernel, the instructions that
# hold most of the samples, the sampled reasons, and the source lines that hold most of them (from nvdisasm -g
# listings of this build's objects). ~2.5 minutes held for two configurations with the start (session 31).
#   OUT=/tmp/x bash bench/probes/ncu_source_stalls.sh "8:device 1:device"
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-bench/results}"
source bench/cuda_build.sh
cuda_python_module build/profile "$out/cmake.log" || exit 1
export PATH="$PATH:/usr/local/cuda/bin"  # cuobjdump and nvdisasm for the listings
kernels="${NCU_KERNELS:-decode_landmark_logits|select|rebuild|sparse_attention}"
# The kernels' listings with source lines (nvdisasm -g of this build's objects), so that the summary can name the
# source line of each sampled instruction.
listings=()
mkdir -p "$out/listings"
for object in $(find build/profile -path '*shadowkv_cuda_kernels.dir*' -name '*.cu.o'); do
  base=$(basename "$object" .cu.o)
  (cd "$out/listings" && rm -f ./*.cubin && cuobjdump -xelf all "$OLDPWD/$object" >/dev/null 2>&1 &&
    for cubin in ./*sm_90a*.cubin; do nvdisasm -g -c "$cubin" >"$base.dis" 2>/dev/null; done; rm -f ./*.cubin)
  [ -s "$out/listings/$base.dis" ] && listings+=("$out/listings/$base.dis")
done
echo "listings: ${#listings[@]}"
for config in "${@:-8:device 1:device}"; do
  for one in $config; do
    batch="${one%%:*}"; values="${one##*:}"
    rep="$out/source-B${batch}-${values}"
    timeout "${NCU_TIMEOUT_S:-200}" ncu --profile-from-start off --clock-control none \
      --section SourceCounters --section WarpStateStats --import-source no \
      --kernel-name "regex:$kernels" -f -o "$rep" \
      python3 bench/probes/decode_kernels_probe.py --batch "$batch" --values "$values" >"$rep.log" 2>&1
    echo "B=$batch $values: rc $?; $(grep -m1 'a step (profiled)' "$rep.log")"
    ncu -i "$rep.ncu-rep" --page source --csv --print-source sass >"$rep.csv" 2>"$rep.err" ||
      { echo "source page failed:"; head -5 "$rep.err"; }
    ncu -i "$rep.ncu-rep" --page details --section WarpStateStats >"$rep-details.txt" 2>&1
    python3 bench/probes/ncu_source_summary.py "$rep.csv" --lines "${listings[@]}" >"$rep-summary.txt" 2>&1
    cat "$rep-summary.txt"

  done
done
# The CSVs (a few MB each) packed for a second look here (ncu_source_summary.py --lines with a local listing of
# the same source); the reports themselves are too large to come back.
(cd "$out" && tar czf source-stalls.tgz source-*.csv && rm -rf source-*.ncu-rep source-*.csv source-*.err listings)
