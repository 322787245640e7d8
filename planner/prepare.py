"""A plan read back from `plan --emit`'s folder, applied in the user's own training script:

    from planner import load_plan
    plan = load_plan("run/plan.json")
    model = plan.prepare(model)          # what Trainer arguments cannot say
    args = plan.training_arguments()     # a transformers.TrainingArguments from training_args.json

The folder's files name each other by file name; paths read from them are resolved against the folder, so the
folder may be copied to another machine and read from any directory.

`prepare` checks the model has the head the plan was made for, and applies the attention implementation the plan was
made for, the parameter dtype (bf16-true trains 16-bit weights with no autocast), LoRA / QLoRA adapters through peft
(`bnb_config()` gives the BitsAndBytesConfig to load a QLoRA base with) and the checkpointing policy (selective is
the per-op policy the memory model traced, planner.program.step; the Trainer's `gradient_checkpointing` flag can only
say "full"). Under FSDP, full checkpointing is FSDP's own (the accelerate config says so), so `prepare` leaves it to
FSDP.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from planner.config import Config
from planner.errors import InputError
from planner.export import CHECKPOINTING_ARGS, DEEPSPEED_ARG, checkpointing_arg
from planner.cpu_trial import cpu_trial, fp32_line
from planner.hardware.cpu import native_cpu_dtype
from planner.models.adapters import Adapter, apply_adapter, with_task
from planner.dataset import load_tokenizer
from planner.models import resolve_model
from planner.models.build import effective_attention, model_class, moe_block_classes
from planner.memory.estimate import MemoryEstimate
from planner.program.step import enable_checkpointing
from planner.receipts import DEFAULT_WARMUP, Meter
from planner.speed.step import ThroughputInfo
from planner.train_data import collator, train_rows
from planner.uncertainty import NO_MARGIN
from planner.vocab import (
    ATTENTION, CHECKPOINTING, CLASS_LABELS, DEEPSPEED, FSDP, OPTIMIZER, PACKAGE, PACKING, PADDING_FREE, PRECISION, TASK,
    TOKEN_LABELS, TP_PLAN_AUTO,
)

TRAINING_ARGS = "training_args.json"
#: training_args.json's values that are paths, relative to the folder (the DeepSpeed config, the Trainer's output)
PATH_ARGS = (DEEPSPEED_ARG, "output_dir")
#: accelerate's variable for the DeepSpeed config file, which it sets from accelerate_config.yaml as written
#: (accelerate/utils/launch.py:581-582) and opens from the current directory (accelerate/utils/dataclasses.py:1265)
DEEPSPEED_CONFIG_ENV = "ACCELERATE_DEEPSPEED_CONFIG_FILE"
log = logging.getLogger("planner")


@dataclass(frozen=True)
class LoadedChoice:
    """plan.json's chosen configuration, shaped as `plan().choice` is: its Config, memory estimate and speed."""

    config: Config
    memory: MemoryEstimate | None
    throughput: ThroughputInfo | None

    @classmethod
    def of(cls, data: dict) -> "LoadedChoice":
        choice, memory, speed = data["choice"], data.get("memory"), data.get("throughput")
        margin = (memory or {}).get("margin") or {}
        return cls(config=Config(**{name: choice[name] for name in Config.model_fields if name in choice}),
                   memory=MemoryEstimate(**{"device": "cuda", **memory}, margin_basis=margin.get("basis", NO_MARGIN),
                                         margin_rows=margin.get("rows", 0)) if memory else None,
                   throughput=ThroughputInfo(**speed) if speed else None)


