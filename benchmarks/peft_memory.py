"""Predicted GPU memory of LoRA / QLoRA fine-tuning against published measurements of HF code with peft.

Rows come from benchmarks/data/published_peft_memory.json (each with its source, configuration, metric and notes;
benchmarks/data/peft_SOURCES.md gives the formulas and caveats). For each row the planner predicts the metric the
row reports (`peak_allocated` for torch.cuda.max_memory_allocated, `peak_reserved` for max_memory_reserved) for the
row's configuration, with the adapters built by peft on the meta model. Rows are in three groups:

* "planned": the program trainplan plans and `plan.prepare` applies: a 16-bit frozen base (or a 4-bit NF4 one),
  fp32 adapters, with or without autocast;
* "other program": HF code running something else: peft's `prepare_model_for_kbit_training` upcasts every
  unquantised weight of a QLoRA model to fp32 (embeddings, norms, the LM head, and so fp32 logits), which
  `plan.prepare` does not do. Reported, not hidden: their error is the cost of that upcast;
* skipped, with the reason: other stacks (LitGPT, torchtune, Unsloth kernels), multi-GPU sharding of a 4-bit
  base, capacity claims without a configuration, DoRA and other adapters, rows without a sequence length.

Run:  HF_HUB_OFFLINE=1 python benchmarks/peft_memory.py [--out benchmarks/results/peft_memory.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from planner import Adapter, estimate_memory

DATA = Path(__file__).resolve().parent / "data"
GPUS = {"A100-80GB": "A100-80GB", "L40S-48GB": "L40S-48GB"}
METRICS = {"max_memory_allocated": "peak_allocated", "max_memory_reserved": "peak_reserved"}
UNITS = {"GB": 1e9, "GiB": 2**30}
#: rows whose peft setup upcasts a QLoRA model's unquantised weights to fp32 (prepare_model_for_kbit_training)
UPCAST = "prepare_model_for_kbit_training"
VANILLA_QLORA = "'baseline-peft-bnb'"   # fms-acceleration's scenario for it


def skip_reason(row: dict) -> str | None:
    framework = row["framework"]
    if "Unsloth" in framework:
        return "a capacity claim (the longest sequence that fits), without its precision or checkpointing"
    if not framework.startswith("hf-transformers"):
        return f"not HF model code with peft ({framework})"
    if row.get("gpus", 1) != 1 or row.get("zero"):
        return "multi-GPU sharding (FSDP / ZeRO-3 with a 4-bit base is not planned)"
    if row["metric"] not in METRICS or row["unit"] not in UNITS or row["gpu"] not in GPUS:
        return f"metric/unit/GPU not mapped ({row['metric']}, {row['unit']}, {row['gpu']})"
    if not row.get("seq_len"):
        return "no sequence length"
    if "dora" in str(row.get("targets")).lower():
        return "DoRA (use_dora) is not planned"
    if row["adapter"] not in ("lora", "qlora", "none (full fine-tuning)"):
        return f"adapter not planned ({row['adapter']})"
    if "Mixtral" in row["model"]:
        return ("measured with transformers 4.x, whose per-expert nn.Linear modules bitsandbytes quantised; "
                "transformers 5 fuses the experts into 3-D parameters it leaves 16-bit")
    return None


def adapter_of(row: dict) -> Adapter | None:
    if row["adapter"] not in ("lora", "qlora"):
        return None
    targets = tuple(t.strip() for t in str(row["targets"]).split(" ")[0].split(",") if t.strip())
    quant = row.get("quant") or {}
    return Adapter(row["adapter"], rank=int(row["rank"]), alpha=row.get("alpha"), targets=targets,
                   dropout=float(row.get("dropout") or 0.0), double_quant=bool(quant.get("double_quant", True)))


def predict(row: dict) -> dict:
    flash = "use_flash_attn=True" in row["notes"]
    est = estimate_memory(row["model"], micro_batch=int(row["micro_batch"]), seq_len=int(row["seq_len"]),
                          precision=row["precision"], optimizer="adamw", checkpointing=row["checkpointing"],
                          grad_accum=int(row.get("grad_accum") or 1), gpu=GPUS[row["gpu"]],
                          attention="flash" if flash else "sdpa", adapter=adapter_of(row))
    measured = float(row["value"]) * UNITS[row["unit"]]
    predicted = getattr(est, METRICS[row["metric"]])
    upcast = VANILLA_QLORA in row["notes"] or (UPCAST in row["notes"] and "NOT vanilla" not in row["notes"])
    return {"id": row["id"], "model": row["model"], "adapter": row["adapter"], "metric": row["metric"],
            "group": "other program" if upcast else "planned", "measured_gib": measured / 2**30,
            "predicted_gib": predicted / 2**30, "error": predicted / measured - 1, "source": row["source"]}


def summary(rows: list[dict]) -> dict:
    errors = [abs(r["error"]) for r in rows]
    if not errors:
        return {}
    return {"rows": len(rows), "median_abs_error": statistics.median(errors), "worst_abs_error": max(errors),
            "under_predicted": sum(r["error"] < 0 for r in rows)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the rows and summary as JSON here")
    args = parser.parse_args()
    data = json.loads((DATA / "published_peft_memory.json").read_text())
    done, skipped = [], []
    for row in data["rows"]:
        reason = skip_reason(row)
        if reason:
            skipped.append({"id": row["id"], "reason": reason})
            continue
        done.append(predict(row))
        r = done[-1]
        print(f"{r['id']:42s} {r['group']:13s} {r['metric']:22s} measured {r['measured_gib']:6.2f} GiB  "
              f"predicted {r['predicted_gib']:6.2f} GiB  {r['error']:+.1%}", flush=True)
    result = {"planned": summary([r for r in done if r["group"] == "planned"]),
              "other_program": summary([r for r in done if r["group"] != "planned"]),
              "rows": done, "skipped": skipped}
    for group in ("planned", "other_program"):
        s = result[group]
        if s:
            print(f"{group}: {s['rows']} rows, median |error| {s['median_abs_error']:.1%}, worst "
                  f"{s['worst_abs_error']:.1%}, {s['under_predicted']} under-predicted")
    print(f"skipped {len(skipped)} rows (reasons in the JSON)")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
