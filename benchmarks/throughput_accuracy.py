"""How well the shipped speed model (planner/speed/ on the traced op profile) reproduces published training
throughput it was never fitted to.

Two sets of published rows, both in benchmarks/data with each row's source:
- hf_throughput.json: Hugging Face model code (transformers docs, HF blog posts, stas00's ml-engineering runs, ...),
  the code our users run. The model is the bundled preset of the row's hub id, with the row's head.
- throughput_calibration.json: optimised stacks (llm-foundry, torchtitan, IBM FSDP, ...). Their fused kernels run
  faster than HF code, so a model of HF code would sit below them; the row's shapes are rebuilt as a transformers
  config (MPT as GPT-2 blocks of the same shapes with MPT's defaults, no dropout and the exact GELU; OLMo as Llama).
  llm-foundry's micro-batch / checkpointing sweeps also give a ranking check: Kendall's tau of predicted vs measured
  order inside each sweep.

No constant of the speed model is fitted to any of these rows: the efficiencies are per-GPU microbenchmark figures
or steps we measured ourselves on a lent H100 (planner/hardware/efficiency.json, each sourced; the host cost of a
checkpointed block is a CPU measurement of torch.utils.checkpoint's bookkeeping) and the GEMM shape constants come
from a GEMM table
(planner/speed/). One constant comes from rows here: torch.compile's device residual
(planner.facts `inductor.compiled_device_residual`), from the ml-engineering Llama-3.1-8B eager/compiled pair.
Leave-one-source-out cross-validation refits it: the ml-engineering fold has no other compiled HF step to derive it
from, so its compiled rows are predicted without it (1.0); every other fold's prediction is the full-data one. All
errors below are therefore out-of-sample. The script says so in its output.

A row that names its system's inter-node network (`nic_per_gpu_Gbps`, with its source) is planned on it, as
`plan --nic-gbps` would be; the others on the catalog's usual system for the GPU. llm-foundry's MPT rows ran
flash-attention's Triton kernel (attn_impl='triton'), slower than SDPA's FlashAttention-2: on the A100, where its
rate is published (FlashAttention-2 paper, efficiency.json `triton_flash_fwd_bwd_fraction`), they are timed with it;
on the H100 at SDPA's rate. Each row's optimizer is timed as its text says it ran (`map_optimizer`): a fused kernel
(apex's or DeepSpeed's FusedAdam, torch fused=True), torch's foreach default, or a Python loop over the tensors
(transformers' adamw_hf, the Trainer's default up to 4.31; torch before 2.0), `vocab.ADAM_STEP`'s three programs;
another optimizer it names is timed by name (`vocab.OPTIMIZER_STEP`'s program where one is counted).

Where a source published its GPU kernel profile (tlkh's DLProf summaries: tensor-core kernels, other kernels,
copies, over the run's steps), the report sets the model's device time per step beside it, GEMMs against the
tensor-core kernels and the rest against the rest: which part of a miss is the GEMM model's and which the others'.

Rows of Liger-Kernel patched model code (fused kernels trainplan never emits) are predicted as the HF code they
replace and reported on a line of their own, apart from the ALL line of the programs trainplan plans; so is a row
whose value is a whole run's wall time divided by its steps (evaluation and checkpoint saves included), which bounds
the step time from above but does not measure it.

Run from the repository root (traces are cached under the trainplan cache; a cold run takes a few minutes):
    HF_HUB_OFFLINE=1 python benchmarks/throughput_accuracy.py [--set hf|optimised|all] [--worst N]
Writes benchmarks/results/throughput_accuracy.json and prints the report (also saved as throughput_accuracy.txt).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

from planner import facts
from planner.config import Config
from planner.hardware import lookup_gpu
from planner.program.workload import Workload
from planner.models import resolve_model
from planner.speed.model import SpeedModel
from planner.vocab import DEFAULT_OPTIMIZER, FOR_LOOP_STEP, FOREACH_STEP, FUSED_STEP

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "benchmarks" / "data"
RESULTS = REPO / "benchmarks" / "results"

#: Hub ids whose rows name a re-upload of a bundled preset (same config.json).
ALIASES = {"nousresearch/llama-3.2-1b": "meta-llama/Llama-3.2-1B",
           "meta-llama/llama-2-70b-chat-hf": "meta-llama/Llama-2-70b-hf"}

#: id prefix -> source group (first match wins).
GROUPS = (("llmf-a100", "llm-foundry A100"), ("llmf-h100", "llm-foundry H100"), ("dlebert", "NVIDIA BERT"),
          ("dlebart", "NVIDIA BART"), ("tt-", "torchtitan"), ("torchao", "torchtitan"), ("f8blog", "torchtitan"),
          ("ibmfsdp", "IBM FSDP"), ("fmsfsdp", "IBM FSDP"), ("flashattn", "flash-attn GPT"),
          ("tinyllama", "TinyLlama"), ("olmocore", "OLMo-core"), ("automodel", "NeMo Automodel"),
          ("mle-", "ml-engineering"), ("hfblog", "HF blog"), ("tfdocs-bert", "transformers docs BERT"),
          ("tfdocs-opt", "transformers docs OPT"), ("tlkh", "tlkh benchmarks"), ("hf15026", "transformers #15026"))


#: Rows whose model code is patched with fused kernels trainplan never emits (Liger-Kernel's RMSNorm, RoPE, SwiGLU and
#: fused linear cross-entropy): predicted as the HF code they replace, and reported apart from the programs planned.
OTHER_PROGRAM = "Liger-Kernel patched model code (not a program trainplan plans)"
WALL_TIME = "a run's wall time over its steps (evaluation and checkpoint saves included; not a step time)"


class Skip(Exception):
    """A row this script cannot interpret; the message is the reason."""


@dataclass
class Case:
    id: str
    group: str
    kind: str                # "hf" or "optimised"
    metric: str
    value: float
    model: object            # a ResolvedModel
    gpu: str
    cfg: Config
    seq_len: int
    per_node: int
    attention: str
    compute_only: bool       # the published time has no optimizer step
    objective: str           # what the backward starts from (`vocab.OBJECTIVE`)
    notes: list[str] = field(default_factory=list)
    predicted: float = 0.0
    #: why the published program is not one trainplan plans (reported apart), or ""
    other_program: str = ""
    #: the published system's inter-node bandwidth per GPU (Gb/s), where the row names it; None: the catalog's
    nic_Gbps: float | None = None
    #: the fused attention kernel's fraction of peak where the row ran a kernel other than SDPA's (None: SDPA's)
    attention_fraction: float | None = None
    #: the row's optimizer (`vocab.OPTIMIZER`) and how an Adam step ran (`vocab.ADAM_STEP`)
    optimizer: str = DEFAULT_OPTIMIZER
    adam_step: str = FUSED_STEP
    #: the GPU kernel times the source profiled (DLProf's summary), where it published them
    kernel_profile: dict | None = None

    @property
    def log_ratio(self) -> float:
        return math.log(self.predicted / self.value)


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
        raise Skip("TF32 matmuls not modelled")
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
    from transformers import GPT2Config, LlamaConfig

    text, seq = row["model"], row["seq_len"]
    layers = _int(text, r"n_layers=(\d+)", r"(\d+)\s*layers", r"(\d+)L\b")
    hidden = _int(text, r"d_model[= ](\d+)", r"hidden (\d+)", r"(\d+) hidden")
    heads = _int(text, r"n_heads=(\d+)", r"(\d+) heads")
    ffn = _int(text, r"ffn[= ](\d+)")
    vocab = _int(text, r"padded to (\d+)", r"vocab[= ]~?(\d+)")
    if None in (layers, hidden, heads, ffn, vocab):
        raise Skip("model dims not published")
    lower = text.lower()
    if "mpt" in lower or "gpt3" in lower or "gpt-3" in lower:
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
        raise Skip("model family not rebuilt (MPT, GPT-3, Llama, OLMo only)")
    config._name_or_path = text.split(" (")[0][:40]
    return resolve_model(config)


def interpret(row: dict, kind: str, models: dict) -> Case:
    if not row.get("gpus") or not row.get("seq_len"):
        raise Skip("GPU count or sequence length not published")
    if "seq_len is the MAX" in row.get("notes", ""):
        raise Skip("sequence length data-dependent (only its maximum published)")
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
    key = (row["model"], row["seq_len"]) if kind == "optimised" else row["model"]
    if key not in models:
        models[key] = hf_model(row) if kind == "hf" else optimised_model(row)
    group = next((g for prefix, g in GROUPS if row["id"].startswith(prefix)), "other")
    attention = "eager" if str(row.get("attention", "")).lower().startswith("eager") else "sdpa"
    other = OTHER_PROGRAM if "Liger-Kernel" in row.get("notes", "") else \
        WALL_TIME if row.get("notes", "").startswith("DERIVED from wall time") else ""
    only = compute_only(row)
    optimizer, adam_step = map_optimizer(row, notes) if not only else (DEFAULT_OPTIMIZER, FUSED_STEP)
    return Case(row["id"], group, kind, row["metric"], float(row["value"]), models[key], gpu, cfg, row["seq_len"],
                max(1, world // nodes), attention, only, objective(row), notes, other_program=other,
                nic_Gbps=row.get("nic_per_gpu_Gbps"), attention_fraction=attention_kernel_fraction(row, gpu, notes),
                optimizer=optimizer, adam_step=adam_step, kernel_profile=row.get("kernel_profile"))


#: The attention text of rows that ran flash-attention's Triton kernel (MPT's attn_impl='triton').
TRITON_FLASH = "attn_impl=triton"


def attention_kernel_fraction(row: dict, gpu: str, notes: list[str]) -> float | None:
    """The row's fused attention kernel's fraction of peak where it is not SDPA's: MPT's Triton FlashAttention,
    at efficiency.json's `triton_flash_fwd_bwd_fraction` for the GPU (sourced for the A100 only)."""
    if TRITON_FLASH not in str(row.get("attention", "")):
        return None
    from planner.hardware.efficiency_data import efficiency_json

    entry = efficiency_json()["gpus"].get(gpu, {}).get("attention", {}).get("triton_flash_fwd_bwd_fraction")
    if entry is None:
        notes.append("Triton FlashAttention timed at SDPA's rate (no published rate on this GPU)")
        return None
    notes.append("Triton FlashAttention at its published rate (efficiency.json)")
    return float(entry["value"])


