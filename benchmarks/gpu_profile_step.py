"""Where a training step's time goes on this GPU: the shipped training script under torch.profiler, beside the plan's
per-op model of the same configuration.

Needs a CUDA GPU (exits 2 without one). For each configuration it plans it pinned (`planner.plan`), writes the files
a probe runs (`probes.runner.probe_files`), runs `python -m probes.train --profile` under them and keeps the
measurement with the profile's summary: device kernels per optimizer step and their total time, host time per op,
the top ops by device time. Beside the plan's model of the micro-step (the GPU's kernel time and the CPU's dispatch
time, both derivable offline from the same plan), this says whether a step is bound by the GPU or by the host's
dispatch, and which kernels the model misjudges (the profiler's own overhead slows the measured steps a little).
Results go to benchmarks/results/gpu_profile_step-<GPU>-<date>.json.

With `--memory-peak` it instead runs `probes.train --memory-peak` on the configurations whose peak the memory model
misjudges most (and one it gets right, as a control): what was live at the peak, by the line that allocated it,
beside the plan's parts (parameters, gradients, optimizer states, activations, overheads). Results go to
benchmarks/results/gpu_memory_peak-<GPU>-<date>.json.

Run:  HF_HUB_OFFLINE=1 python benchmarks/gpu_profile_step.py [--out DIR] [--memory-peak]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import tempfile
from pathlib import Path

CONFIGS = (  # model, seq_len, precision, checkpointing, micro-batch
    ("openai-community/gpt2", 1024, "bf16-mixed", "none", 4),
    ("openai-community/gpt2", 1024, "bf16-mixed", "none", 16),
    ("openai-community/gpt2", 1024, "fp32", "none", 4),
    ("google-bert/bert-large-uncased", 512, "bf16-mixed", "full", 8),
    ("meta-llama/Llama-3.2-1B", 2048, "bf16-mixed", "none", 1),
    ("openai-community/gpt2", 1024, "bf16-mixed", "full", 4),
    ("google-bert/bert-large-uncased", 512, "bf16-mixed", "none", 8),
    ("meta-llama/Llama-3.2-1B", 2048, "bf16-mixed", "full", 1),
    ("bigscience/bloom-560m", 1024, "bf16-mixed", "none", 2),
)
PEAK_CONFIGS = (  # the largest under-predictions of peak allocated (gpu_measured.py), then a control it gets right
    ("google-bert/bert-large-uncased", 512, "bf16-mixed", "full", 32),
    ("meta-llama/Llama-3.2-1B", 2048, "bf16-mixed", "full", 1),
    ("google-bert/bert-large-uncased", 512, "bf16-mixed", "full", 8),
    ("bigscience/bloom-560m", 1024, "bf16-mixed", "full", 2),
    ("openai-community/gpt2", 1024, "bf16-mixed", "none", 4),
)


def profile_one(name: str, seq: int, precision: str, ckpt: str, mb: int, gpu_name: str, folder: Path,
                peak: bool = False) -> dict:
    """Run one pinned configuration's probe under torch.profiler (or, with `peak`, the allocator's history)."""
    from gpu_validation import pinned_plan
    from planner.types import Measurement
    from probes.runner import accelerate_command, probe_files, run_group, write_files

    draft = pinned_plan(name, seq, precision, ckpt, mb, gpu_name)
    write_files(probe_files(draft, draft.choice.config), folder)
    summary = folder / "profile.json"
    cmd = accelerate_command(folder / "accelerate_config.yaml",
                             ["-m", "probes.train", "--plan", str(folder), "--out", str(folder / "results"),
                              "--steps", "3", "--warmup", "1", "--memory-peak" if peak else "--profile", str(summary)])
    _, stderr, code = run_group(cmd, {**os.environ, "PYTHONUNBUFFERED": "1"}, 300, cwd=folder)
    row = {"model": name, "seq_len": seq, "precision": precision, "checkpointing": ckpt, "micro_batch": mb,
           "predicted_step_s": draft.choice.throughput.step_time_s, "exit": code}
    results = sorted((folder / "results").glob("rank-*.json"))
    if results:
        row["measurement"] = Measurement.model_validate_json(results[0].read_text()).model_dump(mode="json")
    if peak:
        est = draft.choice.memory
        row["predicted"] = {"peak_allocated": est.peak_allocated, "parameters": est.parameters,
                            "gradients": est.gradients, "optimizer_states": est.optimizer_states,
                            "activations": est.activations, "terms": est.terms.model_dump(), "method": est.method}
    if summary.exists():
        row["memory_peak" if peak else "profile"] = json.loads(summary.read_text())
    else:
        row["stderr"] = stderr[-2000:]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).with_name("results")))
    parser.add_argument("--memory-peak", action="store_true",
                        help="record what is live at the peak instead of profiling time (PEAK_CONFIGS)")
    args = parser.parse_args()
    import torch

    from planner.hardware import detect_gpus

    local = detect_gpus()
    if not torch.cuda.is_available() or local is None:
        print("no CUDA GPU: this benchmark profiles real steps on one", file=sys.stderr)
        return 2
    result = {"gpu": local.gpu.name, "date": dt.date.today().isoformat(), "torch": torch.__version__, "rows": []}
    kind = "gpu_memory_peak" if args.memory_peak else "gpu_profile_step"
    out = Path(args.out) / f"{kind}-{local.gpu.name}-{result['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    for config in PEAK_CONFIGS if args.memory_peak else CONFIGS:
        with tempfile.TemporaryDirectory(prefix="trainplan-profile-") as tmp:
            try:
                row = profile_one(*config, local.gpu.name, Path(tmp), peak=args.memory_peak)
            except Exception as err:  # noqa: BLE001 - one configuration failing is recorded, the rest still run
                row = {"config": list(config), "error": f"{type(err).__name__}: {str(err)[:300]}"}
        result["rows"].append(row)
        out.write_text(json.dumps(result, indent=1) + "\n")
        prof, meas = row.get("profile", {}), row.get("measurement", {})
        if args.memory_peak:
            anatomy = row.get("memory_peak", {})
            print(f"{config}: peak allocated {meas.get('peak_allocated', 0) / 2**30:.2f} GiB measured, "
                  f"{row.get('predicted', {}).get('peak_allocated', 0) / 2**30:.2f} predicted; replayed "
                  f"{anatomy.get('peak_replayed', 0) / 2**30:.2f} at {anatomy.get('peak_site')}", flush=True)
            continue
        print(f"{config}: step {meas.get('step_time_s', 0) * 1e3:.1f} ms measured, "
              f"{row.get('predicted_step_s', 0) * 1e3:.1f} ms predicted; kernels/step "
              f"{prof.get('device_kernels_per_step', 0):.0f}, device busy {prof.get('device_us_per_step', 0) / 1e3:.1f}"
              f" ms/step, host ops {prof.get('host_op_us_per_step', 0) / 1e3:.1f} ms/step", flush=True)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
