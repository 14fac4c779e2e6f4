"""Every path the documentation cites exists, and no document points outside the repository.

Checked in README.md, CONTRIBUTING.md, bench/README.md and docs/*.md:
* relative markdown links ``[text](path#anchor)`` resolve to a file or folder;
* paths written in the text (``bench/results/...``, ``docs/results/...``, ``cuda/...``, ``tests/...``, and in
  bench/README.md the bench-relative ``results/...``, ``probes/...``, ``micro/...``) exist, except a path of the
  history written as ``<commit>:path`` (``git show 0232ddb:bench/results/...``). A path with a
  placeholder (``<date>``, ``{after,before}`` is expanded first, ``*``) names a pattern of output files: its folder
  must exist, and a brace expansion without placeholders must name existing files;
* a bare ``NAME.md`` is a document of the repository (e.g. no ``DESIGN.md``, which is not part of it);
* docs/semantics.md says in its first lines that it is the algorithm's reference.

Plain text parsing only: no compiled extension, no GPU.
"""

from __future__ import annotations

import itertools
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TOP_DIRS = ("bench", "docs", "tests", "cpp", "cuda", "python", "examples", "cmake", "third_party")
BENCH_RELATIVE = ("results", "probes", "micro", "pending")

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PATH = re.compile(r"(?<![\w/.\-<>{}*])((?:%s)/[A-Za-z0-9_.\-/<>{},*+]*)" % "|".join(TOP_DIRS + BENCH_RELATIVE))
BARE_MD = re.compile(r"(?<![\w/.\-])([A-Za-z][A-Za-z0-9_\-]*\.md)\b")


def documents():
    names = ["README.md", "CONTRIBUTING.md", os.path.join("bench", "README.md")]
    names += sorted(os.path.join("docs", n) for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md"))
    return [n for n in names if os.path.isfile(os.path.join(ROOT, n))]


def expand_braces(text):
    """`a_{x,y}_b` -> [`a_x_b`, `a_y_b`] (several groups: their product)."""
    parts = re.split(r"(\{[^{}]*\})", text)
    choices = [p[1:-1].split(",") if p.startswith("{") and "," in p else [p] for p in parts]
    return ["".join(c) for c in itertools.product(*choices)]


def candidates(doc, path):
    """Where a path written in `doc` may live: the repository root, the document's folder, bench/."""
    here = os.path.dirname(doc)
    return [os.path.normpath(os.path.join(ROOT, base, path)) for base in ("", here, "bench")]


def path_problem(doc, raw):
    path = raw.rstrip(".,:;")
    if not path or path.endswith("/") and path.count("/") == 1 and path[:-1] in TOP_DIRS + BENCH_RELATIVE:
        return None  # a bare folder name used as a word ("results/")
    for one in expand_braces(path):
        pattern = "<" in one or "*" in one
        target = one
        if pattern:  # the folder of an output-name pattern must exist
            cut = min(i for i in (one.find("<"), one.find("*")) if i >= 0)
            target = one[:cut].rsplit("/", 1)[0] if "/" in one[:cut] else ""
            if not target:
                continue
        if not any(os.path.exists(c) for c in candidates(doc, target)):
            return f"{doc}: `{raw}` -> {target} does not exist"
    return None


def markdown_names():
    names = set()
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "build"]
        names.update(f for f in files if f.endswith(".md"))
    return names


def problems_of(doc):
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        text = f.read()
    found = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.\-]*:", target) or target.startswith("#"):
            continue  # http:, mailto:, an anchor of the same page
        path = target.split("#", 1)[0]
        if not os.path.exists(os.path.normpath(os.path.join(ROOT, os.path.dirname(doc), path))):
            found.append(f"{doc}: link ({target}) does not resolve")
    for match in PATH.finditer(text):
        if re.search(r"\b[0-9a-f]{7,40}:$", text[max(0, match.start() - 41):match.start()]):
            continue  # `git show <commit>:path`: a file of the history, not of the tree
        problem = path_problem(doc, match.group(1))
        if problem:
            found.append(problem)
    for name in set(BARE_MD.findall(text)):
        if name not in markdown_names():
            found.append(f"{doc}: {name} is not a document of this repository")
    return sorted(set(found))


# docs/api.md is rewritten by the change that removes the runtime experiment switches (issue 51, item 1); until it
# lands, its old switch notes still cite bench/NOTES.md (now docs/performance.md) and a deleted A/B folder.
PENDING = set()


@pytest.mark.parametrize(
    "doc",
    [pytest.param(d, marks=pytest.mark.xfail(strict=True, reason="cites bench/NOTES.md; see PENDING"))
     if d.replace(os.sep, "/") in PENDING else d for d in documents()])
def test_every_cited_path_exists(doc):
    problems = problems_of(doc)
    assert not problems, "\n".join(problems)


def test_no_document_cites_the_outside_design_note():
    offenders = []
    for doc in documents():
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if "DESIGN.md" in line or re.search(r"DESIGN §\d", line):
                    offenders.append(f"{doc}:{number}: {line.strip()[:120]}")
    assert not offenders, "\n".join(offenders)


def test_semantics_says_it_is_the_algorithms_reference():
    with open(os.path.join(ROOT, "docs", "semantics.md"), encoding="utf-8") as f:
        head = "".join(itertools.islice(f, 6))
    assert "reference" in head and "algorithm" in head, head


def test_the_checker_finds_a_dangling_citation(tmp_path, monkeypatch):
    """The parser itself: a missing result, a missing link target and an outside note are each reported."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "kept.json").write_text("{}")
    (docs / "x.md").write_text(
        "kept: `bench/results/kept.json`, gone: `bench/results/gone.json`, [a link](missing.md), see DESIGN.md;\n"
        "a pattern `bench/results/<date>-<commit>.json`, braces `bench/results/{kept,gone}.json`.\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", str(tmp_path))
    problems = "\n".join(problems_of(os.path.join("docs", "x.md")))
    assert "gone.json" in problems and "missing.md" in problems and "DESIGN.md" in problems, problems
    assert "kept.json`" not in problems and "<date>" not in problems, problems
