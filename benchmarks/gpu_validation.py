"""GPU validation: the plan's own predictions against real training steps on one GPU, each run a receipt.

About 27 single-GPU configurations (`ITEMS`: gpt2, bloom-560m, Llama-3.2-1B, Qwen2.5-0.5B and bert-large with a
sequence-classification head; bf16-mixed, fp16-mixed, fp32, bf16-true and fp8; no, selective and full checkpointing;
Liger-Kernel, LoRA, QLoRA, ZeRO-2 with optimizer offload, torch.compile, a 16,384-token sequence, packed data), each
planned pinned with the public API (`planner.plan`, Liger pinned on or off) and run with the shipped training script
under the emitted files (`probes.runner.run_training`: 1 warm-up and 2 measured optimizer steps, a subprocess per run,
as probes run). The configurations whose mechanism the planner changed most recently come first: a lease ends the
list where its time does. The edge set runs, for two models, the largest micro-batch the plan predicts to fit the
card with its default headroom, and records that the next one up is predicted not to.

Every figure a run is scored on is the plan's own prediction of the configuration that ran, made here before the run
(`benchmarks.runs.plan_prediction`, the path `plan` takes: Liger and all), with the facts it read and the git tree hash
of the planner/ that made it (planner/receipts/source.py), which names the commit without git on this machine. Runs
are serial: while a step is timed nothing else runs on the host (no planning, no importing, no second process). Each
run's receipt.json (the shipped script's, planner/receipts) is kept with that prediction, the device, the host's
processor and the stack (Liger's version among it); after its timed steps the run profiles one more micro-step
(torch.profiler, `probes.train --profile-step`), kept beside the receipts. A configuration that cannot run (a package
missing, a failure, the time left short of its limit) is a record with its reason, never started to be cut: the exit
code is 0 whatever the runs did (2 only without a GPU).

Written as it goes, under --out ($OUT if set, else benchmarks/results/; a --dry-run's default is a new temporary
folder, so that a dry run never lands beside real results), four files:
  gpu_validation-<GPU>-<date>.jsonl            a header line, then one JSON line per configuration
  gpu_validation-<GPU>-<date>.json             the same records with the summary
  gpu_validation-<GPU>-<date>-profiles.json    each run's profiled micro-step (per op: calls, host and device time)
  receipts/gpu_validation-<GPU>-<date>.json    the runs' receipts (benchmarks/runs.py), which the report reads

On the GPU machine (trainplan need not be installed; carry what its image lacks as wheels: benchmarks/device_wheels.py):
    HF_HUB_OFFLINE=1 python3 benchmarks/gpu_validation.py --out $OUT
then copy the receipts file into benchmarks/results/receipts/ and the rest into benchmarks/results/.
Here, predictions only (no GPU):
    HF_HUB_OFFLINE=1 python benchmarks/gpu_validation.py --dry-run [--only gpt2-bf16,bert-seqcls-bf16] [--list]
"""

from __future__ import annotations

import argparse
import atexit
import datetime as dt
import functools
import importlib.util
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the repository's packages import without an install
    sys.path.insert(0, str(ROOT))

from benchmarks import runs  # noqa: E402

START = time.monotonic()
#: Optimizer steps per run, as probes run them: one warm-up, then two measured (peaks are reset after the warm-up).
WARMUP, STEPS = 1, 2
#: The program the emitted files run.
PROGRAM = "trainer"
GIB = 2**30
#: The packed hook's dataset (`skewed_dataset`): rows, seed, median and log-normal sigma of the sample lengths, the
#: lengths' bounds, and the token ids' bound (inside every model's vocabulary here).
DATA_ROWS, DATA_SEED, DATA_MEDIAN, DATA_SIGMA, DATA_LENGTHS, DATA_VOCAB = 1000, 0, 200, 1.0, (8, 4096), 30_000
METRIC = ("per run: torch.cuda.max_memory_allocated and max_memory_reserved after the warm-up, the process's device "
          f"memory in NVML (nvidia-smi), and the median optimizer step of {STEPS} after {WARMUP} warm-up")
CANNOT_SHOW = ("several GPUs or nodes (one GPU only), long runs (1 warm-up and 2 measured steps: no allocator "
               "fragmentation over hours), real data (synthetic full-length batches), other GPUs")


