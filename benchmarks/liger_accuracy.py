"""Predicted memory and speed of HF-code training runs with and without Liger-Kernel against the published pairs.

Rows come from benchmarks/data/liger_published.json: end-to-end runs of HF model code, each measured without and
with Liger-Kernel (`use_liger_kernel`, or Liger's AutoLigerKernelForCausalLM, which applies the same patches). For
each pair the planner predicts both runs from the same configuration, `Config(liger=False)` and `Config(liger=True)`
(the traced program with Liger's stand-ins, planner/program/liger.py), through `planner.memory.estimate.Evaluation`
and `planner.speed.model.SpeedModel`, each with its own instance: their caches are not keyed by `liger`.

Written with benchmarks/evidence.py to benchmarks/results/liger_accuracy.json:

* the memory rows (kind "memory", group program "trainer": the runs used the HF Trainer, through TRL's SFTTrainer):
  "<id>/without" (liger off against the run without Liger) and "<id>/with" (liger on against the run with it), each
  with-row's note giving the prediction with Liger left unmodelled;
* under "throughput", the same rows for tokens per second (in the evidence row shape, not read by
  benchmarks/report.py: a results file holds one kind);
* under "comparison", each kind's error summaries: without-Liger runs, with-Liger runs with Liger modelled and with
  Liger left unmodelled, and the change Liger makes (the bytes it saves; the speed-up), measured against predicted;
* under "skipped", the rows not predicted, with why.

What the mapping cannot reproduce (each row's note repeats the part that applies): the HF example's runs load the
model in bf16 under FSDP1 (bf16 weights, gradients and AdamW states, about 8 bytes a parameter over the GPUs), where
the planner's FSDP keeps fp32 master weights and states (16 bytes); they pad each batch to its longest sample (at most
512 tokens, so 512 over-counts); and they ran transformers 4.45 with Liger 0.1-0.3, whose FLCE still upcast each
chunk's logits to fp32. The README's runs do not say whether "Batch Size = 8" is per GPU (taken so) and report
throughput per GPU (8 GPUs at 3,200 tokens/s each match Llama-3-8B's FLOPs on A100s; 3,200 in all would not).

Run:  HF_HUB_OFFLINE=1 python benchmarks/liger_accuracy.py [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the repository's packages import without an install
    sys.path.insert(0, str(ROOT))

from benchmarks import evidence  # noqa: E402

DATA_FILE = "liger_published.json"
DATA = Path(__file__).resolve().parent / "data"
NAME = "liger_accuracy"
COMMAND = "HF_HUB_OFFLINE=1 python benchmarks/liger_accuracy.py"
UNITS = {"MB (MiB)": 2**20, "MiB": 2**20, "GiB": 2**30, "tokens/s": 1.0}
FSDP1_STATES = ("FSDP1 over a bf16-loaded model keeps bf16 weights, gradients and AdamW states (8 bytes a parameter "
                "over the GPUs); the planner's FSDP keeps fp32 master weights and states (16)")
PADDED = "dynamic padding to the batch's longest sample (at most 512 tokens): predicted at 512"
OLD_LIGER = "measured with transformers 4.45 and Liger 0.1-0.3 (FLCE chunks upcast to fp32), predicted with 0.8.5"


@dataclass(frozen=True)
class Setup:
    """How one source's runs map onto a planner configuration."""

    gpu: str
    world_size: int
    checkpointing: str
    memory_metric: str          # the MemoryEstimate attribute the row's metric is
    per_gpu_throughput: bool    # the row's tokens/s is one GPU's
    note: str
    zero_stage: int = 3
    engine: str | None = "fsdp"
    adapter: tuple | None = None  # (rank, targets) of a LoRA run


SETUPS = {
    "readme-": Setup("A100-80GB", 8, "full", "peak_reserved", True,
                     f"{FSDP1_STATES}; 'Batch Size = 8' taken per GPU; A100 memory not stated (80 GB taken); the "
                     "training script not stated (the repository's examples/huggingface Trainer script taken); Liger "
                     "and transformers versions not stated (figure of 2024-08)"),
    "hfexample-": Setup("A100-80GB", 4, "full", "peak_allocated", False, f"{FSDP1_STATES}; {PADDED}; {OLD_LIGER}"),
    # peft's default LoRA targets for Llama (peft/utils/constants.py): q_proj, v_proj; checkpointing not stated
    "soup-": Setup("H100-80GB", 1, "none", "peak_reserved", True,
                   "LoRA r=16 on q_proj and v_proj (peft's default for Llama; the run's targets are not stated); "
                   "checkpointing not stated (none taken); 'peak VRAM' taken as max_memory_reserved",
                   zero_stage=0, engine=None, adapter=(16, ("q_proj", "v_proj"))),
}
SKIPPED = {
    "pr1424-": "a 2-layer DeepSeek-V3 of which the source gives only the vocabulary, hidden size and experts; its "
               "norms and MLP are not among the layouts the stand-ins read (planner/program/liger.py LAYOUTS)",
    "issue677-": "the micro-batch is not given, and a T4 (compute capability 7.5) is one `liger.applies` refuses",
}
#: Published names -> what the planner resolves. Qwen2-7B has Qwen2.5-7B's architecture (Qwen2ForCausalLM, hidden
#: 3584, intermediate 18944, 28 layers of 28 / 4 heads, vocabulary 152064); Gemma-7B is built from its config.json.
MODELS = {"Qwen/Qwen2-7B": "Qwen/Qwen2.5-7B", "meta-llama/Llama-3.1-8B (LoRA r=16)": "meta-llama/Llama-3.1-8B"}


