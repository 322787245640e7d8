"""Predicted GPU memory against published measurements of HF model code and plain PyTorch training steps.

Rows come from benchmarks/data/published_memory.json (each with its source, the metric it reports and notes) and,
for torchtitan's Llama-3.1-8B FSDP2 runs, benchmarks/data/memory_calibration.json. For each row the prediction is
the metric the row reports: `peak_allocated` for torch.cuda.max_memory_allocated, `peak_reserved` for
max_memory_reserved, `peak_process` (what nvidia-smi shows) for process totals. Rows the planner cannot reproduce are
listed with the reason (image models: the trace builds token inputs; LoRA/QLoRA rows are for the adapters benchmark;
rows whose model code differs from HF's are marked approximate). Rows of pure fp16 models are traced with fp16
weights: model code branches on float16 (OPT's eager softmax upcast). The tables' script (fxmarty's gist; PR #32092
quotes its masked-LM variant) loads them with `from_pretrained(..., torch_dtype=torch.float16)`, which builds the
model under that default dtype, and so does the trace: buffers the code makes in fp32 stay fp32 (GPT-NeoX's rotary
tables, so its rotated keys are fp32), where `model.half()` would cast them. The script's loop (`outputs =
model(**inputs); loss = outputs.logits.sum(); loss.backward()`) is the sum objective (`vocab.OBJECTIVE`): its
outputs, with the cache the config's `use_cache` returns, live through the backward and the next forward.

The transformers docs' SDPA tables were measured with the transformers release that first shipped each model's SDPA
code (`MEASURED_RELEASES`), whose model code differs from the installed one. Besides the installed code's
prediction, each of those rows is traced with its own release (benchmarks/releases.py; `--no-releases` skips this).
The summary lines name which code they are for. The measurements' torch versions (2.2 and 2.4) are not reproduced.

The maintainers' held-out tables (the HF docs' bert-large V100 table and torchtune's README table) are not here.

Run:  HF_HUB_OFFLINE=1 python benchmarks/published_memory.py [--out benchmarks/results/published_memory.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

from planner import estimate_memory
from planner.memory.estimate import Evaluation
from planner.program.workload import Workload
from releases import traced_with_releases

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
#: row id prefix -> the transformers release the table was measured with: the first release that ships the model's
#: SDPA attention, which the table's PR added (checked in the releases' wheels: OPTSdpaAttention is absent from
#: 4.45.2 and present in 4.46.3, GPTNeoXSdpaAttention absent from 4.41.2 and present in 4.42.4, BertSdpaSelfAttention
#: absent from 4.40.2 and present in 4.41.2)
MEASURED_RELEASES = {"hfdoc-opt350m-": "4.46.3", "hfdoc-pythia410m-": "4.42.4", "hfdoc-bertbase-": "4.41.2"}
#: published GPU text -> the catalog entry with the same architecture (what decides kernels and overheads)
GPUS = {"L40S": "L40S-48GB", "rtx3080ti": "RTX3090-24GB", "A100": "A100-80GB", "H100": "H100-80GB"}
#: published precision -> ours: pure fp16 weights have bf16-true's bytes
PRECISIONS = {"fp16-true": "bf16-true", "fp32": "fp32", "bf16-true": "bf16-true", "bf16-mixed": "bf16-mixed",
              "fp16-mixed": "fp16-mixed"}
METRICS = {"max_memory_allocated": "peak_allocated", "max_memory_reserved": "peak_reserved",
           "nvidia-smi": "peak_process"}
UNITS = {"MB": 1e6, "GB": 1e9, "GiB": 2**30, "MiB": 2**20}


def gpu_of(text: str) -> str | None:
    return next((name for key, name in GPUS.items() if key.lower() in text.lower()), None)


def skip_reason(row: dict) -> str | None:
    if row.get("task") == "image-cls":
        return "image model (the trace builds token inputs)"
    if row.get("adapter", "none") != "none":
        return "adapter row (benchmarks/peft_memory.py)"
    if row.get("sharding", "none") not in ("none",) or row.get("gpus", 1) != 1:
        return "multi-GPU sharding not reproduced here"
    if row.get("metric") not in METRICS or row.get("precision") not in PRECISIONS or gpu_of(row.get("gpu", "")) is None:
        return f"metric/precision/GPU not mapped ({row.get('metric')}, {row.get('precision')}, {row.get('gpu')})"
    return None


def model_of(row: dict):
    """The HF model for a row: its hub id, or for the LLMs-from-scratch GPT-2 (untied head) a GPT2Config."""
    if "LLMs-from-scratch" in row["source"]:
        import transformers

        return transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024,
                                       tie_word_embeddings=False, architectures=["GPT2LMHeadModel"])
    return row["model"].split(" ")[0]


def predict(row: dict):
    """The row's configuration through estimate_memory's path; pure fp16 models are traced with fp16 weights."""
    from planner.config import Config
    from planner.hardware import lookup_gpu
    from planner.models import resolve_model

    fwd_bwd_only = "fwd+bwd only" in row.get("step_scope", "")
    step = {"optimizer": "sgd" if fwd_bwd_only else _optimizer(row), "objective": "sum" if fwd_bwd_only else "labels",
            "attention": "eager" if row.get("attention", "").startswith("eager") else "sdpa"}
    shape = {"micro_batch": row["micro_batch"], "grad_accum": row.get("grad_accum", 1),
             "checkpointing": row.get("checkpointing", "none")}
    if row["precision"] != "fp16-true":
        return estimate_memory(model_of(row), seq_len=row["seq_len"], precision=PRECISIONS[row["precision"]],
                               gpu=gpu_of(row["gpu"]), **step, **shape)
    cfg = Config.of(world_size=1, precision=PRECISIONS[row["precision"]], zero_stage=0, offload="none", engine=None,
                    **shape)
    evaluation = Fp16Weights(resolve_model(model_of(row)), seq_len=row["seq_len"], gpus_per_node=1, device="cuda",
                             gpu=lookup_gpu(gpu_of(row["gpu"])), **step)
    return evaluation.estimate(cfg, "auto")


class Fp16Weights(Evaluation):
    """bf16-true's bytes with fp16 weights, built as `from_pretrained(torch_dtype=torch.float16)` builds them."""

    def __init__(self, resolved, **kwargs):
        super().__init__(resolved, **kwargs)
        self.workload.__class__ = Fp16Workload


