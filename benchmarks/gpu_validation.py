"""GPU validation: the planner's peak memory and step time against real training steps on one GPU.

About 20 single-GPU configurations (`ITEMS`: gpt2, bloom-560m, Llama-3.2-1B, Qwen2.5-0.5B and bert-large with a
sequence-classification head; bf16-mixed, fp16-mixed, fp32, bf16-true and fp8; no, selective and full checkpointing;
LoRA, QLoRA, ZeRO-2 with optimizer offload, torch.compile, a 16,384-token sequence), each planned pinned with the public API (`planner.plan`;
memory through `planner.estimate_memory` wherever it can express the configuration) and run with the shipped
training script under the emitted files (`probes.runner.run_training`: 1 warm-up and 2 measured optimizer steps of 2
micro-steps, a subprocess per run, as probes run). The edge set runs, for two models, the largest micro-batch the
plan predicts to fit the card with its default headroom, and records that the next one up is predicted not to. Two
hooks (Liger-Kernel, packed data) run once `planner.request.PlanRequest` has their fields; the packed one is planned
for a pre-tokenised dataset of skewed lengths written here (`skewed_dataset`). A configuration that
cannot run (a package or field missing, a failure, the time budget spent) is a record with its reason: the exit code
is 0 whatever the runs did (2 only without a GPU).

Each run's process starts while the previous one trains, imports, and waits for a gate that the previous run's exit
opens, so the GPU serves one run at a time (`--serial`: one process at a time). No run starts after `--budget`
seconds and every run is cut at it (default 450: with start-up, under 8 minutes on an H100).

Written as it goes, under --out ($OUT if set, else benchmarks/results/; a --dry-run's default is a new temporary
folder, so that a dry run never lands beside real results):
  gpu_validation-<GPU>-<date>.jsonl    a header line, then one JSON line per configuration
  gpu_validation-<GPU>-<date>.json     the same records with the summary (the evidence rows' `source`)
  gpu_validation-{memory,throughput}-<GPU>-<date>.json   evidence rows (benchmarks/evidence.py)

On the GPU machine (trainplan need not be installed; carry what its image lacks, e.g. pydantic, as wheels), naming
the commit the tree was sent from (its rows are first-look: each plan is made before its step runs):
    HF_HUB_OFFLINE=1 python3 benchmarks/gpu_validation.py --out $OUT --commit <git rev-parse HEAD here>
Here, predictions only (no GPU):
    HF_HUB_OFFLINE=1 python benchmarks/gpu_validation.py --dry-run [--only gpt2-bf16,bert-seqcls-bf16] [--list]
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures as cf
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
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the repository's packages import without an install
    sys.path.insert(0, str(ROOT))

from benchmarks import evidence  # noqa: E402
from planner import facts  # noqa: E402

START = time.monotonic()
#: Optimizer steps per run, as probes run them: one warm-up, then two measured (peaks are reset after the warm-up).
WARMUP, STEPS = 1, 2
#: The program the emitted files run, as evidence rows name it (planner/planning.py `PROGRAM`).
PROGRAM = "trainer"
#: A run is not started with fewer seconds than this left of the budget.
MIN_RUN_S = 20.0
#: The first argument that makes this file the gated training process (`gated_training`).
WORKER = "--gated-training"
GIB = 2**30
MEMORY_METRIC = "torch.cuda.max_memory_allocated and max_memory_reserved (peak), nvidia-smi process total"
THROUGHPUT_METRIC = (f"seconds per optimizer step of 2 micro-steps (1 for the edge runs), median of {STEPS} after "
                     f"{WARMUP} warm-up")
#: The packed hook's dataset (`skewed_dataset`): rows, seed, median and log-normal sigma of the sample lengths, the
#: lengths' bounds, and the token ids' bound (inside every model's vocabulary here).
DATA_ROWS, DATA_SEED, DATA_MEDIAN, DATA_SIGMA, DATA_LENGTHS, DATA_VOCAB = 1000, 0, 200, 1.0, (8, 4096), 30_000
#: (prediction, Measurement field, what was measured) of the memory rows.
MEMORY_MEASURES = (("peak_allocated", "peak_allocated", "torch.cuda.max_memory_allocated after the warm-up"),
                   ("peak_reserved", "peak_reserved", "torch.cuda.max_memory_reserved after the warm-up"),
                   ("peak_process", "process_memory", "the process's device memory in NVML (nvidia-smi) at the end"))


@dataclass(frozen=True)
class Case:
    """One configuration to plan pinned and run, and why it is in the list. `extra`: request fields the planner
    may not have yet (a hook); `needs`: modules that must import; `edge`: run the largest micro-batch predicted to
    fit instead of `micro_batch`; `dataset`: planned for `skewed_dataset()` with `seq_len` as its --max-length (the
    data's lengths, not a pinned --seq-len, set the rows)."""

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
        parts += ["skewed pre-tokenised data"] if self.dataset else []
        return ", ".join(parts + [f"{k}={v}" for k, v in self.extra])


GPT2, BLOOM, LLAMA = "openai-community/gpt2", "bigscience/bloom-560m", "meta-llama/Llama-3.2-1B"
QWEN, BERT = "Qwen/Qwen2.5-0.5B", "google-bert/bert-large-uncased"
SEQ_CLS = {"task": "seq-cls", "num_labels": 2}
#: What runs, in order: repeats of earlier H100 rows first (drift), then precisions, checkpointing and heads, then
#: the edges, then what takes longest or needs optional packages, then the hooks.
ITEMS: tuple[Case, ...] = (
    Case("gpt2-bf16", "repeat of the 2026-11-22/23 H100 matrix row: drift of the stack and of the card", GPT2, 1024, 4),
    Case("llama-bf16", "repeat of an earlier H100 row on a Llama block (GQA, 128k vocabulary)", LLAMA, 2048, 1),
    Case("bloom-fp16", "fp16 autocast and its loss scaler at an earlier bf16 row's shape: the 'mixed' family claim",
         BLOOM, 1024, 2, "fp16-mixed"),
    Case("qwen-bf16", "an architecture never measured: Qwen2 (GQA, tied 151k vocabulary, qkv bias)", QWEN, 1024, 2),
    Case("bert-seqcls-bf16", "a sequence-classification head on an encoder: no vocabulary logits", BERT, 512, 16,
         **SEQ_CLS),
    Case("gpt2-fp32", "fp32 weights and matmuls (TF32 off)", GPT2, 1024, 4, "fp32"),
    Case("gpt2-bf16true", "pure bf16 (no master copy, no autocast), never measured", GPT2, 1024, 8, "bf16-true"),
    Case("gpt2-fp16-selective", "selective checkpointing under fp16 autocast on a small model", GPT2, 1024, 8,
         "fp16-mixed", "selective"),
    Case("bloom-bf16-full", "full checkpointing where the 250k-vocabulary logits dominate", BLOOM, 1024, 4,
         checkpointing="full"),
    Case("llama-bf16-selective", "selective checkpointing on a Llama block", LLAMA, 2048, 2, checkpointing="selective"),
    Case("llama-bf16true-full", "pure bf16 with full checkpointing", LLAMA, 2048, 2, "bf16-true", "full"),
    Case("qwen-fp32-full", "fp32 with full checkpointing on the new architecture", QWEN, 1024, 2, "fp32", "full"),
    Case("bert-seqcls-fp16-selective", "the classification head under fp16 autocast, selective checkpointing", BERT,
         512, 32, "fp16-mixed", "selective", **SEQ_CLS),
    Case("bloom-lora", "LoRA: a frozen 16-bit base, fp32 adapters and their optimizer states", BLOOM, 1024, 4,
         peft="lora", needs=("peft",)),
    Case("llama-lora", "LoRA on a Llama block at 2048 tokens", LLAMA, 2048, 2, peft="lora", needs=("peft",)),
    Case("edge-gpt2", "the largest micro-batch predicted to fit must run: activation-bound", GPT2, 1024, 0,
         grad_accum=1, edge=True),
    Case("edge-llama", "the largest micro-batch predicted to fit must run: model states and logits", LLAMA, 2048, 0,
         grad_accum=1, edge=True),
    Case("llama-qlora", "QLoRA: a 4-bit base (bitsandbytes) under bf16 compute", LLAMA, 2048, 2, peft="qlora",
         needs=("peft", "bitsandbytes")),
    Case("gpt2-compile", "torch.compile: the compiled step and activations, the first step's compile time, and the "
         "speed-up over its eager twin gpt2-bf16", GPT2, 1024, 4, compile=True, limit_s=240.0),
    Case("gpt2-zero2-offload", "DeepSpeed ZeRO-2 with the optimizer on the CPU, on one GPU", GPT2, 1024, 8,
         zero_stage=2, offload="optimizer", needs=("deepspeed",), limit_s=300.0),
    Case("llama-fp8", "float8 linears (torchao tensorwise through accelerate's AO backend), eager: the converted "
         "GEMMs at the FP8 rate, six unfused casts per layer, bf16-mixed's activations", LLAMA, 2048, 2, "fp8",
         needs=("torchao",)),
    Case("llama-long-16k", "one 16,384-token sequence with full checkpointing: what each rank of a 65,536-token "
         "sequence split 4 ways holds and computes (ring attention and Ulysses alike)", LLAMA, 16384, 1,
         checkpointing="full", grad_accum=1, limit_s=120.0),
    Case("hook-liger", "Liger-Kernel (use_liger_kernel): fused kernels and the chunked cross-entropy", LLAMA, 2048, 2,
         extra=(("liger", "on"),), needs=("liger_kernel",)),
    Case("hook-packed", "a packed dataset: pre-tokenised samples of skewed lengths packed into rows filled to "
         "--max-length, run as the shipped script runs any plan (full rows, one causal sequence each)", QWEN, 1024, 2,
         extra=(("padding", "packing"),), dataset=True),
)


# --- predictions -------------------------------------------------------------------------------------------------
def pinned_plan(name: str, seq: int | None, precision: str, ckpt: str, mb: int, gpu_name: str,
                batch: int | None = None, compile: str = "off", **fields):
    """The plan of one pinned single-GPU configuration (global batch `batch`, by default two micro-batches; no
    sharding unless `fields` say): what this benchmark runs, and what gpu_profile_step.py, probe_calibration.py and
    gpu_measured.py re-plan."""
    from planner import plan

    fields = {"zero_stage": 0, "offload": False, **fields}
    return plan(name, batch or mb * 2, gpu=gpu_name, gpus_per_node=1, seq_len=seq, micro_batch=mb,
                precision=precision, checkpointing=ckpt, detect=False, compile=compile, **fields)


def case_config(case: Case, gpu: str):
    """The configuration the case's pinned plan chose (or rejected)."""
    from planner.errors import NoFitError

    try:
        return plan_of(case, gpu).choice.config
    except NoFitError as err:
        return err.plan.choice.config


def plan_of(case: Case, gpu: str):
    """The case's pinned plan (raises NoFitError when it is predicted not to fit)."""
    fields = {"zero_stage": case.zero_stage, "offload": case.offload, **dict(case.extra)}
    fields.update({"peft": case.peft} if case.peft != "none" else {})
    fields.update({"task": case.task, "num_labels": case.num_labels} if case.task else {})
    seq = case.seq_len
    if case.dataset:  # the data's lengths set the sequence: its --max-length instead of --seq-len
        fields.update(dataset=str(skewed_dataset()), max_length=case.seq_len)
        seq = None
    return pinned_plan(case.model, seq, case.precision, case.checkpointing, case.micro_batch, gpu,
                       batch=case.micro_batch * case.grad_accum, compile="on" if case.compile else "off", **fields)


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


def predicted_memory(case: Case, gpu: str):
    """The case's predicted memory and where it came from: `planner.estimate_memory` at exactly this configuration,
    or the pinned plan's own estimate where estimate_memory has no input for it (torch.compile, a hook's field, a
    dataset)."""
    if case.compile or case.extra or case.dataset:
        return plan_of(case, gpu).choice.memory, "plan"
    from planner import Adapter, estimate_memory

    adapter = Adapter(method=case.peft) if case.peft != "none" else None
    estimate = estimate_memory(case.model, micro_batch=case.micro_batch, seq_len=case.seq_len,
                               precision=case.precision, checkpointing=case.checkpointing,
                               zero_stage=case.zero_stage, offload=case.offload, grad_accum=case.grad_accum,
                               gpu=gpu, task=case.task, num_labels=case.num_labels, adapter=adapter)
    return estimate, "estimate_memory"


def predict(case: Case, gpu: str) -> tuple:
    """The pinned plan (its files are what runs), the predicted numbers, and the facts they used."""
    with facts.recording() as used:
        draft = plan_of(case, gpu)
        memory, source = predicted_memory(case, gpu)
    cand, speed = draft.choice, draft.choice.throughput
    predicted = {"peak_allocated": memory.peak_allocated, "peak_reserved": memory.peak_reserved,
                 "peak_process": memory.peak_process, "peak": memory.peak, "method": memory.method,
                 "memory_from": source, "plan_peak_allocated": cand.memory.peak_allocated, "fits": cand.fits,
                 "budget": draft.hardware.budget_bytes, "step_time_s": speed.step_time_s,
                 "tokens_per_s": speed.tokens_per_s, "compile_once_s": speed.parts.compile_once,
                 "config": cand.config.label(), "precision_family": cand.config.precision_family()}
    if draft.dataset is not None:  # what the plan read of the data, and the rows it planned (and the script runs)
        predicted.update(seq_len=draft.seq_len, padding=cand.config.padding,
                         dataset=draft.dataset.model_dump(mode="json"))
    return draft, predicted, sorted(used)


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
    """Why the case cannot be planned and run here yet, or None."""
    from planner.request import PlanRequest

    absent = [name for name, _ in case.extra if name not in PlanRequest.model_fields]
    if absent:
        return f"planner.request.PlanRequest has no {', '.join(absent)} field yet"
    return next(filter(None, map(import_problem, case.needs)), None)


# --- running -----------------------------------------------------------------------------------------------------
@dataclass
class Prepared:
    """A case ready to run: its predictions, the facts they used, the emitted files, the edge search's findings."""

    case: Case
    predicted: dict
    facts_used: list
    files: dict
    edge: dict | None = None


def gated_training(argv: list[str]) -> int:
    """The shipped training script, started early: import what it imports, wait until the gate file `argv[0]`
    exists (the previous run has exited), then run `probes.train.main` on the rest, unchanged."""
    gate = Path(argv[0])
    import probes.measure  # noqa: F401 - the Trainer and torch: the imports that overlap the previous run
    import probes.train

    while not gate.exists():
        time.sleep(0.05)
    return probes.train.main(argv[1:])


def _open_after(gate: Path, previous: cf.Future | None, opened: list) -> None:
    if previous is not None:
        cf.wait([previous])
    opened.append(time.monotonic())
    try:
        gate.touch()
    except OSError:  # the run ended (failed to start) before its gate opened
        pass


class Runner:
    """Runs prepared cases with `probes.runner.run_training`, each in its own process group. With `overlap` the next
    run's process starts while the current one trains and waits for its gate (`gated_training`)."""

    def __init__(self, overlap: bool, deadline: float):
        self.overlap, self.deadline = overlap, deadline
        self.depth = 2 if overlap else 1
        self.pool = cf.ThreadPoolExecutor(max_workers=self.depth)
        self.last: cf.Future | None = None
        self.last_limit = 0.0

    def submit(self, files: dict, limit_s: float, receipt: Path | None = None) -> cf.Future:
        """Run the emitted `files`; the run's receipt.json (planner/receipts.py) is kept as `receipt`."""
        waiting = self.last_limit if self.overlap and self.last is not None and not self.last.done() else 0.0
        timeout = max(1.0, min(limit_s + waiting, self.deadline - time.monotonic()))
        future = self.pool.submit(self._run, files, timeout, self.last, receipt)
        self.last, self.last_limit = future, limit_s
        return future

    def _run(self, files: dict, timeout: float, previous: cf.Future | None, receipt: Path | None = None):
        """(Measurement, seconds from the gate's opening to the run's end)."""
        from probes.runner import run_training, write_files

        opened = [time.monotonic()]
        with tempfile.TemporaryDirectory(prefix="gpu-validation-") as tmp:
            folder = write_files(files, Path(tmp))
            kwargs = {}
            if self.overlap:
                gate = folder / "gate"
                threading.Thread(target=_open_after, args=(gate, previous, opened), daemon=True).start()
                kwargs["script"] = (str(Path(__file__).resolve()), WORKER, str(gate))
            result = run_training(folder, timeout, steps=STEPS, warmup=WARMUP, **kwargs)
            if receipt is not None and (folder / "receipt.json").is_file():
                receipt.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(folder / "receipt.json", receipt)
        return result, time.monotonic() - opened[-1]


# --- records and results -----------------------------------------------------------------------------------------
def record(case: Case, status: str, reason: str = "", **more) -> dict:
    """One configuration's JSON line."""
    config = {**asdict(case), "extra": dict(case.extra)}
    for key in ("id", "why", "needs", "limit_s"):
        config.pop(key)
    return {"record": "config", "id": case.id, "why": case.why, "label": case.label(), "config": config,
            "status": status, "reason": reason, **more}


def evidence_rows(case: Case, gpu: str, measured, source: str, family: str) -> tuple[list, list]:
    """The memory and step-time evidence rows of a measured case; each prediction is made again inside
    `evidence.predicted_row` (the planner's caches make that cheap), so each row carries the facts it used."""
    group = evidence.run_group(PROGRAM, gpu, case_config(case, gpu), adapter=case.peft)
    common = {"data_file": "", "source": source, "group": group}
    memory = [evidence.predicted_row(id=f"{case.id}/{ours}", measured=getattr(measured, theirs), note=what,
                                     predict=lambda ours=ours: getattr(predicted_memory(case, gpu)[0], ours),
                                     **common)
              for ours, theirs, what in MEMORY_MEASURES if getattr(measured, theirs)]
    if not measured.step_time_s:
        return memory, []
    speed = evidence.predicted_row(id=f"{case.id}/step_time_s", measured=measured.step_time_s,
                                   predict=lambda: plan_of(case, gpu).choice.throughput.step_time_s,
                                   note=f"micro-batches per step: {case.grad_accum}", **common)
    return memory, [speed]


class Results:
    """What has been measured so far, on disk after every configuration: the JSON lines, the whole record and the
    two evidence files."""

    def __init__(self, out: Path, header: dict):
        out.mkdir(parents=True, exist_ok=True)
        gpu, date = header["gpu"], header["date"]
        stem = f"gpu_validation-{gpu}-{date}"
        self.lines, self.whole = out / f"{stem}.jsonl", out / f"{stem}.json"
        #: as the results folder names it: facts.source_key gives "trainplan:gpu_validation-<GPU>", the key of
        #: every earlier gpu_validation results file of this GPU
        self.source = f"benchmarks/results/{stem}.json (python3 benchmarks/gpu_validation.py)"
        self.evidence = {kind: out / f"gpu_validation-{kind}-{gpu}-{date}.json" for kind in ("memory", "throughput")}
        self.header, self.records, self.rows = header, [], {"memory": [], "throughput": []}
        self.lines.write_text(json.dumps({"record": "run", **header}, sort_keys=True) + "\n")
        self.save()

    def add(self, line: dict, memory: list, speed: list) -> None:
        self.records.append(line)
        self.rows["memory"] += memory
        self.rows["throughput"] += speed
        with self.lines.open("a") as handle:
            handle.write(json.dumps(line, sort_keys=True) + "\n")
        self.save()

    def save(self) -> None:
        whole = {**self.header, "configs": self.records,
                 "summary": {kind: evidence.summary(rows) for kind, rows in self.rows.items()}}
        self.whole.write_text(json.dumps(whole, indent=1, sort_keys=True) + "\n")
        stack = (f"the HF Trainer through trainplan's emitted files (probes/train.py under accelerate launch) on "
                 f"{self.header['nvml_name']}, torch {self.header['torch']}, transformers "
                 f"{self.header['transformers']}")
        cannot = ("several GPUs or nodes (one GPU only), long runs (1 warm-up and 2 measured steps: no allocator "
                  "fragmentation over hours), real data (synthetic full-length batches), other GPUs")
        for kind, metric in (("memory", MEMORY_METRIC), ("throughput", THROUGHPUT_METRIC)):
            rows = self.rows[kind] if self.header.get("dry_run") else \
                evidence.run_rows(self.rows[kind], self.header.get("commit"), self.header["date"])
            evidence.write_results(self.evidence[kind].stem, rows, kind=kind, metric=metric, stack=stack,
                                   cannot_show=cannot, command=self.header["command"], out=self.evidence[kind])


# --- the run -----------------------------------------------------------------------------------------------------
def prepare(case: Case, gpu: str, deadline: float) -> Prepared | dict:
    """Everything before the run, on this thread: what the case needs, the edge search, the pinned plan, its
    predictions and its files. A case that cannot run comes back as its finished record."""
    from probes.runner import probe_files

    why_not = missing(case)
    if why_not:
        return record(case, "skipped", why_not)
    if time.monotonic() > deadline - MIN_RUN_S:
        return record(case, "skipped", "the time budget (--budget) was spent")
    edge = None
    try:
        if case.edge:
            case, edge = edge_case(case, gpu)
        draft, predicted, used = predict(case, gpu)
        files = probe_files(draft, draft.choice.config)
    except Exception as err:  # noqa: BLE001 - a configuration the planner refuses is a record, not a crash
        return record(case, "not planned", f"{type(err).__name__}: {str(err)[:300]}", edge=edge)
    return Prepared(case, predicted, used, files, edge)


def finish(job: Prepared, result, wall_s: float, gpu: str, results: Results) -> dict:
    """The case's record (and evidence rows, when it ran), written at once."""
    status = result.status if result is not None else "dry-run"
    line = record(job.case, status, result.reason if result is not None else "", predicted=job.predicted,
                  facts_used=job.facts_used, wall_s=round(wall_s, 1))
    memory, speed = [], []
    if result is not None:
        line["measured"] = result.model_dump(mode="json")
    if status == "ok":
        try:
            memory, speed = evidence_rows(job.case, gpu, result, results.source, job.predicted["precision_family"])
        except Exception as err:  # noqa: BLE001 - the measurement is kept; the rows' failure is said
            line["reason"] = f"no evidence rows: {type(err).__name__}: {str(err)[:300]}"
        line["errors"] = {row.id.split("/")[-1]: row.error for row in memory + speed}
        line["in_sample_by"] = sorted({key for row in memory + speed for key in row.in_sample_by})
        if job.case.compile:  # the warm-up step compiles: the training's wall time beyond its steps
            line["compile_s_measured"] = result.seconds - (WARMUP + STEPS) * result.step_time_s
    if job.edge is not None:  # holds: the largest predicted to fit ran, and the next one up is predicted not to
        holds = None if result is None else status == "ok" and not job.edge["next_fits"]
        line["edge"] = {**job.edge, "ran": status, "holds": holds}
    results.add(line, memory, speed)
    print(progress_line(line), flush=True)
    return line


def run_all(cases: list[Case], gpu: str, results: Results, runner: Runner | None, deadline: float) -> None:
    """Prepare each case on this thread while the runner measures the previous one; at most `runner.depth` runs
    exist at once. Without a runner (a dry run) each case is recorded as predicted."""
    inflight: deque = deque()
    depth = runner.depth if runner is not None else 1
    for case in cases:
        job = prepare(case, gpu, deadline)
        if isinstance(job, dict):
            results.add(job, [], [])
            print(progress_line(job), flush=True)
        elif runner is None:
            finish(job, None, 0.0, gpu, results)
        else:
            receipt = results.lines.parent / "receipts" / f"{results.lines.stem}-{case.id}.json"
            inflight.append((job, runner.submit(job.files, job.case.limit_s, receipt)))
        while inflight and (len(inflight) >= depth or inflight[0][1].done()):
            done, future = inflight.popleft()
            finish(done, *outcome(future), gpu, results)
    while inflight:
        done, future = inflight.popleft()
        finish(done, *outcome(future), gpu, results)


def outcome(future: cf.Future) -> tuple:
    """A run's (Measurement, seconds); a run that raised instead is an error with its reason."""
    from planner.types import Measurement

    try:
        return future.result()
    except Exception as err:  # noqa: BLE001 - one configuration failing is recorded, the rest still run
        return Measurement(status="error", reason=f"{type(err).__name__}: {str(err)[:300]}"), 0.0


# --- what is printed ---------------------------------------------------------------------------------------------
def _pct(value) -> str:
    return f"{value:+7.1%}" if isinstance(value, float) else f"{'—':>7s}"


def progress_line(line: dict) -> str:
    """One configuration in one line: its errors when measured, its predictions in a dry run, else why not."""
    head = f"{line['id'][:28]:28s} {line['status'][:11]:11s}"
    errors, predicted = line.get("errors"), line.get("predicted") or {}
    if errors:
        return (head + " ".join(_pct(errors.get(k)) for k in ("peak_allocated", "peak_reserved", "peak_process",
                                                               "step_time_s")) + f" {line['wall_s']:5.0f} s")
    if line["status"] == "dry-run":
        return (head + f" predicted {predicted['peak_allocated'] / GIB:6.2f} GiB allocated, "
                f"{predicted['peak_process'] / GIB:6.2f} GiB process, {predicted['step_time_s']:.3f} s/step "
                f"({predicted['memory_from']})")
    return head + " " + (line.get("reason") or "")[:90]


def summary_lines(results: Results, seconds: float) -> list[str]:
    """The one-screen summary: the configurations, the error of each metric, the edges, what did not run."""
    h, records = results.header, results.records
    lines = ["", f"gpu_validation on {h['gpu']} ({h['nvml_name']}), torch {h['torch']}, {seconds:.0f} s, "
                 f"{'dry run' if h['dry_run'] else 'overlap ' + ('on' if h['overlap'] else 'off')}",
             f"{'configuration':28s} {'status':11s}{'alloc':>7s} {'reserved':>7s} {'process':>7s} {'step':>7s}"]
    lines += [progress_line(r) for r in records]
    for measure in ("peak_allocated", "peak_reserved", "peak_process", "step_time_s"):
        errors = [r["errors"][measure] for r in records if measure in (r.get("errors") or {})]
        if errors:
            lines.append(f"{measure:15s} {len(errors):2d} rows  median |error| "
                         f"{statistics.median(abs(e) for e in errors):5.1%}  worst {max(errors, key=abs):+6.1%}  "
                         f"under-predicted {sum(e < 0 for e in errors)}")
    for r in records:
        if "edge" in r and r["edge"]:
            e = r["edge"]
            lines.append(f"edge {r['id']}: mb {e['largest_fitting']} predicted {e['predicted_peak'] / GIB:.1f} GiB "
                         f"of {e['budget'] / GIB:.1f} GiB, ran {e['ran']}; mb {e['next']} predicted "
                         f"{e['next_predicted_peak'] / GIB:.1f} GiB, fits: {e['next_fits']}")
    lines += compile_lines(records)
    kinds = {k: (len(rows), sum(r.in_sample for r in rows)) for k, rows in results.rows.items()}
    lines.append("evidence rows: " + ", ".join(f"{k} {n} ({s} in-sample)" for k, (n, s) in kinds.items()))
    lines.append(f"wrote {results.lines}, {results.whole.name}, "
                 + ", ".join(p.name for p in results.evidence.values()))
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
            predicted = twin["predicted"]["step_time_s"] / r["predicted"]["step_time_s"]
            lines.append(f"compile {r['id']}: speed-up over {twin['id']} measured {measured:.2f}x, predicted "
                         f"{predicted:.2f}x; compile {r['compile_s_measured']:.0f} s, predicted "
                         f"{r['predicted']['compile_once_s']:.0f} s")
    return lines


# --- the command -------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="results folder (default: $OUT, else benchmarks/results; a dry run: "
                                                 "$OUT, else a new temporary folder)")
    parser.add_argument("--dry-run", action="store_true", help="predictions only: no GPU, nothing is run")
    parser.add_argument("--commit", help="the commit the tree was sent from (the GPU machine's copy has no git); "
                                         "recorded as what scored the rows")
    parser.add_argument("--relabel", type=Path, help="a run's whole record (gpu_validation-<GPU>-<date>.json) made "
                                                     "before rows carried strata and labels: label its evidence "
                                                     "files (with --commit, the tree it was sent from)")
    parser.add_argument("--only", help="comma-separated configuration ids (see --list)")
    parser.add_argument("--list", action="store_true", help="print the configurations and why each is there")
    parser.add_argument("--gpu", help="catalog GPU to predict for (default: the detected one; a dry run: H100-80GB)")
    parser.add_argument("--budget", type=float, default=450.0,
                        help="seconds after which no run starts and every run is cut (default 450)")
    parser.add_argument("--serial", action="store_true",
                        help="one training process at a time (no start-up overlapping the previous run)")
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

    return {"gpu": gpu, "nvml_name": nvml_name, "date": dt.date.today().isoformat(), "dry_run": args.dry_run,
            "overlap": not (args.serial or args.dry_run), "budget_s": args.budget, "warmup": WARMUP,
            "steps": STEPS, "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__, "accelerate": accelerate.__version__,
            "python": sys.version.split()[0], "command": "python3 benchmarks/gpu_validation.py --out $OUT",
            "commit": args.commit or (evidence._git("rev-parse", "HEAD") or "").strip() or None}


