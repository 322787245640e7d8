"""Predicted GPU memory of LoRA / QLoRA fine-tuning against published measurements of HF code with peft.

Rows come from benchmarks/data/published_peft_memory.json (each with its source, configuration, metric and notes;
benchmarks/data/peft_SOURCES.md gives the formulas and caveats). For each row the planner predicts the metric the
row reports (`peak_allocated` for torch.cuda.max_memory_allocated, `peak_reserved` for max_memory_reserved) for the
row's configuration, with the adapters built by peft on the meta model. Rows are of three kinds (a row's note says
which):

* the planned program: the program trainplan plans and `plan.prepare` applies: a 16-bit frozen base (or a 4-bit
  NF4 one), fp32 adapters, with or without autocast;
* another program: HF code running something else: peft's `prepare_model_for_kbit_training` upcasts every
  unquantised weight of a QLoRA model to fp32 (embeddings, norms, the LM head, and so fp32 logits), which
  `plan.prepare` does not do. Reported, not hidden: their error is the cost of that upcast;
* skipped, with the reason: other stacks (LitGPT, torchtune, Unsloth kernels), multi-GPU sharding of a 4-bit
  base, capacity claims without a configuration, DoRA and other adapters, rows without a sequence length.

Written (`python -m benchmarks.report` reads them):

* benchmarks/results/receipts/peft_memory.json: each run as a receipt (benchmarks/runs.py), planned by `planner.plan`
  pinned to its configuration (adapters and all) with the installed transformers, its program saying how it trained
  ("trainer": fms-acceleration's runs, the HF Trainer through trl's SFTTrainer; "hf-loop": PEFT's method comparison,
  HF model code in its own loop; "other": peft's fp32 upcast of a QLoRA model, which no plan runs) and its note
  saying whether it ran the planned program; the skipped rows in benchmarks/results/peft_memory-skipped.json;
* benchmarks/results/peft_memory-measured-release.json (kind "other", a diagnostic; `--no-releases` skips it): the
  rows whose notes name the transformers release they ran (fms-acceleration's 4.48.1, PEFT's method comparison's
  5.13.1) traced with that release (benchmarks/releases.py): 4.48.1's causal-LM loss, for one, keeps fp32 copies of
  the logits the installed release does not. Not what a plan predicts: a plan traces the installed release.

Run:  HF_HUB_OFFLINE=1 python benchmarks/peft_memory.py [--no-releases]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the repository's packages import without an install
    sys.path.insert(0, str(ROOT))

from benchmarks import evidence, runs  # noqa: E402
from planner import Adapter, estimate_memory  # noqa: E402
from planner.config import Config  # noqa: E402

DATA_FILE = "published_peft_memory.json"
DATA = Path(__file__).resolve().parent / "data"
NAME = "peft_memory"
COMMAND = "HF_HUB_OFFLINE=1 python benchmarks/peft_memory.py"
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


def upcast(row: dict) -> bool:
    """The run's peft setup upcast the QLoRA model's unquantised weights to fp32, which `plan.prepare` does not."""
    return VANILLA_QLORA in row["notes"] or (UPCAST in row["notes"] and "NOT vanilla" not in row["notes"])


def program_of(row: dict) -> str:
    """How the measured run trained (evidence.Row.group): the HF Trainer (trl's SFTTrainer is one), HF model code in
    a loop of its own, or another program (peft's fp32 upcast of a 4-bit model, which plan.prepare does not run)."""
    if upcast(row):
        return "other"
    return "trainer" if re.search(r"\bHF Trainer\b|SFTTrainer", row["notes"]) else "hf-loop"


def plan_inputs(row: dict) -> dict:
    flash = "use_flash_attn=True" in row["notes"]
    return {"micro_batch": int(row["micro_batch"]), "seq_len": int(row["seq_len"]), "precision": row["precision"],
            "optimizer": "adamw", "checkpointing": row["checkpointing"],
            "grad_accum": int(row.get("grad_accum") or 1), "gpu": GPUS[row["gpu"]],
            "attention": "flash" if flash else "sdpa"}


def group_of(row: dict) -> dict:
    inputs = plan_inputs(row)
    cfg = Config.of(micro_batch=inputs["micro_batch"], grad_accum=inputs["grad_accum"], world_size=1,
                    precision=inputs["precision"], checkpointing=inputs["checkpointing"], zero_stage=0,
                    offload="none")
    adapter = adapter_of(row)
    return evidence.run_group(program_of(row), inputs["gpu"], cfg, adapter=adapter.method if adapter else "none")


def note_of(row: dict, transformers_version: str | None = None) -> str:
    parts = [("other program: peft's prepare_model_for_kbit_training upcast the unquantised weights to fp32 "
              "(embeddings, norms, LM head, so fp32 logits); plan.prepare does not") if upcast(row)
             else "the planned program (16-bit or NF4 base, fp32 adapters)"]
    release = measured_release(row)
    if release:
        parts.append(f"measured with transformers {release}")
    if transformers_version:
        parts.append(f"traced with transformers {transformers_version}")
    return "; ".join(parts)


def request_of(row: dict) -> dict:
    """`planner.plan`'s keywords pinning the row's configuration and adapters on one GPU, its memory traced."""
    inputs, adapter = plan_inputs(row), adapter_of(row)
    fields = {"peft": adapter.method, "lora_rank": adapter.rank, "lora_alpha": adapter.alpha,
              "lora_targets": ",".join(adapter.targets), "lora_dropout": adapter.dropout,
              "double_quant": adapter.double_quant} if adapter else {}
    return {"model": row["model"], "global_batch": inputs["micro_batch"] * inputs["grad_accum"], "gpu": inputs["gpu"],
            "gpus_per_node": 1, "seq_len": inputs["seq_len"], "micro_batch": inputs["micro_batch"],
            "precision": inputs["precision"], "optimizer": inputs["optimizer"], "checkpointing": inputs["checkpointing"],
            "zero_stage": 0, "offload": "none", "attention": inputs["attention"], "compile": "off", "liger": "off",
            "memory_method": "trace", **fields}


def receipt(row: dict):
    """The run's receipt: the pinned plan's own prediction beside the published figure."""
    return runs.receipt_of(id=row["id"], source=row["source"], data_file=f"benchmarks/data/{DATA_FILE}",
                           request=request_of(row), measured={METRICS[row["metric"]]: float(row["value"]) *
                                                              UNITS[row["unit"]]},
                           device=runs.published_device(GPUS[row["gpu"]], 1), program=program_of(row),
                           note=note_of(row))


def predicted(row: dict, note: str) -> tuple[evidence.Row, str]:
    """The row's evidence row (estimate_memory for its configuration, its adapters built by peft on the meta model)
    and the estimate's method."""
    kept = {}

    def predict():
        kept["est"] = estimate_memory(row["model"], adapter=adapter_of(row), **plan_inputs(row))
        return getattr(kept["est"], METRICS[row["metric"]])

    judged = evidence.predicted_row(id=row["id"], data_file=DATA_FILE, source=row["source"],
                                    measured=float(row["value"]) * UNITS[row["unit"]], predict=predict,
                                    group=group_of(row), note=note)
    return judged, kept["est"].method


def release_rows(rows: list[evidence.Row], data: dict[str, dict]) -> tuple[list[evidence.Row], list[str]]:
    """The traced rows whose notes name a release other than the installed one, traced with it; and why a release
    or row could not be."""
    import transformers  # lazy: only to name the installed release

    from benchmarks.releases import traced_with_releases

    by_release: dict[str, list[str]] = {}
    for r in rows:
        release = measured_release(data[r.id])
        if release and release != transformers.__version__:
            by_release.setdefault(release, []).append(r.id)
    found, failed = traced_with_releases(Path(__file__).resolve(), by_release)
    fields = evidence.Row.__dataclass_fields__
    return [evidence.Row(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in got.items() if k in fields})
            for _, got in sorted(found.items())], failed


def worker(ids: list[str]) -> int:
    """`--worker`: the rows `ids` as evidence rows with whatever transformers this interpreter imports, one JSON
    line."""
    import transformers  # lazy: the release the subprocess put first on the path

    out = {}
    for row in json.loads((DATA / DATA_FILE).read_text())["rows"]:
        if row["id"] not in ids:
            continue
        try:
            judged, method = predicted(row, note_of(row, transformers.__version__))
            out[row["id"]] = {**judged.to_json(), "method": method, "transformers": transformers.__version__}
        except Exception as err:  # a release the installed peft or bitsandbytes cannot work with: that row's report
            out[row["id"]] = {"method": "failed", "why": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
    print(json.dumps(out))
    return 0


def _stack() -> str:
    import peft
    import torch
    import transformers

    return (f"planner.estimate_memory with the row's adapters (planner.Adapter, built by peft on the meta model), "
            f"installed stack (transformers {transformers.__version__}, peft {peft.__version__}, torch "
            f"{torch.__version__}); measured: fms-acceleration's Mistral-7B runs on an A100 (HF Trainer via trl, "
            f"transformers 4.48.1, torch 2.4.1) and PEFT's MetaMathQA runs on an L40S (own loop, transformers "
            f"5.13.1, torch 2.13)")


def _short(problem: str) -> str:
    """A failure's line without the file paths it names."""
    text = re.sub(r" \(/[^)]*\)", "", problem)
    return text + ")" * max(0, text.count("(") - text.count(")"))


def _print(name: str, rows: list[evidence.Row]) -> None:
    s = evidence.summary(rows)
    if s["rows"]:
        print(f"{name}: {s['rows']} rows, median |error| {s['median_abs']:.1%}, worst {s['worst_abs']:.1%}, bias "
              f"{s['bias']:+.1%}, under {s['under']:.0%}, in-sample {sum(r.in_sample for r in rows)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=evidence.RESULTS, help="the results folder")
    parser.add_argument("--no-releases", action="store_true",
                        help="skip tracing rows with the transformers release their notes name")
    parser.add_argument("--worker", nargs="+", metavar="ROW_ID", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker)
    data = {row["id"]: row for row in json.loads((DATA / DATA_FILE).read_text())["rows"]}
    receipts, skipped = [], []
    for row in data.values():
        reason = skip_reason(row)
        if reason:
            skipped.append({"id": row["id"], "reason": reason})
            continue
        found = receipt(row)
        receipts.append(found)
        quantity = METRICS[row["metric"]]
        print(f"{found.id:42s} {found.plan.program:8s} {row['metric']:22s} measured "
              f"{found.measured.get(quantity) / 2**30:6.2f} GiB  predicted "
              f"{found.predicted.model.get(quantity) / 2**30:6.2f} GiB  {1 / found.ratio(quantity) - 1:+.1%}"
              f"{'  (other program)' if upcast(row) else ''}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    runs.write(runs.Benchmark(
        name=NAME, command=COMMAND, stack=_stack(), receipts=tuple(receipts),
        metric="peak memory as each run's source reports it: torch.cuda.max_memory_allocated against the plan's "
               "peak_allocated, max_memory_reserved against peak_reserved (neither holds the plan's error margin)",
        cannot_show="other stacks' LoRA (LitGPT, torchtune, Unsloth: skipped), a 4-bit base sharded over GPUs, DoRA; "
                    "models beyond Mistral-7B and Llama-3.2-3B. PEFT's rows' max_memory_reserved spans the whole run, "
                    "evaluation generation included. Two rows ran peft's fp32 upcast of a QLoRA model, a program "
                    "plan.prepare does not run (their notes say so)"))
    (args.out / f"{NAME}-skipped.json").write_text(json.dumps(skipped, indent=1, sort_keys=True) + "\n")
    if not args.no_releases:
        traced = [predicted(data[r.id], note_of(data[r.id]))[0] for r in receipts]
        rebuilt, failed = release_rows(traced, data)
        evidence.write_results(
            f"{NAME}-measured-release", rebuilt, kind="other", command=COMMAND,
            out=args.out / f"{NAME}-measured-release.json",
            metric="a diagnostic, not a plan's error: the rows' peaks (as peft_memory) traced with the transformers "
                   "release each row's notes say it ran",
            stack="planner.estimate_memory with an older transformers installed into trainplan's cache "
                  "(benchmarks/releases.py)",
            cannot_show="what a plan predicts (a plan traces the installed release)"
                        + (f"; not traced: {'; '.join(map(_short, failed))}" if failed else ""))
        _print("each row's measured release where traced (diagnostic)", rebuilt)
        for problem in failed:
            print(f"not traced with its measured release: {problem}")
    print(f"skipped {len(skipped)} rows (reasons in the JSON)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