class Fp16Workload(Workload):
    def request(self, cfg):
        return dataclasses.replace(super().request(cfg), half_dtype="float16")


def measured_release(row: dict) -> str | None:
    return next((release for prefix, release in MEASURED_RELEASES.items() if row["id"].startswith(prefix)), None)


def worker(ids: list[str]) -> int:
    """`--worker`: predict the rows `ids` with whatever transformers this interpreter imports, as one JSON line."""
    import transformers

    wanted = set(ids)
    out = {}
    for row in json.loads((DATA / "published_memory.json").read_text())["cases"]:
        if row["id"] in wanted:
            est = predict(row)
            out[row["id"]] = {"predicted": getattr(est, METRICS[row["metric"]]), "method": est.method,
                              "transformers": transformers.__version__}
    print(json.dumps(out))
    return 0


def activation_error(est, measured: float, predicted: float) -> dict:
    """The error on the activations alone: the measurement less what the prediction holds besides them (model
    states and overheads are exact or fixed), against the predicted activations."""
    rest = predicted - est.activations
    return {"predicted_activations": est.activations, "measured_activations": measured - rest,
            "activation_ratio": (measured - rest) / max(est.activations, 1)}


def _optimizer(row: dict) -> str:
    name = row.get("optimizer", "adamw").lower()
    return "adamw" if name.startswith("adamw") else "adam" if name.startswith("adam") else "sgd"


def torchtitan_rows() -> list[dict]:
    """torchtitan's Llama-3.1-8B FSDP2 runs (no torch.compile), as FSDP2 ZeRO-3 candidates."""
    out = []
    for row in json.loads((DATA / "memory_calibration.json").read_text())["cases"]:
        if row["model"] != "Llama-3.1-8B" or row.get("compile"):
            continue
        est = estimate_memory("meta-llama/Llama-3.1-8B", micro_batch=row["micro_batch"], seq_len=row["seq_len"],
                              precision="bf16-mixed", checkpointing="selective", zero_stage=3, engine="fsdp",
                              world_size=row["gpus"], gpus_per_node=8, gpu="H100-80GB")
        measured = row["GiB"] * 2**30
        out.append({"id": row["id"], "metric": row["metric"], "measured": measured, "predicted": est.peak_reserved,
                    "error": est.peak_reserved / measured - 1, "approximate": True,
                    "note": "torchtitan's model code, FSDP2 through torchtitan"})
    return out


