"""The shipped training script: trains the planned model from random weights on synthetic batches through the files
`plan --emit DIR` wrote, with `accelerate launch` and the HF Trainer, and reports what each rank measured.

    plan --model gpt2 --batch 64 --emit run/
    accelerate launch --config_file run/accelerate_config.yaml -m probes.train --plan run --steps 3

`--steps` counts every optimizer step the run takes; the first `--warmup` of them (default 1, at most `--steps` - 1,
so that one step is always measured) are not measured: `--steps 2` is one warm-up step and one measured step.

(or `plan ... --launch -- -m probes.train --plan DIR`). Each rank prints one `PROBE-RESULT {json}` line and, with
`--out DIR`, writes DIR/rank-<r>.json: peak memory after the warm-up steps (torch.cuda.max_memory_allocated /
max_memory_reserved on CUDA; the live-tensor tracker's peak on the CPU), the median micro-step, optimizer-step and
step times, tokens/s of the rank, and the losses. The model is built with its own initialisation (parameters and
buffers), then `plan.prepare(model)` and `plan.training_arguments()` apply the plan, as in a user's script.
Probes run this very script under each candidate's emitted files.

Before anything is built, the plan's predicted peak is compared with what this machine has (the GPU's free memory;
on the CPU the available RAM): a plan that cannot fit is refused at once, in one line naming both numbers (exit code
2; `--force` runs it anyway). Rank 0 writes one line per optimizer step to stderr: step i/n, loss, seconds.
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
from planner.errors import TrainplanError
from planner.prepare import load_plan
from planner.program.step import make_batch
from planner.types import Measurement
from planner.vocab import FSDP, OK
from probes.protocol import result_line

DESCRIPTION = ("Train the planned model for a few steps (random weights, synthetic batches, the HF Trainer) with the "
               "files `plan --emit DIR` wrote, and report each rank's peak memory and step times.")
#: Exit code of a run refused because the plan cannot fit this machine, or whose plan cannot be read.
NO_FIT = BAD_INPUT = 2
GIB = 2**30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m probes.train", description=DESCRIPTION)
    parser.add_argument("--plan", required=True, help="the folder `plan --emit` wrote (or its plan.json)")
    parser.add_argument("--steps", type=int, default=3,
                        help="optimizer steps the run takes in all, the warm-up included (default 3)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="how many of those steps come first and are not measured (default 1; at most --steps - 1, "
                             "so one step is always measured)")
    parser.add_argument("--out", default=None, help="write each rank's result to OUT/rank-<r>.json")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code to run")
    parser.add_argument("--profile", default=None, metavar="FILE",
                        help="also write FILE: device and host time per op over the run (torch.profiler)")
    parser.add_argument("--profile-step", default=None, metavar="FILE",
                        help="after the measured steps, profile one more micro-step (forward and backward, not timed "
                             "with the rest) and write FILE: device and host time per op (torch.profiler)")
    parser.add_argument("--memory-peak", default=None, metavar="FILE",
                        help="also write FILE: what was live at the run's peak of allocated memory, by the line "
                             "that allocated it (CUDA only; records the allocator's history, which slows the run)")
    parser.add_argument("--force", action="store_true",
                        help="run even when the plan's predicted peak memory exceeds what this machine has")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    args.warmup = min(args.warmup, args.steps - 1)
    return args


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def available_ram() -> int:
    """Bytes of RAM that new allocations can take: /proc/meminfo's MemAvailable (Linux), else the free pages."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def memory_refusal(data: dict) -> str | None:
    """Why the plan (plan.json's contents) cannot fit this machine, and what to do, in one line; None if it fits
    or the plan has no prediction."""
    import torch

    memory = data.get("memory") or {}
    if not memory.get("peak"):
        return None
    if torch.cuda.is_available():
        return _gpu_refusal(data, memory)
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # this machine's ranks share its RAM
    need, have = memory.get("peak_allocated", memory["peak"]) * processes, available_ram()
    if need <= have:
        return None
    many = f"{processes} processes" if processes > 1 else "1 process"
    return (f"this plan needs {need / GIB:.1f} GiB of RAM for its tensors (plan.json memory.peak_allocated x {many}; "
            f"it was planned for {data['hardware']['gpu']}) and this machine has {have / GIB:.1f} GiB available "
            f"(MemAvailable): plan a smaller run ({_smaller(data)}), or pass --force to run it anyway")


def _smaller(data: dict) -> str:
    """The plan command with a smaller micro-batch or sequence, as advice."""
    model, micro = data["model"], data["choice"]["micro_batch"]
    knobs = ([f"--micro-batch below {micro}"] if micro > 1 else []) + [f"--seq-len below {model['seq_len']}"]
    return f"plan --model {model['name']} with {' or '.join(knobs)}"


def _gpu_refusal(data: dict, memory: dict) -> str | None:
    """memory_refusal on CUDA: the plan's peak against this rank's GPU's free memory."""
    import torch

    device = local_rank()
    if device >= torch.cuda.device_count():  # more processes than GPUs: building the model will say so
        return None
    free, _ = torch.cuda.mem_get_info(device)
    # the plan's peak counts this process's CUDA context, which exists now that the free memory was asked for
    need = memory["peak"] - (memory.get("terms") or {}).get("cuda_context", 0)
    if need <= free:
        return None
    return (f"this plan needs {need / GIB:.1f} GiB per GPU (plan.json memory.peak, planned for "
            f"{data['hardware']['gpu']}) and cuda:{device} ({torch.cuda.get_device_name(device)}) has "
            f"{free / GIB:.1f} GiB free: plan for this GPU (plan --model {data['model']['name']} here, without --gpu) "
            f"or a smaller run ({_smaller(data)}), or pass --force to run it anyway")


