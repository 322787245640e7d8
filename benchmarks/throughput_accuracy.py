"""How well the shipped speed model (planner/speed/ on the traced op profile) reproduces published training step
times, and which of them it could have been fitted to: every row is predicted through `benchmarks.evidence`
(`predicted_row`), so the row carries the facts its prediction used and `planner.facts.in_sample_by` decides whether
any of them was fitted to the row or its source. Nothing here says "no fitted fact" that a count did not compute.

Two sets of published rows, both in benchmarks/data with each row's source:
- hf_throughput.json: Hugging Face model code (transformers docs, HF blog posts, stas00's ml-engineering runs, ...),
  the code our users run. The model is the bundled preset of the row's hub id, with the row's head.
- throughput_calibration.json: optimised stacks (llm-foundry, torchtitan, IBM FSDP, NVIDIA DeepLearningExamples,
  ...), their own model code. The row's shapes are rebuilt as a transformers config (MPT as GPT-2 blocks of the same
  shapes with MPT's defaults, no dropout and the exact GELU; OLMo as Llama; DLE's BERT-large and BART-large as
  BERT and BART). Every row is timed at the planner's own figures for its GPU, attention included: llm-foundry's MPT
  rows ran flash-attention's Triton kernel, which trainplan never plans, and get SDPA's rate like every other row.

Each row is a step time: a published tokens/s/GPU or samples/s is converted at the row's batch and sequence, an MFU
at the planner's FLOP count (the step the published MFU implies); forward+backward only where the source timed no
optimizer step. Errors are predicted / measured step time - 1 (positive: the model predicts a slower run). Each row's
`group` holds its program ("trainer": the HF Trainer; "hf-loop": HF model code in a loop of its own; "optimised":
another stack's model code, as each row's source and notes say), its catalog GPU and `Config.precision_family()`.

Leave-one-source-out: for each source some fact was fitted to (its rows, its file, or its source key; planner/facts
`fitted_to`), that source's rows are predicted again with every such fact refitted or dropped: a packaged fact with a
first-principles value takes it (`facts.overriding`), an efficiency.json figure is replaced in a copied `Efficiency`
(the attention rate of the GPU of nearest compute capability, not above, whose figure nothing from that source was
fitted to), and a fact with neither is dropped: a row is predicted with it at 1e-3 and 1e3 times its value, and has
no prediction in that fold unless the two agree (the fact is read but does not enter it). The fold's errors are the
honest figure without fitted facts for the rows the full model has in-sample.

Rank agreement is counted only inside groups where the order is not implied by size: rows of one source, model, GPU,
GPU count and sequence length (and the same optimizer-step coverage), which differ in micro-batch, accumulation,
checkpointing, precision, attention kernel, compilation or sharding; the quantity ranked is samples per second.

Each row's optimizer is timed as its text says it ran (`map_optimizer`): a fused kernel (apex's or DeepSpeed's
FusedAdam, torch fused=True), torch's foreach default, or a Python loop over the tensors (transformers' adamw_hf, the
Trainer's default up to 4.31; torch before 2.0), `vocab.ADAM_STEP`'s three programs; another optimizer it names is
timed by name (`vocab.OPTIMIZER_STEP`'s program where one is counted). A row that names its system's inter-node
network (`nic_per_gpu_Gbps`, with its source) is planned on it, as `plan --nic-gbps` would be.

Where a source published its GPU kernel profile (tlkh's DLProf summaries), the report sets the model's device time
per step beside it, GEMMs against the tensor-core kernels and the rest against the rest.

Results (benchmarks/evidence.py's format; `python -m benchmarks.report` turns them into docs/accuracy.md):
- throughput_accuracy.json (kind "throughput"): HF model code run as trainplan plans it;
- throughput_accuracy_apart.json (kind "other"): HF rows of programs trainplan does not plan (Liger-Kernel patched
  model code) or whose value is no step time (a whole run's wall time over its steps);
- throughput_accuracy_optimised.json (kind "other"): the optimised stacks.
Each keeps the old report's detail under extra keys: `detail`, `leave_one_source_out`, `rank_agreement`, `skipped`,
`kernel_times` (HF set).

Run from the repository root (traces are cached under the trainplan cache; a cold run takes a few minutes):
    HF_HUB_OFFLINE=1 python benchmarks/throughput_accuracy.py [--set hf|optimised|all] [--worst N]
The printed report is also saved as benchmarks/results/throughput_accuracy.txt.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import re
import statistics
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: the repository's packages import without an install
    sys.path.insert(0, str(REPO))

from benchmarks import evidence, runs  # noqa: E402
from planner import facts  # noqa: E402
from planner.config import Config  # noqa: E402
from planner.hardware import lookup_gpu  # noqa: E402
from planner.hardware.efficiency_data import PREFIX, efficiency, efficiency_json, fact_key  # noqa: E402
from planner.models import resolve_model  # noqa: E402
from planner.program.workload import Workload  # noqa: E402
from planner.speed.model import SpeedModel  # noqa: E402
from planner.vocab import DEFAULT_OPTIMIZER, FOR_LOOP_STEP, FOREACH_STEP, FUSED_STEP  # noqa: E402

DATA = REPO / "benchmarks" / "data"
RESULTS = REPO / "benchmarks" / "results"
HF_FILE, OPTIMISED_FILE = "hf_throughput.json", "throughput_calibration.json"
DATA_FILES = {"hf": HF_FILE, "optimised": OPTIMISED_FILE}
COMMAND = "HF_HUB_OFFLINE=1 python benchmarks/throughput_accuracy.py"

#: Hub ids whose rows name a re-upload of a bundled preset (same config.json).
ALIASES = {"nousresearch/llama-3.2-1b": "meta-llama/Llama-3.2-1B",
           "meta-llama/llama-2-70b-chat-hf": "meta-llama/Llama-2-70b-hf"}

#: id prefix -> source group (first match wins), for the report's breakdowns and rank groups.
GROUPS = (("llmf-a100", "llm-foundry A100"), ("llmf-h100", "llm-foundry H100"), ("dlebert", "NVIDIA BERT"),
          ("dlebart", "NVIDIA BART"), ("tt-", "torchtitan"), ("torchao", "torchtitan"), ("f8blog", "torchtitan"),
          ("ibmfsdp", "IBM FSDP"), ("fmsfsdp", "IBM FSDP"), ("flashattn", "flash-attn GPT"),
          ("tinyllama", "TinyLlama"), ("olmocore", "OLMo-core"), ("automodel", "NeMo Automodel"),
          ("mle-", "ml-engineering"), ("hfblog", "HF blog"), ("tfdocs-bert", "transformers docs BERT"),
          ("tfdocs-opt", "transformers docs OPT"), ("tlkh", "tlkh benchmarks"), ("hf15026", "transformers #15026"))

#: `group["program"]` values (evidence.Row): how the measured run trained.
TRAINER, HF_LOOP, OPTIMISED, HF_FORWARD_BACKWARD = "trainer", "hf-loop", "optimised", "hf-forward-backward"
#: A row's text naming the HF Trainer as what ran it (its notes or its optimizer: "HF Trainer examples/...",
#: "AdamW (HF Trainer default)"); other HF rows ran the model in a loop of their own (a benchmark script, Lightning,
#: Accelerate, DeepSpeed's engine), as their notes and sources say.
TRAINER_TEXT = re.compile(r"\b(?:HF|transformers'?) Trainer\b", re.IGNORECASE)

#: Why an HF row's program is not one trainplan plans (reported apart, kind "other").
#: Liger-Kernel's fused kernels: `Config.liger` exists, but nothing traces or emits them yet (planner/program/trace.py
#: names a planner/program/liger.py that is not there), so a plan never times them.
OTHER_PROGRAM = "Liger-Kernel patched model code (not a program trainplan plans)"
WALL_TIME = "a run's wall time over its steps (evaluation and checkpoint saves included; not a step time)"

#: Packaged facts fitted to published rows that a leave-one-source-out fold can drop to a first-principles value.
FIRST_PRINCIPLES: dict[str, tuple[Any, str]] = {
    "inductor.compiled_device_residual": (
        1.0, "no residual: the compiled micro-step as the op-by-op compile model times it"),
}
#: The efficiency.json figure a fold can refit from other GPUs' unfitted figures (by compute capability).
REFITTABLE_FIGURES = ("attention",)


class Skip(Exception):
    """A row this script cannot interpret; the message is the reason."""


@dataclass
class Case:
    id: str
    data_file: str           # the benchmarks/data file of the row
    source: str              # the row's source, as the data says it
    source_group: str        # `GROUPS` label
    data_set: str            # "hf" or "optimised"
    metric: str
    value: float
    model: object            # a ResolvedModel
    model_name: str          # the row's model text
    gpu: str
    cfg: Config
    seq_len: int
    per_node: int
    attention: str
    compute_only: bool       # the published time has no optimizer step
    objective: str           # what the backward starts from (`vocab.OBJECTIVE`)
    program: str             # TRAINER, HF_LOOP or OPTIMISED
    notes: list[str] = field(default_factory=list)
    #: why the published program is not one trainplan plans or its value no step time (reported apart), or ""
    apart: str = ""
    #: the published system's inter-node bandwidth per GPU (Gb/s), where the row names it; None: the catalog's
    nic_Gbps: float | None = None
    #: the row's optimizer (`vocab.OPTIMIZER`) and how an Adam step ran (`vocab.ADAM_STEP`)
    optimizer: str = DEFAULT_OPTIMIZER
    adam_step: str = FUSED_STEP
    #: the GPU kernel times the source profiled (DLProf's summary), where it published them
    kernel_profile: dict | None = None
    #: the source does not state the published value's units (its notes say so)
    units_unstated: bool = False

    @property
    def group(self) -> dict:
        """The row's stratum (evidence.Row.group): an HF loop timed without its optimizer step is a program apart."""
        program = HF_FORWARD_BACKWARD if self.program == HF_LOOP and self.compute_only else self.program
        return evidence.run_group(program, self.gpu, self.cfg, gpus_per_node=self.per_node)

    @property
    def source_key(self) -> str:
        return facts.source_key(self.source)


