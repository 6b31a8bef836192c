"""Capacity reported in heartbeats: nvidia-smi parsing (output captured on an H200 node)."""

from __future__ import annotations

from agents.service import parse_nvidia_smi

# `nvidia-smi --query-gpu=name,memory.total --format=csv,noheader,nounits` on an H200 node.
H200 = "NVIDIA H200, 143771\n"


def test_parses_real_h200_output() -> None:
    assert parse_nvidia_smi(H200) == [{"type": "H200", "count": 1, "memory_gib": 140.4}]


def test_groups_identical_gpus_and_skips_noise() -> None:
    text = H200 * 8 + "NVIDIA L40S, 46068\n[N/A], [N/A]\n\n"
    assert parse_nvidia_smi(text) == [
        {"type": "H200", "count": 8, "memory_gib": 140.4},
        {"type": "L40S", "count": 1, "memory_gib": 45.0},
    ]