@dataclass(frozen=True)
class Case:
    """One configuration to plan pinned and run, and why it is in the list. `extra`: request fields beyond the
    configuration's; `needs`: modules that must import; `edge`: run the largest micro-batch predicted to fit instead
    of `micro_batch`; `dataset`: planned for `skewed_dataset()` with `seq_len` as its --max-length (the data's
    lengths, not a pinned --seq-len, set the rows); `limit_s`: the most a run may take, start-up included."""

    id: str
    why: str
    model: str
    seq_len: int
    micro_batch: int
    precision: str = "bf16-mixed"
    checkpointing: str = "none"
    peft: str = "none"
    task: str | None = None
    num_labels: int | None = None
    zero_stage: int = 0
    offload: str = "none"
    compile: bool = False
    liger: bool = False
    extra: tuple[tuple[str, object], ...] = ()
    needs: tuple[str, ...] = ()
    grad_accum: int = 2
    limit_s: float = 90.0
    edge: bool = False
    dataset: bool = False

    def label(self) -> str:
        parts = [self.model.split("/")[-1], f"s{self.seq_len}", "mb ?" if self.edge else f"mb {self.micro_batch}",
                 self.precision, f"ckpt {self.checkpointing}"]
        parts += [self.peft] if self.peft != "none" else []
        parts += [self.task] if self.task else []
        parts += [f"ZeRO-{self.zero_stage} offload {self.offload}"] if self.zero_stage else []
        parts += ["compiled"] if self.compile else []
        parts += ["Liger"] if self.liger else []
        parts += ["skewed pre-tokenised data"] if self.dataset else []
        return ", ".join(parts + [f"{k}={v}" for k, v in self.extra])


GPT2, BLOOM, LLAMA = "openai-community/gpt2", "bigscience/bloom-560m", "meta-llama/Llama-3.2-1B"
QWEN, BERT = "Qwen/Qwen2.5-0.5B", "google-bert/bert-large-uncased"
SEQ_CLS = {"task": "seq-cls", "num_labels": 2}
LIGER_NEEDS = ("liger_kernel",)
#: What runs, in order: the mechanisms the planner changed last first (Liger's kernels, host-bound steps,
#: recomputation), then repeats of earlier rows, precisions and heads, the packages a lease must carry, the edges,
#: and what takes longest.
ITEMS: tuple[Case, ...] = (
    Case("llama-bf16-liger", "Liger-Kernel's fused linear cross-entropy and kernels on a 128k vocabulary (H200 "
         "2026-11-27: measured 3.15x its prediction)", LLAMA, 2048, 1, liger=True, needs=LIGER_NEEDS, limit_s=180.0),
    Case("qwen-bf16-liger", "Liger's chunks on a tied 151k vocabulary (H200 2026-11-27: 5.09x)", QWEN, 1024, 2,
         liger=True, needs=LIGER_NEEDS, limit_s=150.0),
    Case("bloom-s2048", "BLOOM's eager ALiBi attention at 2048 tokens, where its 16 x 2048 x 2048 score chain "
         "(baddbmm, fp32 mask add and softmax, casts) dominates: the H100's mixed-precision s2048 runs are still "
         "predicted 15-21 % fast, the gap growing with the sequence squared", BLOOM, 2048, 2),
    Case("bloom-s2048-mb1", "its micro-batch-1 twin: predicted near host-bound, measured 15 % faster than full "
         "checkpointing at micro-batch 4 on the H100", BLOOM, 2048, 1),
    Case("bloom-fp16", "fp16 autocast and its loss scaler; on the H200 (2026-11-27) predicted host-bound at 108 ms a "
         "micro-step and measured 85, where its bf16 twin took 86 on the H100: its profile splits host from GPU time",
         BLOOM, 1024, 2, "fp16-mixed"),
    Case("gpt2-bf16", "a host-bound step: dispatch and Python overhead of this GPU's host", GPT2, 1024, 4),
    Case("bert-seqcls-bf16", "a host-bound encoder step with a classification head (no vocabulary logits)", BERT, 512,
         16, **SEQ_CLS),
    Case("bloom-bf16-full", "full checkpointing's recompute where the 250k-vocabulary logits dominate", BLOOM, 1024, 4,
         checkpointing="full"),
    Case("llama-bf16-selective", "selective checkpointing's recompute on a Llama block", LLAMA, 2048, 2,
         checkpointing="selective"),
    Case("gpt2-fp16-selective", "selective checkpointing under fp16 autocast on a small model", GPT2, 1024, 8,
         "fp16-mixed", "selective"),
    Case("llama-bf16", "the Llama block without Liger (its Liger twin above)", LLAMA, 2048, 1),
    Case("qwen-bf16", "Qwen2 without Liger (its Liger twin above)", QWEN, 1024, 2),
    Case("gpt2-fp32", "fp32 weights and matmuls (TF32 off): a GPU-bound step", GPT2, 1024, 4, "fp32"),
    Case("qwen-fp32-full", "fp32 with full checkpointing", QWEN, 1024, 2, "fp32", "full"),
    Case("gpt2-zero2-offload", "DeepSpeed ZeRO-2 with the optimizer on the CPU, on one GPU", GPT2, 1024, 8,
         zero_stage=2, offload="optimizer", needs=("deepspeed",), limit_s=300.0),
    Case("llama-qlora", "QLoRA: a 4-bit base (bitsandbytes) under bf16 compute", LLAMA, 2048, 2, peft="qlora",
         needs=("peft", "bitsandbytes")),
    Case("llama-lora-liger", "LoRA with Liger on a Llama block at 2048 tokens", LLAMA, 2048, 2, peft="lora",
         liger=True, needs=("peft", *LIGER_NEEDS), limit_s=150.0),
    Case("gpt2-bf16true", "pure bf16 (no master copy, no autocast)", GPT2, 1024, 8, "bf16-true"),
    Case("llama-bf16true-full", "pure bf16 with full checkpointing", LLAMA, 2048, 2, "bf16-true", "full"),
    Case("bert-seqcls-fp16-selective", "the classification head under fp16 autocast, selective checkpointing", BERT,
         512, 32, "fp16-mixed", "selective", **SEQ_CLS),
    Case("bloom-lora", "LoRA: a frozen 16-bit base, fp32 adapters and their optimizer states", BLOOM, 1024, 4,
         peft="lora", needs=("peft",)),
    Case("edge-gpt2", "the largest micro-batch predicted to fit must run: activation-bound", GPT2, 1024, 0,
         grad_accum=1, edge=True, limit_s=120.0),
    Case("edge-llama", "the largest micro-batch predicted to fit must run: model states and logits", LLAMA, 2048, 0,
         grad_accum=1, edge=True, limit_s=120.0),
    Case("llama-fp8", "float8 linears (torchao tensorwise through accelerate's AO backend), eager: the converted "
         "GEMMs at the FP8 rate, six unfused casts per layer, bf16-mixed's activations", LLAMA, 2048, 2, "fp8",
         needs=("torchao",), limit_s=150.0),
    Case("llama-long-16k", "one 16,384-token sequence with full checkpointing: what each rank of a 65,536-token "
         "sequence split 4 ways holds and computes (ring attention and Ulysses alike)", LLAMA, 16384, 1,
         checkpointing="full", grad_accum=1, limit_s=120.0),
    Case("hook-packed", "a packed dataset: pre-tokenised samples of skewed lengths packed into rows filled to "
         "--max-length, run as the shipped script runs any plan (full rows, one causal sequence each)", QWEN, 1024, 2,
         extra=(("padding", "packing"),), dataset=True),
    Case("gpt2-compile", "torch.compile: the compiled step and activations, the first step's compile time, and the "
         "speed-up over its eager twin gpt2-bf16", GPT2, 1024, 4, compile=True, limit_s=240.0),
)