def gemma_7b():
    """google/gemma-7b's config.json: hidden 3072, intermediate 24576, 28 layers of 16 heads of 256, vocabulary
    256000, tanh-approximated GELU, tied embeddings."""
    import transformers

    return transformers.GemmaConfig(vocab_size=256000, hidden_size=3072, intermediate_size=24576, num_hidden_layers=28,
                                    num_attention_heads=16, num_key_value_heads=16, head_dim=256,
                                    hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192,
                                    tie_word_embeddings=True, architectures=["GemmaForCausalLM"])


def setup_of(row: dict) -> Setup | None:
    return next((s for prefix, s in SETUPS.items() if row["id"].startswith(prefix)), None)


def skip_reason(row: dict) -> str | None:
    return next((why for prefix, why in SKIPPED.items() if row["id"].startswith(prefix)), None)


class Predictor:
    """The planner's memory and speed for a row's configuration, liger on or off; resolved models and the
    Evaluation / SpeedModel of each (model, sequence, GPU, liger) kept."""

    def __init__(self):
        self._resolved: dict = {}
        self._evaluations: dict = {}
        self._speeds: dict = {}

    def resolved(self, row: dict, setup: Setup):
        from planner.models import resolve_model
        from planner.models.adapters import Adapter

        name = row["model"]
        if name not in self._resolved:
            source = gemma_7b() if name == "google/gemma-7b-it" else MODELS.get(name, name)
            adapter = Adapter(rank=setup.adapter[0], targets=setup.adapter[1]) if setup.adapter else None
            self._resolved[name] = resolve_model(source, adapter=adapter)
        return self._resolved[name]

    def config(self, row: dict, setup: Setup, liger: bool):
        from planner.config import Config

        return Config.of(micro_batch=row["micro_batch"], grad_accum=1, world_size=setup.world_size,
                         precision="bf16-mixed", checkpointing=setup.checkpointing, zero_stage=setup.zero_stage,
                         offload="none", engine=setup.engine, liger=liger)

    def memory(self, row: dict, setup: Setup, liger: bool) -> float:
        from planner.hardware import lookup_gpu
        from planner.memory.estimate import Evaluation

        key = (row["model"], row["seq_len"], setup.gpu, setup.world_size, liger)
        if key not in self._evaluations:
            self._evaluations[key] = Evaluation(self.resolved(row, setup), seq_len=row["seq_len"], optimizer="adamw",
                                                gpus_per_node=setup.world_size, device="cuda",
                                                gpu=lookup_gpu(setup.gpu))
        estimate = self._evaluations[key].estimate(self.config(row, setup, liger))
        return float(getattr(estimate, setup.memory_metric))

    def tokens_per_s(self, row: dict, setup: Setup, liger: bool) -> float:
        from planner.hardware import lookup_gpu
        from planner.program.workload import Workload
        from planner.speed.model import SpeedModel

        key = (row["model"], row["seq_len"], setup.gpu, setup.world_size, liger)
        if key not in self._speeds:
            gpu = lookup_gpu(setup.gpu)
            workload = Workload(self.resolved(row, setup), seq_len=row["seq_len"], optimizer="adamw", gpu=gpu)
            self._speeds[key] = SpeedModel(workload, gpu, setup.world_size)
        info = self._speeds[key](self.config(row, setup, liger))
        return info.tokens_per_s / (setup.world_size if setup.per_gpu_throughput else 1)


def judged_pair(row: dict, setup: Setup, predictor: Predictor) -> tuple[list[evidence.Row], float]:
    """The row's two evidence rows (without, with) and the with-run's prediction with Liger left unmodelled."""
    memory = "throughput" not in row["metric"]
    predict = predictor.memory if memory else predictor.tokens_per_s
    unit = UNITS[row["unit"]]
    groups = {liger: evidence.run_group("trainer", setup.gpu, predictor.config(row, setup, liger),
                                        gpus_per_node=setup.world_size) for liger in (False, True)}
    unmodelled = predict(row, setup, False)
    out = []
    for liger, measured in ((False, row["without_liger"]), (True, row["with_liger"])):
        note = setup.note + ("; values read from chart pixels" if row["values_from_chart_pixels"] else "")
        if liger:
            note += f"; predicted with Liger unmodelled: {unmodelled:.6g} ({unmodelled / (measured * unit) - 1:+.1%})"
        out.append(evidence.predicted_row(id=f"{row['id']}/{'with' if liger else 'without'}", data_file=DATA_FILE,
                                          source=row["source"], measured=measured * unit,
                                          predict=lambda liger=liger: predict(row, setup, liger), group=groups[liger],
                                          note=note))
    return out, unmodelled


