"""Predicted GPU memory against published measurements (benchmarks/data/memory_calibration.json).

Only the rows our model families cover: torchtitan's Llama-3.1-8B FSDP2 runs (bf16 params, fp32 master +
AdamW, per-op selective checkpointing, no torch.compile), metric max_memory_reserved. We compare our `peak`
less the CUDA context (which max_memory_reserved does not include). torchtitan's model code is not HF's,
and FSDP2 is not DeepSpeed ZeRO-3, so a few percent either way is what agreement means here.
The ViT rows need image inputs, which the trace does not build; the ZeRO paper row is in
states_vs_deepspeed.py.

Run:  HF_HUB_OFFLINE=1 python benchmarks/published_memory.py [--data PATH]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from planner import estimate_memory

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO / "benchmarks" / "data" / "memory_calibration.json"
MODELS = {"Llama-3.1-8B": "meta-llama/Llama-3.1-8B"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    args = parser.parse_args()
    rows = json.loads(args.data.read_text())["cases"]
    print(f"{'row':16s} {'GPUs':>5s} {'published GiB':>14s} {'predicted GiB':>14s} {'error':>7s}")
    for row in rows:
        if row["model"] not in MODELS or row.get("compile") or row.get("metric") != "max_memory_reserved":
            continue
        est = estimate_memory(MODELS[row["model"]], micro_batch=row["micro_batch"], seq_len=row["seq_len"],
                              precision="bf16-mixed", checkpointing="selective", zero_stage=3,
                              world_size=row["gpus"], gpus_per_node=8, gpu="H100-80GB")
        predicted = (est.peak - est.terms.cuda_context) / 2**30
        print(f"{row['id']:16s} {row['gpus']:5d} {row['GiB']:14.1f} {predicted:14.1f} {predicted / row['GiB'] - 1:+7.1%}")


if __name__ == "__main__":
    main()
