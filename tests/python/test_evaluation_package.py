"""The layout of the evaluation tooling (``shadowkv_core.evaluation``, issue 12 item 7):

* the product modules (``shadowkv_core``, ``shadowkv_core.hf``) import none of the tooling;
* the haystack builder, the model loader and the RoPE helper are each written once (package and bench/ scripts;
  tests/python/reference.py keeps its own RoPE on purpose: it is the tests' independent reference);
* every ``python -m shadowkv_core...`` command and every ``shadowkv_core.<module>`` reference in the README, docs/,
  bench/, tests/fixtures/, examples/, .ci/ and pyproject.toml names something that exists (stale names after the
  move fail here, not in a user's shell; a line that says "(old name)" mentions one on purpose);
* the one RoPE helper: float32 and float64 agree, and partial rotary passes the extra dims through.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
PACKAGE = os.path.join(ROOT, "python", "shadowkv_core")


def _files(*patterns):
    out = []
    for pattern in patterns:
        out += glob.glob(os.path.join(ROOT, pattern), recursive=True)
    return sorted(set(out))


def test_product_modules_import_no_tooling():
    # (tqdm and accelerate may come in with transformers itself, so only the tooling's own modules are checked)
    code = ("import sys, shadowkv_core, shadowkv_core.hf; "
            "bad = sorted(m for m in sys.modules if m.startswith('shadowkv_core.evaluation') or m == 'matplotlib'); "
            "print(bad); sys.exit(1 if bad else 0)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, f"importing the product pulled in tooling: {run.stdout} {run.stderr}"
    for name in ("__init__.py", "_store.py", "hf.py"):
        text = open(os.path.join(PACKAGE, name)).read()
        assert not re.search(r"^\s*(from|import)\s+\S*evaluation", text, re.M), name
    tooling = {"eval.py", "eval_tasks.py", "fidelity.py", "models.py", "demo.py", "_progress.py"}
    assert not tooling & set(os.listdir(PACKAGE)), "tooling modules are back at the package's top level"


# the definitions that must exist once: (what, regex of a definition)
SINGLE = [
    ("RoPE rotate_half", r"^\s*def _?rotate_half\("),
    ("RoPE tables", r"^\s*def _?rope_tables\("),
    ("RoPE", r"^\s*def _?rope\("),
    ("un-RoPE", r"^\s*def _?unrope\("),
    ("haystack text", r"^\s*def _?haystack_text\("),
    ("haystack prompt ids", r"^\s*def _?haystack_ids\("),
    ("haystack windows", r"^\s*class _?Haystack\b"),
    ("model loader", r"^\s*def _?load_model\("),
]


@pytest.mark.parametrize("what,pattern", SINGLE, ids=[w for w, _ in SINGLE])
def test_each_helper_is_written_once(what, pattern):
    found = []
    for path in _files("python/shadowkv_core/**/*.py", "bench/**/*.py"):
        for line in open(path, encoding="utf-8"):
            if re.match(pattern, line):
                found.append(os.path.relpath(path, ROOT))
    assert len(found) == 1 and found[0].startswith("python/shadowkv_core/evaluation/"), f"{what}: {found}"


DOC_FILES = ["README.md", "docs/*.md", "bench/*.md", "bench/**/*.py", "bench/**/*.sh", "tests/fixtures/*",
             "tests/run.sh", "examples/**/*.py", "examples/**/*.md", ".ci/*", "pyproject.toml"]


def _resolve(dotted: str) -> bool:
    """True when `dotted` is a module, or an attribute chain of the longest module prefix."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            continue
        obj = importlib.import_module(name)
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_documented_commands_and_modules_exist():
    commands, names = set(), set()
    for path in _files(*DOC_FILES):
        if not os.path.isfile(path) or path.endswith((".npz", ".json", ".png")):
            continue
        text = open(path, encoding="utf-8", errors="replace").read()
        text = "\n".join(line for line in text.splitlines() if "(old name)" not in line)   # history, on purpose
        rel = os.path.relpath(path, ROOT)
        commands |= {(m, rel) for m in re.findall(r"python3? -m (shadowkv_core(?:\.\w+)*)", text)}
        names |= {(m.rstrip("."), rel) for m in re.findall(r"\bshadowkv_core(?:\.\w+)+", text)}
        names |= {(m.replace(":", "."), rel) for m in re.findall(r"\"(shadowkv_core(?:\.\w+)*:\w+)\"", text)}
    assert commands, "found no documented command at all"
    bad = []
    for module, rel in sorted(commands):
        spec = importlib.util.find_spec(module)
        runnable = spec is not None and (spec.submodule_search_locations is None or
                                          importlib.util.find_spec(module + ".__main__") is not None)
        if not runnable:
            bad.append(f"{rel}: python -m {module}")
    for dotted, rel in sorted(names):
        if dotted.endswith(("_core.so", ".so")) or not _resolve(dotted):
            if not dotted.startswith("shadowkv_core._core"):
                bad.append(f"{rel}: {dotted}")
    assert not bad, "stale references:\n" + "\n".join(bad)


def test_one_rope_helper_in_both_precisions():
    from shadowkv_core.evaluation.rope import rope, unrope

    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 3, 32, generator=g)
    pos = torch.arange(100, 120)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 24, 2, dtype=torch.float32) / 32))   # partial rotary: 24 of 32
    post64 = rope(x, pos, inv_freq, 1.25)
    post32 = rope(x, pos, inv_freq, 1.25, dtype=torch.float32)
    assert post64.dtype == torch.float64 and post32.dtype == torch.float32
    torch.testing.assert_close(post32.double(), post64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(post64[..., 24:], x[..., 24:].double())                   # passes through
    torch.testing.assert_close(unrope(post64, pos, inv_freq, 1.25), x.double(), rtol=1e-9, atol=1e-9)
    assert (post64[..., :24] - x[..., :24].double()).abs().max() > 0.1                   # really rotated


@pytest.mark.parametrize("module", ["shadowkv_core.evaluation.accuracy", "shadowkv_core.evaluation.fidelity",
                                    "shadowkv_core.evaluation.demo"])
def test_each_command_prints_its_help(module):
    """`python -m <command> --help` prints the options and exits 0 (argparse formats every help string with %: a bare
    "%" in one crashed the accuracy harness's --help)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    run = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 0, f"{module} --help: rc {run.returncode}\n{run.stderr[-2000:]}"
    assert "usage:" in run.stdout and "--" in run.stdout, f"{module} --help printed no options:\n{run.stdout[:500]}"
