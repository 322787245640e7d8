"""What is trained: the head a task asks for, and LoRA / QLoRA adapters built with peft on the meta model.

The head: `--task` names a transformers auto mapping (`vocab.TASK`), whose class for the config's model type
replaces `architectures[0]`, with `num_labels` for classifiers. Adapters: peft's own `get_peft_model` injects them
into the meta model, so trainable parameters are exactly what peft counts (`get_nb_trainable_parameters`), and
the traced step runs peft's LoRA forward (its dropout, its A/B matmuls). With a 16-bit computation (mixed
precision, or a bf16 model) the frozen base is kept in the 16-bit dtype and the trainable parameters in fp32, as
peft's `cast_mixed_precision_params` does (peft/utils/other.py). QLoRA's base is traced as frozen 16-bit linears
(bitsandbytes does not run on fake tensors); its 4-bit storage is counted by formula (`planner/memory/states.py`
`nf4_bytes`) over the modules transformers' bitsandbytes integration converts (`quantized_linear_numel`).
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import asdict, dataclass, replace

from planner import facts
from planner.errors import InputError
from planner.vocab import ADAPTER, ALL_LINEAR, AUTO, CLASS_LABELS, NO_ADAPTER, TASK, TOKEN_LABELS, task_of_class

#: peft's `LoraConfig` defaults where the user gives none: rank 16 and alpha 2 x rank (the common pairing; peft's own
#: defaults, r=8 and alpha=8, are small for 7B-class models); dropout 0.05 (the QLoRA paper's for 7B-13B, arXiv
#: 2305.14314 appendix B.2), 0 where peft adapts fused parameters (`Adapter.for_model`).
DEFAULT_RANK = 16
DEFAULT_DROPOUT = 0.05


#: The facts `nf4_bytes` reads, for callers that use a spec's stored 4-bit bytes (computed once per model)
NF4_FACTS = ("bitsandbytes.nf4_block", "bitsandbytes.nf4_second_block")


def nf4_bytes(elements: int, double_quant: bool) -> int:
    """Bytes bitsandbytes keeps for `elements` weights in 4-bit NF4 (QLoRA's base): two codes a byte, an fp32 absmax
    per block, or with double quantisation a uint8 one and an fp32 absmax per second-level block plus the offset."""
    blocks = math.ceil(elements / facts.get("bitsandbytes.nf4_block"))
    if not double_quant:
        return math.ceil(elements / 2) + 4 * blocks
    return math.ceil(elements / 2) + blocks + 4 * (math.ceil(blocks / facts.get("bitsandbytes.nf4_second_block")) + 1)



@dataclass(frozen=True)
class Adapter:
    """LoRA or QLoRA as the user asked for it: what peft's `LoraConfig` and transformers' `BitsAndBytesConfig` get."""

    method: str = "lora"                    # `vocab.ADAPTER` key (not "none")
    rank: int = DEFAULT_RANK
    alpha: float | None = None              # None: 2 x rank
    targets: tuple[str, ...] = (ALL_LINEAR,)
    dropout: float | None = None            # None: DEFAULT_DROPOUT, settled per model by `for_model`
    double_quant: bool = True               # QLoRA: quantise the 4-bit blocks' absmax constants too
    fused_parameters: tuple[str, ...] = ()  # what peft adapts as parameters, not modules (set by `for_model`)

    def __post_init__(self):
        if self.method not in ADAPTER or self.method == NO_ADAPTER:
            raise InputError(f"unknown adapter {self.method!r}", flag="--peft",
                             hint=f"Use one of {', '.join(m for m in ADAPTER if m != NO_ADAPTER)}.")
        if not isinstance(self.rank, int) or not 0 < self.rank <= 4096:
            raise InputError("the LoRA rank must be an integer from 1 to 4096", flag="--lora-rank")
        if self.alpha is not None and not self.alpha > 0:
            raise InputError("the LoRA alpha must be positive", flag="--lora-alpha")
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise InputError("the LoRA dropout must be in [0, 1)", flag="--lora-dropout")
        if not self.targets or any(not t or "," in t for t in self.targets):
            raise InputError("no LoRA target modules", flag="--lora-targets",
                             hint=f"Use {ALL_LINEAR} or module names such as q_proj,v_proj.")

    @classmethod
    def parse_targets(cls, text: str) -> tuple[str, ...]:
        """`all-linear` or a comma-separated list of module names (`q_proj,v_proj`); an empty name (`,,`, `q_proj,`)
        is kept, for the Adapter to refuse: a list that names nothing is not a request for the default."""
        return tuple(part.strip() for part in text.split(","))

    @property
    def quantized(self) -> bool:
        return ADAPTER[self.method].quantized_base

    def lora_kwargs(self, task: str) -> dict:
        """peft `LoraConfig(**kwargs)` for a model trained for `task` (`vocab.TASK`)."""
        targets = ALL_LINEAR if self.targets == (ALL_LINEAR,) else list(self.targets)
        kwargs = {"r": self.rank, "lora_alpha": self.alpha if self.alpha is not None else 2 * self.rank,
                  "lora_dropout": DEFAULT_DROPOUT if self.dropout is None else self.dropout,
                  "target_modules": targets, "bias": "none"}
        peft_task = TASK[task].peft_task
        if peft_task:
            kwargs["task_type"] = peft_task
        return kwargs

    def _fused_targets(self, model, task: str) -> tuple[str, ...]:
        """The parameters peft adapts as parameters rather than through their modules: transformers 5's fused 3D
        expert weights (Mixtral's `experts.gate_up_proj`), which `all-linear` or the experts' old module names reach
        (peft/utils/transformers_weight_conversion.py `convert_peft_config_for_transformers`)."""
        peft = _import_peft()
        try:
            from peft.utils.transformers_weight_conversion import (
                convert_peft_config_for_transformers,
                get_model_conversion_mapping,
            )
        except ImportError:  # a peft without the conversion adapts modules only
            return ()
        config = peft.LoraConfig(**self.lora_kwargs(task))
        convert_peft_config_for_transformers(config, model=model, conversions=get_model_conversion_mapping(model))
        return tuple(sorted(config.target_parameters or ()))

    def for_model(self, model, task: str) -> Adapter:
        """This adapter with its default dropout settled for `model`: 0 where peft adapts fused parameters, whose
        wrapper refuses dropout (peft/tuners/lora/layer.py `ParamWrapper.__init__`), else DEFAULT_DROPOUT."""
        fused = self._fused_targets(model, task)
        if fused and self.dropout:
            raise InputError(f"peft adapts {', '.join(fused)} as fused parameters, which take no LoRA dropout",
                             flag="--lora-dropout", hint="Use --lora-dropout 0, or name modules only with "
                             "--lora-targets (e.g. q_proj,k_proj,v_proj,o_proj).")
        dropout = self.dropout if self.dropout is not None else 0.0 if fused else DEFAULT_DROPOUT
        return replace(self, dropout=dropout, fused_parameters=fused)

    def bnb_kwargs(self, compute_dtype: str) -> dict | None:
        """transformers `BitsAndBytesConfig(**kwargs)` for QLoRA (None for LoRA), NF4 as the QLoRA paper trains."""
        if not self.quantized:
            return None
        return {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": self.double_quant,
                "bnb_4bit_compute_dtype": compute_dtype}

    def to_json(self) -> dict:
        return {**asdict(self), "targets": list(self.targets), "fused_parameters": list(self.fused_parameters)}

    @classmethod
    def from_json(cls, data: dict | None) -> "Adapter | None":
        if not data:
            return None
        return cls(**{**data, "targets": tuple(data["targets"]),
                      "fused_parameters": tuple(data.get("fused_parameters", ()))})

    def label(self) -> str:
        targets = ",".join(self.targets)
        quant = " over a 4-bit NF4 base" if self.quantized else ""
        return f"{'QLoRA' if self.quantized else 'LoRA'} r={self.rank} on {targets}{quant}"


def with_task(config, task: str | None, num_labels: int | None):
    """A copy of `config` whose `architectures[0]` is transformers' head class for `task` (None or "auto": the
    config's own head) and, for classifiers, `num_labels` labels."""
    if (task in (None, AUTO)) and num_labels is None:
        return config
    cfg = copy.deepcopy(config)
    if task not in (None, AUTO):
        if task not in TASK or TASK[task].auto_mapping is None:
            raise InputError(f"unknown task {task!r}", flag="--task")
        from transformers.models.auto import modeling_auto

        names = getattr(modeling_auto, TASK[task].auto_mapping)
        head = names.get(cfg.model_type)
        if head is None:
            raise InputError(f"transformers has no {task} head for model type {cfg.model_type!r}", flag="--task",
                             hint="Pick a task this model has a head for (--task auto keeps its own).")
        cfg.architectures = [head]
    if num_labels is not None:
        if TASK[_task_of(cfg)].labels not in (CLASS_LABELS, TOKEN_LABELS):
            raise InputError("applies to classification heads", flag="--num-labels",
                             hint="Add --task seq-cls or --task token-cls.")
        if not 1 <= num_labels <= 1_000_000:
            raise InputError("the number of labels must be from 1 to 1,000,000", flag="--num-labels")
        cfg.num_labels = num_labels
    if TASK[_task_of(cfg)].labels == CLASS_LABELS and getattr(cfg, "pad_token_id", None) is None:
        # a sequence classifier finds each row's last token from the pad id, and refuses batches > 1 without
        # one (e.g. LlamaForSequenceClassification.forward); training scripts set it to the EOS id, as we do
        eos = getattr(cfg, "eos_token_id", None)
        cfg.pad_token_id = eos[0] if isinstance(eos, list) else eos
    return cfg


def _task_of(config) -> str:
    return task_of_class((getattr(config, "architectures", None) or [""])[0])


def apply_adapter(model, adapter: Adapter, task: str, half_dtype=None):
    """`model` (a transformers model, meta or real) wrapped by peft's `get_peft_model` with LoRA on the adapter's
    targets; the trainable parameters are the adapters (and a classifier head peft keeps trainable as
    `modules_to_save`). `half_dtype`: frozen floating-point weights go to it and trainable ones to fp32
    (`cast_mixed`), as mixed precision trains adapters. Returns the PeftModel (`.get_base_model()` is the
    transformers model with the adapters injected)."""
    peft = _import_peft()
    try:
        with warnings.catch_warnings():  # peft's notices (transformers deprecations, GPT-2's Conv1D fan-in flag)
            warnings.simplefilter("ignore")
            wrapped = peft.get_peft_model(model, peft.LoraConfig(**adapter.lora_kwargs(task)))
    except ValueError as err:  # e.g. target modules not found in the model
        raise InputError(f"peft cannot add LoRA to this model: {str(err).splitlines()[0][:200]}",
                         flag="--lora-targets", hint=f"Use {ALL_LINEAR} or the model's linear module names.") from err
    if half_dtype is not None:
        cast_mixed(wrapped, half_dtype)
    return wrapped


def cast_mixed(model, half_dtype) -> None:
    """peft's `cast_mixed_precision_params` (peft/utils/other.py): frozen parameters to the 16-bit dtype, trainable
    ones to fp32; integer storage (a QLoRA base's packed 4-bit weights) is left as it is."""
    import torch

    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.to(torch.float32)
        elif p.dtype.is_floating_point:
            p.data = p.data.to(half_dtype)


def _import_peft():
    try:
        import peft
    except ImportError as err:
        raise InputError("LoRA and QLoRA need the peft library", flag="--peft",
                         hint='Install it: pip install -e ".[peft]".') from err
    return peft


def quantized_linear_numel(model) -> int:
    """Weight elements bitsandbytes stores in 4 bits when transformers loads the model with `load_in_4bit`: the
    modules its bnb integration converts (transformers/integrations/bitsandbytes.py `replace_with_bnb_linear`: a
    `Conv1D` or exactly `nn.Linear`, where `should_convert_module` allows), skipping what the quantizer keeps
    (transformers/quantizers/base.py `get_modules_to_not_convert`: the output head, tied weights, the last module,
    the model's `_keep_in_fp32_modules`)."""
    import torch
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.base import HfQuantizer
    from transformers.quantizers.quantizers_utils import should_convert_module

    keep = HfQuantizer.get_modules_to_not_convert(model, None, getattr(model, "_keep_in_fp32_modules", None))
    return sum(module.weight.numel() for name, module in model.named_modules()
               if (isinstance(module, Conv1D) or type(module) is torch.nn.Linear) and should_convert_module(name, keep))