# ------------------------------------------------------------------------------------------------ predicting

#: The source whose rows gave `inductor.compiled_device_residual`: its fold predicts compiled steps without it.
RESIDUAL_SOURCE = "ml-engineering"


def predict(case: Case, speed_models: dict) -> float:
    """The case's published metric as the model predicts it, in its leave-one-source-out fold."""
    if not (case.cfg.compiled and case.group == RESIDUAL_SOURCE):
        return _predict(case, speed_models)
    with facts.overriding({"inductor.compiled_device_residual": 1.0}):
        return _predict(case, speed_models)


def speed_model_of(case: Case, speed_models: dict) -> SpeedModel:
    """The speed model of the case's model, sequence, GPU and program (one per distinct combination)."""
    key = (id(case.model), case.seq_len, case.gpu, case.per_node, case.attention, case.objective, case.nic_Gbps,
           case.attention_fraction, case.optimizer, case.adam_step)
    if key not in speed_models:
        gpu = lookup_gpu(case.gpu).model_copy(update={"nic_Gbps": case.nic_Gbps})
        workload = Workload(case.model, seq_len=case.seq_len, optimizer=case.optimizer, attention=case.attention,
                            gpu=gpu, objective=case.objective)
        speed_models[key] = SpeedModel(workload, gpu, case.per_node, adam_step=case.adam_step)
        if case.attention_fraction is not None:  # the row's own attention kernel, traced as SDPA's (same saves)
            model = speed_models[key]
            model.setup = replace(model.setup, eff=model.eff.model_copy(update={"attention": case.attention_fraction}))
    return speed_models[key]


