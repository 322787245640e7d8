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

Rows whose notes name the transformers release they ran (fms-acceleration's 4.48.1, PEFT's method comparison's
5.13.1) are also traced with that release (benchmarks/releases.py; `--no-releases` skips this): 4.48.1's causal-LM
loss, for one, keeps fp32 copies of the logits the installed release does not.

Run:  HF_HUB_OFFLINE=1 python benchmarks/peft_memory.py [--out benchmarks/results/peft_memory.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from planner import Adapter, estimate_memory
from releases import traced_with_releases

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


def measured_release(row: dict) -> str | None:
    """The transformers release the row's notes say it ran."""
    found = re.search(r"transformers (\d+\.\d+\.\d+)", row.get("notes", ""))
    return found.group(1) if found else None


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
            "predicted_gib": predicted / 2**30, "error": predicted / measured - 1, "source": row["source"],
            "method": est.method}


def add_release_predictions(done: list[dict], rows: dict[str, dict]) -> list[str]:
    """Each traced row's prediction with its measured release, where that is not the installed one (`release`,
    `release_predicted_gib`, `release_error`); returns why a release or row could not be traced."""
    import transformers

    by_release: dict[str, list[str]] = {}
    for r in done:
        release = measured_release(rows[r["id"]])
        if release and release != transformers.__version__ and r["method"] == "trace":
            by_release.setdefault(release, []).append(r["id"])
    found, failed = traced_with_releases(Path(__file__).resolve(), by_release)
    for r in done:
        if r["id"] in found:
            got = found[r["id"]]
            r.update(release=got["transformers"], release_predicted_gib=got["predicted_gib"],
                     release_error=got["predicted_gib"] / r["measured_gib"] - 1)
    return failed


def worker(ids: list[str]) -> int:
    """`--worker`: predict the rows `ids` with whatever transformers this interpreter imports, as one JSON line."""
    import transformers

    out = {}
    for row in json.loads((DATA / "published_peft_memory.json").read_text())["rows"]:
        if row["id"] not in ids:
            continue
        try:
            out[row["id"]] = {**predict(row), "transformers": transformers.__version__}
        except Exception as err:  # a release the installed peft or bitsandbytes cannot work with: that row's report
            out[row["id"]] = {"method": "failed", "why": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
    print(json.dumps(out))
    return 0


def summary(rows: list[dict], key: str = "error") -> dict:
    """Errors of `key` ("error": the installed code; "release_error": the measured release where traced)."""
    errors = [abs(r.get(key, r["error"])) for r in rows]
    if not errors:
        return {}
    return {"rows": len(rows), "median_abs_error": statistics.median(errors), "worst_abs_error": max(errors),
            "under_predicted": sum(r.get(key, r["error"]) < 0 for r in rows)}


def _line(r: dict) -> str:
    release = (f"  with {r['release']}: {r['release_predicted_gib']:6.2f} GiB {r['release_error']:+.1%}"
               if "release" in r else "")
    return (f"{r['id']:42s} {r['group']:13s} {r['metric']:22s} measured {r['measured_gib']:6.2f} GiB  "
            f"predicted {r['predicted_gib']:6.2f} GiB  {r['error']:+.1%}{release}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the rows and summary as JSON here")
    parser.add_argument("--no-releases", action="store_true",
                        help="skip tracing rows with the transformers release their notes name")
    parser.add_argument("--worker", nargs="+", metavar="ROW_ID", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker)
    rows = {row["id"]: row for row in json.loads((DATA / "published_peft_memory.json").read_text())["rows"]}
    done, skipped = [], []
    for row in rows.values():
        reason = skip_reason(row)
        if reason:
            skipped.append({"id": row["id"], "reason": reason})
        else:
            done.append(predict(row))
    failed = [] if args.no_releases else add_release_predictions(done, rows)
    for r in done:
        print(_line(r))
    groups = {"planned": [r for r in done if r["group"] == "planned"],
              "other_program": [r for r in done if r["group"] != "planned"]}
    result = {name: summary(group) for name, group in groups.items()}
    result.update({f"{name} (each row's measured release where traced)": summary(group, "release_error")
                   for name, group in groups.items() if any("release" in r for r in group)})
    for name, s in result.items():
        if s:
            print(f"{name}: {s['rows']} rows, median |error| {s['median_abs_error']:.1%}, worst "
                  f"{s['worst_abs_error']:.1%}, {s['under_predicted']} under-predicted")
    for problem in failed:
        print(f"not traced with its measured release: {problem}")
    print(f"skipped {len(skipped)} rows (reasons in the JSON)")
    if args.out:
        Path(args.out).write_text(json.dumps({**result, "rows": done, "skipped": skipped,
                                              "releases_not_traced": failed}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
