"""GPU validation: predicted vs. measured memory and speed, the allocator model vs. the real allocator, and the
plan's choice vs. an exhaustive probe sweep.

Needs a CUDA GPU (exits 2 without one). For a matrix of models x precisions x checkpointing x micro-batches
(32 single-GPU configurations) it plans the configuration pinned (`planner.plan`), runs it with the shipped
training script under the emitted files (`probes.Prober`, the program users run), and compares the plan's
`peak_allocated` / `peak_reserved` with torch.cuda.max_memory_allocated / max_memory_reserved and its modelled
micro-step, optimizer step and tokens/s with the measured ones. It replays benchmarks/allocator_replay.py's
workloads, and the whole runs the planner writes for two configurations (planner/memory/whole_run.py), through the
real CUDA caching allocator against planner/memory/allocator.py. The compile section runs
three of those configurations eager and under torch.compile (the emitted `torch_compile`), for the compiled step,
its speed-up and its compile time against planner/program/compiled.py's model. Then it plans
bloom-560m at batch 256 with probes (cold probe cache; total probe time) and sweeps every single-GPU torch
candidate by probing, to report the chosen plan's throughput as a fraction of the best measured one.
Results go to benchmarks/results/gpu_validation-<GPU>-<date>-<sections>.json with versions, rewritten after
every row.

Run:  HF_HUB_OFFLINE=1 python benchmarks/gpu_validation.py [--quick] [--out DIR]
          [--sections matrix,allocator,compile,choice]
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
#: (model, seq, precision, checkpointing, micro-batch) run eager and compiled by the compile section
COMPILE_CONFIGS = (("openai-community/gpt2", 1024, "bf16-mixed", "none", 4),
                   ("bigscience/bloom-560m", 1024, "bf16-mixed", "none", 2),
                   ("meta-llama/Llama-3.2-1B", 2048, "bf16-mixed", "full", 1))
CHECKPOINTING = ("none", "full")


def matrix(quick: bool) -> list[tuple]:
    """The configurations, the quick set (bf16-mixed, each model's first micro-batch) first."""
    rows = [(name, seq, precision, ckpt, mb) for name, (seq, mbs) in MODELS.items() for precision in PRECISIONS
            for ckpt in CHECKPOINTING for mb in mbs]
    first = [r for r in rows if r[2] == PRECISIONS[0] and r[4] == MODELS[r[0]][1][0]]
    return first if quick else first + [r for r in rows if r not in first]


def pinned_plan(name: str, seq: int, precision: str, ckpt: str, mb: int, gpu_name: str, batch: int | None = None,
                compile: str = "off"):
    """The plan of one pinned single-GPU configuration (global batch `batch`, by default two micro-batches): what
    this benchmark runs, and what gpu_profile_step.py and gpu_measured.py re-plan."""
    from planner import plan

    return plan(name, batch or mb * 2, gpu=gpu_name, gpus_per_node=1, seq_len=seq, micro_batch=mb,
                precision=precision, checkpointing=ckpt, zero_stage=0, offload=False, detect=False, compile=compile)


def measure_one(prober, gpu_name: str, name: str, seq: int, precision: str, ckpt: str, mb: int,
                compile: str = "off") -> dict:
    """Plan one pinned single-GPU configuration, run it, and compare."""
    from planner.models import resolve_model
    from planner.refine import ProbeContext

    row = {"model": name, "seq_len": seq, "precision": precision, "checkpointing": ckpt, "micro_batch": mb,
           "compile": compile}
    try:
        draft = pinned_plan(name, seq, precision, ckpt, mb, gpu_name, compile=compile)
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
    row["predicted_peak_process"] = est.peak_process
    if got.status == "ok":
        row["allocated_error"] = est.peak_allocated / got.peak_allocated - 1
        row["reserved_error"] = est.peak_reserved / got.peak_reserved - 1
        if got.process_memory:
            row["process_error"] = est.peak_process / got.process_memory - 1
        row["step_time_error"] = speed.step_time_s / got.step_time_s - 1
    return row


def validate_memory(prober, gpu_name: str, configs: list[tuple], save) -> list[dict]:
    rows = []
    for name, seq, precision, ckpt, mb in configs:
        row = measure_one(prober, gpu_name, name, seq, precision, ckpt, mb)
        rows.append(row)
        save(rows)
        print(f"{name:32s} {precision:10s} {ckpt:5s} mb={mb:<3d} {row.get('status'):7s} "
              f"alloc err {row.get('allocated_error', float('nan')):+.1%}  "
              f"reserved err {row.get('reserved_error', float('nan')):+.1%}  "
              f"process err {row.get('process_error', float('nan')):+.1%}  "
              f"step err {row.get('step_time_error', float('nan')):+.1%}", flush=True)
    return rows


def validate_compile(prober, gpu_name: str, save) -> list[dict]:
    """Each COMPILE_CONFIGS row eager and compiled: the measured speed-up and compile time (the compiled probe's wall
    time less the eager one's: the same launch, build and steps, plus Inductor) against the model's."""
    rows = []
    for config in COMPILE_CONFIGS:
        eager, compiled = (measure_one(prober, gpu_name, *config, compile=mode) for mode in ("off", "on"))
        row = {"eager": eager, "compiled": compiled}
        if eager.get("status") == "ok" and compiled.get("status") == "ok":
            row.update(speedup_measured=eager["step_time_s"] / compiled["step_time_s"],
                       speedup_predicted=eager["predicted_step_s"] / compiled["predicted_step_s"],
                       compile_s_measured=compiled["seconds"] - eager["seconds"],
                       compile_s_predicted=compiled["predicted_parts"]["compile_once"],
                       compiled_step_error=compiled["step_time_error"],
                       peak_allocated_compiled_over_eager=compiled["peak_allocated"] / eager["peak_allocated"])
        rows.append(row)
        save(rows)
        nan = float("nan")
        print(f"{config[0]:32s} compiled {compiled.get('status')}: speed-up measured "
              f"{row.get('speedup_measured', nan):.2f}x, modelled {row.get('speedup_predicted', nan):.2f}x; "
              f"compile {row.get('compile_s_measured', nan):.0f} s, modelled "
              f"{row.get('compile_s_predicted', nan):.0f} s", flush=True)
    return rows


def validate_allocator() -> dict:
    """The allocator model against the real CUDA caching allocator on replayed workloads."""
    sys.path.insert(0, str(Path(__file__).parent))
    import allocator_replay

    out = {}
    workloads = {name: (lambda name=name: allocator_replay.synthetic_events(name))
                 for name in ("small_churn", "training_step", "growing_batch", "random_mixed")}
    for config in WHOLE_RUNS:  # the events the planner's whole-run replay predicts with (planner/memory/whole_run.py)
        for i in range(2):
            workloads[f"whole_run {' '.join(map(str, config))} variant {i}"] = (
                lambda config=config, i=i: whole_run_events(*config)[i])
    for name, events in workloads.items():
        try:
            out[name] = allocator_replay.compare_on_cuda(events())
        except Exception as err:  # noqa: BLE001 - one workload failing is recorded, the rest still run
            out[name] = {"error": str(err)[:300]}
        print(f"allocator {name}: {out[name]}", flush=True)
    return out


#: Whole runs replayed through the real allocator (model, seq, precision, checkpointing, micro-batch, batch): the
#: H100 row whose reserved peak turned on where the cuBLAS workspaces land, and a plain one
WHOLE_RUNS = (("bigscience/bloom-560m", 2048, "bf16-mixed", "selective", 4, 256),
              ("openai-community/gpt2", 1024, "bf16-mixed", "none", 4, 8))


def whole_run_events(name: str, seq: int, precision: str, ckpt: str, mb: int, batch: int) -> list:
    """The whole run's events (both workspace placements) the planner writes for one pinned configuration."""
    from planner.memory.whole_run import evaluation_runs, whole_run_variants
    from planner.models import resolve_model
    from planner.memory.estimate import Evaluation
    from planner.hardware import lookup_gpu

    draft = pinned_plan(name, seq, precision, ckpt, mb, "H100-80GB", batch=batch)
    evaluation = Evaluation(resolve_model(name), seq_len=seq, optimizer=draft.optimizer, attention=draft.attention,
                            device="cuda", gpu=lookup_gpu("H100-80GB"))
    return whole_run_variants(*evaluation_runs(evaluation, draft.choice.config))


def sweep_order(candidates) -> list:
    """Single-GPU torch candidates that fit, round-robin over (precision, checkpointing) families, each family's
    predicted-fastest first: a time-limited sweep still covers every family."""
    families: dict[tuple, list] = {}
    for cand in sorted(candidates, key=lambda c: -(c.throughput.tokens_per_s if c.throughput else 0)):
        cfg = cand.config
        if not (cfg.zero_stage or cfg.world_size > 1 or not cand.fits):
            families.setdefault((cfg.precision, cfg.checkpointing), []).append(cand)
    order = []
    while any(families.values()):
        order += [family.pop(0) for family in families.values() if family]
    return order


def validate_choice(gpu_name: str, sweep_budget_s: float, probe_budget_s: float, save) -> dict:
    """Sweep candidates by probing (saved after each), then plan with probes from a cold cache; the chosen
    configuration's measured tokens/s as a fraction of the best swept."""
    from planner import plan
    from planner.models import resolve_model
    from planner.refine import ProbeContext
    from probes import Prober

    os.environ["TRAINPLAN_CACHE"] = tempfile.mkdtemp(prefix="trainplan-validation-")  # cold probe cache
    unprobed = plan("bigscience/bloom-560m", 256)
    context = ProbeContext(resolve_model("bigscience/bloom-560m"), unprobed.seq_len, unprobed.optimizer,
                           unprobed.attention, gpu_name, unprobed)
    prober, swept, out = Prober(device="cuda", use_cache=False), [], {"unprobed_choice": unprobed.choice.config.label()}
    sweep_start = time.monotonic()
    for cand in sweep_order(unprobed.candidates):
        if time.monotonic() - sweep_start > sweep_budget_s:
            break
        got = prober(context, cand.config)
        swept.append({"config": cand.config.label(), "predicted_tokens_per_s": cand.throughput.tokens_per_s,
                      "predicted_peak_allocated": cand.memory.peak_allocated, **got.model_dump(mode="json")})
        out["sweep"] = swept
        save(out)
        print(f"sweep {cand.config.label()}: {got.status} {got.tokens_per_s:.0f} tokens/s "
              f"(predicted {cand.throughput.tokens_per_s:.0f})", flush=True)
    measured = {row["config"]: row["tokens_per_s"] for row in swept if row["status"] == "ok"}
    best = max(measured.items(), key=lambda kv: kv[1]) if measured else (None, None)
    out.update(best=best[0], best_tokens_per_s=best[1],
               unprobed_fraction_of_best=measured.get(out["unprobed_choice"], 0) / best[1] if best[1] else None)
    save(out)
    start = time.monotonic()
    chosen = plan("bigscience/bloom-560m", 256, measure=Prober(device="cuda"), probe_budget_s=probe_budget_s)
    label = chosen.choice.config.label()
    out.update(chosen=label, chosen_predicted_tokens_per_s=chosen.choice.throughput.tokens_per_s,
               chosen_measured_tokens_per_s=measured.get(label), chosen_source=chosen.choice.throughput.source,
               plan_with_probes_s=time.monotonic() - start, probes=[p.model_dump(mode="json") for p in chosen.probes],
               fraction_of_best=measured.get(label, 0) / best[1] if best[1] and label in measured else None)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one precision and micro-batch per model")
    parser.add_argument("--out", default=str(Path(__file__).with_name("results")))
    parser.add_argument("--sections", default="matrix,allocator,compile,choice",
                        help="comma-separated: matrix, allocator, compile, choice")
    parser.add_argument("--probe-budget", type=float, default=600.0, help="seconds of probes for the planned choice")
    parser.add_argument("--configs", default=":", help="a slice I:J of the matrix (quick set first)")
    parser.add_argument("--sweep-budget", type=float, default=240.0,
                        help="seconds for the exhaustive sweep (fastest-predicted candidates first)")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
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
    tag = "-".join(sorted(sections)) + ("" if args.configs == ":" else "-" + args.configs.replace(":", "_"))
    out = Path(args.out) / f"gpu_validation-{gpu_name}-{result['date']}-{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(rows=None) -> None:  # after every row: a run cut short still leaves what it measured
        if rows is not None:
            result["matrix"] = rows
            ok = [r for r in rows if r.get("status") == "ok"]
            for key in ("allocated_error", "reserved_error", "process_error", "step_time_error"):
                errors = [r[key] for r in ok if key in r]
                if errors:
                    result[f"{key}_median_abs"] = statistics.median(abs(e) for e in errors)
                    result[f"{key}_worst"] = max(errors, key=abs)
        out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")

    if "matrix" in sections:
        start, _, stop = args.configs.partition(":")
        configs = matrix(args.quick)[int(start or 0):int(stop) if stop else None]
        validate_memory(Prober(device="cuda", use_cache=False), gpu_name, configs, save)
    if "allocator" in sections:
        result["allocator"] = validate_allocator()
        save()
    if "compile" in sections:
        def save_compile(rows: list[dict]) -> None:
            result["compile"] = rows
            save()

        validate_compile(Prober(device="cuda", use_cache=False), gpu_name, save_compile)
    if "choice" in sections:
        def save_choice(part: dict) -> None:
            result["choice"] = part
            save()

        save_choice(validate_choice(gpu_name, args.sweep_budget, args.probe_budget, save_choice))
        c = result["choice"]
        print(f"plan chose {c['chosen']} ({c['chosen_source']}; unprobed: {c['unprobed_choice']}), measured "
              f"{c['chosen_measured_tokens_per_s']} tokens/s vs best swept {c['best']} {c['best_tokens_per_s']}; "
              f"plan with probes took {c['plan_with_probes_s']:.0f} s")
    save()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
