"""What a plan is asked for: `PlanRequest` defines every input once (type, bounds, help, flag); the CLI's options are
generated from its fields and `plan()` validates through it. `MemoryRequest` does the same for `estimate_memory()`.
A validation failure becomes one InputError naming the flag to fix."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from planner.dataset import check_source
from planner.errors import InputError, TrainplanError
from planner.models.adapters import Adapter
from planner.vocab import (
    ADAPTER, ATTENTION, AUTO, AUTO_METHOD, CHECKPOINTING, COMPILE, DEFAULT_OPTIMIZER, DEFAULT_PRECISION,
    DEFAULT_SHARDING_ENGINE, ENGINE, LABELS_OBJECTIVE, LIGER, LR_SCALING, MEMORY_METHOD, NO_ADAPTER, NO_CHECKPOINTING,
    NO_OFFLOAD, OBJECTIVE, OFFLOAD, OPTIMIZER, PADDING, PRECISION, SDPA, SHARDING_ENGINES, TASK_CHOICES, AdapterMethod,
    Attention, Checkpointing, CompileMode, LigerMode, LRScaling, MemoryMethod, Objective, Offload, Optimizer, Precision,
    SPLIT_OFF, ShardingEngine, TaskChoice, choices_text,
)


@dataclass(frozen=True)
class Limits:
    """Sane upper bounds on sizes: beyond them a value is a typo, and planning it would take forever (the number of
    micro-batch splits grows with the batch's divisors)."""

    batch: int = 2**24              # 16.7M samples per optimizer step (real LLM batches are 10^3-10^4 samples)
    gpus_per_node: int = 128        # the largest NVLink domains (e.g. 72-GPU racks) fit
    nodes: int = 16_384
    world_size: int = 2**17         # 131,072 GPUs in all
    seq_len: int = 2**21            # 2M tokens
    host_memory_gb: float = 2**20   # 1 PB of RAM per node
    nic_gbps: float = 10_000.0      # per GPU; today's fastest NICs run 800 Gb/s


LIMITS = Limits()
#: `offload` value that lets the search choose (the library also takes True for it and False for "none")
ANY_OFFLOAD = AUTO


def option(default: Any = None, *, help: str, flag: str | None = None, cli: bool = True, scale: float | None = None,
           **bounds) -> Any:
    """A request field: its help text and, where it is not `--field-name`, its CLI flag ("--batch,-b"); `cli=False`
    keeps it out of the CLI; `scale` multiplies the CLI's value into the field's unit (GB -> bytes)."""
    extra = {key: value for key, value in (("flag", flag), ("cli", cli), ("scale", scale)) if value is not None}
    return Field(default, description=help, json_schema_extra=extra or None, **bounds)


def flag_of(model: type[BaseModel], field: str) -> str:
    """The CLI flag a user types for `field` of `model` (the library's keyword where the CLI has none)."""
    info = model.model_fields.get(field)
    extra = (info.json_schema_extra or {}) if info else {}
    return str(extra.get("flag", "--" + field.replace("_", "-"))).split(",")[0]


def as_flags(changes: dict[str, Any]) -> str:
    """PlanRequest field values as the CLI flags that give them ("--gpu A100-80GB --peft qlora"), in the CLI's unit."""
    words = []
    for field, value in changes.items():
        extra = PlanRequest.model_fields[field].json_schema_extra or {}
        scale = extra.get("scale")
        words.append(f"{flag_of(PlanRequest, field)} {value / scale:g}" if scale else f"{flag_of(PlanRequest, field)} "
                     f"{value}")
    return " ".join(words)


class _Request(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    @classmethod
    def of(cls, **fields):
        """A validated request; the first problem becomes an InputError naming its flag."""
        try:
            return cls(**fields)
        except ValidationError as err:
            raise input_error(cls, err.errors()[0]) from None


class PlanRequest(_Request):
    """One plan: the job, the hardware, what may be pinned, the run, the learning rate. Field docs are the flags'
    help."""

    model: Any = option(help="Hub id, local folder with config.json, or a bundled preset.", flag="--model,-m")
    global_batch: int = option(help="Global batch size (samples per optimizer step).", flag="--batch,-b", gt=0,
                               le=LIMITS.batch, strict=True)
    seq_len: int | None = option(help="Training sequence length (default: the model's, at most 2048).", gt=0,
                                 le=LIMITS.seq_len, strict=True)
    gpu: str | None = option(help="GPU model, e.g. A100-80GB (default: detected, else the reference A100-80GB).")
    gpus_per_node: int | None = option(help="GPUs per node (default: detected count, else 1).", gt=0,
                                       le=LIMITS.gpus_per_node, strict=True)
    nodes: int = option(1, help="Number of nodes.", gt=0, le=LIMITS.nodes, strict=True)
    optimizer: Optimizer = option(DEFAULT_OPTIMIZER, help=choices_text(OPTIMIZER))
    precision: Literal[(AUTO, *PRECISION)] = option(AUTO, help=choices_text({AUTO: None, **PRECISION}))  # type: ignore[valid-type]
    micro_batch: int | None = option(help="Pin the micro-batch size.", gt=0, le=LIMITS.batch, strict=True)
    checkpointing: Checkpointing | None = option(help="Pin activation checkpointing: " + choices_text(CHECKPOINTING))
    zero_stage: int | None = option(help="Pin the sharding stage (ZeRO numbering, 0-3).", ge=0, le=3, strict=True)
    attention: Attention = option(SDPA, help=choices_text(ATTENTION))
    engine: ShardingEngine = option(DEFAULT_SHARDING_ENGINE, help="Engine for sharded candidates: "
                                    + choices_text(SHARDING_ENGINES)
                                    + " (FSDP2: stage 2 = SHARD_GRAD_OP, 3 = FULL_SHARD).")
    offload: Literal[(ANY_OFFLOAD, *OFFLOAD)] = option(  # type: ignore[valid-type]
        ANY_OFFLOAD, help="CPU offload: auto (the search chooses) | " + choices_text(OFFLOAD))
    headroom: float | None = option(help="Fraction of GPU memory kept free (default 0.05).", ge=0.0, lt=0.9,
                                    allow_inf_nan=False)
    host_memory: int | None = option(help="Host RAM per node in GB, for CPU offload (default: this machine's when "
                                          "planning for its GPU, else that of the GPU's usual system, which the "
                                          "output names: 2,000 GB for an 8 x A100-80GB node).", scale=1e9, gt=0,
                                     le=int(LIMITS.host_memory_gb * 1e9))
    nic_gbps: float | None = option(help="Inter-node bandwidth per GPU in Gb/s, for plans over several nodes (default: "
                                         "the GPU's usual system, e.g. 200 for DGX A100; AWS p4d's EFA: 50).", gt=0,
                                    le=LIMITS.nic_gbps, allow_inf_nan=False, strict=True)
    lr: float | None = option(help="Base learning rate, tuned at --lr-batch.", gt=0, allow_inf_nan=False)
    lr_batch: int | None = option(help="Batch the base LR was tuned at (default: micro-batch x GPUs).", gt=0,
                                  le=LIMITS.batch, strict=True)
    lr_scaling: LRScaling = option(AUTO, help=choices_text(LR_SCALING))
    memory_method: MemoryMethod = option(AUTO_METHOD, help=choices_text(MEMORY_METHOD))
    trust_remote_code: bool = option(False, help="Allow the model's own code (auto_map) to run.")
    task: TaskChoice = option(AUTO, help="The head to train: auto (the config's architectures[0]), "
                              + ", ".join(TASK_CHOICES[1:]) + ".")
    num_labels: int | None = option(help="Labels of a classification head (--task seq-cls or token-cls).", gt=0,
                                    le=1_000_000, strict=True)
    peft: AdapterMethod = option(NO_ADAPTER, help="Train adapters over the frozen model: " + choices_text(ADAPTER))
    lora_rank: int | None = option(help="LoRA rank r (default 16).", gt=0, le=4096, strict=True)
    lora_alpha: float | None = option(help="LoRA alpha (default 2 x rank).", gt=0, allow_inf_nan=False)
    lora_targets: str | None = option(help="all-linear (default) or module names, e.g. q_proj,v_proj.")
    lora_dropout: float | None = option(help="LoRA dropout (default 0.05).", ge=0.0, lt=1.0)
    double_quant: bool = option(True, help="QLoRA: quantise the 4-bit blocks' constants too (bitsandbytes' double "
                                           "quantisation).", flag="--double-quant/--no-double-quant")
    adapter: Any = option(help="A planner.Adapter (the library's alternative to --peft and --lora-*).", cli=False)
    train_tokens: float | None = option(help="Tokens of the whole run: sizes the LR warmup; with --compare-gpus, the "
                                             "run's time (and cost with --price).", gt=0, allow_inf_nan=False)
    train_steps: int | None = option(help="Optimizer steps of the whole run (sizes the LR warmup; or give "
                                          "--train-tokens).", gt=0, le=LIMITS.batch, strict=True)
    compile: CompileMode = option(AUTO, help="torch.compile the model: " + choices_text(COMPILE)
                                  + ". auto compiles where it is faster over the run (give its length).")
    liger: LigerMode = option(AUTO, help="Liger-Kernel's Triton kernels (the Trainer's use_liger_kernel): "
                              + choices_text(LIGER) + ". auto weighs them where liger-kernel is installed here.")
    tensor_parallel: str = option(AUTO, help="Split each layer across N GPUs of a node (transformers' tensor-parallel "
                                  "plan, with FSDP2 over the rest): auto (weighed where the model has a plan), off, "
                                  "or N.")
    context_parallel: str = option(AUTO, help="Split each sequence across N GPUs by ring attention (accelerate's "
                                   "cp_size, FSDP2): auto (weighed from 16,384 tokens), off, or N.")
    sequence_parallel: str = option(AUTO, help="Split each sequence across N GPUs by DeepSpeed's Ulysses all-to-alls "
                                    "(accelerate's sp_size): auto (weighed from 16,384 tokens), off, or N.")
    receipts: str | None = option(help="A receipt.json or a folder of them (a team's runs) to calibrate speeds on this "
                                       "GPU with, beside the receipts in the cache (docs/receipts.md).",
                                  flag="--receipts")
    use_receipts: bool = option(True, help="Calibrate with the receipts earlier runs left in the cache.",
                                flag="--cached-receipts/--no-cached-receipts")
    dataset: str | None = option(help="Your training data (JSON lines, JSON, CSV, Parquet, a save_to_disk folder, or a "
                                      "hub dataset in the local cache): plans for its sample lengths and batching.")
    text_field: str | None = option(help="The dataset's text column (default: a chat 'messages' column rendered by "
                                         "the tokenizer's chat template, else 'text'); a pre-tokenised "
                                         "'input_ids' column is counted as it is.")
    tokenizer: str | None = option(help="Tokenizer folder or cached hub id for --dataset (default: the model's; none "
                                        "for a pre-tokenised set).")
    max_length: int | None = option(help="Truncate --dataset's samples to this many tokens (default: the model's "
                                         "maximum).", gt=0, le=LIMITS.seq_len, strict=True)
    epochs: float | None = option(help="Passes over --dataset: the run's length when --train-steps and "
                                       "--train-tokens are not given (default 1).", gt=0, allow_inf_nan=False)
    dataset_rows: int | None = option(help="Rows of --dataset tokenised at most: a seeded sample of a larger set "
                                           "(default 20,000).", gt=0, le=10**7, strict=True)
    padding: Literal[(AUTO, *PADDING)] = option(AUTO, help="How --dataset's samples are batched: auto (the fastest in "  # type: ignore[valid-type]
                                                "tokens of data per second) | " + choices_text(PADDING))

    @field_validator("model")
    @classmethod
    def _model(cls, value):
        if value is None or (isinstance(value, str) and not value.strip()):
            raise InputError("is required", flag="--model", hint="e.g. --model bigscience/bloom-560m",
                             changes={"model": "bigscience/bloom-560m"})
        return value.strip() if isinstance(value, str) else value

    @field_validator("offload", mode="before")
    @classmethod
    def _offload(cls, value):
        return {True: ANY_OFFLOAD, False: NO_OFFLOAD}.get(value, value) if isinstance(value, bool) else value

    @field_validator("tensor_parallel", "context_parallel", "sequence_parallel", mode="before")
    @classmethod
    def _split(cls, value, info):
        text = str(value).strip().lower()
        if text in (AUTO, SPLIT_OFF) or (text.isdigit() and 1 <= int(text) <= LIMITS.world_size):
            return SPLIT_OFF if text == "1" else text
        raise InputError(f"{value!r} is not auto, off or a number of GPUs", flag=flag_of(cls, info.field_name),
                         hint="e.g. 4: each sequence split across 4 GPUs.")

    @field_validator("task", mode="before")
    @classmethod
    def _task(cls, value):
        return AUTO if value is None else value

    @model_validator(mode="after")
    def _together(self) -> "PlanRequest":
        if self.gpus_per_node is not None and self.gpus_per_node * self.nodes > LIMITS.world_size:
            raise InputError(f"{self.gpus_per_node * self.nodes} GPUs in all is above the supported "
                             f"{LIMITS.world_size:,}", flag="--nodes")
        if self.lr is not None and self.lr_batch is None:
            raise InputError("needs the batch the learning rate was tuned at", flag="--lr-batch",
                             hint=f"A recipe's LR: --lr-batch <the recipe's global batch> (--lr-batch "
                                  f"{self.global_batch} keeps it as given); an LR tuned at micro-batch x GPUs: that "
                                  "product (it is then scaled by sqrt(k) or k).",
                             changes={"lr_batch": self.global_batch})
        given = next((flag_of(PlanRequest, f) for f in DATASET_FIELDS if getattr(self, f) not in (None, AUTO)), None)
        if given and self.dataset is None:
            raise InputError("applies to --dataset", flag=given, hint="Add --dataset FILE.")
        if self.dataset is not None:
            check_source(self.dataset)  # a missing file is said before the model or the data loads
        if self.dataset is not None and self.seq_len is not None:
            raise InputError("cannot be combined with --dataset: the data's lengths set the sequence", flag="--seq-len",
                             hint="Drop --seq-len; --max-length truncates the samples.", changes={"seq_len": None})
        if self.train_tokens is not None and self.train_steps is not None:
            raise InputError("give the run's length once", flag="--train-steps",
                             hint="Drop --train-steps or --train-tokens.", changes={"train_steps": None})
        self.resolved_adapter()  # LoRA flags without --peft, or both an adapter and --peft
        return self

    def split_sizes(self, field: str) -> int | None:
        """A pinned sequence split (--context-parallel / --sequence-parallel N), else None (auto or off)."""
        value = getattr(self, field)
        return int(value) if value.isdigit() else None

    def resolved_adapter(self) -> Adapter | None:
        """The LoRA / QLoRA adapter asked for, or None; LoRA flags without --peft are an InputError."""
        lora = {"--lora-rank": self.lora_rank, "--lora-alpha": self.lora_alpha, "--lora-targets": self.lora_targets,
                "--lora-dropout": self.lora_dropout, "--no-double-quant": None if self.double_quant else False}
        if self.adapter is not None:
            if self.peft != NO_ADAPTER or any(value is not None for value in lora.values()):
                raise InputError("give the adapter once", flag="--peft",
                                 hint="Pass adapter=Adapter(...) or peft=... with its lora_* settings, not both.")
            if not isinstance(self.adapter, Adapter):
                raise InputError(f"adapter must be a planner.Adapter, got {type(self.adapter).__name__}",
                                 flag="--peft")
            return self.adapter
        if self.peft == NO_ADAPTER:
            given = next((flag for flag, value in lora.items() if value is not None), None)
            if given:
                method = "qlora" if given == "--no-double-quant" else "lora"
                raise InputError("applies to adapters", flag=given, hint=f"Add --peft {method}"
                                 + (" (or --peft qlora)." if method == "lora" else "."), changes={"peft": method})
            return None
        if not self.double_quant and not ADAPTER[self.peft].quantized_base:
            raise InputError("applies to QLoRA's 4-bit base", flag="--no-double-quant", hint="Add --peft qlora.",
                             changes={"peft": "qlora"})
        fields = {"rank": self.lora_rank, "alpha": self.lora_alpha, "dropout": self.lora_dropout,
                  "targets": Adapter.parse_targets(self.lora_targets) if self.lora_targets is not None else None}
        return Adapter(method=self.peft, double_quant=self.double_quant,
                       **{k: v for k, v in fields.items() if v is not None})

    @property
    def world_size(self) -> int | None:
        """GPUs in all, where the GPUs per node are given."""
        return None if self.gpus_per_node is None else self.gpus_per_node * self.nodes


#: PlanRequest fields a plan of one configuration does not need to predict it again: the model (given apart), the
#: configuration's own (`Config.request_fields` pins them), the data, the receipts, the learning rate, an adapter object.
NOT_PREDICTION_FIELDS = frozenset({
    "model", "micro_batch", "precision", "checkpointing", "zero_stage", "engine", "offload", "compile", "liger",
    "tensor_parallel", "context_parallel", "sequence_parallel", "padding", "dataset", "text_field", "tokenizer",
    "max_length", "epochs", "dataset_rows", "receipts", "use_receipts", "lr", "lr_batch", "lr_scaling", "adapter"})


def prediction_request(request: PlanRequest) -> dict | None:
    """The keyword arguments of `planner.plan` besides a configuration's own that predict as `request` did (None for
    a model given as an object, a local folder (a receipt names no path) or a dataset's plan (its lengths are the
    data's): today's planner cannot plan those again from a receipt)."""
    model = request.model
    if not isinstance(model, str) or request.dataset is not None or request.adapter is not None \
            or os.path.isdir(os.path.expanduser(model)):
        return None
    return {"model": model, **{field: getattr(request, field) for field in PlanRequest.model_fields
                               if field not in NOT_PREDICTION_FIELDS}}


#: PlanRequest fields that only mean something with --dataset
DATASET_FIELDS = ("text_field", "tokenizer", "max_length", "epochs", "dataset_rows", "padding")


class MemoryRequest(_Request):
    """One configuration's memory (`estimate_memory`): the model and its workload, the configuration, the device."""

    model: Any = option(help="Hub id, local folder with config.json, a bundled preset, a PretrainedConfig or a module.",
                        flag="--model")
    micro_batch: int = option(1, help="Samples per GPU per forward/backward.", gt=0, le=LIMITS.batch, strict=True)
    seq_len: int | None = option(help="Sequence length (default: the model's).", gt=0, le=LIMITS.seq_len, strict=True)
    precision: Precision = option(DEFAULT_PRECISION, help=choices_text(PRECISION))
    optimizer: Optimizer = option(DEFAULT_OPTIMIZER, help=choices_text(OPTIMIZER))
    checkpointing: Checkpointing = option(NO_CHECKPOINTING, help=choices_text(CHECKPOINTING))
    zero_stage: int = option(0, help="Sharding stage (ZeRO numbering, 0-3).", ge=0, le=3, strict=True)
    offload: Offload = option(NO_OFFLOAD, help=choices_text(OFFLOAD))
    world_size: int = option(1, help="Data-parallel GPUs.", gt=0, le=LIMITS.world_size, strict=True)
    gpus_per_node: int | None = option(help="GPUs per node.", gt=0, le=LIMITS.gpus_per_node, strict=True)
    attention: Attention = option(SDPA, help=choices_text(ATTENTION))
    device: Literal["cuda", "cpu"] = option("cuda", help="cuda: a GPU process; cpu: the tensor bytes of a CPU run.")
    gpu: str | None = option(help="A catalog GPU: its attention kernel and CUDA overheads.")
    grad_accum: int = option(1, help="Micro-batches per optimizer step.", gt=0, le=LIMITS.batch, strict=True)
    method: MemoryMethod = option(AUTO_METHOD, help=choices_text(MEMORY_METHOD), flag="--memory-method")
    trust_remote_code: bool = option(False, help="Allow the model's own code (auto_map) to run.")
    engine: Literal[tuple(ENGINE)] | None = option(help="torch, deepspeed or fsdp (default: torch at stage 0, "  # type: ignore[valid-type]
                                                        "deepspeed above).")
    objective: Objective = option(LABELS_OBJECTIVE, help=choices_text(OBJECTIVE))
    task: TaskChoice | None = option(help="The head to train (default: the config's).")
    num_labels: int | None = option(help="Labels of a classification head.", gt=0, le=1_000_000, strict=True)
    adapter: Any = option(help="A planner.Adapter: LoRA or QLoRA over the frozen model.")


#: pydantic's error types -> what went wrong, in words (the flag is added by `_input_error`)
_MESSAGES = {
    "int_type": "must be an integer, got {input!r}", "int_parsing": "must be an integer, got {input!r}",
    "int_from_float": "must be an integer, got {input!r}", "float_type": "must be a number, got {input!r}",
    "float_parsing": "must be a number, got {input!r}", "finite_number": "must be a finite number, got {input!r}",
    "bool_type": "must be true or false, got {input!r}", "string_type": "must be text, got {input!r}",
    "literal_error": "unknown value {input!r}", "extra_forbidden": "is not an input trainplan knows",
    "missing": "is required",
}


def input_error(model: type[BaseModel], error: dict) -> TrainplanError:
    field = str(error["loc"][0]) if error["loc"] else "input"
    flag = flag_of(model, field) if field in model.model_fields else field
    kind, value, ctx = error["type"], error.get("input"), error.get("ctx") or {}
    if kind == "literal_error":
        return InputError(f"unknown value {value!r}", flag=flag, hint=f"Use one of {ctx.get('expected', '')}.")
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        return _bound_error(kind, value, ctx, flag)
    message = _MESSAGES.get(kind, error["msg"]).format(input=value)
    return InputError(message, flag=flag)


def _bound_error(kind: str, value, ctx: dict, flag: str) -> InputError:
    bound = next(iter(ctx.values()), None)
    if kind in ("less_than", "less_than_equal") and isinstance(bound, (int, float)) and bound > 1:
        shown = f"{bound:,}" if isinstance(bound, int) else f"{bound:,g}"
        return InputError(f"{value} is above the supported {shown}", flag=flag,
                          hint=f"trainplan plans for at most {shown}; check the value.")
    if kind == "greater_than" and bound == 0:
        what = "integer" if isinstance(value, int) else "number"
        return InputError(f"must be a positive {what}, got {value!r}", flag=flag)
    words = {"greater_than": "above", "greater_than_equal": "at least", "less_than": "below",
             "less_than_equal": "at most"}[kind]
    return InputError(f"must be {words} {bound}, got {value!r}", flag=flag)