def model_config(plan, trust_remote_code: bool):
    """The planned model's config (resolved offline, as `plan` did), read before the training arguments exist:
    with ZeRO-3 they make every model built afterwards go through deepspeed.zero.Init."""

    return plan.model_config(resolve_model(plan.model_name, trust_remote_code=trust_remote_code).config)


def build_model(plan, config, trust_remote_code: bool):
    """The planned model with random weights from its own initialisation, on this rank's device (on the CPU for
    DeepSpeed ZeRO-3, whose zero.Init partitions it as it is built)."""
    import torch

    cls = model_class(config, trust_remote_code)
    cfg = plan.config
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
    try:
        plan = load_plan(args.plan)
        plan.model_name  # noqa: B018 - a local model folder the plan names must be found before anything loads
    except TrainplanError as err:
        if local_rank() == 0:
            sys.stderr.write(f"probes.train: {err.message}" + (f"; {err.hint}" if err.hint else "") + "\n")
        return BAD_INPUT
    refusal = None if args.force else memory_refusal(plan.data)
    if refusal:
        if local_rank() == 0:  # one line per machine
            sys.stderr.write(f"probes.train: {refusal}\n")
        return NO_FIT
    result = train(plan, args)
    sys.stdout.write(result_line(result))
    sys.stdout.flush()
    if result.status != OK and local_rank() == 0:
        sys.stderr.write(f"probes.train: the run failed ({result.status}): {result.reason.splitlines()[0]}\n")
    _leave_process_group()
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank-{rank()}.json").write_text(result.model_dump_json(indent=1) + "\n")
    return 0 if result.status == OK else 1


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

    # lazy: probes.measure imports the Trainer (seconds); --help and the memory check answer before it loads
    from probes.measure import profile_summary

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        yield
    Path(path).write_text(json.dumps(profile_summary(prof, steps), indent=1) + "\n")


def train(plan, args) -> Measurement:
    """Train and measure; a failed run is a result too (an out-of-memory error an OOM), as a probe reads it."""
    # lazy: probes.measure imports the Trainer (seconds); --help and the memory check answer before it loads
    from probes.measure import failure, memory_history

    try:
        with memory_history(args.memory_peak):  # from before the model exists: every block of the run is in the trace
            return _train(plan, args)
    except Exception as err:  # noqa: BLE001 - a failed run is a result line, as a probe reads it
        return failure(err)


def progress(total: int):
    """A Trainer callback writing one line per optimizer step to stderr on rank 0: step i/n, loss, seconds."""
    from transformers import TrainerCallback

    class Progress(TrainerCallback):
        start = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and logs and "loss" in logs:
                sys.stderr.write(f"step {state.global_step}/{total}  loss {logs['loss']:.4f}  "
                                 f"{time.perf_counter() - self.start:.2f} s\n")
                sys.stderr.flush()

    return Progress()


def _train(plan, args) -> Measurement:
    import torch
    from transformers import Trainer
    from transformers.trainer_callback import PrinterCallback

    # lazy: probes.measure imports the Trainer (seconds); --help and the memory check answer before it loads
    from probes.measure import StepMeter

    cfg = plan.config
    cuda = torch.cuda.is_available()
    total = args.steps
    config = model_config(plan, args.trust_remote_code)
    targs = plan.training_arguments(output_dir=tempfile.mkdtemp(prefix="trainplan-train-"), max_steps=total,
                                    save_strategy="no", report_to="none", logging_steps=1, disable_tqdm=True,
                                    dataloader_num_workers=0, seed=0)
    model = plan.prepare(build_model(plan, config, args.trust_remote_code))  # after the arguments: zero.Init
    data = SyntheticBatches(model, cfg.global_batch * total, plan.seq_len)
    meter = StepMeter(warmup=args.warmup, cuda=cuda, model=model)
    optimizer = plan.create_optimizer(model)  # LAMB: a class the Trainer has no name for
    receipt = plan.callback(warmup=args.warmup)  # receipt.json in the plan's folder
    trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[meter, progress(total), receipt],
                      optimizers=(optimizer, None) if optimizer is not None else (None, None))
    trainer.remove_callback(PrinterCallback)  # its log dicts on stdout: the progress lines say it once
    if not cuda:
        _fsdp_on_cpu(trainer, cfg)
    start = time.perf_counter()
    with meter.tracking(), profiled(args.profile, total, cuda):
        trainer.train()
    wall = time.perf_counter() - start
    measured = meter.measurement(micro_batch=targs.per_device_train_batch_size, seq_len=plan.seq_len,
                                 processes=int(os.environ.get("WORLD_SIZE", "1")), engine=cfg.engine, wall_s=wall)
    if args.profile_step:  # after everything was measured: its time and memory are in nothing above
        profile_micro_step(trainer, args.profile_step, cuda)
    return measured


def profile_micro_step(trainer, path: str, cuda: bool) -> None:
    """One more micro-step (the Trainer's own `training_step`, transformers/trainer.py: forward and backward of a
    batch of its data loader, no optimizer step) under torch.profiler, its per-op summary written to `path`."""
    with profiled(path, 1, cuda):
        trainer.training_step(trainer.model_wrapped, next(iter(trainer.get_train_dataloader())))


if __name__ == "__main__":
    sys.exit(main())