# ------------------------------------------------------------------------------------------ interpreting rows

def map_gpu(text: str) -> str:
    name = text.upper()
    if name.startswith("V100"):
        return "V100-32GB" if "32" in name else "V100-16GB"
    if name.startswith("A100"):
        return "A100-40GB" if "40G" in name else "A100-80GB"
    for prefix, catalog in (("H100", "H100-80GB"), ("H200", "H200-141GB"), ("B200", "B200-192GB"),
                            ("L40S", "L40S-48GB")):
        if name.startswith(prefix):
            return catalog
    raise Skip(f"GPU {text!r} not in the catalog")


def map_precision(text: str, notes: list[str]) -> str:
    t = text.lower()
    if "fp8" in t:
        raise Skip("fp8 not modelled")
    if "tf32" in t and "disabled" not in t:
        return "tf32"  # fp32 weights, matmuls on TF32 tensor cores (vocab.PRECISION "tf32", which plans choose)
    if t.startswith("fp16-true") or t.startswith("bf16-true") or (t.startswith("bf16") and "mixed" not in t
                                                                  and "amp" not in t):
        if t.startswith("fp16"):
            notes.append("fp16 weights run as bf16-true (same tensor-core peak)")
        return "bf16-true"
    if "amp" in t:
        return "bf16-mixed" if "bf16" in t else "fp16-mixed"
    for precision in ("bf16-mixed", "fp16-mixed", "fp32"):
        if t.startswith(precision):
            return precision
    raise Skip(f"precision {text!r} not mapped")


def map_sharding(row: dict) -> tuple[int, str]:
    s = row["sharding"].lower()
    if "context parallel" in s or "tensor" in s or "pipeline" in s:
        raise Skip("model parallelism not modelled")
    if s.startswith("fsdp"):  # FULL_SHARD = ZeRO-3; SHARD_GRAD_OP = ZeRO-2
        return (2 if "SHARD_GRAD_OP" in row.get("notes", "") else 3), "fsdp"
    match = re.search(r"zero-?([0-3])", s)
    if match:
        stage = int(match.group(1))
        return stage, ("deepspeed" if stage else "torch")
    if s in ("ddp", "none", "single"):
        return 0, "torch"
    raise Skip(f"sharding {row['sharding']!r} not mapped")


def map_checkpointing(text: str) -> str:
    for mode in ("none", "full", "selective"):
        if text.lower().startswith(mode):
            return mode
    raise Skip("checkpointing not stated")


def map_offload(row: dict, stage: int) -> str:
    text = str(row.get("offload") or "none").lower()
    if text in ("none", "false"):
        return "none"
    if "param" in text:
        return "optimizer+params"
    return "optimizer" if stage else "none"


#: Optimizers a row's text names, before Adam's variants (`vocab.OPTIMIZER` names).
OTHER_OPTIMIZERS = ((r"adafactor", "adafactor"), (r"8-?bit", "adamw-8bit"), (r"\blion\b", "lion"),
                    (r"\blamb\b", "lamb"), (r"\bsgd\b.*momentum", "sgd-momentum"), (r"\bsgd\b", "sgd"))
#: The Trainer's default `optim` was "adamw_hf" (transformers' own AdamW, a Python loop) up to transformers 4.31 and
#: "adamw_torch" from 4.32 (training_args.py `default_optim` of the 4.31.0 and 4.32.1 wheels), which torch runs as
#: foreach on CUDA from torch 2.0 (`_default_to_fused_or_foreach`; torch 1.x stepped in a Python loop).
TRAINER_ADAMW_TORCH_FROM = (4, 32)


def map_optimizer(row: dict, notes: list[str]) -> tuple[str, str]:
    """The row's optimizer and, for AdamW, how its step ran: a fused kernel (torch fused=True, the Trainer's
    adamw_torch_fused, apex's or DeepSpeed's FusedAdam, DeepSpeed's CPU Adam), torch's foreach default, or a Python
    loop over the tensors (transformers' adamw_hf; torch before 2.0). Unstated: the planner's own, fused."""
    text = str(row.get("optimizer", "")).lower()
    for pattern, name in OTHER_OPTIMIZERS:
        if re.search(pattern, text):
            return name, FUSED_STEP
    if any(word in text for word in ("fused", "apex", "deepspeed", "cpu adam")):
        return DEFAULT_OPTIMIZER, FUSED_STEP
    context = " ".join(str(row.get(k, "")) for k in ("optimizer", "source", "notes")).lower()
    release = re.search(r"transformers(?:@v|[ =v]*)(\d+)\.(\d+)", context)
    old_torch = re.search(r"(?:torch|pytorch)[ =v]*1\.\d+", context) is not None
    if "adamw_hf" in text or "transformers adamw" in text or (
            "trainer default" in text and release and tuple(map(int, release.groups())) < TRAINER_ADAMW_TORCH_FROM):
        notes.append("transformers' AdamW: a Python loop over the tensors")
        return DEFAULT_OPTIMIZER, FOR_LOOP_STEP
    if re.search(r"adamw_torch|\btorch\b", text) or "trainer default" in text:
        if old_torch or "foreach=false" in text:
            notes.append("torch's AdamW before 2.0: a Python loop over the tensors")
            return DEFAULT_OPTIMIZER, FOR_LOOP_STEP
        if "trainer default" in text and not release:
            notes.append("the Trainer's default AdamW, release unstated: torch's foreach step")
        return DEFAULT_OPTIMIZER, FOREACH_STEP
    return DEFAULT_OPTIMIZER, FUSED_STEP