# --- predictions -------------------------------------------------------------------------------------------------
def pinned_plan(name: str, seq: int | None, precision: str, ckpt: str, mb: int, gpu_name: str,
                batch: int | None = None, compile: str = "off", **fields):
    """The plan of one pinned single-GPU configuration (global batch `batch`, by default two micro-batches; no
    sharding unless `fields` say): what this benchmark runs, and what gpu_profile_step.py, probe_calibration.py and
    gpu_measured.py re-plan."""
    from planner import plan

    return plan(name, batch or mb * 2, detect=False, use_receipts=False,
                **pinned_fields(seq, precision, ckpt, mb, gpu_name, compile, **fields))


def pinned_fields(seq: int | None, precision: str, ckpt: str, mb: int, gpu_name: str, compile: str = "off",
                  **fields) -> dict:
    """`planner.plan`'s keywords besides the model and batch that pin one single-GPU configuration."""
    return {"gpu": gpu_name, "gpus_per_node": 1, "seq_len": seq, "micro_batch": mb, "precision": precision,
            "checkpointing": ckpt, "compile": compile, "zero_stage": 0, "offload": False, **fields}


def request_of(case: Case, gpu: str) -> dict:
    """`planner.plan`'s keyword arguments for the case's pinned plan (the model and global batch included)."""
    fields = {"zero_stage": case.zero_stage, "offload": case.offload, "liger": "on" if case.liger else "off",
              **dict(case.extra)}
    fields.update({"peft": case.peft} if case.peft != "none" else {})
    fields.update({"task": case.task, "num_labels": case.num_labels} if case.task else {})
    seq = case.seq_len
    if case.dataset:  # the data's lengths set the sequence: its --max-length instead of --seq-len
        fields.update(dataset=str(skewed_dataset()), max_length=case.seq_len)
        seq = None
    pinned = pinned_fields(seq, case.precision, case.checkpointing, case.micro_batch, gpu,
                           "on" if case.compile else "off", **fields)
    return {"model": case.model, "global_batch": case.micro_batch * case.grad_accum,
            **{k: v for k, v in pinned.items() if v is not None}}


