"""pytest configuration: devices and the report header. Helpers live in helpers.py, the reference in reference.py.

* Devices: the tests run on ``cpu``; set ``SHADOWKV_TEST_DEVICES=cpu,cuda`` to run them on both backends. A
  requested device that is not present is reported as an explicit skip with its reason.
* Every random input comes from a ``torch.Generator`` seeded from a seed printed in the assertion messages.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# The tests make many tiny tensor operations (the float64 reference); on a few shared cores torch's intra-op threads
# only add overhead (measured 6x slower with 2 threads than with 1).
torch.set_num_threads(1)

DEVICES = [d.strip() for d in os.environ.get("SHADOWKV_TEST_DEVICES", "cpu").split(",") if d.strip()]


def pytest_report_header(config):
    try:
        import shadowkv_core
        info = shadowkv_core.build_info()
    except Exception as exc:  # only informative: the tests themselves fail on the import
        info = f"shadowkv_core not importable: {exc!r}"
    return [f"shadowkv_core build_info: {info}", f"test devices: {DEVICES}"]


@pytest.fixture(params=DEVICES)
def device(request):
    dev = request.param
    if dev.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip(f"device {dev} requested by SHADOWKV_TEST_DEVICES but torch sees no CUDA device")
    return dev
