"""The CUDA architectures a build has code for: build_info() lists them, and KVStore(device="cuda:N") on a GPU none of
them runs on raises ValueError at construction. The comparison itself (SASS, PTX, arch- and family-specific targets)
is tested on the host in tests/cpp/test_cuda_architectures.cpp; here only what a GPU can confirm.
"""

from __future__ import annotations

import re

import pytest
import torch

from shadowkv_core import KVStore, build_info

INFO = build_info()
# CMake's syntax, keywords ("native", "all-major") resolved: "90a-real", "90-virtual", "86", "100f-real", ...
ENTRY = re.compile(r"^[1-9][0-9]+[af]?(-real|-virtual)?$")


def _number(entry: str) -> int:
    return int(re.match(r"^[0-9]+", entry).group(0))


def test_build_info_lists_the_cuda_architectures():
    architectures = INFO["cuda_architectures"]
    assert isinstance(architectures, list)
    if not INFO["cuda_compiled"]:
        assert architectures == [], INFO
        return
    assert architectures, f"a CUDA build lists the architectures its kernels were compiled for: {INFO}"
    for entry in architectures:
        assert ENTRY.match(entry), f"{entry!r} in {architectures}"


@pytest.mark.skipif(
    "cuda" not in INFO["backends"] or not torch.cuda.is_available(),
    reason=f"needs the CUDA backend and a GPU (backends {INFO['backends']}, torch.cuda {torch.cuda.is_available()})",
)
def test_store_on_each_visible_gpu_is_built_or_rejected_clearly():
    architectures = INFO["cuda_architectures"]
    for index in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(index)
        name = torch.cuda.get_device_name(index)
        # Two cases that need no compatibility rules: machine code for exactly this GPU runs; a list whose every
        # entry is newer than the GPU has nothing for it.
        exact = any(_number(e) == 10 * major + minor and not e.endswith("-virtual") for e in architectures)
        all_newer = bool(architectures) and all(_number(e) > 10 * major + minor for e in architectures)
        try:
            store = KVStore(1, 2, 1, 64, max_seq_len=256, rank=32, budget=64, device=f"cuda:{index}")
        except ValueError as exc:
            message = str(exc)
            assert f"cuda:{index}" in message and name in message, message
            assert f"compute capability {major}.{minor}" in message, message
            if major < 8:
                assert "8.0 or newer" in message, message
                continue
            assert not exact, f"{name} ({major}.{minor}) rejected by a build for {architectures}: {message}"
            assert ";".join(architectures) in message and "SHADOWKV_CUDA_ARCHITECTURES" in message, message
            continue
        assert not all_newer and major >= 8, f"{name} ({major}.{minor}) accepted by a build for {architectures}"
        assert store.device == f"cuda:{index}"