def plan_of(case: Case, gpu: str):
    """The case's pinned plan (raises NoFitError when it is predicted not to fit)."""
    from planner import plan

    request = request_of(case, gpu)
    return plan(request.pop("model"), request.pop("global_batch"), detect=False, use_receipts=False, **request)


def case_config(case: Case, gpu: str):
    """The configuration the case's pinned plan chose (or rejected)."""
    from planner.errors import NoFitError

    try:
        return plan_of(case, gpu).choice.config
    except NoFitError as err:
        return err.plan.choice.config


@functools.cache
def skewed_dataset() -> Path:
    """The packed hook's data, written once per process into a temporary folder (removed at exit): DATA_ROWS rows of
    JSON lines, each an `input_ids` list (pre-tokenised, as TRL's SFTTrainer and the Trainer take it, so planning needs
    no tokenizer) of random ids below DATA_VOCAB, its length log-normal around DATA_MEDIAN tokens within DATA_LENGTHS
    (a long tail past --max-length); seeded, so every run writes the same bytes (and the planner's cache knows them).
    Only the plan reads it: the training runs synthetic full rows of the plan's length, as for every case."""
    rng = random.Random(DATA_SEED)
    low, high = DATA_LENGTHS
    folder = Path(tempfile.mkdtemp(prefix="gpu-validation-data-"))
    atexit.register(shutil.rmtree, folder, True)
    path = folder / "skewed-pretokenised.jsonl"
    with path.open("w") as handle:
        for _ in range(DATA_ROWS):
            length = min(high, max(low, round(rng.lognormvariate(math.log(DATA_MEDIAN), DATA_SIGMA))))
            handle.write(json.dumps({"input_ids": [rng.randrange(DATA_VOCAB) for _ in range(length)]}) + "\n")
    return path


def predict(case: Case, gpu: str):
    """The case's pinned plan (its files are what runs) and its prediction (`runs.plan_prediction`: the plan's own
    figures, the facts they read, the planner that made them)."""
    prediction, draft = runs.plan_prediction(request_of(case, gpu))
    return draft, prediction


def edge_case(case: Case, gpu: str) -> tuple[Case, dict]:
    """The largest micro-batch whose pinned plan (one micro-batch per step) fits the card with the default headroom
    (doubling, then bisecting), as a case to run; and the predictions at it and at the next one up."""
    from planner.errors import NoFitError

    @functools.cache
    def at(mb: int) -> tuple[bool, int, int]:
        try:
            draft = plan_of(replace(case, micro_batch=mb), gpu)
        except NoFitError as err:
            draft = err.plan
        return draft.choice.fits, draft.choice.memory.peak, draft.hardware.budget_bytes

    low, high = 0, 1
    while at(high)[0] and high < 4096:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if at(middle)[0] else (low, middle)
    if low == 0:
        raise ValueError("not even micro-batch 1 is predicted to fit")
    info = {"largest_fitting": low, "predicted_peak": at(low)[1], "budget": at(low)[2], "next": low + 1,
            "next_fits": at(low + 1)[0], "next_predicted_peak": at(low + 1)[1]}
    return replace(case, id=f"{case.id}-mb{low}", micro_batch=low, edge=False), info


# --- what a case needs -------------------------------------------------------------------------------------------
@functools.cache
def import_problem(module: str) -> str | None:
    """Why `module` does not import here (None: it does). Tried in a child process, so that a library that touches
    CUDA when imported leaves this process without a CUDA context."""
    if importlib.util.find_spec(module) is None:
        return f"{module} is not installed"
    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=180,
                          check=False)
    if done.returncode:
        tail = (done.stderr.strip().splitlines() or [""])[-1]
        return f"{module} does not import: {tail[:200]}"
    return None


def missing(case: Case) -> str | None:
    """Why the case cannot be planned and run here, or None."""
    return next(filter(None, map(import_problem, case.needs)), None)


# --- running -----------------------------------------------------------------------------------------------------
@dataclass
class Prepared:
    """A case ready to run: its pinned plan's prediction, the emitted files, the edge search's findings."""

    case: Case
    prediction: object
    draft: object
    files: dict
    edge: dict | None = None