def relabel(whole: Path, commit: str) -> list[Path]:
    """The evidence files of a run recorded before rows carried their stratum and label (the run's whole record
    `whole`, sent from `commit`): each row's group from its configuration's record, first-look (`evidence.run_rows`)."""
    from planner.config import Config

    record_ = json.loads(whole.read_text())
    configs = {c["id"]: c["config"] for c in record_["configs"]}
    written = []
    for kind in ("memory", "throughput"):
        path = whole.with_name(whole.name.replace("gpu_validation-", f"gpu_validation-{kind}-"))
        result = json.loads(path.read_text())
        rows = []
        for data in result["rows"]:
            c = configs[data["id"].split("/")[0]]
            cfg = Config.of(micro_batch=c["micro_batch"], grad_accum=c["grad_accum"], world_size=1,
                            precision=c["precision"], checkpointing=c["checkpointing"], zero_stage=c["zero_stage"],
                            offload=c["offload"], compiled=c["compile"])
            group = evidence.run_group(PROGRAM, record_["gpu"], cfg, adapter=c["peft"])
            fields = {k: (tuple(v) if isinstance(v, list) else v) for k, v in data.items()
                      if k in evidence.Row.__dataclass_fields__}
            rows.append(evidence.Row(**{**fields, "group": group}))
        rows = evidence.run_rows(rows, commit, record_["date"])
        written.append(evidence.write_results(result["benchmark"], rows, kind=kind, metric=result["metric"],
                                              stack=result["stack"], cannot_show=result["cannot_show"],
                                              command=result["command"], out=path))
    return written


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.relabel:
        for path in relabel(args.relabel, args.commit):
            print(f"relabelled {path}")
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
    runner = None if args.dry_run else Runner(overlap=not args.serial, deadline=deadline)
    run_all(cases, gpu, results, runner, deadline)
    import torch

    # the runs are the only CUDA processes: this one must not hold a context (memory) beside them
    results.header["this_process_initialised_cuda"] = torch.cuda.is_initialized()
    results.save()
    print("\n".join(summary_lines(results, time.monotonic() - START)))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == [WORKER]:
        sys.exit(gated_training(sys.argv[2:]))
    sys.exit(main())
