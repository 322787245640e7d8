"""GPU validation: predicted vs. measured memory and speed, the allocator model vs. the real allocator, and the
plan's choice vs. an exhaustive probe sweep.

Needs a CUDA GPU (exits 2 without one). For a matrix of models x precisions x checkpointing x micro-batches
(32 single-GPU configurations) it plans the configuration pinned (`planner.plan`), runs it with the shipped
training script under the emitted files (`probes.Prober`, the program users run), and compares the plan's
`peak_allocated` / `peak_reserved` with torch.cuda.max_memory_allocated / max_memory_reserved and its modelled
micro-step, optimizer step and tokens/s with the measured ones. It replays benchmarks/allocator_replay.py's
workloads through the real CUDA caching allocator against planner/memory/allocator.py. Then it plans
bloom-560m at batch 256 with probes (cold probe cache; total probe time) and sweeps every single-GPU torch
candidate by probing, to report the chosen plan's throughput as a fraction of the best measured one.
Results go to benchmarks/results/gpu_validation-<GPU>-<date>.json with versions.

Run:  HF_HUB_OFFLINE=1 python benchmarks/gpu_validation.py [--quick] [--out DIR] [--skip-choice]
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


def measure_one(prober, gpu_name: str, name: str, seq: int, precision: str, ckpt: str, mb: int) -> dict:
    """Plan one pinned single-GPU configuration, run it, and compare."""
    from planner import plan
    from planner.models import resolve_model
    from planner.refine import ProbeContext

    row = {"model": name, "seq_len": seq, "precision": precision, "checkpointing": ckpt, "micro_batch": mb}
    try:
        draft = plan(name, mb * 2, gpu=gpu_name, gpus_per_node=1, seq_len=seq, micro_batch=mb, precision=precision,
                     checkpointing=ckpt, zero_stage=0, offload=False, detect=False)
    except Exception as err:  # noqa: BLE001 - a configuration the planner refuses is a row, not a crash
        return {**row, "status": "not planned", "reason": str(err)[:300]}
    cand = draft.choice
    context = ProbeContext(resolve_model(name), draft.seq_len, draft.optimizer, draft.attention, gpu_name, draft)
    got = prober(context, cand.config)
    est, speed = cand.memory, cand.throughput
    row.update(predicted_peak_allocated=est.peak_allocated, predicted_peak_reserved=est.peak_reserved,
               predicted_fits=cand.fits, predicted_step_s=speed.step_time_s,
               predicted_tokens_per_s=speed.tokens_per_s, predicted_parts=speed.parts.model_dump(),
               method=est.method, **got.model_dump(mode="json"))
    if got.status == "ok":
        row["allocated_error"] = est.peak_allocated / got.peak_allocated - 1
        row["reserved_error"] = est.peak_reserved / got.peak_reserved - 1
        row["step_time_error"] = speed.step_time_s / got.step_time_s - 1
    return row


def validate_memory(prober, gpu_name: str, quick: bool) -> list[dict]:
    rows = []
    for name, seq, precision, ckpt, mb in matrix(quick):
        row = measure_one(prober, gpu_name, name, seq, precision, ckpt, mb)
        rows.append(row)
        print(f"{name:32s} {precision:10s} {ckpt:5s} mb={mb:<3d} {row.get('status'):7s} "
              f"alloc err {row.get('allocated_error', float('nan')):+.1%}  "
              f"reserved err {row.get('reserved_error', float('nan')):+.1%}  "
              f"step err {row.get('step_time_error', float('nan')):+.1%}", flush=True)
    return rows


def validate_allocator() -> dict:
    """The allocator model against the real CUDA caching allocator on replayed workloads."""
    sys.path.insert(0, str(Path(__file__).parent))
    import allocator_replay

    out = {}
    for name in ("small_churn", "training_step", "growing_batch", "random_mixed"):
        try:
            out[name] = allocator_replay.compare_on_cuda(allocator_replay.synthetic_events(name))
        except Exception as err:  # noqa: BLE001 - one workload failing is recorded, the rest still run
            out[name] = {"error": str(err)[:300]}
        print(f"allocator {name}: {out[name]}", flush=True)
    return out


def validate_choice(gpu_name: str) -> dict:
    from planner import plan
    from planner.models import resolve_model
    from planner.refine import ProbeContext
    from probes import Prober

    os.environ["TRAINPLAN_CACHE"] = tempfile.mkdtemp(prefix="trainplan-validation-")  # cold probe cache
    start = time.monotonic()
    chosen = plan("bigscience/bloom-560m", 256, measure=Prober(device="cuda"), probe_budget_s=600)
    probe_time = time.monotonic() - start
    prober = Prober(device="cuda")
    best, swept = None, []
    context = ProbeContext(resolve_model("bigscience/bloom-560m"), chosen.seq_len, chosen.optimizer,
                           chosen.attention, gpu_name, chosen)
    for cand in chosen.candidates:
        cfg = cand.config
        if cfg.zero_stage or cfg.world_size > 1:
            continue
        got = prober(context, cfg)
        swept.append({"config": cfg.label(), "predicted_tokens_per_s": cand.throughput.tokens_per_s
                      if cand.throughput else None, **got.model_dump(mode="json")})
        if got.status == "ok" and (best is None or got.tokens_per_s > best[1]):
            best = (cfg.label(), got.tokens_per_s)
    chosen_tps = chosen.choice.throughput.tokens_per_s
    return {"chosen": chosen.choice.config.label(), "chosen_tokens_per_s": chosen_tps,
            "chosen_source": chosen.choice.throughput.source, "plan_with_probes_s": probe_time,
            "probes": [p.model_dump(mode="json") for p in chosen.probes], "best": best[0] if best else None,
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
    for key in ("allocated_error", "reserved_error", "step_time_error"):
        if ok:
            result[f"{key}_median_abs"] = statistics.median(abs(r[key]) for r in ok)
            result[f"{key}_worst"] = max((r[key] for r in ok), key=abs)
    result["matrix"] = rows
    result["allocator"] = validate_allocator()
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