def prepare(case: Case, gpu: str, deadline: float) -> Prepared | dict:
    """Everything before the run: what the case needs, the edge search, the pinned plan, its prediction and its
    files. A case that cannot run, or could not finish in the time left, comes back as its finished record."""
    from probes.runner import probe_files

    why_not = missing(case)
    if why_not:
        return record(case, "skipped", why_not)
    left = deadline - time.monotonic()
    if left < case.limit_s:
        return record(case, "skipped", f"{left:.0f} s of the time budget (--budget) left, and the run may take "
                                       f"{case.limit_s:.0f} s: not started rather than cut")
    edge = None
    try:
        if case.edge:
            case, edge = edge_case(case, gpu)
        draft, prediction = predict(case, gpu)
        files = probe_files(draft, draft.choice.config)
    except Exception as err:  # noqa: BLE001 - a configuration the planner refuses is a record, not a crash
        return record(case, "not planned", f"{type(err).__name__}: {str(err)[:300]}", edge=edge)
    return Prepared(case, prediction, draft, files, edge)


def run(job: Prepared) -> tuple:
    """The run of a prepared case, alone: (Measurement, seconds, its receipt.json or None, its profiled micro-step or
    None)."""
    from probes.runner import run_training, write_files

    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu-validation-") as tmp:
        folder = write_files(job.files, Path(tmp))
        profile = folder / "profile.json"
        result = run_training(folder, job.case.limit_s, steps=STEPS, warmup=WARMUP,
                              extra=("--profile-step", str(profile)))
        receipt = json.loads((folder / "receipt.json").read_text()) if (folder / "receipt.json").is_file() else None
        traced = json.loads(profile.read_text()) if profile.is_file() else None
    return result, time.monotonic() - start, receipt, traced


def the_receipt(job: Prepared, written: dict | None, source: str):
    """The run's receipt, scored on the prediction made here (the same plan's figures, with the facts they read):
    None where the run wrote none or an unreadable one."""
    from planner.receipts import parse

    if written is None:
        return None
    try:
        receipt = parse({**written, "predicted": job.prediction.model_dump(mode="json")}, believed=False)
    except ValueError as err:
        return f"its receipt.json does not read: {err}"
    return receipt.model_copy(update={"id": job.case.id, "source": source, "note": job.case.why})


def finish(job: Prepared, outcome: tuple | None, results: Results) -> dict:
    """The case's record (and its receipt, when it ran), written at once."""
    result, wall_s, written, profile = outcome or (None, 0.0, None, None)
    status = result.status if result is not None else "dry-run"
    line = record(job.case, status, result.reason if result is not None else "",
                  predicted=job.prediction.model_dump(mode="json"), planned=job.draft.choice.config.label(),
                  wall_s=round(wall_s, 1))
    receipt = None
    if result is not None:
        line["measured"] = result.model_dump(mode="json")
    if status == "ok":
        receipt = the_receipt(job, written, results.source)
        if isinstance(receipt, str) or receipt is None:
            line["reason"], receipt = receipt or "the run wrote no receipt.json", None
        else:
            line["errors"] = errors_of(receipt)
        if job.case.compile:  # the warm-up step compiles: the training's wall time beyond its steps
            line["compile_s_measured"] = result.seconds - (WARMUP + STEPS) * result.step_time_s
    if job.edge is not None:  # holds: the largest predicted to fit ran, and the next one up is predicted not to
        holds = None if result is None else status == "ok" and not job.edge["next_fits"]
        line["edge"] = {**job.edge, "ran": status, "holds": holds}
    results.add(line, receipt, profile)
    print(progress_line(line), flush=True)
    return line


def errors_of(receipt) -> dict:
    """Each figure's error against the plan's own prediction: predicted / measured - 1."""
    from planner.receipts import MEMORY_FIGURES, STEP_TIME

    out = {}
    for quantity in (*MEMORY_FIGURES, STEP_TIME):
        ratio = receipt.ratio(quantity)
        if ratio:
            out[quantity] = 1 / ratio - 1
    return out


def run_all(cases: list[Case], gpu: str, results: Results, dry_run: bool, deadline: float) -> None:
    """Each case planned, then run alone (a dry run records its prediction only)."""
    for case in cases:
        job = prepare(case, gpu, deadline)
        if isinstance(job, dict):
            results.add(job, None, None)
            print(progress_line(job), flush=True)
            continue
        finish(job, None if dry_run else run(job), results)


# --- records and results -----------------------------------------------------------------------------------------
def record(case: Case, status: str, reason: str = "", **more) -> dict:
    """One configuration's JSON line."""
    config = {**asdict(case), "extra": dict(case.extra)}
    for key in ("id", "why", "needs", "limit_s"):
        config.pop(key)
    return {"record": "config", "id": case.id, "why": case.why, "label": case.label(), "config": config,
            "status": status, "reason": reason, **more}


