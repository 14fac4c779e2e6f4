"""Prints the Markdown step table of a step-benchmark result file (bench/results/<date>-<commit>.json), so that
bench/README.md's table is regenerated from the committed numbers, not copied by hand.

    python bench/step_table.py bench/results/2026-12-01-40b5c33.json
"""

from __future__ import annotations

import json
import sys


def _in_tapered_parts(r: dict) -> bool:
    """Whether the row's step ran in three pipeline parts or more, the splits that can be tapered (cuda_backend.cpp,
    part_start): asked for (decode_pipeline_parts >= 3), or the CUDA backend's choice with bf16 values crossing PCIe
    (three parts from 16 sequences; with fp8 values its choice was three until session 14 and two since, which a
    result file does not record, so those rows are not labelled)."""
    parts = r.get("decode_pipeline_parts") or 0
    if parts > 0:
        return parts >= 3
    return r["batch"] >= 16 and r.get("value_store", "host") == "host"


def table(path: str) -> str:
    data = json.load(open(path))
    lines = [f"{data.get('gpu', '?')}, commit {data.get('commit', '?')}, tests of the same run: {data.get('tests')}; "
             f"memory copy {data['bandwidths'][0] / 1e12:.2f} TB/s, host→device {data['bandwidths'][1] / 1e9:.1f} GB/s",
             "",
             "| B | S | budget | values | factors | hit | ours (ms) | graph (ms) | full attn (ms) | floor (ms) | ours/full | ours/floor |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in data["results"]:
        best = min(r["ours_ms"], r.get("ours_graph_ms", r["ours_ms"]))
        graph = f"{r['ours_graph_ms']:.3f}" if "ours_graph_ms" in r else "-"
        lines.append(f"| {r['batch']} | {r['seq_len']} | {r['budget']} | {r.get('value_store', 'host')} | "
                     f"{r.get('factor_dtype', 'float32')}{' (parts ' + str(r['decode_pipeline_parts']) + ')' if r.get('decode_pipeline_parts') else ''}"
                     f"{' (group max)' if r.get('group_score') == 'max' else ''}"
                     f"{' (two centroids)' if r.get('chunk_score') == 'two_centroids' else ''}"
                     f"{' (values in place)' if r.get('device_values') == 'in_place' else ''}"
                     f"{' (' + r['pipeline_split'] + ' parts)' if r.get('pipeline_split') and _in_tapered_parts(r) else ''}"
                     f"{' (FMA attention)' if r.get('attention') == 'fma' else ''}"
                     f"{' (select on ' + str(r['select_cluster']) + ' CTAs)' if r.get('select_cluster') else ''}"
                     f"{' (plain launches)' if r.get('programmatic_launch') is False else ''}"
                     f"{' (fetch at normal priority)' if r.get('fetch_priority') == 'normal' else ''}"
                     f"{' (no RoPE table)' if r.get('rope_table') is False else ''}"
                     f"{' (rebuild on TF32 MMAs)' if r.get('rebuild_mma') == 'tf32' else ''}"
                     f"{' (select merge by every CTA)' if r.get('select_merge') == 'all' else ''}"
                     f"{' (rebuild RoPE in shared memory)' if r.get('rebuild_rope') == 'shared' else ''}"
                     f"{' (' + r['logits'].upper() + ' landmark logits)' if r.get('logits') in ('fma', 'mma') else ''}"
                     f"{' (no logits tile pool)' if r.get('logits_pool') is False else ''}"
                     f"{' (fetch CTAs ' + str(r['fetch_ctas']) + ')' if r.get('fetch_ctas') else ''}"
                     f"{' (cache ' + str(r['cache_tokens']) + ' tokens)' if r.get('cache_tokens') else ''} | {r['hit']:.2f} | "
                     f"{r['ours_ms']:.3f} | {graph} | {r['full_ms']:.3f} | {r['floor_ms']:.3f} | "
                     f"{best / r['full_ms']:.2f} | {best / r['floor_ms']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(sys.argv[1]))
