"""GPU validation: predicted vs. measured memory and speed, and the plan's choice vs. an exhaustive probe sweep.

Needs a CUDA GPU (exits 2 without one). For a matrix of models x precisions x checkpointing x micro-batches it
runs a real probe (probes.worker, one subprocess each) and compares with `estimate_memory(device="cuda")`
(peak_allocated vs torch.cuda.max_memory_allocated, peak vs max_memory_reserved + context) and with the speed
model (tokens/s). Then it plans bloom-560m at batch 256 with probes (cold probe cache; total probe time) and
sweeps every single-GPU torch candidate by probing, to report the chosen plan's throughput as a fraction of the
best measured one. Results go to benchmarks/results/gpu_validation-<GPU>-<date>.json with versions.

Run:  HF_HUB_OFFLINE=1 python benchmarks/gpu_validation.py [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

MODELS = {  # name -> (seq_len, micro-batches)
    "openai-community/gpt2": (1024, (4, 16)),
    "bigscience/bloom-560m": (1024, (2, 8)),
    "meta-llama/Llama-3.2-1B": (2048, (1, 4)),
    "google-bert/bert-large-uncased": (512, (8, 32)),
}
PRECISIONS = ("bf16-mixed", "fp32")
CHECKPOINTING = ("none", "full")


def matrix(quick: bool):
    for name, (seq, mbs) in MODELS.items():
        for precision in PRECISIONS[:1] if quick else PRECISIONS:
            for ckpt in CHECKPOINTING:
                for mb in mbs[:1] if quick else mbs:
                    yield name, seq, precision, ckpt, mb


def validate_memory(prober, gpu_name: str, quick: bool) -> list[dict]:
    from planner.memory.estimate import estimate_memory
    from planner.models import resolve_model
    from planner.refine import ProbeContext
    from planner.hardware import lookup_gpu
    from planner.search import model_speed
    from planner.types import Config

    rows = []
    for name, seq, precision, ckpt, mb in matrix(quick):
        resolved = resolve_model(name)
        cfg = Config(micro_batch=mb, grad_accum=2, world_size=1, precision=precision, checkpointing=ckpt,
                     zero_stage=0, offload="none")
        est = estimate_memory(resolved, micro_batch=mb, seq_len=seq, precision=precision, checkpointing=ckpt,
                              gpu=gpu_name, grad_accum=2)
        speed = model_speed(resolved, lookup_gpu(gpu_name), cfg, seq, 1, "sdpa")
        got = prober(ProbeContext(resolved, seq, "adamw", "sdpa", gpu_name), cfg)
        row = {"model": name, "seq_len": seq, "precision": precision, "checkpointing": ckpt, "micro_batch": mb,
               "predicted_peak_allocated": est.peak_allocated, "predicted_peak": est.peak,
               "predicted_tokens_per_s": speed.tokens_per_s, "method": est.method, **got}
        if got.get("status") == "ok":
            row["allocated_error"] = est.peak_allocated / got["peak_allocated"] - 1
            row["reserved_plus_context_error"] = est.peak / (got["peak_reserved"] + est.terms["cuda_context"]) - 1
            row["tokens_per_s_ratio"] = speed.tokens_per_s / got["tokens_per_s"]
        rows.append(row)
        print(f"{name:32s} {precision:10s} {ckpt:5s} mb={mb:<3d} {got.get('status'):7s} "
              f"alloc err {row.get('allocated_error', float('nan')):+.1%}  "
              f"speed pred/meas {row.get('tokens_per_s_ratio', float('nan')):.2f}", flush=True)
    return rows


def validate_choice(gpu_name: str) -> dict:
    from planner import plan
    from planner.refine import ProbeContext
    from probes import Prober

    os.environ["TRAINPLAN_CACHE"] = tempfile.mkdtemp(prefix="trainplan-validation-")  # cold probe cache
    start = time.monotonic()
    chosen = plan("bigscience/bloom-560m", 256, measure=Prober(device="cuda"), probe_budget_s=600)
    probe_time = time.monotonic() - start
    prober = Prober(device="cuda")
    best, swept = None, []
    from planner.models import resolve_model

    context = ProbeContext(resolve_model("bigscience/bloom-560m"), chosen.seq_len, chosen.optimizer, chosen.attention,
                           gpu_name)
    for cand in chosen.candidates:
        cfg = cand.config
        if cfg.zero_stage or cfg.precision == "fp16-mixed":
            continue
        got = prober(context, cfg)
        swept.append({"config": cfg.label(), **got})
        if got.get("status") == "ok" and (best is None or got["tokens_per_s"] > best[1]):
            best = (cfg.label(), got["tokens_per_s"])
    chosen_tps = chosen.choice.throughput.tokens_per_s
    return {"chosen": chosen.choice.config.label(), "chosen_tokens_per_s": chosen_tps,
            "chosen_source": chosen.choice.throughput.source, "plan_with_probes_s": probe_time,
            "probes": list(chosen.probes), "best": best[0] if best else None,
            "best_tokens_per_s": best[1] if best else None,
            "fraction_of_best": chosen_tps / best[1] if best else None, "sweep": swept}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one precision and micro-batch per model")
    parser.add_argument("--out", default=str(Path(__file__).with_name("results")))
    parser.add_argument("--skip-choice", action="store_true", help="only the memory/speed matrix")
    args = parser.parse_args()
    import torch
    import transformers

    from planner.hardware import detect_gpus
    from probes import Prober

    local = detect_gpus()
    if not torch.cuda.is_available() or local is None:
        print("no CUDA GPU: this benchmark measures real steps on one", file=sys.stderr)
        return 2
    gpu_name = local.gpu.name
    result = {"gpu": gpu_name, "nvml_name": local.nvml_name, "date": dt.date.today().isoformat(),
              "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__}
    rows = validate_memory(Prober(device="cuda", use_cache=False), gpu_name, args.quick)
    ok = [r for r in rows if r.get("status") == "ok"]
    if ok:
        result["memory_allocated_median_abs_error"] = statistics.median(abs(r["allocated_error"]) for r in ok)
        result["memory_allocated_worst_abs_error"] = max(abs(r["allocated_error"]) for r in ok)
        result["speed_median_ratio"] = statistics.median(r["tokens_per_s_ratio"] for r in ok)
    result["matrix"] = rows
    if not args.skip_choice:
        result["choice"] = validate_choice(gpu_name)
        c = result["choice"]
        print(f"plan chose {c['chosen']} ({c['chosen_source']}), {c['fraction_of_best']:.0%} of the best swept "
              f"({c['best']}); plan with probes took {c['plan_with_probes_s']:.0f} s")
    out = Path(args.out) / f"gpu_validation-{gpu_name}-{result['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