class Results:
    """What has been measured so far, on disk after every configuration: the JSON lines, the whole record, the
    profiled micro-steps and the receipts."""

    def __init__(self, out: Path, header: dict):
        out.mkdir(parents=True, exist_ok=True)
        gpu, date = header["gpu"], header["date"]
        self.stem = f"gpu_validation-{gpu}-{date}"
        self.lines, self.whole = out / f"{self.stem}.jsonl", out / f"{self.stem}.json"
        self.profiles_path = out / f"{self.stem}-profiles.json"
        self.receipts_folder = out / "receipts"
        #: as the results folder names it: facts.source_key gives "trainplan:gpu_validation-<GPU>"
        self.source = f"benchmarks/results/{self.stem}.json (python3 benchmarks/gpu_validation.py)"
        self.header, self.records, self.receipts, self.profiles = header, [], [], {}
        self.lines.write_text(json.dumps({"record": "run", **header}, sort_keys=True) + "\n")
        self.save()

    def add(self, line: dict, receipt, profile: dict | None) -> None:
        self.records.append(line)
        if receipt is not None:
            self.receipts.append(receipt)
        if profile is not None:
            self.profiles[line["id"]] = profile
        with self.lines.open("a") as handle:
            handle.write(json.dumps(line, sort_keys=True) + "\n")
        self.save()

    def summary(self) -> dict:
        out = {}
        for quantity in ("peak_allocated", "peak_reserved", "peak_process", "step_time_s"):
            errors = [r["errors"][quantity] for r in self.records if quantity in (r.get("errors") or {})]
            if errors:
                out[quantity] = {"runs": len(errors), "median_abs": statistics.median(abs(e) for e in errors),
                                 "worst": max(errors, key=abs), "under": sum(e < 0 for e in errors)}
        return out

    def save(self) -> None:
        whole = {**self.header, "configs": self.records, "summary": self.summary()}
        self.whole.write_text(json.dumps(whole, indent=1, sort_keys=True) + "\n")
        if self.profiles:
            self.profiles_path.write_text(json.dumps(self.profiles, indent=1, sort_keys=True) + "\n")
        if self.receipts and not self.header["dry_run"]:
            stack = (f"the HF Trainer through trainplan's emitted files (probes/train.py under accelerate launch) on "
                     f"{self.header['nvml_name']}, torch {self.header['torch']}, transformers "
                     f"{self.header['transformers']}")
            runs.write(runs.Benchmark(name=self.stem, metric=METRIC, stack=stack, cannot_show=CANNOT_SHOW,
                                      command=self.header["command"], receipts=tuple(self.receipts)),
                       folder=self.receipts_folder)


# --- a run recorded before runs kept receipts ---------------------------------------------------------------------
def recorded_receipts(whole: Path, commit: str) -> runs.Benchmark:
    """The receipts of a run recorded before runs kept them (its whole record, gpu_validation-<GPU>-<date>.json, made
    on the tree of `commit`), each scored against the plan's own prediction the record holds: the pinned plan's
    peak_allocated and step time (and its reserved and process peaks where the record's estimate_memory figures were
    the plan's: where its allocated peak equals the plan's), and the configuration that ran (Liger where the plan
    had it)."""
    from benchmarks.provenance import git

    data = json.loads(whole.read_text())
    tree = (git("rev-parse", f"{commit}:planner") or "").strip() or None
    receipts = []
    for line in data["configs"]:
        if line["status"] != "ok":
            continue
        receipts.append(_recorded(line, data, tree, whole))
    header = {k: data[k] for k in ("nvml_name", "torch", "transformers")}
    return runs.Benchmark(name=whole.stem, metric=METRIC, stack=f"the HF Trainer through trainplan's emitted files on "
                          f"{header['nvml_name']}, torch {header['torch']}, transformers {header['transformers']}",
                          cannot_show=CANNOT_SHOW, command=f"python benchmarks/gpu_validation.py --from-record "
                                                           f"benchmarks/results/{whole.name} --commit {commit}",
                          receipts=tuple(receipts))