def compute_only(row: dict) -> bool:
    """The published time covers forward and backward only."""
    optimizer = str(row.get("optimizer", "")).lower()
    derived = json.dumps(row.get("derived") or {}).lower()
    notes = row.get("notes", "").lower()
    return (optimizer.startswith("none") or "forward + backward" in derived or "no optimizer step" in notes
            or "optimizer step not included" in notes)


def objective(row: dict) -> str:
    """fxmarty's SDPA benchmark backpropagates `logits.sum()`, not a loss."""
    return "sum" if "logits.sum().backward()" in row.get("notes", "") else "labels"


def batch(row: dict) -> tuple[int, int]:
    micro, accum, total = row.get("micro_batch"), row.get("grad_accum"), row.get("global_batch")
    if micro is None:
        raise Skip("micro-batch not published")
    if accum is None:
        world = row["gpus"]
        accum = total // (micro * world) if total and total % (micro * world) == 0 else 1
    return micro, accum


# ------------------------------------------------------------------------------------------------ models

def hf_model(row: dict):
    """The bundled preset of the row's hub id, with the row's head where the source used another."""
    name = ALIASES.get(row["model"].lower(), row["model"])
    try:
        resolved = resolve_model(name)
    except Exception as err:  # noqa: BLE001 - a model without a bundled preset
        raise Skip(f"no bundled preset for {row['model']}") from err
    notes = row.get("notes", "")
    if "SequenceClassification" in notes:
        config = resolved.config.__class__.from_dict(resolved.config.to_dict())
        config.architectures = [config.architectures[0].replace("ForMaskedLM", "ForSequenceClassification")]
        config.num_labels = 2
        resolved = resolve_model(config)
    return resolved


def _int(text: str, *patterns: str) -> int | None:
    for pattern in patterns:
        match = re.search(pattern, text, re.I)
        if match:
            return int(match.group(1))
    return None


def optimised_model(row: dict):
    """A transformers config of the row's published shapes."""
    from transformers import BertConfig, GPT2Config, LlamaConfig

    text, seq = row["model"], row["seq_len"]
    lower = text.lower()
    if lower.startswith("bart"):
        return _bart(text)
    layers = _int(text, r"n_layers=(\d+)", r"(\d+)\s*layers", r"(\d+)L\b")
    hidden = _int(text, r"d_model[= ](\d+)", r"hidden (\d+)", r"(\d+) hidden")
    heads = _int(text, r"n_heads=(\d+)", r"(\d+) heads")
    ffn = _int(text, r"ffn[= ](\d+)")
    vocab = _int(text, r"padded to (\d+)", r"vocab[= ]~?(\d+)")
    if None in (layers, hidden, heads, ffn, vocab):
        raise Skip("model dims not published")
    if lower.startswith("bert"):
        head = "BertForQuestionAnswering" if "QuestionAnswering" in text else "BertForPreTraining"
        config = BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                            intermediate_size=ffn, vocab_size=vocab, max_position_embeddings=max(512, seq),
                            architectures=[head])
    elif "mpt" in lower or "gpt3" in lower or "gpt-3" in lower:
        # MPT's own defaults where they differ from GPT-2's: no dropout (mosaicml/llm-foundry
        # llmfoundry/models/mpt/configuration_mpt.py: resid_pdrop = emb_pdrop = 0.0, attn_config_defaults
        # attn_pdrop 0.0) and the exact GELU (llmfoundry/models/layers/ffn.py `_FFN_ACT_FN_DEFAULT`:
        # gelu, approximate 'none'), one kernel where GPT-2's tanh form is seven
        mpt = {"activation_function": "gelu", "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0} \
            if "mpt" in lower else {}
        config = GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_inner=ffn, vocab_size=vocab,
                            n_positions=seq, tie_word_embeddings=True, architectures=["GPT2LMHeadModel"], **mpt)
    elif "llama" in lower or "olmo" in lower:
        kv = _int(text, r"/\s*(\d+)\s*KV") or heads
        config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                             num_key_value_heads=kv, intermediate_size=ffn, vocab_size=vocab,
                             max_position_embeddings=seq, architectures=["LlamaForCausalLM"])
    else:
        raise Skip("model family not rebuilt (MPT, GPT-3, Llama, OLMo, BERT, BART only)")
    config._name_or_path = text.split(" (")[0][:40]
    return resolve_model(config)


def _bart(text: str):
    """BART's published shapes (encoder and decoder layers given apart) as a transformers BartConfig."""
    from transformers import BartConfig

    encoder, decoder = _int(text, r"(\d+)\s*enc"), _int(text, r"(\d+)\s*dec")
    hidden, heads = _int(text, r"d_model[= ](\d+)"), _int(text, r"(\d+) heads")
    ffn, vocab = _int(text, r"ffn[= ](\d+)"), _int(text, r"vocab[= ]~?(\d+)")
    if None in (encoder, decoder, hidden, heads, ffn, vocab):
        raise Skip("model dims not published")
    config = BartConfig(d_model=hidden, encoder_layers=encoder, decoder_layers=decoder, encoder_attention_heads=heads,
                        decoder_attention_heads=heads, encoder_ffn_dim=ffn, decoder_ffn_dim=ffn, vocab_size=vocab,
                        architectures=["BartForConditionalGeneration"])
    config._name_or_path = text.split(" (")[0][:40]
    return resolve_model(config)


def program_of(row: dict, data_set: str) -> str:
    """How the measured run trained (evidence.Row.group "program"), as the row's notes and optimizer say."""
    if data_set == "optimised":
        return OPTIMISED
    text = " ".join(str(row.get(k, "")) for k in ("notes", "optimizer", "quote"))
    return TRAINER if TRAINER_TEXT.search(text) else HF_LOOP


