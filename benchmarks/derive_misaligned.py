"""The misaligned-GEMM rates in planner/hardware/efficiency.json, derived from the lent H100's step profiles.

A 16-bit GEMM whose dimensions are not all multiples of 8 elements runs cuBLAS's narrower-load kernels: GPT-2's
50257-token LM head (odd: `..._align1` kernels) and BERT-large's 30522-token MLM head (even, not a multiple of 4:
`..._align2`). benchmarks/gpu_profile_step.py profiled both on a lent H100 (benchmarks/results/
gpu_profile_step-H100-80GB-*.json keep each kernel's device time per optimizer step). For each profiled 16-bit
configuration this sums the device time of the LM head's three GEMMs (the kernels named `_align1` / `_align2`) and
solves for the fraction of peak that makes the planner's GEMM time (planner/speed/kernels.py `gemm_seconds`: FLOPs /
(peak x fraction x shape efficiency)) equal it: fraction = sum(FLOPs / shape efficiency) / (time x peak). The
efficiency.json entries are the mean per alignment.

Run:  python benchmarks/derive_misaligned.py
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
#: the LM heads profiled: model -> (hidden, vocabulary)
HEADS = {"openai-community/gpt2": (768, 50257), "google-bert/bert-large-uncased": (1024, 30522)}
KERNEL = re.compile(r"_align([124])\b")


def head_fraction(row: dict, eff, peak: float) -> tuple[int, float] | None:
    """(alignment, fraction of peak) of one profiled configuration's LM-head kernels, None without them."""
    from planner.speed.kernels import gemm_efficiency

    profile = row.get("profile") or {}
    if row["model"] not in HEADS or row["precision"] == "fp32" or not profile:
        return None
    kernels = [op for op in profile["ops"] if KERNEL.search(op["name"])]
    if not kernels:
        return None
    hidden, vocab = HEADS[row["model"]]
    tokens = row["micro_batch"] * row["seq_len"]
    micro_steps = row["measurement"]["grad_accum"]
    shapes = ((tokens, vocab, hidden), (tokens, hidden, vocab), (vocab, hidden, tokens))  # forward, two backward
    work = micro_steps * sum(2 * m * n * k / gemm_efficiency(1, m, n, k, eff) for m, n, k in shapes)
    seconds = sum(op["self_device_us"] for op in kernels) * 1e-6
    alignment = int(KERNEL.search(kernels[0]["name"]).group(1))
    return alignment, work / seconds / peak


def main() -> int:
    from planner.hardware import lookup_gpu
    from planner.hardware.efficiency_data import efficiency

    eff, gpu = efficiency("H100-80GB"), lookup_gpu("H100-80GB")
    peak = gpu.peak_tflops_for("bf16") * 1e12
    found: dict[int, list[float]] = {}
    for path in sorted(RESULTS.glob("gpu_profile_step-H100-80GB-*.json")):
        for row in json.loads(path.read_text())["rows"]:
            got = head_fraction(row, eff, peak)
            if got:
                found.setdefault(got[0], []).append(got[1])
                print(f"{path.name}  {row['model']:32s} {row['checkpointing']:5s} mb {row['micro_batch']:2d}  "
                      f"align{got[0]}  {got[1]:.3f}")
    for alignment, values in sorted(found.items()):
        print(f"align{alignment}: mean {statistics.mean(values):.3f} over {len(values)} profiles")
    return 0


if __name__ == "__main__":
    sys.exit(main())
