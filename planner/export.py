"""The plan as the dicts other launchers consume: DeepSpeed config, Accelerate config, Trainer arguments.

Concrete values only ("auto" and Infinity are rejected by our users' tools or are not JSON). Each file carries what
its tool can express of the plan; the rest (selective checkpointing, bf16-true weights) is applied by
`LoadedPlan.prepare(model)` in the user's script. Files are written by `emit/`; these functions only build the dicts,
so launchers can use them without files.
"""

from __future__ import annotations

import dataclasses
import functools

from planner.config import Config
from planner.memory.gpu import DeepSpeedBuckets
from planner.models.adapters import Adapter
from planner.program.liger import trainer_config as liger_trainer_config
from planner.vocab import (
    ATTENTION, CHECKPOINTING, DEEPSPEED, DEFAULT_OPTIMIZER, ENGINE, FSDP, GROUPED, INDUCTOR, OFFLOAD, OPTIMIZER,
    PRECISION, TORCH,
)

#: Gradient clipping norm emitted for every engine (the Trainer's default max_grad_norm).
GRADIENT_CLIPPING = 1.0
#: fp16 dynamic loss scaling, written out explicitly: DeepSpeed's defaults (deepspeed/runtime/fp16/loss_scaler.py
#: `DynamicLossScaler`: init 2**16 via initial_scale_power 16, window 1000, hysteresis 2, min scale 1).
FP16_LOSS_SCALING = {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
                     "min_loss_scale": 1}
#: fp16 dynamic loss scaling under torch AMP (the Trainer and accelerate without DeepSpeed): GradScaler's defaults
#: (torch/amp/grad_scaler.py `GradScaler.__init__`): start at 2**16, halve and skip the step on inf/NaN gradients,
#: double after 2000 steps without one. accelerate builds it with these unless a GradScalerKwargs handler says
#: otherwise.
TORCH_GRAD_SCALER = {"init_scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000}
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
WEIGHT_DECAY = 0.0
#: The Trainer's default schedule, written out so that the file says what will happen
#: (transformers/training_args.py `lr_scheduler_type` default).
LR_SCHEDULER = "linear"
#: TrainingArguments' field naming the DeepSpeed config (a file, or the config itself as a dict)
DEEPSPEED_ARG = "deepspeed"
#: DeepSpeed prints every this many steps (its default is 10; the Trainer logs on its own).
STEPS_PER_PRINT = 100
#: For the DeepSpeed multi-node launch: torchrun on every node (launch.sh run with MACHINE_RANK on each), so no
#: passwordless ssh or pdsh is needed, and no hostfile: only DeepSpeed's own launchers read one
#: (accelerate/utils/launch.py:452-454 `prepare_deepspeed_cmd_env`, accelerate/utils/constants.py
#: DEEPSPEED_MULTINODE_LAUNCHERS).
DS_MULTINODE_LAUNCHER = "standard"
#: TrainingArguments' checkpointing fields, old name -> new: transformers 5 renamed them and warns (FutureWarning) when
#: the old names are given (transformers/training_args.py `__post_init__`); transformers < 5 has only the old names.
CHECKPOINTING_ARGS = {"gradient_checkpointing": "activation_checkpointing",
                      "gradient_checkpointing_kwargs": "activation_checkpointing_kwargs"}


def deepspeed_config(plan) -> dict:
    return deepspeed_config_for(plan.choice.config, plan.model.hidden, plan.optimizer, plan.lr.learning_rate,
                                plan.lr.warmup_steps)


def deepspeed_config_for(cfg: Config, hidden: int, optimizer: str, lr: float | None, warmup_steps: int = 0) -> dict:
    """The DeepSpeed config of one configuration (also what probes run)."""
    out = {
        "train_batch_size": cfg.global_batch,
        "train_micro_batch_size_per_gpu": cfg.micro_batch,
        "gradient_accumulation_steps": cfg.grad_accum,
        "gradient_clipping": GRADIENT_CLIPPING,
        "zero_optimization": _zero_block(cfg, hidden),
        "steps_per_print": STEPS_PER_PRINT,
        "wall_clock_breakdown": False,
    }
    flag = PRECISION[cfg.precision].trainer_flag
    if flag:
        out[flag] = {"enabled": True, **(FP16_LOSS_SCALING if PRECISION[cfg.precision].loss_scaling else {})}
    ds_type = OPTIMIZER[optimizer].deepspeed
    if lr is not None and ds_type:
        params = {"lr": lr, "weight_decay": WEIGHT_DECAY}
        if OPTIMIZER[optimizer].adam_betas:
            params.update(betas=list(ADAM_BETAS), eps=ADAM_EPS)
        out["optimizer"] = {"type": ds_type, "params": params}
        if warmup_steps > 0:  # WarmupLR rejects 0 steps; without warmup the Trainer's schedule applies
            out["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": lr,
                                                              "warmup_num_steps": warmup_steps,
                                                              "warmup_type": "linear"}}
    return out


