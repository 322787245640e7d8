"""Instrument A of benchmarks/cpu_memory_accuracy.py (torch.profiler's CPU memory timeline) on allocations whose live
bytes are known by hand: a test of the instrument, not of the planner."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from cpu_memory_accuracy import memory_profiler, timeline_live_bytes  # noqa: E402

MIB = 2**20


def test_timeline_peak_of_known_allocations():
    floats = MIB // 4
    before = torch.ones(floats)                 # 1 MiB allocated before the profile, touched inside it
    with memory_profiler() as prof:
        a = before + before                     # +1 MiB  -> 2 live (no scalar operand: no 0-dim temporaries)
        b = torch.ones(3 * floats)              # +3 MiB  -> 5 live: the peak
        del a                                   # -1 MiB  -> 4
        c = torch.zeros(floats // 2)            # +0.5    -> 4.5
        del b, c                                # -3.5    -> 1
    live = timeline_live_bytes(prof)
    assert live["start"] == 1 * MIB
    assert live["peak"] == 5 * MIB
    assert live["end"] == 1 * MIB
    assert live["events_peak_delta"] == 4 * MIB
    assert live["allocation_events"] == 6       # three allocations, three frees; `before` is never freed
