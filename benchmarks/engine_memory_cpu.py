"""Every engine end to end on the CPU: `plan --emit`, then `accelerate launch` the shipped training script
(probes/train.py) with the emitted files, and each rank's measured peak (the live-tensor tracker) against
`estimate_memory(device="cpu")` for the same configuration.

Cases: one process; DDP with 2 processes (gloo); DeepSpeed ZeRO-1 and ZeRO-2 on 2 processes; ZeRO-2 with optimizer
offload and ZeRO-3 with parameter offload on one; FSDP2 full shard on 2. A tiny random-init Llama, micro-batch 2,
sequence 64, 1 warm-up and 2 measured optimizer steps. tests/test_e2e_engines.py runs the same cases.

Run:  HF_HUB_OFFLINE=1 python benchmarks/engine_memory_cpu.py [--out benchmarks/results/engine_memory_cpu.json]
(about 2 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

#: name -> the `plan` flags that pin it (batch 8, micro-batch 2, sequence 64, bf16-mixed for all: the speed model
#: prefers fp32 for this dispatch-bound toy, and the cases compare engines at one precision)
CASES = {
    "single": ["--gpus-per-node", "1", "--zero-stage", "0"],
    "ddp": ["--gpus-per-node", "2", "--zero-stage", "0"],
    "zero1": ["--gpus-per-node", "2", "--zero-stage", "1", "--offload", "none"],
    "zero2": ["--gpus-per-node", "2", "--zero-stage", "2", "--offload", "none"],
    "zero2-offload-optimizer": ["--gpus-per-node", "1", "--zero-stage", "2", "--offload", "optimizer"],
    "zero3-offload-params": ["--gpus-per-node", "1", "--zero-stage", "3", "--offload", "optimizer+params"],
    "fsdp2-full-shard": ["--gpus-per-node", "2", "--zero-stage", "3", "--engine", "fsdp", "--offload", "none"],
    "lora-single": ["--gpus-per-node", "1", "--zero-stage", "0", "--peft", "lora", "--lora-rank", "4"],
    "lora-ddp-classifier": ["--gpus-per-node", "2", "--zero-stage", "0", "--peft", "lora", "--lora-rank", "4",
                            "--task", "seq-cls", "--num-labels", "3"],
}
SEQ_LEN = 64


def tiny_model(folder: Path) -> Path:
    import transformers

    transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=300, max_position_embeddings=256,
                             architectures=["LlamaForCausalLM"]).save_pretrained(folder)
    return folder


def emit_plan(model: Path, flags: list[str], out: Path) -> dict:
    """`plan --emit` through the CLI, as a user runs it; returns plan.json."""
    from typer.testing import CliRunner

    from planner.cli import app

    args = ["--model", str(model), "--batch", "8", "--micro-batch", "2", "--seq-len", str(SEQ_LEN), "--gpu",
            "A100-80GB", "--precision", "bf16-mixed", "--no-probe", *flags, "--emit", str(out)]
    result = CliRunner().invoke(app, args)
    if result.exit_code != 0:
        raise RuntimeError(f"plan {' '.join(args)} exited {result.exit_code}: {result.output[-500:]}")
    return json.loads((out / "plan.json").read_text())


def estimate_for(model: Path, plan: dict):
    from planner import Adapter, estimate_memory

    choice, info = plan["choice"], plan["model"]
    return estimate_memory(str(model), task=info["task"], num_labels=info.get("num_labels") or None,
                           adapter=Adapter.from_json(info.get("adapter")), micro_batch=choice["micro_batch"],
                           seq_len=SEQ_LEN,
                           precision=choice["precision"], checkpointing=choice["checkpointing"],
                           grad_accum=choice["grad_accum"], zero_stage=choice["zero_stage"], offload=choice["offload"],
                           world_size=choice["world_size"], engine=choice["engine"], device="cpu")


def run_case(name: str, model: Path, work: Path) -> dict:
    """Emit, train, compare: one row per case (the ranks' largest peak)."""
    from probes.runner import run_training

    folder = work / name
    planned = emit_plan(model, CASES[name], folder)
    choice = planned["choice"]
    result = run_training(folder, timeout_s=900, steps=2, warmup=1)
    row = {"case": name, "engine": choice["engine"], "zero_stage": choice["zero_stage"], "offload": choice["offload"],
           "world_size": choice["world_size"], "precision": choice["precision"], "micro_batch": choice["micro_batch"],
           "grad_accum": choice["grad_accum"], "status": result.status, "reason": result.reason,
           "processes": result.processes, "ran_micro_batch": result.micro_batch, "ran_grad_accum": result.grad_accum,
           "losses": list(result.losses), "measured_peak": result.peak_allocated}
    if result.status == "ok":
        est = estimate_for(model, planned)
        row.update(predicted_peak=est.peak, error=est.peak / result.peak_allocated - 1)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the rows as JSON")
    args = parser.parse_args()
    import torch
    import transformers

    with tempfile.TemporaryDirectory(prefix="trainplan-engines-") as tmp:
        model = tiny_model(Path(tmp) / "model")
        rows = [run_case(name, model, Path(tmp)) for name in CASES]
    for r in rows:
        err = f"{r['error']:+.2%}" if "error" in r else r["reason"][:60]
        print(f"{r['case']:24s} {r['engine']:9s} ZeRO-{r['zero_stage']} {r['offload']:16s} x{r['world_size']}  "
              f"measured {r['measured_peak'] / 2**20:6.2f} MiB  predicted "
              f"{r.get('predicted_peak', 0) / 2**20:6.2f} MiB  {err}")
    errors = [abs(r["error"]) for r in rows if "error" in r]
    print(f"median |error| {statistics.median(errors):.2%}, worst {max(errors):.2%} over {len(errors)} engines")
    if args.out:
        data = {"torch": torch.__version__, "transformers": transformers.__version__, "rows": rows}
        Path(args.out).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