def _errors(values: list[float]) -> dict:
    if not values:
        return {"rows": 0}
    absolute = sorted(abs(v) for v in values)
    return {"rows": len(values), "median_abs": statistics.median(absolute), "worst_abs": absolute[-1],
            "bias": statistics.median(values)}


def comparison(pairs: list[tuple[list[evidence.Row], float]], kind: str) -> dict:
    """Errors of the without-runs, of the with-runs with Liger modelled and unmodelled, and of the change Liger makes:
    for memory the bytes it saves (predicted over measured saving, less 1: the states the planner plans apart from
    the run's cancel), for throughput the speed-up (predicted over measured ratio of with to without, less 1)."""
    without = [p[0][0].error for p in pairs]
    modelled = [p[0][1].error for p in pairs]
    unmodelled = [p[1] / p[0][1].measured - 1 for p in pairs]
    change, found = [], []
    for (off, on), _ in pairs:
        measured, predicted = ((off.measured - on.measured, off.predicted - on.predicted) if kind == "memory" else
                               (on.measured / off.measured, on.predicted / off.predicted))
        change.append(predicted / measured - 1)
        found.append({"id": off.id.split("/")[0], "measured": measured, "predicted": predicted})
    name = "saving" if kind == "memory" else "speedup"
    return {"without_liger": _errors(without), "with_liger_modelled": _errors(modelled),
            "with_liger_unmodelled": _errors(unmodelled), name: _errors(change), f"{name}_pairs": found}


def run() -> tuple[dict[str, list], list[dict], dict[str, float]]:
    """The judged pairs by kind, the skipped rows, and seconds per row."""
    predictor, pairs, skipped, seconds = Predictor(), {"memory": [], "throughput": []}, [], {}
    for row in json.loads((DATA / DATA_FILE).read_text())["cases"]:
        setup, why = setup_of(row), skip_reason(row)
        if setup is None or why:
            skipped.append({"id": row["id"], "reason": why or "no setup"})
            continue
        start = time.perf_counter()
        pairs["throughput" if "throughput" in row["metric"] else "memory"].append(judged_pair(row, setup, predictor))
        seconds[row["id"]] = time.perf_counter() - start
    return pairs, skipped, seconds


def _stack() -> str:
    import torch
    import transformers

    return (f"planner.memory.estimate.Evaluation and planner.speed.model.SpeedModel with Config(liger=...), installed "
            f"stack (transformers {transformers.__version__}, torch {torch.__version__}, Liger-Kernel 0.8.5's patches "
            f"as traced stand-ins). Measured: Liger-Kernel's README figure (Llama-3-8B, 8 A100s, FSDP1), its "
            f"examples/huggingface runs (Llama-3-8B, Qwen2-7B, Gemma-7B on 4 A100-80GB, FSDP1, TRL SFTTrainer) and a "
            f"LoRA run of Llama-3.1-8B on one H100 (MakazhanAlpamys/Soup #78)")


def _line(kind: str, name: str, s: dict) -> str:
    if not s["rows"]:
        return f"{kind:10s} {name:26s} no rows"
    return (f"{kind:10s} {name:26s} {s['rows']} rows, median |error| {s['median_abs']:.1%}, worst "
            f"{s['worst_abs']:.1%}, bias {s['bias']:+.1%}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=evidence.RESULTS, help="the results folder")
    args = parser.parse_args()
    start = time.perf_counter()
    pairs, skipped, seconds = run()
    rows = [r for pair in pairs["memory"] for r in pair[0]]
    args.out.mkdir(parents=True, exist_ok=True)
    path = evidence.write_results(
        NAME, rows, kind="other", stack=_stack(), command=COMMAND, out=args.out / f"{NAME}.json",
        metric="per-GPU peak memory of the row's run (torch.cuda.max_memory_allocated, or max_memory_reserved where "
               "the source reports reserved or 'peak VRAM'), each run of a pair predicted with Config(liger) as it "
               "ran",
        cannot_show="the stand-ins against a Liger run on the installed stack: every pair here was measured with "
                    "older Liger and transformers releases, under FSDP1 with bf16 states the planner does not plan "
                    "(16 bytes a parameter planned, about 8 held) and with dynamic padding; the per-pair change "
                    "(`comparison`) cancels most of what the absolute errors carry from that")
    record = json.loads(path.read_text())
    record.update(throughput=[r.to_json() for pair in pairs["throughput"] for r in pair[0]], skipped=skipped,
                  comparison={kind: comparison(found, kind) for kind, found in pairs.items()},
                  seconds={"rows": seconds, "total": time.perf_counter() - start})
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    for kind, found in pairs.items():
        for r in (r for pair in found for r in pair[0]):
            print(f"{r.id:48s} measured {r.measured:12.6g} predicted {r.predicted:12.6g} {r.error:+7.1%}")
        for name, s in record["comparison"][kind].items():
            if not name.endswith("_pairs"):
                print(_line(kind, name, s))
    print(f"wrote {path} in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