def _predict(case: Case, speed_models: dict) -> float:
    t = speed_model_of(case, speed_models)(case.cfg)
    step = t.parts.compute if case.compute_only else t.step_time_s
    tokens = case.cfg.global_batch * case.seq_len
    if case.metric == "tokens_per_s_per_gpu":
        return tokens / step / case.cfg.world_size
    if case.metric in ("samples_per_s", "samples_per_s_total"):
        return case.cfg.global_batch / step
    if case.metric == "step_time_s":
        return step
    if case.metric == "mfu":
        return t.mfu * 100 * t.step_time_s / step
    raise Skip(f"metric {case.metric!r} not mapped")


def signed_error(case: Case) -> float:
    """predicted / published - 1, in time-like terms (positive = the model predicts a slower run)."""
    ratio = case.predicted / case.value
    return ratio - 1 if case.metric == "step_time_s" else 1 / ratio - 1


def load(kind: str, progress, speed_models: dict) -> tuple[list[Case], dict[str, int]]:
    """The set's rows interpreted and predicted, the speed models they need kept in `speed_models`
    (`speed_model_of`; its keys hold for as long as the returned cases keep their models)."""
    path = DATA / ("hf_throughput.json" if kind == "hf" else "throughput_calibration.json")
    data = json.loads(path.read_text())
    rows = data["rows"] if "rows" in data else data["cases"]
    cases, skipped, models = [], defaultdict(int), {}
    for i, row in enumerate(rows):
        progress(f"{kind} {i + 1}/{len(rows)} {row['id']}")
        try:
            case = interpret(row, kind, models)
            case.predicted = predict(case, speed_models)
            cases.append(case)
        except Skip as reason:
            skipped[str(reason)] += 1
        except ValueError as err:  # a combination the planner's Config refuses
            skipped[f"not a planner configuration: {str(err)[:80]}"] += 1
    return cases, dict(skipped)


