"""Where a training step's time goes on this GPU: the shipped training script under torch.profiler, beside the plan's
per-op model of the same configuration.

Needs a CUDA GPU (exits 2 without one). For each configuration it plans it pinned (`planner.plan`), writes the files
a probe runs (`probes.runner.probe_files`), runs `python -m probes.train --profile` under them and keeps the
measurement with the profile's summary: device kernels per optimizer step and their total time, host time per op,
the top ops by device time. Beside the plan's model of the micro-step (the GPU's kernel time and the CPU's dispatch
time, both derivable offline from the same plan), this says whether a step is bound by the GPU or by the host's
dispatch, and which kernels the model misjudges (the profiler's own overhead slows the measured steps a little).
Results go to benchmarks/results/gpu_profile_step-<GPU>-<date>.json.

Run:  HF_HUB_OFFLINE=1 python benchmarks/gpu_profile_step.py [--out DIR]
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
)


def profile_one(name: str, seq: int, precision: str, ckpt: str, mb: int, gpu_name: str, folder: Path) -> dict:
    from gpu_validation import pinned_plan
    from planner.types import Measurement
    from probes.runner import accelerate_command, probe_files, run_group, write_files

    draft = pinned_plan(name, seq, precision, ckpt, mb, gpu_name)
    write_files(probe_files(draft, draft.choice.config), folder)
    summary = folder / "profile.json"
    cmd = accelerate_command(folder / "accelerate_config.yaml",
                             ["-m", "probes.train", "--plan", str(folder), "--out", str(folder / "results"),
                              "--steps", "2", "--warmup", "1", "--profile", str(summary)])
    _, stderr, code = run_group(cmd, {**os.environ, "PYTHONUNBUFFERED": "1"}, 300, cwd=folder)
    row = {"model": name, "seq_len": seq, "precision": precision, "checkpointing": ckpt, "micro_batch": mb,
           "predicted_step_s": draft.choice.throughput.step_time_s, "exit": code}
    results = sorted((folder / "results").glob("rank-*.json"))
    if results:
        row["measurement"] = Measurement.model_validate_json(results[0].read_text()).model_dump(mode="json")
    if summary.exists():
        row["profile"] = json.loads(summary.read_text())
    else:
        row["stderr"] = stderr[-2000:]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).with_name("results")))
    args = parser.parse_args()
    import torch

    from planner.hardware import detect_gpus

    local = detect_gpus()
    if not torch.cuda.is_available() or local is None:
        print("no CUDA GPU: this benchmark profiles real steps on one", file=sys.stderr)
        return 2
    result = {"gpu": local.gpu.name, "date": dt.date.today().isoformat(), "torch": torch.__version__, "rows": []}
    out = Path(args.out) / f"gpu_profile_step-{local.gpu.name}-{result['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    for config in CONFIGS:
        with tempfile.TemporaryDirectory(prefix="trainplan-profile-") as tmp:
            try:
                row = profile_one(*config, local.gpu.name, Path(tmp))
            except Exception as err:  # noqa: BLE001 - one configuration failing is recorded, the rest still run
                row = {"config": list(config), "error": f"{type(err).__name__}: {str(err)[:300]}"}
        result["rows"].append(row)
        out.write_text(json.dumps(result, indent=1) + "\n")
        prof, meas = row.get("profile", {}), row.get("measurement", {})
        print(f"{config}: step {meas.get('step_time_s', 0) * 1e3:.1f} ms measured, "
              f"{row.get('predicted_step_s', 0) * 1e3:.1f} ms predicted; kernels/step "
              f"{prof.get('device_kernels_per_step', 0):.0f}, device busy {prof.get('device_us_per_step', 0) / 1e3:.1f}"
              f" ms/step, host ops {prof.get('host_op_us_per_step', 0) / 1e3:.1f} ms/step", flush=True)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
