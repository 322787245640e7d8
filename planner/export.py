"""The plan as the dicts other launchers consume: DeepSpeed config, Accelerate config, Trainer arguments.

Concrete values only ("auto" and Infinity are rejected by our users' tools or are not JSON). Files are
written by `emit/`; these functions only build the dicts, so launchers can use them without files.
"""

from __future__ import annotations

from planner.memory.estimate import ds_bucket_elements

#: Gradient clipping norm emitted for every engine (the Trainer's default max_grad_norm).
GRADIENT_CLIPPING = 1.0
#: DeepSpeed's fp16 dynamic loss scaling, written out explicitly (reference.md: DeepSpeed defaults).
FP16_LOSS_SCALING = {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
                     "min_loss_scale": 1}
ADAM_BETAS = [0.9, 0.999]
ADAM_EPS = 1e-8
#: DeepSpeed optimizer types for ours; others (sgd, adafactor, 8-bit) are built by the training script.
DS_OPTIMIZER = {"adamw": "AdamW", "adam": "Adam", "lion": "Lion"}
MIXED = {"bf16-mixed": "bf16", "fp16-mixed": "fp16", "fp32": "no", "bf16-true": "bf16"}


def deepspeed_config(plan) -> dict:
    return deepspeed_config_for(plan.choice.config, plan.model["hidden"], plan.optimizer, plan.lr.learning_rate,
                                plan.lr.warmup_steps)


def deepspeed_config_for(cfg, hidden: int, optimizer: str, lr: float | None, warmup_steps: int = 0) -> dict:
    """The DeepSpeed config of one configuration (also what probes run)."""
    buckets = ds_bucket_elements(hidden)
    zero: dict = {"stage": cfg.zero_stage}
    if cfg.zero_stage > 0:
        zero.update(overlap_comm=True, contiguous_gradients=True, reduce_bucket_size=buckets["reduce_bucket_size"])
    if cfg.zero_stage in (1, 2):
        zero.update(allgather_partitions=True, allgather_bucket_size=buckets["allgather_bucket_size"],
                    reduce_scatter=True)
    if cfg.zero_stage == 3:
        zero.update(stage3_prefetch_bucket_size=buckets["stage3_prefetch_bucket_size"],
                    stage3_param_persistence_threshold=buckets["stage3_param_persistence_threshold"],
                    stage3_max_live_parameters=1_000_000_000, stage3_max_reuse_distance=1_000_000_000,
                    stage3_gather_16bit_weights_on_model_save=True)
    if cfg.offload in ("optimizer", "optimizer+params"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if cfg.offload == "optimizer+params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    out = {
        "train_batch_size": cfg.global_batch,
        "train_micro_batch_size_per_gpu": cfg.micro_batch,
        "gradient_accumulation_steps": cfg.grad_accum,
        "gradient_clipping": GRADIENT_CLIPPING,
        "zero_optimization": zero,
        "steps_per_print": 100,
        "wall_clock_breakdown": False,
    }
    if cfg.precision == "fp16-mixed":
        out["fp16"] = {"enabled": True, **FP16_LOSS_SCALING}
    elif cfg.precision in ("bf16-mixed", "bf16-true"):
        out["bf16"] = {"enabled": True}
    if lr is not None and optimizer in DS_OPTIMIZER:
        params = {"lr": lr, "weight_decay": 0.0}
        if optimizer != "lion":
            params.update(betas=ADAM_BETAS, eps=ADAM_EPS)
        out["optimizer"] = {"type": DS_OPTIMIZER[optimizer], "params": params}
    if lr is not None and optimizer in DS_OPTIMIZER and warmup_steps > 0:
        # WarmupLR rejects 0 steps; without warmup the LR is simply constant (no scheduler block)
        out["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": lr,
                                                          "warmup_num_steps": warmup_steps, "warmup_type": "linear"}}
    return out