def _zero_block(cfg: Config, hidden: int) -> dict:
    buckets = DeepSpeedBuckets.for_hidden(hidden)
    zero: dict = {"stage": cfg.zero_stage, "overlap_comm": True, "contiguous_gradients": True,
                  "reduce_bucket_size": buckets.reduce_bucket_size}
    if cfg.zero_stage in (1, 2):
        zero.update(allgather_partitions=True, allgather_bucket_size=buckets.allgather_bucket_size,
                    reduce_scatter=True)
    if cfg.zero_stage == 3:
        zero.update(stage3_prefetch_bucket_size=buckets.stage3_prefetch_bucket_size,
                    stage3_param_persistence_threshold=buckets.stage3_param_persistence_threshold,
                    stage3_max_live_parameters=1_000_000_000, stage3_max_reuse_distance=1_000_000_000,
                    stage3_gather_16bit_weights_on_model_save=True)
    offload = OFFLOAD[cfg.offload]
    if offload.optimizer_on_cpu:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload.params_on_cpu:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return zero


def accelerate_config(plan, *, ds_config_path: str = "ds_config.json", main_process_ip: str | None = None,
                      main_process_port: int = 29500, machine_rank: int = 0) -> dict:
    """accelerate's config file: single GPU, DDP, DeepSpeed or FSDP2, one node or many."""
    cfg, hw = plan.choice.config, plan.hardware
    out = {
        "compute_environment": "LOCAL_MACHINE", "debug": False, "downcast_bf16": "no", "enable_cpu_affinity": False,
        "machine_rank": machine_rank, "main_training_function": "main", "num_machines": hw.nodes,
        "num_processes": cfg.world_size, "rdzv_backend": "static" if hw.nodes == 1 else "c10d",
        "same_network": True, "tpu_env": [], "tpu_use_cluster": False, "tpu_use_sudo": False, "use_cpu": False,
        "gpu_ids": "all",
    }
    if hw.nodes > 1:
        if not main_process_ip:
            raise ValueError("a multi-node plan needs the address of machine rank 0 (main_process_ip)")
        out.update(main_process_ip=main_process_ip, main_process_port=main_process_port)
    if cfg.engine == DEEPSPEED:
        # no mixed_precision key: accelerate rejects it next to a DeepSpeed config file
        ds = {"deepspeed_config_file": ds_config_path, "zero3_init_flag": cfg.zero_stage == 3}
        if hw.nodes > 1:
            ds.update(deepspeed_multinode_launcher=DS_MULTINODE_LAUNCHER)
        out.update(distributed_type=ENGINE[DEEPSPEED].distributed_type, deepspeed_config=ds)
    elif cfg.engine == FSDP:
        out.update(distributed_type=ENGINE[FSDP].distributed_type, mixed_precision=PRECISION[cfg.precision].accelerate,
                   fsdp_config=_fsdp(cfg, plan.model.layer_class))
    else:
        out.update(distributed_type=ENGINE[TORCH].distributed_type if cfg.world_size > 1 else "NO",
                   mixed_precision=PRECISION[cfg.precision].accelerate)
    parallelism = parallelism_config(cfg, plan.attention, plan.seq_len)
    if parallelism:
        out["parallelism_config"] = parallelism
    if cfg.compiled:  # accelerate/commands/launch.py reads dynamo_config's keys as its --dynamo_* flags
        out["dynamo_config"] = {"dynamo_backend": INDUCTOR.upper()}
    if PRECISION[cfg.precision].float8:
        out["fp8_config"] = float8_config(cfg)
    return out


