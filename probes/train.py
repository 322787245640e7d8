"""The shipped training script: trains the planned model from random weights on synthetic batches through the files
`plan --emit DIR` wrote, with `accelerate launch` and the HF Trainer, and reports what each rank measured.

    plan --model gpt2 --batch 64 --emit run/
    accelerate launch --config_file run/accelerate_config.yaml -m probes.train --plan run --steps 3

(or `plan ... --launch -- -m probes.train --plan DIR`). Each rank prints one `PROBE-RESULT {json}` line and, with
`--out DIR`, writes DIR/rank-<r>.json: peak memory after the warm-up steps (torch.cuda.max_memory_allocated /
max_memory_reserved on CUDA; the live-tensor tracker's peak on the CPU), the median micro-step, optimizer-step and
step times, tokens/s of the rank, and the losses. The model is built with its own initialisation (parameters and
buffers), then `plan.prepare(model)` and `plan.training_arguments()` apply the plan, as in a user's script.
Probes run this very script under each candidate's emitted files.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from planner.models import resolve_model
from planner.models.build import model_class
from planner.prepare import load_plan
from planner.program.step import make_batch
from planner.types import Measurement
from planner.vocab import FSDP
from probes.measure import StepMeter, failure, memory_history, profile_summary
from probes.protocol import result_line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m probes.train", description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True, help="the folder `plan --emit` wrote (or its plan.json)")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps measured (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=1, help="optimizer steps before measuring")
    parser.add_argument("--out", default=None, help="write each rank's result to OUT/rank-<r>.json")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code to run")
    parser.add_argument("--profile", default=None, metavar="FILE",
                        help="also write FILE: device and host time per op over the run (torch.profiler)")
    parser.add_argument("--memory-peak", default=None, metavar="FILE",
                        help="also write FILE: what was live at the run's peak of allocated memory, by the line "
                             "that allocated it (CUDA only; records the allocator's history, which slows the run)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    return args


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def model_config(plan, trust_remote_code: bool):
    """The planned model's config (resolved offline, as `plan` did), read before the training arguments exist:
    with ZeRO-3 they make every model built afterwards go through deepspeed.zero.Init."""

    return plan.model_config(resolve_model(plan.model_name, trust_remote_code=trust_remote_code).config)


def build_model(plan, config, trust_remote_code: bool):
    """The planned model with random weights from its own initialisation, on this rank's device (on the CPU for
    DeepSpeed ZeRO-3, whose zero.Init partitions it as it is built)."""
    import torch

    cls = model_class(config, trust_remote_code)
    cfg = plan.choice
    device = "cpu"
    if torch.cuda.is_available() and not (cfg.sharded and cfg.zero_stage == 3):
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    torch.manual_seed(0)
    with torch.device(device):
        return cls._from_config(config, dtype=torch.float32)


class SyntheticBatches:
    """`count` random samples of the model's task (token ids and the labels its head trains on)."""

    def __init__(self, model, count: int, seq_len: int):
        self.tensors = make_batch(model, count, seq_len, device="cpu")

    def __len__(self) -> int:
        return len(self.tensors["input_ids"])

    def __getitem__(self, index: int) -> dict:
        return {name: value[index] for name, value in self.tensors.items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = load_plan(args.plan)
    try:
        result = train(plan, args)
    except Exception as err:  # noqa: BLE001 - a failed run is a result line, as a probe reads it

        result = failure(err)
    sys.stdout.write(result_line(result))
    sys.stdout.flush()
    _leave_process_group()
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank-{rank()}.json").write_text(result.model_dump_json(indent=1) + "\n")
    return 0 if result.status == "ok" else 1


def _leave_process_group() -> None:
    """Destroy the process group before exit: torch aborts a process that exits with one alive."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _fsdp_on_cpu(trainer, cfg) -> None:
    """accelerate turns FSDP on only for GPU distributed types (accelerate/state.py `AcceleratorState.__init__`),
    so on a machine without CUDA a planned FSDP run would silently train as CPU DDP. For CPU runs (the project's
    tests) set what accelerate sets on a GPU: the FSDP plugin, read from the FSDP_* environment `accelerate launch`
    exported, and the Trainer's flag that creates the optimizer after the model is sharded
    (transformers/trainer.py `create_accelerator_and_postprocess`)."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    if cfg.engine != FSDP or state.distributed_type == DistributedType.FSDP:
        return
    plugin = FullyShardedDataParallelPlugin()
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP
    trainer.is_fsdp_enabled = True


@contextlib.contextmanager
def profiled(path: str | None, steps: int, cuda: bool):
    """Run the block under torch.profiler when `path` is given and write its per-op summary there."""
    if not path:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        yield
    Path(path).write_text(json.dumps(profile_summary(prof, steps), indent=1) + "\n")


def train(plan, args) -> Measurement:
    with memory_history(args.memory_peak):  # from before the model exists: every block of the run is in the trace
        return _train(plan, args)


def _train(plan, args) -> Measurement:
    import torch
    from transformers import Trainer

    cfg = plan.choice
    cuda = torch.cuda.is_available()
    total = args.warmup + args.steps
    config = model_config(plan, args.trust_remote_code)
    cpu_only = {} if cuda else {"use_cpu": True, "tf32": None}  # a CPU has no TF32 (TrainingArguments refuses it)
    targs = plan.training_arguments(output_dir=tempfile.mkdtemp(prefix="trainplan-train-"), max_steps=total,
                                    save_strategy="no", report_to="none", logging_steps=1, disable_tqdm=True,
                                    dataloader_num_workers=0, seed=0, **cpu_only)
    model = plan.prepare(build_model(plan, config, args.trust_remote_code))  # after the arguments: zero.Init
    data = SyntheticBatches(model, cfg.global_batch * total, plan.seq_len)
    meter = StepMeter(warmup=args.warmup, cuda=cuda, model=model)
    optimizer = plan.create_optimizer(model)  # LAMB: a class the Trainer has no name for
    trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[meter],
                      optimizers=(optimizer, None) if optimizer is not None else (None, None))
    if not cuda:
        _fsdp_on_cpu(trainer, cfg)
    start = time.perf_counter()
    with meter.tracking(), profiled(args.profile, total, cuda):
        trainer.train()
    wall = time.perf_counter() - start
    return meter.measurement(micro_batch=targs.per_device_train_batch_size, seq_len=plan.seq_len,
                             processes=int(os.environ.get("WORLD_SIZE", "1")), engine=cfg.engine, wall_s=wall)


if __name__ == "__main__":
    sys.exit(main())