def interpret(row: dict, data_set: str, models: dict) -> Case:
    if not row.get("gpus") or not row.get("seq_len"):
        raise Skip("GPU count or sequence length not published")
    if "seq_len is the MAX" in row.get("notes", ""):
        raise Skip("sequence length data-dependent (only its maximum published)")
    binned = BINNED.search(row.get("notes", ""))
    if binned and int(binned.group(1)) == row["seq_len"]:
        raise Skip("sequence length data-dependent (batches binned below the published length)")
    notes: list[str] = []
    gpu = map_gpu(row["gpu"])
    precision = map_precision(row["precision"], notes)
    stage, engine = map_sharding(row)
    if precision == "bf16-true" and stage:
        precision = "bf16-mixed"
        notes.append("16-bit weights under ZeRO run as bf16-mixed (ZeRO keeps fp32 master weights)")
    micro, accum = batch(row)
    world, nodes = row["gpus"], row.get("nodes") or 1
    cfg = Config.of(micro_batch=micro, grad_accum=accum, world_size=world, precision=precision,
                    checkpointing=map_checkpointing(row["checkpointing"]), zero_stage=stage,
                    offload=map_offload(row, stage), engine=engine, compiled=bool(row.get("compile")))
    key = (row["model"], row["seq_len"]) if data_set == "optimised" else row["model"]
    if key not in models:
        models[key] = hf_model(row) if data_set == "hf" else optimised_model(row)
    group = next((g for prefix, g in GROUPS if row["id"].startswith(prefix)), "other")
    attention = "eager" if str(row.get("attention", "")).lower().startswith("eager") else "sdpa"
    if TRITON_FLASH in str(row.get("attention", "")):
        notes.append("ran flash-attention's Triton kernel; timed at the planner's SDPA rate for the GPU")
    apart = OTHER_PROGRAM if "Liger-Kernel" in row.get("notes", "") else \
        WALL_TIME if row.get("notes", "").startswith("DERIVED from wall time") else ""
    only = compute_only(row)
    optimizer, adam_step = map_optimizer(row, notes) if not only else (DEFAULT_OPTIMIZER, FUSED_STEP)
    return Case(row["id"], DATA_FILES[data_set], row["source"], group, data_set, row["metric"], float(row["value"]),
                models[key], row["model"], gpu, cfg, row["seq_len"], max(1, world // nodes), attention, only,
                objective(row), program_of(row, data_set), notes, apart=apart, nic_Gbps=row.get("nic_per_gpu_Gbps"),
                optimizer=optimizer, adam_step=adam_step, kernel_profile=row.get("kernel_profile"),
                units_unstated="UNITS NOT STATED" in row.get("notes", ""))


#: The attention text of rows that ran flash-attention's Triton kernel (MPT's attn_impl='triton').
TRITON_FLASH = "attn_impl=triton"
#: Notes saying a sequence length's data was binned to shorter lengths (NVIDIA DLE BERT's phase 2: "Phase-2 (seq 512)
#: data uses LDDL binning", "Seq512 uses LDDL binning"): the published rate is not at the stated length.
BINNED = re.compile(r"seq\s*(\d+)\)?\s+(?:data\s+)?uses\s+LDDL\s+binning", re.IGNORECASE)


# ------------------------------------------------------------------------------------------------ receipts

def receipt_of(case: Case, row: evidence.Row):
    """A planned HF row as a receipt (benchmarks/runs.py): the published run's configuration and program, the speed
    model's step (`predict_step`, the plan's speed model with the run's own objective and optimizer kernel) beside
    the published one."""
    from planner.receipts import Figures, Hardware, Prediction, Receipt, RunPlan, planner_tree, planner_version

    world = case.cfg.world_size
    plan = RunPlan(model=case.model_name, seq_len=case.seq_len, choice=case.cfg, program=case.group["program"],
                   hardware=Hardware(gpu=case.gpu, gpus_per_node=case.per_node, nodes=max(1, world // case.per_node)),
                   optimizer=case.optimizer, attention=case.attention)
    step = Figures(step_time_s=row.predicted)
    return Receipt(id=case.id, source=case.source, data_file=f"benchmarks/data/{case.data_file}", plan=plan,
                   device=runs.published_device(case.gpu, world), predictor="throughput_accuracy",
                   predicted=Prediction(model=step, printed=step, tree=planner_tree(), version=planner_version(),
                                        facts=row.facts_used, figure_facts={"throughput": row.facts_used}),
                   measured=Figures(step_time_s=row.measured), note="; ".join(case.notes))


def predict_again(receipt):
    """Today's prediction of a receipt this benchmark wrote: its data row interpreted and timed afresh."""
    from planner.receipts import Figures, Prediction, planner_tree, planner_version

    data_set = next(name for name, file in DATA_FILES.items() if receipt.data_file.endswith(file))
    data = json.loads((DATA / DATA_FILES[data_set]).read_text())
    entry = next(r for r in (data["rows"] if "rows" in data else data["cases"]) if r["id"] == receipt.id)
    case = interpret(entry, data_set, {})
    with facts.recording() as used:
        step = Figures(step_time_s=predict_step(case, {}))
    return Prediction(model=step, printed=step, tree=planner_tree(), version=planner_version(),
                      facts=tuple(sorted(used)), figure_facts={"throughput": tuple(sorted(used))})


# ------------------------------------------------------------------------------------------------ folds

@dataclass(frozen=True)
class Refit:
    """An efficiency.json figure a fold replaces: `figure` of the GPU's Efficiency takes `value`, read from fact
    `key` (which the prediction then records in place of the held-out one); a probe (`scale`, no `key`) multiplies
    the GPU's own figure instead."""

    figure: str
    key: str | None
    value: float | None = None
    scale: float | None = None


#: The scales a fold's dropped facts are probed at: a prediction equal at both does not depend on them.
PROBES = (1e-3, 1e3)


@dataclass(frozen=True)
class Fold:
    """A leave-one-source-out fold: the predictions of one source's rows without any fact fitted to it."""

    source: str                                     # the held-out source key
    fitted: tuple[str, ...]                         # every fact fitted to it (its rows, its files, its key)
    overrides: Mapping[str, Any]                    # packaged facts at a first-principles value
    efficiency: Mapping[str, Refit]                 # efficiency.json facts replaced, by the held-out fact's key
    dropped: tuple[str, ...]                        # neither: a prediction that depends on one has none in the fold
    how: Mapping[str, str]                          # fact -> what the fold did with it
    probe: float | None = None                      # the dropped facts' scale in a probe of this fold

    @property
    def name(self) -> str:
        return self.source if self.probe is None else f"{self.source} x{self.probe:g}"

    def probed(self, scale: float) -> Fold | None:
        """This fold with its dropped facts at `scale` times their value (None: one is not a number)."""
        overrides, refits = dict(self.overrides), dict(self.efficiency)
        for key in self.dropped:
            if key.startswith(PREFIX):
                refits[key] = Refit(key.split(":", 2)[2], None, scale=scale)
                continue
            value = facts.fact(key).value
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                return None
            overrides[key] = value * scale
        return replace(self, overrides=overrides, efficiency=refits, probe=scale)


def names_of(source: str, members: Iterable[tuple[str, str]]) -> set[str]:
    """What a fact's `fitted_to` may name that belongs to `source`: its key, its rows and its files' "*"."""
    members = list(members)
    return {source} | {facts.row_name(f, i) for f, i in members} | {facts.row_name(f, "*") for f, _ in members}


def data_members() -> dict[str, list[tuple[str, str]]]:
    """Every row of every benchmarks/data file a throughput or compile benchmark reads, skipped ones included, by
    source key: (data file, row id)."""
    found: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for name in DATA_FILES.values():
        data = json.loads((DATA / name).read_text())
        for part in ("rows", "cases", "compile_time"):
            for row in data.get(part, []):
                found[facts.source_key(row["source"])].append((name, row["id"]))
    return dict(found)


def _cc(gpu_name: str) -> tuple[int, int] | None:
    try:
        return lookup_gpu(gpu_name).compute_capability_tuple
    except Exception:  # noqa: BLE001 - a name efficiency.json has that the catalog lacks
        return None


def refit_figure(key: str, names: set[str]) -> tuple[Refit | None, str]:
    """An efficiency.json fact ("efficiency:<GPU>:<figure>") without `names`: the same figure of the catalog GPU of
    nearest compute capability not above this GPU's whose own entry none of `names` was fitted to (one kernel
    generation's measured rate carried to the next where nothing unfitted was measured); None where there is none."""
    _, gpu, figure = key.split(":", 2)
    mine = _cc(gpu)
    if figure not in REFITTABLE_FIGURES or mine is None:
        return None, "no refit without its source: a prediction that depends on it has none in this fold"
    candidates = []
    for other in efficiency_json()["gpus"]:
        other_key, cc = fact_key(other, figure), _cc(other)
        if other == gpu or cc is None or cc > mine or other_key not in facts.all_facts():
            continue
        if names & set(facts.fact(other_key).fitted_to):
            continue
        candidates.append((cc, other, other_key))
    if not candidates:
        return None, ("no GPU at or below its compute capability has an unfitted figure: a prediction that depends "
                      "on it has none in this fold")
    cc, other, other_key = max(candidates, key=lambda c: (c[0], c[1]))
    value = getattr(efficiency(other), figure)
    return Refit(figure, other_key, value), (f"refitted to {other}'s unfitted figure {value:g} ({other_key}, compute "
                                             f"capability {cc[0]}.{cc[1]} vs {mine[0]}.{mine[1]})")


def make_fold(source: str, members: Iterable[tuple[str, str]]) -> Fold | None:
    """The fold holding out `source` (None: no fact was fitted to it; its rows are predicted as by the full model)."""
    names = names_of(source, members)
    fitted = sorted(key for key, fact in facts.all_facts().items() if names & set(fact.fitted_to))
    if not fitted:
        return None
    overrides, refits, dropped, how = {}, {}, [], {}
    for key in fitted:
        if key in FIRST_PRINCIPLES:
            overrides[key], reason = FIRST_PRINCIPLES[key]
            how[key] = f"dropped to {overrides[key]!r} ({reason})"
            continue
        refit, how[key] = refit_figure(key, names) if key.startswith("efficiency:") else (
            None, "no first-principles value: a prediction that depends on it has none in this fold")
        if refit is None:
            dropped.append(key)
        else:
            refits[key] = refit
    return Fold(source, tuple(fitted), overrides, refits, tuple(dropped), how)


def make_folds() -> dict[str, Fold]:
    """A fold per source some fact was fitted to, by source key."""
    folds = {source: make_fold(source, members) for source, members in data_members().items()}
    return {source: fold for source, fold in folds.items() if fold is not None}


# ------------------------------------------------------------------------------------------------ predicting

def speed_model_of(case: Case, speed_models: dict, fold: Fold | None = None) -> SpeedModel:
    """The speed model of the case's model, sequence, GPU and program (one per distinct combination); in a fold,
    a copy whose Efficiency has the fold's refitted figures (its fact keys naming what they were read from)."""
    key = (id(case.model), case.seq_len, case.gpu, case.per_node, case.attention, case.objective, case.nic_Gbps,
           case.optimizer, case.adam_step)
    if key not in speed_models:
        gpu = lookup_gpu(case.gpu).model_copy(update={"nic_Gbps": case.nic_Gbps})
        workload = Workload(case.model, seq_len=case.seq_len, optimizer=case.optimizer, attention=case.attention,
                            gpu=gpu, objective=case.objective)
        speed_models[key] = SpeedModel(workload, gpu, case.per_node, adam_step=case.adam_step)
    model = speed_models[key]
    if fold is None:
        return model
    held = [k for k in model.eff.fact_keys if k in fold.efficiency]
    if not held:
        return model
    if (key, fold.name) not in speed_models:
        eff, keys = model.eff, set(model.eff.fact_keys)
        for k in held:
            refit = fold.efficiency[k]
            eff = eff.model_copy(update=refitted(eff, refit))
            keys = (keys - {k}) | ({refit.key} if refit.key else set())
        folded = copy.copy(model)  # shares the traced profiles, which no efficiency figure enters
        folded.setup = replace(model.setup, eff=eff.model_copy(update={"fact_keys": tuple(sorted(keys))}))
        speed_models[(key, fold.name)] = folded
    return speed_models[(key, fold.name)]


def refitted(eff, refit: Refit) -> dict:
    """The Efficiency fields a refit changes."""
    if refit.figure.startswith("matmul."):
        dtype = refit.figure.split(".", 1)[1]
        value = refit.value if refit.scale is None else eff.matmul[dtype] * refit.scale
        return {"matmul": {**eff.matmul, dtype: value}}
    value = refit.value if refit.scale is None else getattr(eff, refit.figure) * refit.scale
    return {refit.figure: value}


def predict_step(case: Case, speed_models: dict, fold: Fold | None = None) -> float:
    """The case's step time (s) as the model predicts it (forward+backward only where the published time has no
    optimizer step), in `fold` where given."""
    model = speed_model_of(case, speed_models, fold)
    with facts.overriding(fold.overrides if fold else {}):
        t = model(case.cfg)
    return t.parts.compute if case.compute_only else t.step_time_s


def measured_step(case: Case, speed_models: dict) -> float:
    """The step time (s) the published value states or implies at the row's batch and sequence; an MFU at the
    planner's FLOP count (which no efficiency figure enters)."""
    cfg = case.cfg
    if case.metric == "step_time_s":
        return case.value
    if case.metric == "tokens_per_s_per_gpu":
        return cfg.global_batch * case.seq_len / (case.value * cfg.world_size)
    if case.metric in ("samples_per_s", "samples_per_s_total"):
        return cfg.global_batch / case.value
    if case.metric == "mfu":
        t = speed_model_of(case, speed_models)(cfg)
        return t.mfu * t.step_time_s / (case.value / 100)  # FLOPs / (world x peak), over the published fraction
    raise Skip(f"metric {case.metric!r} not mapped")


def judged_row(*, id: str, data_file: str, source: str, measured: float, predict: Callable[[], float],
               group: dict, note: str = "", fold: Fold | None = None,
               also: Iterable[tuple[str, str]] = ()) -> evidence.Row:
    """`evidence.predicted_row`, with two additions: a fold's overridden facts are not counted as used (their fitted
    values were not), and `also` names further rows (id, source) of `data_file` the prediction stands on (a speed-up
    is two rows), whose fitted facts make it in-sample too."""
    row = evidence.predicted_row(id=id, data_file=data_file, source=source, measured=measured, predict=predict,
                                 group=group, note=note)
    used = tuple(k for k in row.facts_used if not (fold and k in fold.overrides))
    fitted = set(facts.in_sample_by(used, data_file, id, source))
    for other_id, other_source in also:
        fitted |= set(facts.in_sample_by(used, data_file, other_id, other_source))
    if fold:  # what the fold did with the facts this prediction would have used
        gpu = group.get("gpu")
        mine = [k for k in fold.fitted if k not in fold.dropped and (k in row.facts_used or (
            k in fold.efficiency and fold.efficiency[k].key in row.facts_used and k.split(":")[1] == gpu))]
        note = "; ".join(filter(None, [note, f"without {fold.source}: "
                                       + ("; ".join(f"{k} {fold.how[k]}" for k in mine) or "no refit used")]))
    return replace(row, facts_used=used, in_sample_by=tuple(sorted(fitted)), note=note)


def judge(case: Case, speed_models: dict, fold: Fold | None = None) -> evidence.Row:
    return judged_row(id=case.id, data_file=case.data_file, source=case.source,
                      measured=measured_step(case, speed_models),
                      predict=lambda: predict_step(case, speed_models, fold),
                      group=case.group, note="; ".join(case.notes), fold=fold)


def load(data_set: str, progress, speed_models: dict) -> tuple[list[Case], dict[str, evidence.Row], dict[str, int]]:
    """The set's rows interpreted and judged (the full model), the speed models they need kept in `speed_models`
    (`speed_model_of`; its keys hold for as long as the returned cases keep their models)."""
    data = json.loads((DATA / DATA_FILES[data_set]).read_text())
    raw = data["rows"] if "rows" in data else data["cases"]
    cases, rows, skipped, models = [], {}, defaultdict(int), {}
    for i, entry in enumerate(raw):
        progress(f"{data_set} {i + 1}/{len(raw)} {entry['id']}")
        try:
            case = interpret(entry, data_set, models)
            rows[case.id] = judge(case, speed_models)
            cases.append(case)
        except Skip as reason:
            skipped[str(reason)] += 1
        except ValueError as err:  # a combination the planner's Config refuses
            skipped[f"not a planner configuration: {str(err)[:80]}"] += 1
    return cases, rows, dict(skipped)


def in_fold(fold: Fold, predict_row: Callable[[Fold], evidence.Row]) -> evidence.Row | None:
    """A row predicted in `fold`. Where the fold dropped facts (no value without the source), the row is predicted
    with them at `PROBES` times their value: equal predictions do not depend on them (a fact read but not entering
    the value, as the compile seconds per op in a step without `train_steps`); else the row has none (None)."""
    if not fold.dropped:
        return predict_row(fold)
    probes = [fold.probed(scale) for scale in PROBES]
    if any(p is None for p in probes):
        return None
    low, high = (predict_row(p) for p in probes)
    if not math.isclose(low.predicted, high.predicted, rel_tol=1e-9):
        return None
    return replace(low, note=f"{low.note}; the same at {PROBES[0]:g}x and {PROBES[1]:g}x the facts the fold "
                             "dropped (they do not enter this prediction)")


def leave_one_source_out(cases: list[Case], rows: dict[str, evidence.Row], folds: dict[str, Fold],
                         speed_models: dict) -> dict[str, evidence.Row | None]:
    """Every case's row as its source's fold predicts it: the full model's where no fact was fitted to its source,
    else predicted again in the fold (`in_fold`; None: it depends on a fact the fold could not refit)."""
    out: dict[str, evidence.Row | None] = {}
    for case in cases:
        fold = folds.get(case.source_key)
        out[case.id] = rows[case.id] if fold is None else in_fold(fold, lambda f, c=case: judge(c, speed_models, f))
    return out


# ------------------------------------------------------------------------------------------------ rank agreement

#: What may vary inside a rank group: everything but what sets a row's size (its model, sequence length, GPU count).
RANK_VARIES = {"micro-batch": lambda c: c.cfg.micro_batch, "accumulation": lambda c: c.cfg.grad_accum,
               "optimizer": lambda c: (c.optimizer, c.adam_step), "network": lambda c: (c.per_node, c.nic_Gbps),
               "checkpointing": lambda c: c.cfg.checkpointing, "precision": lambda c: c.cfg.precision,
               "attention": lambda c: c.attention, "compile": lambda c: c.cfg.compiled,
               "sharding": lambda c: (c.cfg.engine, c.cfg.zero_stage, c.cfg.offload)}


def rank_agreement(cases: list[Case], rows: Mapping[str, evidence.Row | None]) -> dict:
    """Kendall's tau of predicted vs measured samples per second, pooled over the pairs inside groups of one source,
    model, GPU, GPU count and sequence length (and optimizer-step coverage): the order of sizes is fixed inside a
    group, so a concordant pair is the model telling configurations apart. Uses `rows` (the leave-one-source-out
    rows); rows without a prediction are left out; pairs measured equal are not counted."""
    groups: dict[tuple, list[tuple[Case, evidence.Row]]] = defaultdict(list)
    for case in cases:
        row = rows.get(case.id)
        if row is not None:
            groups[(case.source_group, case.model_name, case.gpu, case.cfg.world_size, case.seq_len,
                    case.compute_only)].append((case, row))
    out, concordant, discordant = [], 0, 0
    for key, members in sorted(groups.items(), key=lambda kv: str(kv[0])):
        if len(members) < 2:
            continue
        varies = [name for name, of in RANK_VARIES.items() if len({str(of(c)) for c, _ in members}) > 1]
        rates = [(c.cfg.global_batch / r.predicted, c.cfg.global_batch / r.measured) for c, r in members]
        c_n = d_n = 0
        for i in range(len(rates)):
            for j in range(i + 1, len(rates)):
                product = (rates[i][0] - rates[j][0]) * (rates[i][1] - rates[j][1])
                c_n += product > 0
                d_n += product < 0
        if c_n + d_n == 0:
            continue
        concordant, discordant = concordant + c_n, discordant + d_n
        out.append({"group": f"{key[0]}: {key[1][:40]} {key[2]} x{key[3]} seq {key[4]}"
                             + (" (fwd+bwd)" if key[5] else ""),
                    "rows": len(members), "varies": varies, "concordant": c_n, "discordant": d_n,
                    "tau": (c_n - d_n) / (c_n + d_n)})
    pairs = concordant + discordant
    return {"groups": out, "pairs": pairs, "concordant": concordant, "discordant": discordant,
            "tau": (concordant - discordant) / pairs if pairs else None}


# ------------------------------------------------------------------------------------------------ reporting

def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def line(label: str, rows: list[evidence.Row], width: int = 34) -> str:
    if not rows:
        return f"  {label:<{width}}    0"
    errors = [r.error for r in rows]
    abs_err = [abs(e) for e in errors]
    return (f"  {label:<{width}} {len(rows):>4}  median |err| {median(abs_err):6.1%}  worst {max(abs_err):6.1%}  "
            f"median signed {median(errors):+6.1%}")


def sample_lines(rows: list[evidence.Row], loso: Mapping[str, evidence.Row | None],
                 folds: dict[str, Fold]) -> list[str]:
    """The headline lines, every label from counts: no fitted fact used, in-sample, and the
    leave-one-source-out view (every row predicted without any fact fitted to its source)."""
    out_rows = [r for r in rows if not r.in_sample]
    in_rows = [r for r in rows if r.in_sample]
    judged = [loso[r.id] for r in rows if loso.get(r.id) is not None]
    honest = [r for r in judged if not r.in_sample]
    refolded = sorted({facts.source_key(r.source) for r in in_rows} & set(folds))
    lines = [line(f"no fitted fact: {len(out_rows)} of {len(rows)} rows", out_rows),
             line(f"in-sample: {len(in_rows)} of {len(rows)} rows", in_rows)]
    by_fact = Counter(key for r in in_rows for key in r.in_sample_by)
    if by_fact:
        lines.append("    in-sample by: " + ", ".join(f"{k} ({n} rows)" for k, n in sorted(by_fact.items())))
    lines.append(line(f"leave-one-source-out: {len(honest)} of {len(rows)} rows", honest))
    if len(honest) < len(rows):
        lines.append(f"    {len(rows) - len(judged)} rows have no prediction without their source; "
                     f"{len(judged) - len(honest)} stay in-sample in their fold")
    if refolded:
        again = sum(facts.source_key(r.source) in folds for r in in_rows)
        lines.append(f"    folds refitted: {', '.join(refolded)} ({again} in-sample rows predicted again)")
    return lines


BREAKDOWNS = {"source": lambda c: c.source_group, "program": lambda c: c.program, "gpu": lambda c: c.gpu,
              "precision": lambda c: c.cfg.precision, "checkpointing": lambda c: c.cfg.checkpointing,
              "engine": lambda c: f"{c.cfg.engine} zero{c.cfg.zero_stage}" if c.cfg.zero_stage else c.cfg.engine}


def report(title: str, cases: list[Case], rows: dict[str, evidence.Row], loso: Mapping[str, evidence.Row | None],
           folds: dict[str, Fold], worst: int) -> list[str]:
    mine = [rows[c.id] for c in cases]
    out = [f"\n{title}: {len(mine)} rows"] + sample_lines(mine, loso, folds)
    if not mine:
        return out
    in_cases = [c for c in cases if rows[c.id].in_sample]
    if in_cases:
        out.append("  in-sample rows: the full model's error, then the error in their source's fold:")
        for c in in_cases:
            fold_row = loso.get(c.id)
            fold_text = f"{fold_row.error:+7.1%}" if fold_row is not None else "   none"
            out.append(f"    {c.id:<44} {rows[c.id].error:+7.1%}  fold {fold_text}  ({c.gpu})")
    out_cases = [c for c in cases if not rows[c.id].in_sample]
    if out_cases:
        out.append(f"  by stratum, over the {len(out_cases)} rows no fitted fact entered:")
    for name, key in BREAKDOWNS.items():
        buckets = defaultdict(list)
        for c in out_cases:
            buckets[key(c)].append(rows[c.id])
        out += [line(f"{name}={value}", rs, width=44) for value, rs in sorted(buckets.items())]
    out.append("  worst rows (err = predicted/measured step time - 1; [in-sample] where a fitted fact entered):")
    for c in sorted(cases, key=lambda c: -abs(rows[c.id].error))[:worst]:
        flag = " [in-sample]" if rows[c.id].in_sample else ""
        out.append(f"    {c.id:<40} {rows[c.id].error:+7.1%}{flag}  {c.cfg.label()}  {'; '.join(c.notes)}")
    return out


def kernel_times(cases: list[Case], speed_models: dict) -> tuple[list[str], list[dict]]:
    """Where a source profiled its GPU kernels, the model's device time per optimizer step beside them: its GEMMs
    against the tensor-core kernels, the rest (other kernels, the optimizer's, copies) against the rest."""
    from planner.speed.kernels import device_time
    from planner.speed.optimizer import optimizer_step

    lines, rows = [], []
    for case in (c for c in cases if c.kernel_profile):
        model = speed_model_of(case, speed_models)
        profile, anchor = model.profile(case.cfg)
        cfg = case.cfg
        device = device_time(profile, cfg.micro_batch / anchor, cfg.precision, model.gpu, model.eff)
        optimizer = optimizer_step(model.workload.spec, cfg, case.optimizer, model.gpu, model.eff,
                                   case.per_node, case.adam_step).gpu_s
        kp, steps = case.kernel_profile, case.kernel_profile["steps"]
        measured_gemm = kp["tensor_core_ns"] / steps * 1e-9
        measured_rest = (kp["other_ns"] + kp["memory_ns"]) / steps * 1e-9
        gemm = cfg.grad_accum * device.gemm_s
        rest = cfg.grad_accum * (device.attention_s + device.memory_s) + optimizer
        rows.append({"id": case.id, "gemm_ms": gemm * 1e3, "tensor_core_ms": measured_gemm * 1e3,
                     "rest_ms": rest * 1e3, "other_kernels_ms": measured_rest * 1e3})
        lines.append(f"    {case.id:<40} GEMMs {gemm * 1e3:6.1f} ms vs tensor-core kernels {measured_gemm * 1e3:6.1f} "
                     f"({gemm / measured_gemm - 1:+.0%}); the rest {rest * 1e3:6.1f} ms vs other kernels "
                     f"{measured_rest * 1e3:6.1f} ({rest / measured_rest - 1:+.0%}); all {(gemm + rest) * 1e3:6.1f} "
                     f"vs {(measured_gemm + measured_rest) * 1e3:6.1f} ms")
    if lines:
        lines.insert(0, "\n  GPU kernel time per step where the source profiled its kernels (model vs DLProf):")
    return lines, rows


def rank_lines(title: str, ranks: dict) -> list[str]:
    if not ranks["pairs"]:
        return [f"\n  {title}: no group of one model, GPU count and sequence length has two rows that differ"]
    lines = [f"\n  {title}: Kendall tau {ranks['tau']:+.2f} over {ranks['pairs']} pairs ({ranks['concordant']} "
             f"concordant, {ranks['discordant']} discordant) in {len(ranks['groups'])} groups of one source, model, "
             "GPU count and sequence length (leave-one-source-out predictions; sequence-length sweeps not ranked)"]
    lines += [f"    {g['group']:<64} n={g['rows']:<3} tau {g['tau']:+.2f}  varies: {', '.join(g['varies']) or '-'}"
              for g in ranks["groups"]]
    return lines


def attention_contrast() -> dict:
    """H200's attention figure beside H100's: the same GH100 silicon and bf16 peak, timed at FlashAttention-3's
    in-step rate on one and SDPA's measured rate on the other (efficiency.json, which this script does not change)."""
    keys = {"H200": fact_key("H200-141GB", "attention"), "H100": fact_key("H100-80GB", "attention")}
    h200, h100 = efficiency("H200-141GB").attention, efficiency("H100-80GB").attention
    peaks = lookup_gpu("H200-141GB").peak_tflops_bf16, lookup_gpu("H100-80GB").peak_tflops_bf16
    ratio = (h200 * peaks[0]) / (h100 * peaks[1])
    return {"h200": h200, "h100": h100, "peak_h200": peaks[0], "peak_h100": peaks[1], "per_flop_ratio": ratio,
            "keys": keys, "text": (
                f"H200 attention is timed at {h200:.3f} of its bf16 peak ({keys['H200']}: FlashAttention-3 inside "
                f"ml-engineering's 8k step) while H100 is timed at {h100:.3f} ({keys['H100']}: SDPA's flash backend "
                f"measured on the lent H100), both at {peaks[0]:g} TFLOPS peak: {ratio:.2f}x per attention FLOP apart "
                "on one kernel family, so an H200 row's error says nothing about an SDPA run on H200 (the "
                "leave-one-source-out fold times H200 at H100's rate)")}


def default_attention_text(cases: list[Case]) -> str:
    """Which GPUs efficiency.json times at its default attention rate, what that rate was fitted to, and which of
    them the rows judge with it (a row whose attention is not SDPA's does not use it)."""
    entries = {name: gpu.get("attention", {}) for name, gpu in efficiency_json()["gpus"].items()}
    defaulted = sorted(name for name, entry in entries.items()
                       if any(isinstance(e, dict) and e.get("default") for e in entry.values()))
    default = facts.fact(fact_key(defaulted[0], "attention")) if defaulted else None
    if default is None:
        return ""
    judged = sorted({c.gpu for c in cases if c.gpu in defaulted and c.attention == "sdpa"})
    return (f"{len(defaulted)} GPUs ({', '.join(defaulted)}) are timed at efficiency.json's default attention rate "
            f"({default.value:g}, fitted to {', '.join(default.fitted_to)}); rows judge it on "
            f"{len(judged)} of them{': ' + ', '.join(judged) if judged else ''}.")


def results_of(name: str, kind: str, metric: str, stack: str, cannot_show: str, cases: list[Case],
               rows: dict[str, evidence.Row], loso: Mapping[str, evidence.Row | None], folds: dict[str, Fold],
               extra: dict) -> Path:
    """Write one results file (evidence format) with the old report's detail under extra keys."""
    mine = [rows[c.id] for c in cases]
    path = evidence.write_results(name, mine, kind=kind, metric=metric, stack=stack, cannot_show=cannot_show,
                                  command=COMMAND)
    record = json.loads(path.read_text())
    judged = [loso[c.id] for c in cases if loso.get(c.id) is not None]
    used = sorted({facts.source_key(c.source) for c in cases} & set(folds))
    record["leave_one_source_out"] = {
        "summary": evidence.summary(r for r in judged if not r.in_sample),
        "no_prediction": sorted(c.id for c in cases if loso.get(c.id) is None),
        "folds": {s: {"fitted": list(folds[s].fitted), "how": dict(folds[s].how)} for s in used},
        "rows": [r.to_json() for r in judged if r is not rows[r.id]]}
    record["detail"] = [{"id": c.id, "source_group": c.source_group, "metric": c.metric, "published": c.value,
                         "config": c.cfg.label(), "notes": c.notes, "apart": c.apart} for c in cases]
    record.update(extra)
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return path


def loso_text(cases: list[Case], rows: dict[str, evidence.Row], loso: Mapping[str, evidence.Row | None]) -> str:
    """One computed sentence on the in-sample rows and their folds, for `cannot_show`."""
    in_rows = [rows[c.id] for c in cases if rows[c.id].in_sample]
    if not in_rows:
        return f"No fact its rows' predictions used was fitted to them or their source ({len(cases)} rows)."
    folded = [loso[r.id] for r in in_rows if loso.get(r.id) is not None and not loso[r.id].in_sample]
    s = evidence.summary(folded)
    keys = sorted({k for r in in_rows for k in r.in_sample_by})
    head = (f"{len(in_rows)} of {len(cases)} rows are in-sample (by {', '.join(keys)}); predicted again without "
            f"any fact fitted to their source (results key leave_one_source_out), {len(folded)} of them ")
    if not folded:
        return head + "have a prediction."
    return head + (f"miss by median {s['median_abs']:.1%} (worst {s['worst_abs']:.1%}, bias {s['bias']:+.1%}), the "
                   "honest figure without fitted facts for those rows.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", choices=("hf", "optimised", "all"), default="all")
    parser.add_argument("--worst", type=int, default=8)
    args = parser.parse_args()
    sets = ("hf", "optimised") if args.set == "all" else (args.set,)

    def progress(text: str) -> None:
        sys.stderr.write(f"\r{text[:100]:<100}")
        sys.stderr.flush()

    folds = make_folds()
    contrast = attention_contrast()
    lines = ["Facts fitted to published rows, and what each source's leave-one-source-out fold does with them:"]
    for source, fold in sorted(folds.items()):
        lines.append(f"  {source}:")
        lines += [f"    {key}: {fold.how[key]}" for key in fold.fitted]
    planned_all: list[evidence.Row] = []
    loso_all: dict[str, evidence.Row | None] = {}
    for data_set in sets:
        speed_models: dict = {}
        cases, rows, skipped = load(data_set, progress, speed_models)
        progress(f"{data_set}: leave-one-source-out folds")
        loso = leave_one_source_out(cases, rows, folds, speed_models)
        loso_all.update(loso)
        ranks = rank_agreement(cases, loso)
        skipped_lines = [f"  skipped: {n} x {why}" for why, n in sorted(skipped.items(), key=lambda kv: -kv[1])]
        if data_set == "hf":
            planned = [c for c in cases if not c.apart]
            apart = [c for c in cases if c.apart]
            planned_all += [rows[c.id] for c in planned]
            kernel_lines, kernel_rows = kernel_times(cases, speed_models)
            lines += report("HF model code run as trainplan plans it (hf_throughput.json)", planned, rows, loso,
                            folds, args.worst)
            lines += skipped_lines + kernel_lines + rank_lines("rank agreement (HF rows planned)",
                                                               rank_agreement(planned, loso))
            for why in sorted({c.apart for c in apart}):
                lines += report(f"Apart: {why}", [c for c in apart if c.apart == why], rows, loso, folds, args.worst)
            trainer = sum(c.program == TRAINER for c in planned)
            runs.write(runs.Benchmark(
                name="throughput_accuracy", command=COMMAND,
                metric="step time (s) of HF model code as each source ran it: published tokens/s/GPU and samples/s "
                       "converted at the row's batch and sequence; forward+backward only where the source timed no "
                       "optimizer step (program hf-forward-backward)",
                stack="trainplan's speed model (planner/speed/) on the traced op profile, efficiency.json's per-GPU "
                      "figures, each run's own objective and optimizer kernel",
                cannot_show=f"{trainer} of {len(planned)} runs ran the HF Trainer (the rest ran HF model code in a "
                            "loop of their own), so the Trainer's own per-step work is not judged here",
                receipts=tuple(receipt_of(c, rows[c.id]) for c in planned)))
            results_of(
                "throughput_accuracy", "other",
                "the runs of receipts/throughput_accuracy.json as rows, with each predicted again without the "
                "facts fitted to its source (leave_one_source_out): step time (s) of HF model code as each source "
                "ran it", "trainplan's speed model (planner/speed/) on the traced op profile, efficiency.json's "
                "per-GPU figures",
                f"{trainer} of {len(planned)} rows ran the HF Trainer (the rest ran HF model code in a loop of their "
                "own), so the Trainer's own per-step work is not judged here. " + loso_text(planned, rows, loso)
                + f" {contrast['text']}. torch.compile's residual comes from one source's one pair; compiled rows "
                f"of other sources would test it. {default_attention_text(planned)}",
                planned, rows, loso, folds,
                {"skipped": skipped, "kernel_times": kernel_rows, "rank_agreement": rank_agreement(planned, loso),
                 "attention_contrast": {k: v for k, v in contrast.items() if k != "text"}})
            results_of(
                "throughput_accuracy_apart", "other",
                "step time (s) of HF rows reported apart: " + "; ".join(sorted({c.apart for c in apart})),
                "trainplan's speed model, the rows predicted as the HF code the Liger kernels replace",
                "Liger-Kernel's fused kernels are not traced, so those rows test the HF program they replace, not "
                "theirs; a wall-time row bounds the step from above. " + loso_text(apart, rows, loso),
                apart, rows, loso, folds, {})
        else:
            planned_all += []
            lines += report("Optimised stacks (throughput_calibration.json; their own model code, not HF's)", cases,
                            rows, loso, folds, args.worst)
            lines += skipped_lines + rank_lines("rank agreement (optimised stacks)", ranks)
            triton = sum("Triton" in "; ".join(c.notes) for c in cases)
            tf32 = sum(c.cfg.precision == "tf32" for c in cases)
            unstated = sum(c.units_unstated for c in cases)
            results_of(
                "throughput_accuracy_optimised", "other",
                "step time (s) of optimised stacks' own model code (llm-foundry, torchtitan, IBM FSDP, NVIDIA "
                "DeepLearningExamples, ...) with their shapes rebuilt as transformers configs: published "
                "tokens/s/GPU, samples/s and MFU (at the planner's FLOP count) converted at the row's batch and "
                "sequence", "trainplan's speed model timing HF-style programs of the same shapes",
                "These are not programs trainplan plans: their fused kernels (Triton or fused attention, fused "
                f"LayerNorm/GELU, fused optimizers) differ from HF code's. {triton} rows ran flash-attention's "
                "Triton kernel and are timed at the planner's SDPA rate for their GPU; "
                f"{tf32} rows ran TF32 matmuls; {unstated} rows' units are not stated by their source (read as "
                "sequences/s). " + loso_text(cases, rows, loso),
                cases, rows, loso, folds, {"skipped": skipped, "rank_agreement": ranks})
    if len(sets) > 1:
        lines += ["\nEvery published row of a program trainplan plans (results/throughput_accuracy.json):"]
        lines += sample_lines(planned_all, loso_all, folds)
    lines += ["\nNot changed here (efficiency.json belongs to the facts): " + contrast["text"] + "."]
    sys.stderr.write("\r" + " " * 100 + "\r")
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "throughput_accuracy.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