def parallelism_config(cfg: Config, attention: str, seq_len: int) -> dict:
    """accelerate's parallelism_config block (keys as its launcher's --parallelism_config_* flags, commands/launch.py
    :900-982, which it exports as PARALLELISM_CONFIG_* for ParallelismConfig, utils/launch.py:403-427): FSDP2's
    tensor parallelism or ring attention (cp_size, with the allgather rotation accelerate recommends), or DeepSpeed's
    Ulysses (sp_size, with the attention kernel it wraps); empty where the plan uses none."""
    prefix = "parallelism_config_"
    if cfg.tensor_parallel > 1:
        fields = {"dp_shard_size": cfg.data_parallel, "tp_size": cfg.tensor_parallel}
    elif cfg.context_parallel > 1:
        fields = {"dp_shard_size": cfg.data_parallel, "cp_size": cfg.context_parallel, "cp_backend": TORCH,
                  "cp_comm_strategy": "allgather"}
    elif cfg.sequence_parallel > 1:  # accelerate names the backends by their libraries: torch, deepspeed
        fields = {"dp_replicate_size": 1, "dp_shard_size": cfg.data_parallel, "sp_size": cfg.sequence_parallel,
                  "sp_backend": DEEPSPEED, "sp_seq_length": seq_len, "sp_seq_length_is_variable": False,
                  "sp_attn_implementation": ATTENTION[attention].transformers}
    else:
        return {}
    return {prefix + key: value for key, value in fields.items()}


def float8_config(cfg: Config) -> dict:
    """accelerate's fp8_config for torchao (launch.py:1272-1273 prefixes each key with fp8_, utils/launch.py:82-97
    exports them as ACCELERATE_FP8_*): the AO backend, torchao's float8 all-gather under FSDP2 (accelerate's default
    with AORecipeKwargs, utils/dataclasses.py:336-356), inner dimensions padded to 16 for torch._scaled_mm."""
    return {"backend": "AO", "enable_fsdp_float8_all_gather": cfg.engine == FSDP, "pad_inner_dim": True}


def _fsdp(cfg: Config, layer_class: str) -> dict:
    """FSDP2 through accelerate (accelerate/utils/dataclasses.py `FullyShardedDataParallelPlugin`, fsdp_version 2):
    stage 3 reshards after forward (FULL_SHARD), stage 2 keeps the gathered weights to the backward
    (SHARD_GRAD_OP). Full checkpointing is FSDP's own (the Trainer raises if its flag is set too); selective is
    applied by `plan.prepare`."""
    ckpt = CHECKPOINTING[cfg.checkpointing]
    return {
        "fsdp_version": 2,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": layer_class,
        "fsdp_reshard_after_forward": cfg.zero_stage == 3,
        "fsdp_offload_params": OFFLOAD[cfg.offload].params_on_cpu,
        "fsdp_activation_checkpointing": ckpt.enabled and not ckpt.per_op_policy,
        # accelerate refuses its AO float8 backend with FSDP2's RAM-efficient loading (accelerator.py:518-527)
        "fsdp_cpu_ram_efficient_loading": not PRECISION[cfg.precision].float8,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
    }


def training_args(plan, *, ds_config_path: str = "ds_config.json", output_dir: str = "output") -> dict:
    """Keyword arguments for transformers.TrainingArguments: what the Trainer can express of the plan. Paths are as
    given (the emitted file holds names relative to its folder; `LoadedPlan` resolves them)."""
    cfg = plan.choice.config
    flag = PRECISION[cfg.precision].trainer_flag
    ckpt = CHECKPOINTING[cfg.checkpointing]
    trainer_ckpt = ckpt.enabled and not ckpt.per_op_policy and cfg.engine != FSDP
    info = OPTIMIZER[plan.optimizer]
    out = {
        "output_dir": output_dir,
        "per_device_train_batch_size": cfg.micro_batch,
        "gradient_accumulation_steps": cfg.grad_accum,
        "bf16": flag == "bf16",
        "fp16": flag == "fp16",
        checkpointing_arg("gradient_checkpointing"): trainer_ckpt,
        "max_grad_norm": GRADIENT_CLIPPING,
        "lr_scheduler_type": LR_SCHEDULER,
        "warmup_steps": plan.lr.warmup_steps,
        "optim": info.trainer or OPTIMIZER[DEFAULT_OPTIMIZER].trainer,  # a placeholder for plan.create_optimizer's
        "weight_decay": WEIGHT_DECAY,
        "ddp_find_unused_parameters": False,
    }
    if PRECISION[cfg.precision].tf32:  # TrainingArguments sets torch.backends.cuda.matmul.allow_tf32 from it
        out["tf32"] = True
    if cfg.compiled:  # the Trainer hands accelerate a TorchDynamoPlugin with this backend (transformers/trainer.py)
        out.update(torch_compile=True, torch_compile_backend=INDUCTOR)
    if cfg.liger:  # the Trainer patches the model in train() (transformers/integrations/liger.py)
        out["use_liger_kernel"] = True
        liger_config = liger_trainer_config(plan.model.model_type, plan.model.task)
        if liger_config is not None:
            out["liger_kernel_config"] = liger_config
    if info.options:
        out["optim_args"] = info.options
    if info.adam_betas:  # the betas the DeepSpeed block uses too
        out.update(adam_beta1=ADAM_BETAS[0], adam_beta2=ADAM_BETAS[1], adam_epsilon=ADAM_EPS)
    if trainer_ckpt:
        out[checkpointing_arg("gradient_checkpointing_kwargs")] = {"use_reentrant": False}
    if plan.lr.learning_rate is not None:
        out["learning_rate"] = plan.lr.learning_rate
    if cfg.engine == DEEPSPEED:
        out[DEEPSPEED_ARG] = ds_config_path
    if cfg.padding == GROUPED:  # the Trainer's length-grouped sampler (transformers/trainer_pt_utils.py)
        out.update(length_grouped_args())
    return out