def run(releases: bool = True) -> tuple[list[dict], list[dict], list[str]]:
    """Rows with the installed code's prediction and, where `releases`, their measured release's; the skipped rows;
    the releases that could not be traced, with why."""
    rows, skipped, cases = [], [], {}
    for row in json.loads((DATA / "published_memory.json").read_text())["cases"]:
        reason = skip_reason(row)
        if reason:
            skipped.append({"id": row["id"], "reason": reason})
            continue
        measured = row["value"] * UNITS[row["unit"]]
        est = predict(row)
        predicted = getattr(est, METRICS[row["metric"]])
        cases[row["id"]] = row
        rows.append({"id": row["id"], "metric": row["metric"], "measured": measured, "predicted": predicted,
                     "error": predicted / measured - 1, "approximate": "LLMs-from-scratch" in row["source"],
                     "margin": est.margin, "covered_with_margin": predicted + est.margin >= measured,
                     **activation_error(est, measured, predicted)})
    failed = _add_release_predictions(rows, cases) if releases else []
    return rows + torchtitan_rows(), skipped, failed


def _add_release_predictions(rows: list[dict], cases: dict[str, dict]) -> list[str]:
    """Each row's prediction with its table's measured release (benchmarks/releases.py); returns what could not."""
    by_release: dict[str, list[str]] = {}
    for r in rows:
        release = measured_release(cases[r["id"]])
        if release:
            by_release.setdefault(release, []).append(r["id"])
    found, failed = traced_with_releases(Path(__file__).resolve(), by_release)
    for r in rows:
        if r["id"] in found:
            got = found[r["id"]]
            r.update(release=got["transformers"], release_predicted=got["predicted"],
                     release_error=got["predicted"] / r["measured"] - 1)
    return failed


def summary(rows: list[dict], key: str = "error") -> dict:
    """Errors of `key` ("error": the installed code; "measured_code": the measured release where traced)."""
    errors = [r.get("release_error", r["error"]) if key == "measured_code" else r[key] for r in rows]
    covered = [r.get("release_predicted", r["predicted"]) + r["margin"] >= r["measured"] if key == "measured_code"
               else r.get("covered_with_margin", True) for r in rows if "margin" in r]
    return {"rows": len(rows), "median_abs_error": statistics.median(abs(e) for e in errors),
            "worst_abs_error": max(abs(e) for e in errors), "under_predicted": sum(e < 0 for e in errors),
            "under_by_more_than_3pct": sum(e < -0.03 for e in errors),
            "not_covered_with_margin": sum(not c for c in covered)}


def _line(name: str, s: dict) -> str:
    return (f"{name}: {s['rows']} rows, median |error| {s['median_abs_error']:.1%}, worst {s['worst_abs_error']:.1%}, "
            f"{s['under_predicted']} under-predicted ({s['under_by_more_than_3pct']} by more than 3%); "
            f"{s['not_covered_with_margin']} above the prediction plus its error margin")


def report(rows: list[dict]) -> dict:
    import transformers

    installed = transformers.__version__
    exact = [r for r in rows if not r["approximate"]]
    result = {f"all (transformers {installed})": summary(rows),
              f"exact_model_code (transformers {installed})": summary(exact)}
    if any("release_error" in r for r in rows):
        result["exact_model_code (each table's measured release where traced)"] = summary(exact, "measured_code")
        for release in sorted({r["release"] for r in rows if "release" in r}):
            group = [r for r in rows if r.get("release") == release]
            result[f"rows measured with transformers {release}, traced with it"] = summary(group, "measured_code")
            result[f"rows measured with transformers {release}, traced with {installed}"] = summary(group)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write rows and summary as JSON")
    parser.add_argument("--no-releases", action="store_true",
                        help="skip tracing rows with the transformers release they were measured with")
    parser.add_argument("--worker", nargs="+", metavar="ROW_ID", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker)
    rows, skipped, failed = run(releases=not args.no_releases)
    for r in rows:
        release = (f"  with {r['release']}: {r['release_predicted'] / 2**30:6.2f} GiB {r['release_error']:+7.1%}"
                   if "release" in r else "")
        print(f"{r['id']:44s} {r['metric']:22s} measured {r['measured'] / 2**30:7.2f} GiB  predicted "
              f"{r['predicted'] / 2**30:7.2f} GiB  {r['error']:+7.1%}{'  (approximate)' if r['approximate'] else ''}"
              f"{release}")
    result = report(rows)
    for name, s in result.items():
        print(_line(name, s))
    for problem in failed:
        print(f"not traced with its measured release: {problem}")
    print(f"skipped {len(skipped)} rows: " + ", ".join(sorted({s['reason'] for s in skipped})))
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": result, "rows": rows, "skipped": skipped,
                                              "releases_not_traced": failed}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