def accelerate_config(plan, *, engine: str = "deepspeed", ds_config_path: str = "ds_config.json",
                      main_process_ip: str | None = None, main_process_port: int = 29500, machine_rank: int = 0,
                      layer_class: str | None = None) -> dict:
    """accelerate's config file contents: single GPU, DDP, DeepSpeed, or FSDP (`engine="fsdp"`)."""
    cfg = plan.choice.config
    hw = plan.hardware
    out = {
        "compute_environment": "LOCAL_MACHINE", "debug": False, "downcast_bf16": "no", "enable_cpu_affinity": False,
        "machine_rank": machine_rank, "main_training_function": "main", "num_machines": hw.nodes,
        "num_processes": cfg.world_size, "rdzv_backend": "static" if hw.nodes == 1 else "c10d",
        "same_network": True, "tpu_env": [], "tpu_use_cluster": False, "tpu_use_sudo": False, "use_cpu": False,
        "gpu_ids": "all",
    }
    if hw.nodes > 1:
        out["main_process_ip"] = main_process_ip or "127.0.0.1"
        out["main_process_port"] = main_process_port
    if cfg.zero_stage > 0 and engine == "fsdp":
        out.update(distributed_type="FSDP", mixed_precision=MIXED[cfg.precision], fsdp_config=_fsdp(plan, layer_class))
    elif cfg.zero_stage > 0 or cfg.offload != "none":
        # no mixed_precision key: accelerate rejects it next to a DeepSpeed config file
        out.update(distributed_type="DEEPSPEED",
                   deepspeed_config={"deepspeed_config_file": ds_config_path, "zero3_init_flag": cfg.zero_stage == 3})
    else:
        out.update(distributed_type="MULTI_GPU" if cfg.world_size > 1 else "NO", mixed_precision=MIXED[cfg.precision])
    return out


def _fsdp(plan, layer_class: str | None) -> dict:
    cfg = plan.choice.config
    return {
        "fsdp_activation_checkpointing": cfg.checkpointing != "none",
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_backward_prefetch": "BACKWARD_PRE",
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_forward_prefetch": False,
        "fsdp_offload_params": cfg.offload == "optimizer+params",
        "fsdp_sharding_strategy": "FULL_SHARD" if cfg.zero_stage == 3 else "SHARD_GRAD_OP",
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_sync_module_states": True,
        "fsdp_transformer_layer_cls_to_wrap": layer_class or plan.model.get("layer_class") or "",
        "fsdp_use_orig_params": True,
        "fsdp_version": 1,
    }


def training_args(plan, *, ds_config_path: str = "ds_config.json", output_dir: str = "output") -> dict:
    """Keyword arguments for transformers.TrainingArguments."""
    cfg = plan.choice.config
    out = {
        "output_dir": output_dir,
        "per_device_train_batch_size": cfg.micro_batch,
        "gradient_accumulation_steps": cfg.grad_accum,
        "bf16": cfg.precision in ("bf16-mixed", "bf16-true"),
        "fp16": cfg.precision == "fp16-mixed",
        "gradient_checkpointing": cfg.checkpointing != "none",
        "max_grad_norm": GRADIENT_CLIPPING,
        "warmup_steps": plan.lr.warmup_steps,
        "optim": "adamw_torch_fused" if plan.optimizer in ("adamw", "adam") else _trainer_optim(plan.optimizer),
    }
    if cfg.checkpointing != "none":
        out["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
    if plan.lr.learning_rate is not None:
        out["learning_rate"] = plan.lr.learning_rate
    if cfg.zero_stage > 0:
        out["deepspeed"] = ds_config_path
        if plan.optimizer in DS_OPTIMIZER and plan.lr.learning_rate is not None:
            out["adam_beta1"], out["adam_beta2"] = ADAM_BETAS
            out["adam_epsilon"] = ADAM_EPS
            out["weight_decay"] = 0.0
    return out


def _trainer_optim(optimizer: str) -> str:
    return {"sgd": "sgd", "sgd-momentum": "sgd", "adafactor": "adafactor", "adamw-8bit": "adamw_bnb_8bit",
            "lion": "lion_32bit"}[optimizer]
