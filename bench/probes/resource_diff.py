#!/usr/bin/env python3
"""The kernels whose registers or stack (spills) differ between two builds: `cuobjdump -res-usage` over every CUDA
object under each directory, functions matched by name. patch_ab.sh prints it for B (and C) against A, since a
branch's speed can hang on its compiled registers as much as on its source (docs/performance.md, "Tried and lost": the descriptor cursor and the outlier flags loaded ahead).

    python3 bench/probes/resource_diff.py <build dir A> <build dir B>

cuobjdump comes with the CUDA toolkit (on this project's CPU machine: pip download nvidia-cuda-cuobjdump).
"""
import os
import re
import subprocess
import sys


def cuobjdump():
    """cuobjdump from PATH, else the toolkit's."""
    for candidate in [*os.environ.get("PATH", "").split(os.pathsep), "/usr/local/cuda/bin"]:
        path = os.path.join(candidate, "cuobjdump")
        if candidate and os.access(path, os.X_OK):
            return path
    sys.exit("resource_diff.py: no cuobjdump on PATH or in /usr/local/cuda/bin")


def same_in_every_tree(mangled):
    """The name with its anonymous namespace's hashes zeroed: nvcc names `namespace {` after the source file and a hash
    of its path (`_GLOBAL__N__1d303cb7_14_value_fetch_cu_8f2cd03d`), which differs between two checkouts of the same
    file. Zeroed in place, so the length prefixes still hold and c++filt still reads it."""
    return re.sub(r"(_GLOBAL__N__)([0-9a-f]+)(_\d+_\w+?_cu_)([0-9a-f]{8})",
                  lambda m: m.group(1) + "0" * len(m.group(2)) + m.group(3) + "0" * 8, mangled)


def usage(root):
    """{mangled function: (registers, stack bytes)} of the CUDA objects under root."""
    found = {}
    tool = cuobjdump()
    for directory, _, files in os.walk(root):
        for name in files:
            if not name.endswith(".cu.o"):
                continue
            text = subprocess.run([tool, "-res-usage", os.path.join(directory, name)], capture_output=True,
                                  text=True, check=False).stdout
            function = None
            for line in text.splitlines():
                m = re.match(r"^\s*Function (\S+):$", line)
                if m:
                    function = same_in_every_tree(m.group(1))
                    continue
                m = re.search(r"REG:(\d+) STACK:(\d+)", line)
                if m and function:
                    found[function] = (int(m.group(1)), int(m.group(2)))
                    function = None
    return found


def short(names):
    """Demangled, without namespaces and parameter lists: decode_landmark_logits_kernel<__nv_bfloat16, 256, 4, 1, true>."""
    try:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout
        demangled = out.splitlines()
    except (FileNotFoundError, subprocess.CalledProcessError):
        demangled = list(names)
    result = []
    for text in demangled:
        text = re.sub(r"\([^()]*\)$", "", text)  # the parameter list
        text = re.sub(r"(\w+::|\(anonymous namespace\)::)", "", text)
        text = re.sub(r"\(int\)|\(bool\)", "", text)
        result.append(text)
    return result


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    a, b = usage(sys.argv[1]), usage(sys.argv[2])
    names = sorted(set(a) | set(b))
    changed = [n for n in names if a.get(n) != b.get(n)]
    if not changed:
        print(f"registers and stack: the same in all {len(names)} kernels")
        return 0
    print(f"registers / stack bytes that differ ({len(changed)} of {len(names)} kernels), A -> B:")
    for name, label in zip(changed, short(changed)):
        before, after = a.get(name), b.get(name)
        fmt = lambda x: "-" if x is None else f"{x[0]} / {x[1]}"
        spill = " (stack: spills?)" if after and after[1] > (before[1] if before else 0) else ""
        print(f"  {label[:110]:<110} {fmt(before):>10} -> {fmt(after):<10}{spill}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