class LoadedPlan:
    """plan.json and its folder: the chosen configuration and what it takes to train it."""

    def __init__(self, data: dict, folder: Path | None, training_args: dict | None = None):
        """`data`: plan.json's; `folder`: where its files are (None for a plan in memory, whose `training_args` are
        then given)."""
        self.data, self.folder, self._training_args = data, folder, training_args
        self.choice = LoadedChoice.of(data)
        self.config = self.choice.config
        self.cpu_changes: list[str] = []  # what a CPU trial of the plan turned off (`cpu_trial`), a line each

    @property
    def model_name(self) -> str:
        """The model's hub id or preset name, or its local folder as found from this plan's folder."""
        if self.data["model"].get("source") == "folder":
            return self.local_path("model", self.data["model"]["name"])
        return self.data["model"]["name"]

    @property
    def dataset_source(self) -> str | None:
        """The dataset the plan was made for (`plan --dataset`): a file or folder as found from this plan's folder,
        or a hub id; None for a plan made without one."""
        source = (self.data.get("dataset") or {}).get("source")
        return self.local_path("dataset", source) if source else None

    def local_path(self, kind: str, given: str) -> str:
        """A local path the plan names (`kind`: model, dataset or tokenizer): where plan.json's `paths` say it is
        (relative to this folder, else its absolute path when the plan was emitted), else `given` as it is."""
        where = (self.data.get("paths") or {}).get(kind)
        if not where or self.folder is None:
            return given
        candidates = [os.path.normpath(self.folder / where["relative"]), where["absolute"]]
        found = next((path for path in candidates if os.path.exists(path)), None)
        if found is None:
            raise InputError(f"the plan's {kind} {given} is in neither {candidates[0]} nor {candidates[1]}",
                             flag=f"--{kind}", hint=f"Copy the {kind} there, or plan again with its new path.")
        return found

    @property
    def seq_len(self) -> int:
        return int(self.data["model"]["seq_len"])

    @property
    def attention(self) -> str:
        return self.data["attention"]

    @property
    def optimizer(self) -> str:
        return self.data["optimizer"]

    @property
    def adapter(self):
        """The LoRA / QLoRA adapter planned (planner.models.adapters.Adapter), or None."""

        return Adapter.from_json(self.data["model"].get("adapter"))

    def model_config(self, config):
        """`config` as the plan's model: its head class and labels where the plan asked for another head
        (`plan --task`), as `plan` built it."""

        model = self.data["model"]
        own = (getattr(config, "architectures", None) or [None])[0]
        task = model["task"] if model.get("architecture") and model["architecture"] != own else None
        classifier = model["task"] in TASK and TASK[model["task"]].labels in (CLASS_LABELS, TOKEN_LABELS)
        return with_task(config, task, (model.get("num_labels") or None) if classifier else None)

    def create_optimizer(self, model):
        """The plan's optimizer where the Trainer has no name for it (LAMB: bitsandbytes' `LAMB`), for
        `Trainer(..., optimizers=(plan.create_optimizer(model), None))`; None where training_args.json names it."""

        info = OPTIMIZER[self.optimizer]
        if info.client is None:
            return None
        import importlib

        module, name = info.client.rsplit(".", 1)
        try:
            cls = getattr(importlib.import_module(module), name)
        except ImportError as err:
            raise InputError(f"{self.optimizer} needs {module.split('.')[0]}", flag="--optimizer",
                             hint=PACKAGE[info.package].install if info.package else None) from err
        import dataclasses

        from transformers import TrainingArguments

        # training_args.json with the Trainer's own defaults for what it leaves out (no --lr: no learning_rate)
        args = {f.name: f.default for f in dataclasses.fields(TrainingArguments)} | self.training_arguments_dict()
        params = [p for p in model.parameters() if p.requires_grad]
        return cls(params, lr=args["learning_rate"], betas=(args["adam_beta1"], args["adam_beta2"]),
                   eps=args["adam_epsilon"], weight_decay=args["weight_decay"])

    def from_pretrained_kwargs(self) -> dict:
        """What `AutoModelFor...from_pretrained(name, **kwargs)` needs for this plan: transformers' tensor-parallel
        plan for a TP plan (it shards the weights as it loads them, under the launcher's processes), the
        BitsAndBytesConfig for QLoRA (left out on a machine without CUDA, whose trial trains the adapters over the
        16-bit base: bitsandbytes' 4-bit kernels need a GPU)."""
        kwargs = {}
        if self.config.tensor_parallel > 1:
            kwargs["tp_plan"] = TP_PLAN_AUTO
        bnb = self.bnb_config() if _cuda() else None
        if self.bnb_config() is not None and bnb is None:
            log.warning("CPU trial: the 4-bit base is off (bitsandbytes' kernels need a GPU): LoRA over a 16-bit base")
        if bnb is not None:
            kwargs["quantization_config"] = bnb
        return kwargs

    def load_model(self, trust_remote_code: bool = False):
        """The plan's model with its pretrained weights and head (`from_pretrained` with `from_pretrained_kwargs()`).
        Build the training arguments first: under ZeRO-3 they make DeepSpeed partition the weights as they load."""
        config = self.model_config(resolve_model(self.model_name, trust_remote_code=trust_remote_code).config)
        cls = model_class(config, trust_remote_code)
        return cls.from_pretrained(self.model_name, config=config, trust_remote_code=trust_remote_code,
                                   **self.from_pretrained_kwargs())

    def tokenizer(self, name: str | None = None):
        """A fast tokenizer, loaded offline: `name`, else the one the plan read its dataset with, else the model's."""
        data = self.data.get("dataset") or {}
        planned = self.local_path("tokenizer", data["tokenizer"]) if data.get("tokenizer") else self.model_name
        return load_tokenizer(name or planned)

    def train_dataset(self, tokenizer, source: str | None = None, text_field: str | None = None):
        """`source` (else the plan's dataset) as training rows: tokenised, cut at the plan's maximum length, packed
        where the plan packs (planner/train_data.py). Needs the `data` extra, and TRL to pack."""
        data = self.data.get("dataset") or {}
        source = source or self.dataset_source
        if source is None:
            raise InputError("the plan was made without a dataset and none was given", flag="--dataset",
                             hint="Pass the data file or folder to train on.")
        return train_rows(source, tokenizer, text_field=text_field or data.get("text_field"),
                          max_length=data.get("max_length") or self.seq_len, padding=self.config.padding,
                          row_length=data.get("row_length") or self.seq_len)

    def data_collator(self, tokenizer):
        """The collator for `train_dataset`'s rows, batched as the plan chose (planner/train_data.py)."""
        return collator(tokenizer, self.config.padding)

    def bnb_config(self):
        """A transformers BitsAndBytesConfig to load a QLoRA plan's base with (None otherwise):
        `AutoModelFor...from_pretrained(name, quantization_config=plan.bnb_config())`."""
        adapter = self.adapter
        if adapter is None or not adapter.quantized:
            return None
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(**adapter.bnb_kwargs(self.config.half_dtype() or "bfloat16"))

    def prepare(self, model):
        """Apply to `model` what the plan assumed and the Trainer's arguments cannot express; returns the model
        (a peft PeftModel for LoRA / QLoRA plans)."""

        cfg = self.config
        self._check_head(model)
        if cfg.tensor_parallel > 1 and (getattr(model, "tp_size", None) or 1) != cfg.tensor_parallel:
            raise InputError(f"the plan splits each layer across {cfg.tensor_parallel} GPUs, and this model is not "
                             "split so", flag="--plan", hint="Load it with from_pretrained(..., "
                             "**plan.from_pretrained_kwargs()) under accelerate launch, then prepare it.")
        kernel = ATTENTION[effective_attention(model.config, self.attention)].transformers
        if getattr(model.config, "_attn_implementation", None) != kernel and hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(kernel)
        if PRECISION[cfg.precision].tf32:  # for a loop of the user's own; TrainingArguments(tf32=True) does the same
            import torch

            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        if PRECISION[cfg.precision].weight_bytes < 4 and not cfg.sharded:
            import torch

            if self.trial_half_dtype():
                model = model.to(torch.bfloat16)
            else:
                log.warning("CPU trial: %s", fp32_line("bf16 weights", "bfloat16"))
        ckpt = CHECKPOINTING[cfg.checkpointing]
        if ckpt.enabled and not (cfg.engine == FSDP and not ckpt.per_op_policy):
            enable_checkpointing(model, cfg.checkpointing)
        if cfg.engine == DEEPSPEED and cfg.zero_stage == 3:
            _moe_leaves(model)
        return self._with_adapter(model)

    def _check_head(self, model) -> None:
        """The plan's memory and speed are those of its head class: another head is a different program."""
        planned = self.data["model"].get("architecture")
        got = type(getattr(model, "get_base_model", lambda: model)()).__name__
        if planned and got != planned:
            raise InputError(f"the plan was made for {planned}, this model is a {got}", flag="--task",
                             hint=f"Load the model as {planned}, or plan again with the head you train.")

    def _with_adapter(self, model):
        """LoRA / QLoRA as planned: peft's adapters on the plan's targets, with the frozen base in the 16-bit compute
        dtype and the adapters in fp32 under mixed precision (as the memory model traced it)."""
        adapter = self.adapter
        if adapter is None or hasattr(model, "peft_config"):  # full fine-tuning, or adapters the user added already
            return model
        import torch

        half = self.trial_half_dtype()
        return apply_adapter(model, adapter, self.data["model"]["task"], getattr(torch, half) if half else None)

    def trial_half_dtype(self) -> str | None:
        """The plan's 16-bit dtype (Config.half_dtype) as this machine runs it: None (fp32) on a machine without CUDA
        whose CPU lacks native instructions for it (planner/hardware/cpu.py), where emulation is tens of times
        slower; the plan's files keep their precision."""
        half = self.config.half_dtype()
        return half if half is None or _cuda() or native_cpu_dtype(half) else None

    def training_arguments_dict(self, **overrides) -> dict:
        """training_args.json with its paths resolved against the folder, then `overrides` applied; the checkpointing
        arguments under the names the installed transformers takes (an older file, or overrides, may use either)."""
        if self._training_args is not None:
            data = dict(self._training_args)
        else:
            data = json.loads((self.folder / TRAINING_ARGS).read_text())
            for key in PATH_ARGS:
                if isinstance(data.get(key), str):
                    data[key] = str(self.folder / Path(data[key]).expanduser())  # an absolute path stays as it is
        args = _current_names(data) | _current_names(overrides)
        if args.get("use_cpu") or not _cuda():
            args, self.cpu_changes = cpu_trial(args, float8=self.float8)
            for line in self.cpu_changes:
                log.warning("CPU trial: %s", line)
        return args

    def sft_config(self, **overrides):
        """TRL's SFTConfig for the plan: the Trainer's arguments, the rows' max_length, and packing or padding-free
        batches where the plan chose them (trl/trainer/sft_config.py). Needs TRL (the `trl` extra)."""
        try:
            from trl import SFTConfig
        except ImportError as err:
            raise InputError("plan.sft_config() needs TRL", flag="--dataset", hint=PACKAGE["trl"].install) from err
        padding = self.data["choice"].get("padding")
        fields = {"max_length": self.seq_len, "packing": padding == PACKING, "padding_free": padding == PADDING_FREE}
        return self._with_mixed_precision(SFTConfig(**(self.training_arguments_dict() | fields | overrides)))

    def training_arguments(self, **overrides):
        """A transformers.TrainingArguments built from training_args.json, with `overrides` applied."""
        from transformers import TrainingArguments

        return self._with_mixed_precision(TrainingArguments(**self.training_arguments_dict(**overrides)))

    @property
    def float8(self) -> bool:
        return PRECISION[self.data["choice"]["precision"]].float8

    def _with_mixed_precision(self, args):
        """The arguments' `mixed_precision`, which TrainingArguments reads from ACCELERATE_MIXED_PRECISION (the
        accelerate config's) unless fp16 or bf16 is set (training_args.py:1614-1618) and hands to the Accelerator
        (trainer.py:744): a float8 plan's fp8 on a GPU (TrainingArguments has no fp8 flag); "no" on a CPU trial that
        runs fp32 (`cpu_trial`), where the config's bf16 would otherwise come back."""
        if self.float8 and not args.use_cpu:
            args.mixed_precision = PRECISION[self.data["choice"]["precision"]].accelerate
        elif args.use_cpu and not (args.bf16 or args.fp16):
            args.mixed_precision = "no"
        return args

    def callback(self, folder=None, *, warmup: int = DEFAULT_WARMUP, cache: bool = True):
        """A TrainerCallback writing the run's receipt.json (docs/receipts.md): `Trainer(..., callbacks=
        [plan.callback()])`. `folder`: default the plan's folder, else (a plan in memory) the Trainer's output_dir."""
        # lazy: the Trainer's modules load only for a run, not for planning
        from planner.receipt_callback import ReceiptCallback

        return ReceiptCallback(self.data, self.seq_len, folder or self.folder, warmup=warmup, cache=cache)

    def receipt(self, folder=None, *, warmup: int = DEFAULT_WARMUP, tokens_per_step: float | None = None,
                cache: bool = True) -> Meter:
        """A receipt for a loop without the Trainer: `with plan.receipt() as meter:` and `meter.step()` after each
        optimizer step; receipt.json is written when the block ends (default folder as `callback`)."""
        return Meter(self.data, folder or self.folder, warmup=warmup, tokens_per_step=tokens_per_step, cache=cache)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _current_names(args: dict) -> dict:
    """`args` with the checkpointing arguments under the names the installed TrainingArguments takes without a
    deprecation warning (transformers 5 renamed them; transformers < 5 knows only the old names)."""
    out = dict(args)
    for old, new in CHECKPOINTING_ARGS.items():
        wanted = checkpointing_arg(old)
        other = new if wanted == old else old
        if other in out:
            value = out.pop(other)
            out.setdefault(wanted, value)
    return out