def _recorded(line: dict, data: dict, tree: str | None, whole: Path):
    from planner.config import Config
    from planner.receipts import Device, Figures, Hardware, Prediction, Receipt, RunPlan

    config, predicted, measured = line["config"], line["predicted"], line["measured"]
    liger = "Liger" in predicted["config"]
    fields = {k: config[k] for k in ("model", "seq_len", "micro_batch", "precision", "checkpointing", "peft", "task",
                                     "num_labels", "zero_stage", "offload", "compile", "grad_accum")}
    case = Case(id=line["id"], why=line["why"], liger=liger, extra=tuple(config["extra"].items()), **fields)
    choice = Config.of(micro_batch=config["micro_batch"], grad_accum=config["grad_accum"], world_size=1,
                       precision=config["precision"], checkpointing=config["checkpointing"],
                       zero_stage=config["zero_stage"], offload=config["offload"], compiled=config["compile"],
                       liger=liger)
    own = {"peak_allocated": predicted["plan_peak_allocated"], "step_time_s": predicted["step_time_s"],
           "tokens_per_s": predicted["tokens_per_s"]}
    if predicted["peak_allocated"] == predicted["plan_peak_allocated"]:  # estimate_memory gave the plan's figures
        own.update(peak_reserved=predicted["peak_reserved"], peak_process=predicted["peak_process"])
    figures = Figures.model_validate(own, strict=False)
    request = {k: v for k, v in request_of(case, data["gpu"]).items() if k != "dataset"}
    plan = RunPlan(model=config["model"], seq_len=config["seq_len"], adapter=config["peft"], task=config["task"],
                   choice=choice, hardware=Hardware(gpu=data["gpu"], gpus_per_node=1, nodes=1), request=request)
    seen = Figures.model_validate({"peak_allocated": measured["peak_allocated"],
                                   "peak_reserved": measured["peak_reserved"],
                                   "peak_process": measured["process_memory"] or None,
                                   "step_time_s": measured["step_time_s"],
                                   "tokens_per_s": measured["tokens_per_s"]}, strict=False)
    return Receipt(id=line["id"], created=data["date"], source=f"benchmarks/results/{whole.name} (python3 "
                   "benchmarks/gpu_validation.py)", data_file=f"benchmarks/results/{whole.name}", plan=plan,
                   device=Device(kind="cuda", name=data["nvml_name"], gpu=data["gpu"], count=1),
                   versions={k: data.get(k) for k in ("python", "torch", "cuda", "transformers", "accelerate")},
                   predicted=Prediction(model=figures, printed=figures, tree=tree, facts=tuple(line["facts_used"])),
                   measured=seen, steps=data["steps"], warmup=data["warmup"], note=line["why"])


# --- what is printed ---------------------------------------------------------------------------------------------
def _pct(value) -> str:
    return f"{value:+7.1%}" if isinstance(value, float) else f"{'—':>7s}"


def progress_line(line: dict) -> str:
    """One configuration in one line: its errors when measured, its predictions in a dry run, else why not."""
    head = f"{line['id'][:28]:28s} {line['status'][:11]:11s}"
    errors, predicted = line.get("errors"), (line.get("predicted") or {}).get("model") or {}
    if errors:
        return (head + " ".join(_pct(errors.get(k)) for k in ("peak_allocated", "peak_reserved", "peak_process",
                                                               "step_time_s")) + f" {line['wall_s']:5.0f} s")
    if line["status"] == "dry-run":
        return (head + f" predicted {(predicted.get('peak_allocated') or 0) / GIB:6.2f} GiB allocated, "
                f"{(predicted.get('peak_process') or 0) / GIB:6.2f} GiB process, "
                f"{predicted.get('step_time_s') or 0:.3f} s/step ({line['planned']})")
    return head + " " + (line.get("reason") or "")[:90]


def summary_lines(results: Results, seconds: float) -> list[str]:
    """The one-screen summary: the configurations, the error of each figure against the plan's own prediction, the
    edges, what did not run."""
    h, records = results.header, results.records
    lines = ["", f"gpu_validation on {h['gpu']} ({h['nvml_name']}), torch {h['torch']}, {seconds:.0f} s, "
                 f"{'dry run' if h['dry_run'] else 'serial runs'}",
             f"{'configuration':28s} {'status':11s}{'alloc':>7s} {'reserved':>7s} {'process':>7s} {'step':>7s}"]
    lines += [progress_line(r) for r in records]
    for quantity, s in results.summary().items():
        lines.append(f"{quantity:15s} {s['runs']:2d} runs  median |error| {s['median_abs']:5.1%}  worst "
                     f"{s['worst']:+6.1%}  under-predicted {s['under']}")
    for r in records:
        if r.get("edge"):
            e = r["edge"]
            lines.append(f"edge {r['id']}: mb {e['largest_fitting']} predicted {e['predicted_peak'] / GIB:.1f} GiB "
                         f"of {e['budget'] / GIB:.1f} GiB, ran {e['ran']}; mb {e['next']} predicted "
                         f"{e['next_predicted_peak'] / GIB:.1f} GiB, fits: {e['next_fits']}")
    lines += compile_lines(records)
    lines.append(f"receipts: {len(results.receipts)}; wrote {results.lines}, {results.whole.name}"
                 + (f", {results.profiles_path.name}" if results.profiles else "")
                 + (f", receipts/{results.stem}.json" if results.receipts and not h["dry_run"] else ""))
    return lines


