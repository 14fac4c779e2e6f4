"""Imports shadowkv_core before and after torch (and transformers), each in a fresh interpreter, and prints the exit
status and the CUDA libraries (cudart, cuBLAS, cuBLASLt, cuSOLVER) each process mapped: a crash in one order only
points at two copies of a CUDA library with the same soname (the toolkit's, linked by the extension, and the one torch
ships).

    PYTHONPATH=python python3 bench/probes/import_order.py
"""

import subprocess
import sys

CASES = {
    "shadowkv_core, then torch": "import shadowkv_core; import torch; torch.zeros(1, device='cuda' if torch.cuda.is_available() else 'cpu')",
    "torch, then shadowkv_core": "import torch; import shadowkv_core",
    "shadowkv_core, then shadowkv_core.hf": "import shadowkv_core, shadowkv_core.hf",
}
LIST_LIBRARIES = ("; import re; print('\\n'.join(sorted({line.split()[-1] for line in open('/proc/self/maps') "
                  "if re.search(r'lib(cudart|cublas|cublasLt|cusolver)[.-]', line)})))")


def main() -> int:
    failed = 0
    for name, code in CASES.items():
        run = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code + LIST_LIBRARIES],
                             capture_output=True, text=True, timeout=300)
        failed += run.returncode != 0
        print(f"== {name}: exit {run.returncode}")
        print(run.stdout.strip())
        if run.returncode != 0:
            print(run.stderr.strip()[-4000:])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
