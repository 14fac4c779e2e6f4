#!/usr/bin/env bash
# Copies the CUTLASS/CuTe headers of this machine's nvidia-cutlass package (cutlass_library/source/include) into
# .device/cutlass/include, for a GPU machine that has no package index to install it from. .device/ is git-ignored;
# carry it along; bench/gpu_check.sh passes it to CMake (SHADOWKV_CUTLASS_INCLUDE_DIR) when the folder exists.
#   bash bench/carry_cutlass.sh          (needs: pip install "nvidia-cutlass>=4.2,<5")
set -euo pipefail
cd "$(dirname "$0")/.."
source="$(python3 -c "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))")"
[ -d "$source/cute" ] || { echo "carry_cutlass: no CUTLASS headers under $source" >&2; exit 1; }
rm -rf .device/cutlass
mkdir -p .device/cutlass
cp -rL "$source" .device/cutlass/include
du -sh .device/cutlass