def compile_lines(records: list[dict]) -> list[str]:
    """Each compiled run beside its eager twin (the same configuration, not compiled): the speed-up and the compile
    time, measured and predicted."""
    def key(r: dict) -> str:
        return json.dumps({**r["config"], "compile": False}, sort_keys=True)

    eager = {key(r): r for r in records if r["status"] == "ok" and not r["config"]["compile"]}
    lines = []
    for r in records:
        twin = eager.get(key(r))
        if r["config"]["compile"] and r["status"] == "ok" and twin:
            measured = twin["measured"]["step_time_s"] / r["measured"]["step_time_s"]
            predicted = twin["predicted"]["model"]["step_time_s"] / r["predicted"]["model"]["step_time_s"]
            lines.append(f"compile {r['id']}: speed-up over {twin['id']} measured {measured:.2f}x, predicted "
                         f"{predicted:.2f}x; compile {r['compile_s_measured']:.0f} s measured")
    return lines


# --- the command -------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="results folder (default: $OUT, else benchmarks/results; a dry run: "
                                                 "$OUT, else a new temporary folder)")
    parser.add_argument("--dry-run", action="store_true", help="predictions only: no GPU, nothing is run")
    parser.add_argument("--only", help="comma-separated configuration ids (see --list)")
    parser.add_argument("--list", action="store_true", help="print the configurations and why each is there")
    parser.add_argument("--gpu", help="catalog GPU to predict for (default: the detected one; a dry run: H100-80GB)")
    parser.add_argument("--from-record", type=Path, metavar="RECORD",
                        help="write the receipts of a run recorded before runs kept them (its whole record, "
                             "gpu_validation-<GPU>-<date>.json), with --commit, the commit the run was sent from")
    parser.add_argument("--commit", help="with --from-record: the commit whose tree the recorded run planned with")
    parser.add_argument("--budget", type=float, default=450.0,
                        help="seconds after which no run starts; a run that could outlast it is not started "
                             "(default 450)")
    args = parser.parse_args(argv)
    known = [case.id for case in ITEMS]
    unknown = sorted(set((args.only or "").split(",")) - set(known) - {""})
    if unknown:
        parser.error(f"unknown configuration {', '.join(unknown)}; known: {', '.join(known)}")
    return args


def header(args, gpu: str, nvml_name: str) -> dict:
    import accelerate
    import torch
    import transformers

    from planner.hardware.host import cpu_name
    from planner.receipts import planner_tree, versions

    return {"gpu": gpu, "nvml_name": nvml_name, "date": dt.date.today().isoformat(), "dry_run": args.dry_run,
            "budget_s": args.budget, "warmup": WARMUP, "steps": STEPS, "torch": torch.__version__,
            "cuda": torch.version.cuda, "transformers": transformers.__version__,
            "accelerate": accelerate.__version__, "python": sys.version.split()[0], "host": cpu_name(),
            "versions": versions(), "planner_tree": planner_tree(),
            "command": "python3 benchmarks/gpu_validation.py --out $OUT"}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_record:
        print(f"wrote {runs.write(recorded_receipts(args.from_record, args.commit))}")
        return 0
    cases = [c for c in ITEMS if not args.only or c.id in args.only.split(",")]
    if args.list:
        print("\n".join(f"{c.id:28s} {c.label()}\n{'':28s} {c.why}" for c in cases))
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # the training processes run in temporary folders: the repository's packages must import from there
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    from planner.hardware import detect_gpus  # NVML only: this process never opens a CUDA context

    local = None if args.dry_run else detect_gpus()
    if local is None and not args.dry_run:
        print("no CUDA GPU: this benchmark measures real steps on one (--dry-run predicts only)", file=sys.stderr)
        return 2
    gpu = args.gpu or (local.gpu.name if local else "H100-80GB")
    out = args.out or Path(os.environ.get("OUT") or (
        tempfile.mkdtemp(prefix="gpu-validation-dry-run-") if args.dry_run else ROOT / "benchmarks" / "results"))
    results = Results(out, header(args, gpu, local.nvml_name if local else "none (dry run)"))
    deadline = START + args.budget if not args.dry_run else float("inf")
    run_all(cases, gpu, results, args.dry_run, deadline)
    import torch

    # the runs are the only CUDA processes: this one must not hold a context (memory) beside them
    results.header["this_process_initialised_cuda"] = torch.cuda.is_initialized()
    results.save()
    print("\n".join(summary_lines(results, time.monotonic() - START)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
