"""The report dicts carry exactly the fields of their C++ structs (cpp/include/shadowkv/report.hpp): every data member
and every derived value (a const member function without arguments, such as total() and hit_rate()), no more, no less.
A field added to a struct and forgotten in python/src/bindings.cpp fails here instead of going missing silently.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from helpers import generator, randn
from shadowkv_core import KVStore

REPORT_HPP = Path(__file__).resolve().parents[2] / "cpp" / "include" / "shadowkv" / "report.hpp"


def struct_fields(name: str) -> set:
    """Data members and argument-free const member functions of `struct name` in report.hpp."""
    text = REPORT_HPP.read_text()
    match = re.search(r"^struct %s \{\n(.*?)^\};" % name, text, re.S | re.M)
    assert match, f"struct {name} not found in {REPORT_HPP}"
    body = re.sub(r"//.*", "", match.group(1))
    body = re.sub(r"\{[^{}]*\}", ";", body)  # member function bodies (their locals are no fields)
    members = re.findall(r"^\s*[\w:]+(?:<[\w:, ]*>)?\s+(\w+)(?:\s*=[^;]*)?;", body, re.M)  # std::vector<int> too
    derived = re.findall(r"(\w+)\(\)\s*const\b", body)
    return set(members) | set(derived)


def test_the_header_parser_sees_the_structs():
    # The parser must find the fields it guards (an empty parse would make the comparisons below meaningless).
    assert {"low_rank_factors", "value_store_host", "device_reserved", "host_reserved", "shared",
            "total"} <= struct_fields("memory_report")
    assert {"decode_steps", "folds", "hit_rate"} <= struct_fields("store_stats")
    assert {"prefilled", "last_position", "values_on", "shares_prompt_with"} <= struct_fields("sequence_info")


@pytest.fixture
def used_store(device):
    """A store with one prefilled sequence after a few decode steps on `device`, and its slot."""
    g = generator(801)
    store = KVStore(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=64, max_batch=1, max_seq_len=128, rank=32,
                    budget=16, outlier_chunks=1, local_chunks=1, generation_window=16, dtype="float32",
                    device=device)
    (slot,) = store.add_sequences(1)
    store.prefill(0, [slot], randn(g, 1, 60, 2, 64).to(device), randn(g, 1, 60, 2, 64).to(device), keys_post_rope=False)
    for _ in range(3):
        store.decode(0, [slot], randn(g, 1, 4, 64).to(device), randn(g, 1, 2, 64).to(device),
                     randn(g, 1, 2, 64).to(device))
    return store, slot


def test_memory_report_has_exactly_the_struct_fields(used_store):
    store, _ = used_store
    report = store.memory_report()
    assert set(report) == struct_fields("memory_report"), (
        f"missing {struct_fields('memory_report') - set(report)}, extra {set(report) - struct_fields('memory_report')}")
    assert all(isinstance(v, int) for v in report.values()), report
    assert report["total"] > 0


def test_stats_have_exactly_the_struct_fields(used_store):
    store, _ = used_store
    stats = store.stats()
    assert set(stats) == struct_fields("store_stats"), (
        f"missing {struct_fields('store_stats') - set(stats)}, extra {set(stats) - struct_fields('store_stats')}")
    assert stats["decode_steps"] == 3


def test_sequence_info_has_exactly_the_struct_fields(used_store):
    store, slot = used_store
    info = store.sequence_info(0, slot)
    assert set(info) == struct_fields("sequence_info"), (
        f"missing {struct_fields('sequence_info') - set(info)}, extra {set(info) - struct_fields('sequence_info')}")
    assert info["total_len"] == 63