# ------------------------------------------------------------------------------------------------ reporting

def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return (s[(n - 1) // 2] + s[n // 2]) / 2 if n else float("nan")


def kendall_tau(pairs: list[tuple[float, float]]) -> float:
    concordant = discordant = 0
    for i in range(len(pairs)):
        for j in range(i + 1, len(pairs)):
            product = (pairs[i][0] - pairs[j][0]) * (pairs[i][1] - pairs[j][1])
            concordant += product > 0
            discordant += product < 0
    total = concordant + discordant
    return (concordant - discordant) / total if total else float("nan")


def sweeps(cases: list[Case]) -> list[tuple[str, int, float]]:
    """llm-foundry's tables: rows of one model, GPU and GPU count, which differ in sequence length, micro-batch and
    checkpointing; Kendall's tau of predicted vs published tokens/s per GPU inside each."""
    groups = defaultdict(list)
    for c in cases:
        if c.group.startswith("llm-foundry") and c.metric == "tokens_per_s_per_gpu":
            groups[(c.model.spec.name, c.gpu, c.cfg.world_size)].append((c.predicted, c.value))
    return [(f"{k[0]} {k[1]} x{k[2]}", len(v), kendall_tau(v)) for k, v in sorted(groups.items()) if len(v) >= 3]


def line(label: str, errors: list[float], width: int = 30) -> str:
    abs_err = [abs(e) for e in errors]
    return (f"  {label:<{width}} {len(errors):>4}  median |err| {median(abs_err):6.1%}  worst {max(abs_err):6.1%}  "
            f"median signed {median(errors):+6.1%}")


BREAKDOWNS = {"source": lambda c: c.group, "gpu": lambda c: c.gpu, "precision": lambda c: c.cfg.precision,
              "checkpointing": lambda c: c.cfg.checkpointing,
              "engine": lambda c: f"{c.cfg.engine} zero{c.cfg.zero_stage}" if c.cfg.zero_stage else c.cfg.engine}


def report(title: str, cases: list[Case], skipped: dict[str, int], worst: int) -> list[str]:
    out = [f"\n{title}: {len(cases)} rows predicted, {sum(skipped.values())} skipped"]
    others = [c for c in cases if c.other_program]
    cases = [c for c in cases if not c.other_program]
    if not cases:
        return out
    errors = [signed_error(c) for c in cases]
    out.append(line("ALL (out-of-sample)", errors))
    for why in sorted({c.other_program for c in others}):
        out.append(line(f"apart: {why}", [signed_error(c) for c in others if c.other_program == why], width=30))
    for name, key in BREAKDOWNS.items():
        buckets = defaultdict(list)
        for c, e in zip(cases, errors):
            buckets[key(c)].append(e)
        out += [line(f"{name}={value}", es) for value, es in sorted(buckets.items())]
    out.append("  worst rows (err = predicted/published step time - 1):")
    for c in sorted(cases + others, key=lambda c: -abs(signed_error(c)))[:worst]:
        out.append(f"    {c.id:<40} {signed_error(c):+7.1%}  {c.cfg.label()}  {'; '.join(c.notes)}")
    out += [f"  skipped: {n} x {why}" for why, n in sorted(skipped.items(), key=lambda kv: -kv[1])]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", choices=("hf", "optimised", "all"), default="all")
    parser.add_argument("--worst", type=int, default=8)
    args = parser.parse_args()
    kinds = ("hf", "optimised") if args.set == "all" else (args.set,)

    def progress(text: str) -> None:
        sys.stderr.write(f"\r{text[:100]:<100}")
        sys.stderr.flush()

    lines = ["Leave-one-source-out: one speed-model constant comes from these rows (torch.compile's device residual, "
             f"from {RESIDUAL_SOURCE}); that source's fold predicts its compiled rows without it, every other fold as "
             "the full model does; all errors are out-of-sample."]
    record, planned = {}, []
    for kind in kinds:
        speed_models: dict = {}
        cases, skipped = load(kind, progress, speed_models)
        planned += [signed_error(c) for c in cases if not c.other_program]
        title = "HF model code (hf_throughput.json)" if kind == "hf" else \
            "Optimised stacks (throughput_calibration.json; their own model code, not HF's)"
        lines += report(title, cases, skipped, args.worst)
        record[kind] = [{"id": c.id, "group": c.group, "metric": c.metric, "published": c.value,
                         "predicted": c.predicted, "error": signed_error(c), "config": c.cfg.label(),
                         "notes": c.notes, "other_program": c.other_program} for c in cases]
        if kind == "hf":
            kernel_lines, record["kernel_times"] = kernel_times(cases, speed_models)
            lines += kernel_lines
        if kind == "optimised":
            taus = sweeps(cases)
            lines.append(f"\n  llm-foundry sweeps: median Kendall tau {median([t for _, _, t in taus]):+.2f} "
                         f"over {len(taus)} tables (>= 3 rows each)")
            lines += [f"    {name:<44} n={n:<3} tau {tau:+.2f}" for name, n, tau in taus]
            record["kendall_tau"] = [{"sweep": name, "rows": n, "tau": tau} for name, n, tau in taus]
    if len(kinds) > 1:
        lines += ["\nEvery published row of a program trainplan plans (both sets):", line("ALL (out-of-sample)", planned)]
    sys.stderr.write("\r" + " " * 100 + "\r")
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "throughput_accuracy.txt").write_text(text + "\n")
    (RESULTS / "throughput_accuracy.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