@functools.cache
def length_grouped_args() -> dict:
    """The TrainingArguments that turn on the length-grouped sampler: transformers 5's `train_sampling_strategy`
    (transformers/training_args.py), earlier releases' `group_by_length`."""
    # lazy: transformers takes seconds to import; only files for its Trainer need it
    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return {"train_sampling_strategy": "group_by_length"} if "train_sampling_strategy" in names else \
        {"group_by_length": True}


@functools.cache
def checkpointing_arg(old: str) -> str:
    """The name the installed TrainingArguments takes, without a deprecation warning, for the checkpointing argument
    transformers < 5 calls `old` (a key of CHECKPOINTING_ARGS)."""
    # lazy: transformers takes seconds to import; only files for its Trainer need it
    from transformers import TrainingArguments

    new = CHECKPOINTING_ARGS[old]
    return new if new in {f.name for f in dataclasses.fields(TrainingArguments)} else old


def peft_config(plan) -> dict | None:
    """The adapters as the libraries take them (None for full fine-tuning): `lora_config`, peft's
    `LoraConfig(**...)`; `bnb_config`, transformers' `BitsAndBytesConfig(**...)` for loading a QLoRA base (its compute
    dtype the plan's 16-bit one); `mixed_precision_cast`, whether frozen weights go to that 16-bit dtype and
    trainable ones to fp32 (what `LoadedPlan.prepare` does)."""

    adapter = Adapter.from_json(plan.model.adapter)
    if adapter is None:
        return None
    half = plan.choice.config.half_dtype()  # "bfloat16" / "float16", None for fp32
    return {"lora_config": adapter.lora_kwargs(plan.model.task), "bnb_config": adapter.bnb_kwargs(half or "bfloat16"),
            "mixed_precision_cast": half}


def loss_scaling(plan) -> dict | None:
    """The fp16 loss-scaling policy the emitted files run (None without fp16): DeepSpeed's block as ds_config.json
    writes it, or torch's GradScaler; gradients are clipped after unscaling in both (the Trainer's
    `accelerator.clip_grad_norm_` unscales first; DeepSpeed clips the unscaled fp32 gradients)."""
    cfg = plan.choice.config
    if not PRECISION[cfg.precision].loss_scaling:
        return None
    policy = dict(FP16_LOSS_SCALING) if cfg.engine == DEEPSPEED else dict(TORCH_GRAD_SCALER)
    return {"engine": DEEPSPEED if cfg.engine == DEEPSPEED else "torch.amp.GradScaler", **policy,
            "clip_grad_norm_after_unscale": GRADIENT_CLIPPING}


def emit_problem(plan) -> str | None:
    """Why the plan's files cannot train it as planned, or None: an optimizer no library here implements."""
    info = OPTIMIZER[plan.optimizer]
    if info.trainer is None and info.client is None:
        return (f"no library trainplan drives implements {plan.optimizer} (torch, transformers, DeepSpeed, "
                "bitsandbytes): the plan's memory and speed stand, but emitted files would train another optimizer")
    return None