def _moe_leaves(model) -> None:
    """ZeRO-3 prefetches parameters in the order modules ran last step, and a mixture of experts runs its experts in
    a data-dependent order: DeepSpeed's answer is to mark each MoE block a leaf, so entering it gathers all its
    experts at once (deepspeed/utils/z3_leaf_module.py `set_z3_leaf_modules`)."""

    blocks = moe_block_classes(model)
    if blocks:
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(model, blocks)


def load_plan(path) -> LoadedPlan:
    """Read a plan written by `plan --emit` (plan.json, or the folder holding it). Raises InputError.

    Under `accelerate launch --config_file FOLDER/accelerate_config.yaml` from another directory, accelerate hands the
    training processes the config's DeepSpeed file name as written; it is pointed at the folder here, so that an
    Accelerator the script builds finds it (the Trainer takes it from `training_arguments()`)."""
    path = Path(path).expanduser()
    file = path / "plan.json" if path.is_dir() else path
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise InputError(f"cannot read the plan {file}: {err}", flag="--plan",
                         hint="Pass the plan.json that `plan --emit DIR` wrote (or DIR).") from err
    if not isinstance(data, dict) or not {"choice", "model", "attention", "optimizer"} <= set(data):
        raise InputError(f"{file} is not a plan written by `plan --emit`", flag="--plan")
    folder = Path(os.path.abspath(file)).parent
    _point_accelerate_at(folder)
    return LoadedPlan(data, folder)


def _point_accelerate_at(folder: Path) -> None:
    """Resolve accelerate's DeepSpeed config variable against `folder` when it names a file there by a relative path
    that the current directory does not have."""
    name = os.environ.get(DEEPSPEED_CONFIG_ENV)
    if name and not os.path.isabs(name) and not os.path.exists(name) and (folder / name).is_file():
        os.environ[DEEPSPEED_CONFIG_ENV] = str(folder / name)
