"""The planner's vocabulary: every kind of choice, defined once, each value with what it means.

Each kind is a table from value to the facts other modules need about it; its `Literal` alias is derived from the
table, so a new value is one line here. Request validation, the CLI's choices, the search space, the emitters and
the probes all read these tables; rules that combine several kinds live on `planner.config.Config`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args


@dataclass(frozen=True)
class PackageInfo:
    module: str                  # what `import` names
    extra: str | None = None     # trainplan's extra (pyproject.toml) that installs it
    command: str | None = None   # the command that installs it, for a package no extra installs

    @property
    def install(self) -> str:
        """The command that installs it into a trainplan checkout."""
        return f'pip install -e ".[{self.extra}]"' if self.extra else str(self.command)


#: Packages a plan (or a feature) may need beyond the base install (each choice below names the ones it needs); each
#: installs through the pyproject.toml extra that pins it (tests/test_hints_replan.py checks the extras exist).
PACKAGE: dict[str, PackageInfo] = {
    "deepspeed": PackageInfo("deepspeed", "deepspeed"),
    "peft": PackageInfo("peft", "peft"),
    "bitsandbytes": PackageInfo("bitsandbytes", "bitsandbytes"),
    "flash-attn": PackageInfo("flash_attn", command="pip install flash-attn --no-build-isolation"),
    "liger-kernel": PackageInfo("liger_kernel", "liger"),
    "torchao": PackageInfo("torchao", "fp8"),
    # what a feature needs rather than a plan: the report page, dataset files, TRL's batching
    "matplotlib": PackageInfo("matplotlib", "report"),
    "datasets": PackageInfo("datasets", "data"),
    "trl": PackageInfo("trl", "trl"),
}
#: The extras the shipped training scripts need on a node besides the plan's packages: --dataset's formats and TRL
#: (train_trl.py, padding-free and packed batches).
SCRIPT_EXTRAS = ("data", "trl")


@dataclass(frozen=True)
class LauncherInfo:
    doc: str
    program: str               # what submits the job
    image: bool = False        # the nodes run a container image the user names (--image)
    volume: str = ""           # what --volume names for it, where the run folder lives ("": it takes none)


#: Cluster engines a plan's folder can be submitted to (`plan --emit DIR --launcher NAME`; emit/slurm.py,
#: emit/kubernetes.py, emit/skypilot.py).
LAUNCHER: dict[str, LauncherInfo] = {
    "slurm": LauncherInfo("a Slurm batch job (sbatch DIR/train.sbatch), one accelerate launch per node under srun; "
                          "the run folder on the cluster's shared file system", "sbatch"),
    "kubernetes": LauncherInfo("a Kubeflow Trainer v2 TrainJob on the torch-distributed runtime (kubectl apply "
                               "--server-side -f DIR/trainjob.yaml), the folder's files in a ConfigMap beside it",
                               "kubectl", image=True,
                               volume="a PersistentVolumeClaim name"),
    "skypilot": LauncherInfo("a SkyPilot task (sky launch --workdir DIR DIR/sky.yaml), the folder synced to each "
                             "node as its workdir", "sky",
                             volume="a bucket URI (s3://, gs://, r2://, cos://, oci:// or nebius://)"),
}
Launcher = Literal[tuple(LAUNCHER)]  # type: ignore[valid-type]
SLURM, KUBERNETES, SKYPILOT = LAUNCHER


@dataclass(frozen=True)
class PrecisionInfo:
    doc: str
    weight_bytes: int          # bytes per stored parameter (and gradient) under the torch engine
    compute: str               # the matmuls' dtype: names the GPU catalog's peak (`GPU.peak_tflops`)
    autocast: str | None       # torch.autocast dtype (a `torch` attribute name), None without autocast
    zero_weight_bytes: int     # the working weights (and gradients) a ZeRO/FSDP engine keeps per parameter
    zero_master: bool          # a ZeRO engine keeps an fp32 master copy and fp32 gradient partition too
    loss_scaling: bool         # fp16 gradients underflow without dynamic loss scaling
    needs_bf16: bool           # needs bf16 tensor cores (compute capability >= 8.0)
    zero_engines: bool         # DeepSpeed/FSDP can run it (they keep fp32 master weights; pure bf16 is torch-only)
    trainer_flag: str | None   # the TrainingArguments flag that turns it on (bf16 / fp16), None for none
    accelerate: str            # accelerate's `mixed_precision` value
    in_auto: bool              # `--precision auto` may choose it (pure bf16 changes the numerics: only on request)
    #: fp32 matmuls run on TF32 tensor cores (torch.backends.cuda.matmul.allow_tf32, the Trainer's `tf32`; torch's
    #: default is off since 1.12, torch/backends/cuda/__init__.py): the GPU needs TF32 (compute capability >= 8.0)
    tf32: bool = False
    #: accelerate's AO backend swaps the eligible nn.Linear layers for torchao's Float8Linear (tensorwise scaling):
    #: their GEMMs run on FP8 tensor cores, everything else as under bf16 autocast (`planner.speed.float8`)
    float8: bool = False
    packages: tuple[str, ...] = ()   # what it needs installed (`PACKAGE`)
    #: the nearest precision to offer where a GPU cannot run this one (the same numerics, one step more widely run)
    fallback: str | None = None


PRECISION: dict[str, PrecisionInfo] = {
    "fp32": PrecisionInfo("fp32 weights, gradients, optimizer states and matmuls (TF32 off, torch's default)",
                          4, "fp32", None, 4, False, False, False, True, None, "no", True),
    "tf32": PrecisionInfo("fp32 weights, gradients and optimizer states; matmuls on TF32 tensor cores (10-bit "
                          "mantissa inputs, fp32 accumulation; Ampere and later)", 4, "tf32", None, 4, False, False,
                          False, True, None, "no", True, tf32=True, fallback="fp32"),
    "fp16-mixed": PrecisionInfo("fp32 weights; torch.autocast runs matmuls in fp16; dynamic loss scaling",
                                4, "fp16", "float16", 2, True, True, False, True, "fp16", "fp16", True,
                                fallback="fp32"),
    "bf16-mixed": PrecisionInfo("fp32 weights; torch.autocast runs matmuls in bf16 (Ampere and later)",
                                4, "bf16", "bfloat16", 2, True, False, True, True, "bf16", "bf16", True,
                                fallback="fp16-mixed"),
    "bf16-true": PrecisionInfo("bf16 weights, gradients and optimizer states, no autocast and no fp32 master "
                               "copy (torchtune-style pure bf16); torch engine only; chosen only on request",
                               2, "bf16", None, 2, False, False, True, False, None, "no", False,
                               fallback="bf16-mixed"),
    # No Trainer flag: TrainingArguments(bf16=True) would overwrite accelerate's ACCELERATE_MIXED_PRECISION=fp8
    # (transformers/training_args.py:1614-1618); the script sets `mixed_precision` instead (planner/prepare.py).
    "fp8": PrecisionInfo("bf16-mixed, with the linear layers' GEMMs in float8 (torchao's Float8Linear, tensorwise "
                         "dynamic scaling, through accelerate's AO backend; the first and last linear stay bf16); "
                         "FP8 tensor cores (compute capability >= 8.9)", 4, "bf16", "bfloat16", 2, True, False,
                         True, True, None, "fp8", True, float8=True, packages=("torchao",),
                         fallback="bf16-mixed"),
}
Precision = Literal[tuple(PRECISION)]  # type: ignore[valid-type]
FP32, TF32, FP16_MIXED = "fp32", "tf32", "fp16-mixed"
#: The dtypes matmuls compute in (`PrecisionInfo.compute`), naming the catalog's peaks (`peak_tflops_<dtype>`) and
#: efficiency.json's achievable fractions.
COMPUTE_DTYPES = ("bf16", "fp16", "tf32", "fp32")
#: The dtype float8 GEMMs run in (the catalog's `peak_tflops_fp8`, efficiency.json's `matmul.fp8`).
FP8_COMPUTE = "fp8"
FP32_COMPUTE = COMPUTE_DTYPES[-1]
BF16_COMPUTE = COMPUTE_DTYPES[0]
#: `estimate_memory`'s default (the design contract's example)
DEFAULT_PRECISION = BF16_MIXED = "bf16-mixed"
#: The precision request that lets the planner choose.
AUTO = "auto"
#: --context-parallel / --sequence-parallel: never split a sequence; `auto` weighs splits from AUTO_SPLIT_FROM tokens
#: (a search bound, keeping shorter plans' search as it was), a number pins one
SPLIT_OFF = "off"
AUTO_SPLIT_FROM = 16384
#: transformers' `from_pretrained(tp_plan=...)` value that applies the model's own tensor-parallel plan
TP_PLAN_AUTO = AUTO


@dataclass(frozen=True)
class ActivationsInfo:
    doc: str
    half_weights: bool         # the traced model computes with 16-bit weights
    autocast: bool             # the traced forward runs under autocast


#: The traced program's weights and autocast, which decide the activations' dtypes (`Config.activation_family`).
ACTIVATIONS: dict[str, ActivationsInfo] = {
    "fp32": ActivationsInfo("fp32 weights, no autocast", False, False),
    "mixed": ActivationsInfo("fp32 weights under autocast (16-bit casts of matmul inputs)", False, True),
    "half": ActivationsInfo("16-bit weights, no autocast (bf16-true; DeepSpeed's 16-bit module)", True, False),
    "half+autocast": ActivationsInfo("16-bit weights under autocast (FSDP2's working copy under accelerate)", True,
                                     True),
}
ActivationFamily = Literal[tuple(ACTIVATIONS)]  # type: ignore[valid-type]


def activation_family(half_weights: bool, autocast: bool) -> str:
    return next(k for k, v in ACTIVATIONS.items() if (v.half_weights, v.autocast) == (half_weights, autocast))


@dataclass(frozen=True)
class OptimizerInfo:
    doc: str
    state_bytes: int                # optimizer state bytes per trainable parameter when states are fp32
    lr_rule: str                    # LR scaling the `auto` rule applies: sqrt (Adam-family), linear (SGD-family)
    trainer: str | None             # TrainingArguments.optim (transformers/training_args.py OptimizerNames); None: none
    torch_class: str | None = None  # torch.optim class traces and benchmarks build; None: not in torch
    options: str = ""               # extra arguments, in TrainingArguments.optim_args' "key=value,..." form
    deepspeed: str | None = None    # DeepSpeed optimizer block type; None: a client optimizer the Trainer builds
    adam_betas: bool = False        # takes Adam's betas and eps
    follows_weights: bool = True    # states take the parameters' dtype (bf16-true halves them); quantised do not
    factored: bool = False          # second moment factored per matrix (shape-dependent bytes)
    #: a class the script builds itself (`LoadedPlan.create_optimizer`) where the Trainer has no name for it
    client: str | None = None
    norm_passes: int = 0            # extra reads of weights and update per step (LAMB's per-layer trust ratio)
    warmup: bool = False            # meant to be used with LR warmup whenever the LR is scaled up
    package: str | None = None      # what it needs installed (`PACKAGE`), None: torch or transformers


#: state_bytes: adam/adamw exp_avg + exp_avg_sq (4 + 4); sgd-momentum momentum_buffer (4); lion exp_avg (4, Chen et al.
#: 2023, arXiv 2302.06675); adamw-8bit two uint8 states (bitsandbytes blockwise quantisation; its per-block fp32 absmax
#: adds 2 x 4 B per 2048 elements, 0.004 B/param); adafactor is shape-dependent (`states.adafactor_state_elements`).
#: "adam" is emitted as the Trainer's fused AdamW with weight decay 0, which is Adam.
OPTIMIZER: dict[str, OptimizerInfo] = {
    "adamw": OptimizerInfo("AdamW (decoupled weight decay); fused on CUDA", 8, "sqrt", "adamw_torch_fused",
                           torch_class="AdamW", deepspeed="AdamW", adam_betas=True),
    "adam": OptimizerInfo("Adam (emitted with weight decay 0, where it equals AdamW)", 8, "sqrt", "adamw_torch_fused",
                          torch_class="Adam", deepspeed="Adam", adam_betas=True),
    "sgd": OptimizerInfo("plain SGD, no state", 0, "linear", "sgd", torch_class="SGD"),
    "sgd-momentum": OptimizerInfo("SGD with momentum 0.9 (one fp32 buffer)", 4, "linear", "sgd", torch_class="SGD",
                                  options="momentum=0.9"),
    "adafactor": OptimizerInfo("Adafactor: factored second moment, no first moment", 4, "sqrt", "adafactor",
                               torch_class="Adafactor", factored=True),
    "adamw-8bit": OptimizerInfo("bitsandbytes AdamW8bit: two uint8 states", 2, "sqrt", "adamw_bnb_8bit",
                                adam_betas=True, follows_weights=False, package="bitsandbytes"),
    "paged-adamw-8bit": OptimizerInfo("bitsandbytes PagedAdamW8bit: AdamW8bit with states in CUDA unified memory, "
                                      "paged to the host under memory pressure (QLoRA's optimizer)", 2, "sqrt",
                                      "paged_adamw_8bit", adam_betas=True, follows_weights=False,
                                      package="bitsandbytes"),
    # LAMB (You et al. 2020, arXiv 1904.00962, section 4: square-root LR scaling with linear-epoch warmup): Adam's two
    # moments and a per-layer trust ratio ||w|| / ||update||; the Trainer has no LAMB, bitsandbytes has
    # (bitsandbytes/optim/lamb.py `LAMB`), built by `plan.create_optimizer(model)`.
    "lamb": OptimizerInfo("LAMB: Adam moments with a per-layer trust ratio, for large batches (bitsandbytes' LAMB)", 8,
                          "sqrt", None, adam_betas=True, client="bitsandbytes.optim.LAMB", norm_passes=2, warmup=True,
                          package="bitsandbytes"),
    # Sophia (Liu et al. 2023, arXiv 2305.14342): a momentum and a diagonal Hessian estimate (two states), the
    # estimate refreshed every k = 10 steps by an extra backward; in none of torch, transformers, DeepSpeed or
    # bitsandbytes, so it is planned but not emitted.
    "sophia": OptimizerInfo("Sophia: momentum and a diagonal Hessian estimate (no library here implements it: planned, "
                            "not emitted)", 8, "sqrt", None),
    "lion": OptimizerInfo("Lion: sign update, one momentum state (bitsandbytes on the torch engine)", 4, "sqrt",
                          "lion_32bit", deepspeed="Lion", package="bitsandbytes"),
}
Optimizer = Literal[tuple(OPTIMIZER)]  # type: ignore[valid-type]
DEFAULT_OPTIMIZER, ADAMW_8BIT = "adamw", "adamw-8bit"


@dataclass(frozen=True)
class StepProgram:
    """How an optimizer step runs on the GPU: the element accesses per trainable parameter its kernels make (reads
    plus writes; `state` counts the optimizer's states and the step's temporaries, all at the states' width), and
    what the host issues: kernels a Python loop launches per matrix (2-D or more) and per vector parameter tensor,
    multi-tensor ops per step, and host-only ops per tensor (a CPU step counter's increment and the `.item()` that
    reads it back)."""

    doc: str
    weight: int
    grad: int
    state: int
    matrix_kernels: int = 0
    vector_kernels: int = 0
    foreach_ops: int = 0
    host_ops_per_tensor: int = 0


#: torch/optim/adam.py (torch 2.13), AdamW with decoupled weight decay: `_fused_adam` calls one `torch._fused_adamw_`,
#: which reads the weight, gradient and both moments and writes the weight and moments (its `step` tensors live on the
#: GPU: one more multi-tensor add); `_multi_tensor_adam` runs 8 foreach ops (weight decay `_foreach_mul_`, `lerp_`,
#: `mul_`, `addcmul_`, `sqrt`, `div_`, `add_`, `addcdiv_`) and reads each CPU `step` back twice (`_get_value`);
#: `_single_tensor_adam` runs the same 8 kernels per tensor from Python, with `step_t += 1` and one `_get_value`.
#: tests/test_throughput.py counts these from the optimizers themselves. torch picks foreach for CUDA tensors when
#: neither flag is given (torch/optim/optimizer.py `_default_to_fused_or_foreach`) and the for-loop on the CPU;
#: the Trainer's `adamw_torch_fused`, DeepSpeed's FusedAdam and apex's FusedAdam run the fused kernel.
#: transformers' own AdamW (`optim="adamw_hf"`; transformers/optimization.py `AdamW`, last in 4.4x) is a Python loop of
#: the same kind, timed as "for-loop": `mul_`, `add_`, `mul_`, `addcmul_`, `sqrt`, `add_`, `addcdiv_` per tensor (the
#: same 3 gradient and 14 state accesses), plus `p.add_(p)` with weight decay (8 kernels, 5 weight accesses; the
#: Trainer's default weight_decay 0 leaves 7 and 2), its step count a Python int.
ADAM_STEP: dict[str, StepProgram] = {
    "fused": StepProgram("one fused kernel over all tensors (torch fused=True, DeepSpeed/apex FusedAdam)",
                         weight=2, grad=1, state=4, foreach_ops=2),
    "foreach": StepProgram("multi-tensor foreach ops (torch's default for CUDA tensors)",
                           weight=4, grad=3, state=14, foreach_ops=8, host_ops_per_tensor=2),
    "for-loop": StepProgram("a Python loop over the tensors, 8 kernels each (torch foreach=False; transformers' "
                            "adamw_hf)", weight=4, grad=3, state=14, matrix_kernels=8, vector_kernels=8,
                            host_ops_per_tensor=2),
}
AdamStep = Literal[tuple(ADAM_STEP)]  # type: ignore[valid-type]
#: what the emitted files run: the Trainer's `adamw_torch_fused` (OPTIMIZER's `trainer` names) or DeepSpeed's FusedAdam
FUSED_STEP, FOREACH_STEP, FOR_LOOP_STEP = "fused", "foreach", "for-loop"

#: The step the emitted files run for the other optimizers torch or transformers implement, counted from the
#: optimizers in tests/test_throughput.py as for ADAM_STEP. The Trainer builds `torch.optim.SGD` (momentum from
#: optim_args; transformers/trainer_optimizer.py `_get_sgd`), which steps CUDA tensors with foreach ops: one
#: `_foreach_add_`, with momentum `_foreach_mul_` and two `_foreach_add_` on the buffers and weights. Its `adafactor`
#: is transformers' Adafactor with scale_parameter=False, relative_step=False (`_get_adafactor`), a Python loop
#: (transformers/optimization.py `Adafactor.step`): per matrix 24 kernels, the factored row and column means and
#: the weight's and update's RMS norms among them; per vector 16; its temporaries are full-size (16 state accesses
#: per element of a matrix, 20 of a vector: the matrices' figure is used; counted on fp32 weights, where 16-bit
#: ones add an fp32 copy of the weight and gradient each). bitsandbytes' optimizers (8-bit AdamW,
#: Lion, LAMB) are not counted here: their step keeps the bytes-only estimate.
OPTIMIZER_STEP: dict[str, StepProgram] = {
    "sgd": StepProgram("torch SGD, foreach", weight=2, grad=1, state=0, foreach_ops=1),
    "sgd-momentum": StepProgram("torch SGD with momentum, foreach", weight=2, grad=1, state=5, foreach_ops=3),
    "adafactor": StepProgram("transformers' Adafactor, a Python loop", weight=3, grad=2, state=16, matrix_kernels=24,
                             vector_kernels=16),
}


@dataclass(frozen=True)
class CheckpointingInfo:
    doc: str
    enabled: bool              # blocks run under torch.utils.checkpoint
    per_op_policy: bool        # selective: torch's per-op SAC policy decides what is saved (step.py)
    moving_parts: int          # tie-break weight (fewer moving parts win among equally fast candidates)


CHECKPOINTING: dict[str, CheckpointingInfo] = {
    "none": CheckpointingInfo("every activation kept for the backward", False, False, 0),
    "selective": CheckpointingInfo("matmul and attention outputs kept (every second mm recomputed), the rest "
                                   "recomputed: torchtitan's per-op policy", True, True, 1),
    "full": CheckpointingInfo("only each block's input kept; the block's forward recomputed in the backward",
                              True, False, 2),
}
Checkpointing = Literal[tuple(CHECKPOINTING)]  # type: ignore[valid-type]
NO_CHECKPOINTING, SELECTIVE, FULL = "none", "selective", "full"


@dataclass(frozen=True)
class SwitchInfo:
    doc: str
    candidates: tuple[bool, ...]  # whether the search plans without it (False), with it (True), or both


#: `torch.compile` of the model (TorchInductor, default mode): the Trainer's `torch_compile`, accelerate's
#: `dynamo_config`. What it changes is read from the model's graph (planner/program/compiled.py).
COMPILE: dict[str, SwitchInfo] = {
    "auto": SwitchInfo("compiled where it is faster over the run, its first-step compile time included (needs the "
                        "run's length: --train-steps or --train-tokens); eager otherwise", (False, True)),
    "on": SwitchInfo("compile the model (torch.compile, TorchInductor)", (True,)),
    "off": SwitchInfo("eager PyTorch", (False,)),
}
CompileMode = Literal[tuple(COMPILE)]  # type: ignore[valid-type]

#: Liger-Kernel's Triton kernels (the Trainer's `use_liger_kernel`); what they patch per model type is read from
#: liger-kernel's own table (planner/program/liger.py).
LIGER: dict[str, SwitchInfo] = {
    "auto": SwitchInfo("with and without, where liger-kernel is installed here and patches the model on this GPU",
                       (False, True)),
    "on": SwitchInfo("the Trainer's use_liger_kernel (refused where Liger has no patches for the model or GPU)",
                     (True,)),
    "off": SwitchInfo("the model's own modules", (False,)),
}
LigerMode = Literal[tuple(LIGER)]  # type: ignore[valid-type]
#: the "on" and "off" of both switches
COMPILE_ON, COMPILE_OFF = LIGER_ON, LIGER_OFF = "on", "off"
#: The Inductor backend the emitted files name (TrainingArguments.torch_compile_backend, accelerate's dynamo_backend).
INDUCTOR = "inductor"


@dataclass(frozen=True)
class OffloadInfo:
    doc: str
    optimizer_on_cpu: bool
    params_on_cpu: bool
    moving_parts: int


OFFLOAD: dict[str, OffloadInfo] = {
    "none": OffloadInfo("everything on the GPU", False, False, 0),
    "optimizer": OffloadInfo("optimizer states and step on the CPU (DeepSpeed ZeRO-Offload)", True, False, 2),
    "optimizer+params": OffloadInfo("optimizer and parameters in CPU memory (ZeRO-3 / FSDP CPU offload)", True, True,
                                    4),
}
Offload = Literal[tuple(OFFLOAD)]  # type: ignore[valid-type]
NO_OFFLOAD, OFFLOAD_OPTIMIZER, OFFLOAD_ALL = "none", "optimizer", "optimizer+params"


@dataclass(frozen=True)
class AttentionInfo:
    doc: str
    transformers: str          # config._attn_implementation
    saves_scores: bool         # keeps the s x s attention matrix for the backward
    packages: tuple[str, ...] = ()   # what it needs installed (`PACKAGE`)


ATTENTION: dict[str, AttentionInfo] = {
    "eager": AttentionInfo("the model's own matmul-softmax-matmul attention", "eager", True),
    "sdpa": AttentionInfo("torch scaled_dot_product_attention (flash / memory-efficient kernels on CUDA)", "sdpa",
                          False),
    "flash": AttentionInfo("the FlashAttention-2 package through transformers (`pip install flash-attn`; "
                           "Ampere+ GPUs, fp16/bf16)", "flash_attention_2", False, ("flash-attn",)),
}
Attention = Literal[tuple(ATTENTION)]  # type: ignore[valid-type]
EAGER, SDPA, FLASH = "eager", "sdpa", "flash"


@dataclass(frozen=True)
class KernelInfo:
    doc: str
    saves_scores: bool         # keeps the s x s attention matrix (and the dropout mask) for the backward
    traced_as: str             # the implementation the CPU trace runs (config._attn_implementation)
    sdpa_backend: str | None   # torch.nn.attention.SDPBackend the trace forces (None: torch's own choice)


#: The attention kernel a step really runs (planner/program/kernels.py picks it), and how the CPU trace reproduces
#: what it saves: flash and memory-efficient kernels keep the output and a log-sum-exp (dropout runs inside the
#: kernel), which the CPU's flash kernel saves too; math and eager keep the scores.
KERNEL: dict[str, KernelInfo] = {
    "eager": KernelInfo("the model's own matmul-softmax-matmul", True, "eager", None),
    "flash": KernelInfo("FlashAttention (SDPA's flash backend, or the flash-attn package)", False, "sdpa", None),
    "efficient": KernelInfo("SDPA's memory-efficient backend (xformers-style; fp32 too)", False, "sdpa", None),
    "math": KernelInfo("SDPA's math fallback: matmul, softmax, matmul in ATen", True, "sdpa", "MATH"),
}
Kernel = Literal[tuple(KERNEL)]  # type: ignore[valid-type]


@dataclass(frozen=True)
class PaddingInfo:
    doc: str
    models: str     # the library code whose batches the arithmetic follows (planner/dataset.py)
    padded: bool    # every row of a micro-batch is padded to the batch's longest sample
    #: attention implementations (`ATTENTION`) that keep samples apart under it; () where every one does (each
    #: sample its own row); `needs_them`: without one it cannot run at all (else its samples attend across)
    apart_with: tuple[str, ...] = ()
    needs_them: bool = False


#: How samples become micro-batches; the values are the plan's JSON values. Packed and flattened rows keep samples
#: apart only through varlen attention on their position_ids (transformers' FlashAttention-2 path,
#: modeling_flash_attention_utils.py `_is_packed_sequence`); under plain SDPA or eager a packed row attends across
#: the samples it holds.
PADDING: dict[str, PaddingInfo] = {
    "longest": PaddingInfo("random batches, each padded to its longest sample",
                           "transformers/data/data_collator.py DataCollatorWithPadding, DataCollatorForLanguageModeling "
                           "(padding=True, i.e. 'longest', their default)", True),
    "grouped": PaddingInfo("batches of similar lengths (TrainingArguments train_sampling_strategy='group_by_length', "
                           "group_by_length=True before transformers 5), padded to their longest",
                           "transformers/trainer_pt_utils.py LengthGroupedSampler, get_length_grouped_indices", True),
    "packing": PaddingInfo("samples concatenated into rows of max_length tokens (TRL SFTConfig packing=True)",
                           "trl/data_utils.py pack_dataset", False, ("flash",)),
    "padding-free": PaddingInfo("each micro-batch concatenated into one row with position_ids, no padding (needs "
                                "varlen attention such as FlashAttention)",
                                "transformers/data/data_collator.py DataCollatorWithFlattening; TRL SFTConfig "
                                "padding_free=True", False, ("flash",), True),
}
Padding = Literal[tuple(PADDING)]  # type: ignore[valid-type]
LONGEST, GROUPED, PACKING, PADDING_FREE = PADDING


@dataclass(frozen=True)
class EngineInfo:
    doc: str
    zero_stages: tuple[int, ...]                 # the sharding stages it runs (ZeRO numbering)
    offloads: dict[int, tuple[str, ...]]         # stage -> the offloads it can do at that stage
    distributed_type: str                        # accelerate's distributed_type
    stage_names: dict[int, str]                  # how a stage is called in this engine's own terms
    autocast: bool                               # mixed precision runs under torch.autocast (accelerate native_amp)
    half_working_copy: bool                      # mixed precision computes with 16-bit weights (no fp32 params)
    packages: tuple[str, ...] = ()               # what it needs installed (`PACKAGE`)


ENGINE: dict[str, EngineInfo] = {
    "torch": EngineInfo("plain PyTorch: one GPU or DDP (no sharding)", (0,), {0: ("none",)}, "MULTI_GPU",
                        {0: "DDP"}, True, False),
    # DeepSpeed converts the module to 16 bits and runs it without autocast (deepspeed/runtime/engine.py
    # `_configure_distributed_model`: module.half() / module.bfloat16()); accelerate skips native_amp for it
    # (accelerate/accelerator.py `Accelerator.__init__`, the mixed-precision block).
    "deepspeed": EngineInfo("DeepSpeed ZeRO stages 1-3 with CPU offload of the optimizer (and, at stage 3, the "
                            "parameters)", (1, 2, 3),
                            {1: ("none", "optimizer"), 2: ("none", "optimizer"),
                             3: ("none", "optimizer", "optimizer+params")}, "DEEPSPEED",
                            {1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}, False, True, ("deepspeed",)),
    # FSDP2 through accelerate: MixedPrecisionPolicy(param_dtype=bf16/fp16) gathers 16-bit weights, and accelerate
    # also wraps the forward in autocast (native_amp) (accelerate/utils/dataclasses.py
    # `FullyShardedDataParallelPlugin.set_mixed_precision`; accelerator.py `prepare_model`).
    "fsdp": EngineInfo("PyTorch FSDP2 through accelerate: SHARD_GRAD_OP-like (stage 2) or FULL_SHARD (stage 3); CPU "
                       "offload moves parameters, gradients and the optimizer step together", (2, 3),
                       {2: ("none",), 3: ("none", "optimizer+params")}, "FSDP",
                       {2: "FSDP SHARD_GRAD_OP", 3: "FSDP FULL_SHARD"}, True, True),
}
Engine = Literal[tuple(ENGINE)]  # type: ignore[valid-type]
TORCH, DEEPSPEED, FSDP = "torch", "deepspeed", "fsdp"
#: Engines a user picks for sharded candidates (`--engine`).
SHARDING_ENGINES = (DEEPSPEED, FSDP)
UNSHARDED_ENGINE = TORCH
DEFAULT_SHARDING_ENGINE = DEEPSPEED
ShardingEngine = Literal[SHARDING_ENGINES]  # type: ignore[valid-type]
#: The two ways of splitting each sequence across GPUs (the request's and Config's fields) and the engine each runs
#: under: torch's ring attention through FSDP2 (accelerate's cp_size), DeepSpeed's Ulysses all-to-alls (sp_size)
SEQUENCE_SPLIT: dict[str, str] = {"context_parallel": FSDP, "sequence_parallel": DEEPSPEED}
SPLIT_FIELDS = tuple(SEQUENCE_SPLIT)
CONTEXT_PARALLEL, SEQUENCE_PARALLEL = SPLIT_FIELDS


@dataclass(frozen=True)
class TaskInfo:
    doc: str
    class_suffixes: tuple[str, ...]   # transformers head classes of this task end with one of these
    lm_head: bool                     # logits over the vocabulary (vs. a few labels)
    labels: str                       # what the loss compares with: tokens | class | token-class | none
    #: the transformers auto mapping that names this task's head class per model type
    #: (transformers/models/auto/modeling_auto.py), None where `--task` cannot ask for it
    auto_mapping: str | None = None
    peft_task: str | None = None      # peft's TaskType (peft/utils/peft_types.py), None: a plain LoraModel


#: What a model is trained to do, read from its head class (one place for the suffix lists).
TASK: dict[str, TaskInfo] = {
    "causal-lm": TaskInfo("next-token prediction", ("ForCausalLM", "LMHeadModel"), True, "tokens",
                          "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "CAUSAL_LM"),
    "seq2seq": TaskInfo("encoder-decoder generation", ("ForConditionalGeneration", "ForSeq2SeqLM"), True, "tokens",
                        "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "SEQ_2_SEQ_LM"),
    "masked-lm": TaskInfo("masked-token prediction", ("ForMaskedLM", "ForPreTraining"), True, "tokens",
                          "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    "seq-cls": TaskInfo("a label per sequence", ("ForSequenceClassification",), False, "class",
                        "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "SEQ_CLS"),
    "token-cls": TaskInfo("a label per token", ("ForTokenClassification",), False, "token-class",
                          "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "TOKEN_CLS"),
    "other": TaskInfo("a base model or head without a known loss (trained on the mean of its output)", (), False,
                      "none"),
}
Task = Literal[tuple(TASK)]  # type: ignore[valid-type]
OTHER_TASK = "other"
TOKEN_LABELS = "token-class"
TOKEN_TARGETS = "tokens"
#: `--task` values: the model's own head (`architectures[0]`), or a task whose head transformers has for it
TASK_CHOICES = (AUTO, *(task for task, info in TASK.items() if info.auto_mapping))
TaskChoice = Literal[TASK_CHOICES]  # type: ignore[valid-type]
CLASS_LABELS = "class"


@dataclass(frozen=True)
class AdapterInfo:
    doc: str
    trains_adapters: bool       # the base is frozen and low-rank adapters train (peft)
    quantized_base: bool        # the frozen base's linear weights are stored 4-bit (bitsandbytes NF4)
    packages: tuple[str, ...] = ()   # what it needs installed (`PACKAGE`)


#: What trains: the whole model, or adapters on a frozen (and maybe 4-bit) base.
ADAPTER: dict[str, AdapterInfo] = {
    "none": AdapterInfo("full fine-tuning: every parameter trains", False, False),
    "lora": AdapterInfo("LoRA (Hu et al. 2021, arXiv 2106.09685) through peft: rank-r adapters on the chosen linears, "
                        "the base frozen in the 16-bit compute dtype", True, False, ("peft",)),
    "qlora": AdapterInfo("QLoRA (Dettmers et al. 2023, arXiv 2305.14314): LoRA over a base whose linear weights "
                         "bitsandbytes stores in 4-bit NF4", True, True, ("peft", "bitsandbytes")),
}
AdapterMethod = Literal[tuple(ADAPTER)]  # type: ignore[valid-type]
NO_ADAPTER = "none"
#: `--lora-targets` value for every linear layer but the output head (peft's `INCLUDE_LINEAR_LAYERS_SHORTHAND`)
ALL_LINEAR = "all-linear"


def task_of_class(class_name: str) -> str:
    """The task of a transformers head class, from its name."""
    return next((task for task, info in TASK.items() if class_name.endswith(info.class_suffixes)), OTHER_TASK)


@dataclass(frozen=True)
class LRScalingInfo:
    doc: str
    factor: Callable[[float], float] | None   # LR multiplier for k = B / B_ref; None: resolved per optimizer


#: What the backward starts from.
OBJECTIVE: dict[str, str] = {
    "labels": "the head's own loss on labels, as the Trainer trains",
    "sum": "the sum of the model's first output, as benchmarks' own loops train (`outputs = model(**inputs); "
           "outputs.logits.sum().backward()`: the outputs live through the backward and the next forward)",
}
Objective = Literal[tuple(OBJECTIVE)]  # type: ignore[valid-type]
LABELS_OBJECTIVE = "labels"


LR_SCALING: dict[str, LRScalingInfo] = {
    "auto": LRScalingInfo("sqrt for Adam-family optimizers, linear for SGD-family (each optimizer's `lr_rule`)", None),
    "sqrt": LRScalingInfo("scale by sqrt(B / B_ref) (Malladi et al. 2022, arXiv 2205.10287; Hoffer et al. 2017)",
                          math.sqrt),
    "linear": LRScalingInfo("scale by B / B_ref (Goyal et al. 2017, arXiv 1706.02677), with warmup", lambda k: k),
    "none": LRScalingInfo("keep the base LR", lambda k: 1.0),
}
LRScaling = Literal[tuple(LR_SCALING)]  # type: ignore[valid-type]

MEMORY_METHOD: dict[str, str] = {
    "auto": "trace the model's step where it can be traced, else the formulas",
    "trace": "trace the real model's step under FakeTensorMode (fails if the model cannot be traced)",
    "analytic": "per-block formulas only (fast, approximate)",
}
MemoryMethod = Literal[tuple(MEMORY_METHOD)]  # type: ignore[valid-type]
AUTO_METHOD, TRACE, ANALYTIC = "auto", "trace", "analytic"


@dataclass(frozen=True)
class EstimateInfo:
    doc: str
    exact: bool                # computed for this very program: an over-budget peak is a real OOM
    lower_bound: bool          # provably no more than the real peak
    understated: bool          # deliberately low (a bound or a screen): the real peak may be well above
    measured: bool = False     # measured on the GPU (no margin for the model's error)


#: Where a MemoryEstimate's numbers come from.
ESTIMATE: dict[str, EstimateInfo] = {
    "trace": EstimateInfo("activations traced from the model's own step at this micro-batch", True, False, False),
    "analytic": EstimateInfo("activations from per-block formulas", False, False, False),
    "analytic-calibrated": EstimateInfo("formulas scaled by a trace of the same activation family", False, False,
                                        False),
    "analytic-screen": EstimateInfo("formulas divided by their largest over-estimate seen: a screen, not a proof",
                                    False, False, True),
    "states-only": EstimateInfo("model states and fixed overheads alone, no activations: a lower bound", False, True,
                                True),
    "probe": EstimateInfo("measured on the GPU by a probe", True, False, False, True),
    "probe-calibrated": EstimateInfo("estimate corrected by probes of the same family", False, False, False, True),
    "receipt-calibrated": EstimateInfo("estimate corrected by receipts of earlier runs of the same family on this GPU",
                                       False, False, False, True),
}
EstimateMethod = Literal[tuple(ESTIMATE)]  # type: ignore[valid-type]
#: A number measured by a probe (an estimate's method, a speed's source)
PROBE = "probe"


#: How a measured run trained (a receipt's `program`): trainplan plans the Trainer's; the others are published runs'
#: own loops, judged against the plan of the configuration they ran.
PROGRAM: dict[str, str] = {
    "trainer": "the HF Trainer on HF model code, prepared as planner/prepare.py does (what trainplan's files run)",
    "hf-loop": "HF model code in a training loop of its own",
    "hf-forward-backward": "HF model code in a loop of its own, timed without its optimizer step",
    "optimised": "another stack's own model code and loop",
    "other": "a program trainplan does not plan (peft's fp32 upcast of a 4-bit model, say)",
}
Program = Literal[tuple(PROGRAM)]  # type: ignore[valid-type]
TRAINER = "trainer"


#: What measuring a candidate can end in (`planner.types.Measurement.status`).
MEASUREMENT_STATUS: dict[str, str] = {
    "ok": "the candidate ran: its peaks and times are measured",
    "oom": "the candidate ran out of memory (it does not fit)",
    "timeout": "the probe did not finish within its time (stopped, with its process group)",
    "error": "the probe failed for another reason (its message says why)",
    "skipped": "not measured here (why is in the reason): the estimate stands",
}
MeasurementStatus = Literal[tuple(MEASUREMENT_STATUS)]  # type: ignore[valid-type]
OK, OOM, TIMEOUT, ERROR, SKIPPED = MEASUREMENT_STATUS


def values(kind) -> tuple[str, ...]:
    """The values of a `Literal` alias defined here, in order."""
    return tuple(get_args(kind))


def choices_text(table) -> str:
    """`a | b | c` for help texts."""
    return " | ".join(table)
