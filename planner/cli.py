"""`plan` / `trainplan`: parse -> request -> planner.plan() -> render / emit / launch. Thin by design.

Exit codes: 0 a plan was found; 1 nothing fits (with what would); 2 bad input (flag and fix); 3 an internal error
(a bug: please report it).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer

from emit import EmitOptions, check_destination, emit, launch_command, run_launch
from emit.files import ACCELERATE_CONFIG
from planner.errors import InputError, NoFitError, TrainplanError
from planner.hardware import catalog, detect_gpus, lookup_gpu
from planner.models.presets import presets
from planner.render import comparison_table, render_no_fit, render_plan
from planner.request import build_request
from planner.vocab import (
    ADAPTER, ATTENTION, AUTO, AUTO_METHOD, CHECKPOINTING, COMPILE, DEFAULT_OPTIMIZER, DEFAULT_SHARDING_ENGINE,
    LR_SCALING, MEMORY_METHOD, NO_ADAPTER, OFFLOAD, OPTIMIZER, PRECISION, SDPA, SHARDING_ENGINES, TASK_CHOICES,
    choices_text,
)

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None,
                  context_settings={"help_option_names": ["-h", "--help"]})
Opt = typer.Option

# --- the flags (help texts read the vocabulary's tables)
Model = Annotated[Optional[str], Opt("--model", "-m", help="Hub id, local folder with config.json, or a bundled preset.")]
Batch = Annotated[Optional[int], Opt("--batch", "-b", help="Global batch size (samples per optimizer step).")]
SeqLen = Annotated[Optional[int], Opt("--seq-len", help="Training sequence length (default: the model's, at most 2048).")]
Gpu = Annotated[Optional[str], Opt("--gpu", help="GPU model, e.g. A100-80GB (default: detected, else the reference "
                                                  "A100-80GB).")]
GpusPerNode = Annotated[Optional[int], Opt("--gpus-per-node", help="GPUs per node (default: detected count, else 1).")]
Nodes = Annotated[int, Opt("--nodes", help="Number of nodes.")]
Optimizer = Annotated[str, Opt("--optimizer", help=choices_text(OPTIMIZER))]
Precision = Annotated[str, Opt("--precision", help=choices_text({AUTO: None, **PRECISION}))]
MicroBatch = Annotated[Optional[int], Opt("--micro-batch", help="Pin the micro-batch size.")]
Checkpointing = Annotated[Optional[str], Opt("--checkpointing", help="Pin activation checkpointing: "
                                                                      + choices_text(CHECKPOINTING))]
ZeroStage = Annotated[Optional[int], Opt("--zero-stage", help="Pin the sharding stage (ZeRO numbering, 0-3).")]
Attention = Annotated[str, Opt("--attention", help=choices_text(ATTENTION))]
Engine = Annotated[str, Opt("--engine", help="Engine for sharded candidates: " + choices_text(SHARDING_ENGINES)
                                              + " (FSDP2: stage 2 = SHARD_GRAD_OP, 3 = FULL_SHARD).")]
NoOffload = Annotated[bool, Opt("--no-offload", help="Never offload optimizer or parameters to the CPU.")]
Offload = Annotated[Optional[str], Opt("--offload", help="Pin the CPU offload: " + choices_text(OFFLOAD))]
Headroom = Annotated[Optional[float], Opt("--headroom", help="Fraction of GPU memory kept free (default 0.05).")]
HostMemory = Annotated[Optional[float], Opt("--host-memory", help="Host RAM per node in GB, for CPU offload (default: "
                                            "this machine's when planning for its GPU, else an assumed 2 TiB node).")]
NicGbps = Annotated[Optional[float], Opt("--nic-gbps", help="Inter-node bandwidth per GPU in Gb/s, for plans over "
                                       "several nodes (default: the GPU's usual system, e.g. 200 for DGX A100; AWS "
                                       "p4d's EFA: 50).")]
Lr = Annotated[Optional[float], Opt("--lr", help="Base learning rate, tuned at --lr-batch.")]
LrBatch = Annotated[Optional[int], Opt("--lr-batch", help="Batch the base LR was tuned at (default: micro-batch x "
                                                          "GPUs).")]
LrScaling = Annotated[str, Opt("--lr-scaling", help=choices_text(LR_SCALING))]
MemoryMethod = Annotated[str, Opt("--memory-method", help=choices_text(MEMORY_METHOD))]
TrustRemoteCode = Annotated[bool, Opt("--trust-remote-code", help="Allow the model's own code (auto_map) to run.")]
Task = Annotated[str, Opt("--task", help="The head to train: auto (the config's architectures[0]), "
                                          + ", ".join(TASK_CHOICES[1:]) + ".")]
NumLabels = Annotated[Optional[int], Opt("--num-labels", help="Labels of a classification head (--task seq-cls or "
                                                              "token-cls).")]
Peft = Annotated[str, Opt("--peft", help="Train adapters over the frozen model: " + choices_text(ADAPTER))]
LoraRank = Annotated[Optional[int], Opt("--lora-rank", help="LoRA rank r (default 16).")]
LoraAlpha = Annotated[Optional[float], Opt("--lora-alpha", help="LoRA alpha (default 2 x rank).")]
LoraTargets = Annotated[Optional[str], Opt("--lora-targets", help="all-linear (default) or module names, e.g. "
                                                                  "q_proj,v_proj.")]
LoraDropout = Annotated[Optional[float], Opt("--lora-dropout", help="LoRA dropout (default 0.05).")]
NoDoubleQuant = Annotated[bool, Opt("--no-double-quant", help="QLoRA: keep the 4-bit blocks' constants in fp32.")]
AsJson = Annotated[bool, Opt("--json", help="Print the plan (or the error) as JSON.")]
EmitDir = Annotated[Optional[Path], Opt("--emit", help="Write accelerate_config.yaml, training_args.json, plan.json, "
                                                       "launch.sh (and ds_config.json, hostfile where needed) here.")]
Force = Annotated[bool, Opt("--force", help="Overwrite files --emit would replace.")]
MainIp = Annotated[Optional[str], Opt("--main-process-ip", help="Multi-node: address of machine rank 0 (required "
                                                                "with --nodes > 1 when emitting).")]
MainPort = Annotated[int, Opt("--main-process-port", help="Multi-node: rendezvous port.")]
MachineRank = Annotated[int, Opt("--machine-rank", help="Multi-node: this machine's rank (0 to nodes - 1).")]
Hostnames = Annotated[Optional[str], Opt("--hostnames", help="Multi-node: comma-separated hosts for the hostfile.")]
Probe = Annotated[Optional[bool], Opt("--probe/--no-probe", help="Confirm the top candidates with short real steps "
                                                                 "on the local GPU (default: on when CUDA is "
                                                                 "available).")]
ProbeBudget = Annotated[float, Opt("--probe-budget", help="Seconds of probing at most: a probe still running then "
                                                          "is stopped.")]
Launch = Annotated[bool, Opt("--launch", help="Run `accelerate launch` with the plan: plan ... --launch -- train.py "
                                              "ARGS")]
DryRun = Annotated[bool, Opt("--dry-run", help="With --launch: print the command instead of running it.")]
ListModels = Annotated[bool, Opt("--list-models", help="List the bundled model presets and exit.")]
ListGpus = Annotated[bool, Opt("--list-gpus", help="List the GPU catalog and exit.")]
CompareGpus = Annotated[Optional[str], Opt("--compare-gpus", help="Plan the same job on each of these GPUs "
                                           "(comma-separated, e.g. A100-80GB,H100-80GB) and print one table.")]
TrainTokens = Annotated[Optional[float], Opt("--train-tokens", help="Tokens of the whole run: sizes the LR warmup; "
                                             "with --compare-gpus, the run's time (and cost with --price).")]
CompileFlag = Annotated[str, Opt("--compile", help="torch.compile the model: " + choices_text(COMPILE) + ". auto "
                                                   "compiles where it is faster over the run (give its length).")]
TrainSteps = Annotated[Optional[int], Opt("--train-steps", help="Optimizer steps of the whole run (sizes the LR "
                                                                "warmup; or give --train-tokens).")]
Price = Annotated[Optional[list[str]], Opt("--price", help="With --compare-gpus: GPU=USD_PER_HOUR per GPU-hour; "
                                           "repeat for each GPU.")]


@dataclass(frozen=True)
class Flags:
    """Every flag as typed, before validation."""

    model: str | None = None
    batch: int | None = None
    seq_len: int | None = None
    gpu: str | None = None
    gpus_per_node: int | None = None
    nodes: int = 1
    optimizer: str = DEFAULT_OPTIMIZER
    precision: str = AUTO
    micro_batch: int | None = None
    checkpointing: str | None = None
    zero_stage: int | None = None
    attention: str = SDPA
    engine: str = DEFAULT_SHARDING_ENGINE
    no_offload: bool = False
    offload: str | None = None
    headroom: float | None = None
    host_memory: float | None = None
    nic_gbps: float | None = None
    lr: float | None = None
    lr_batch: int | None = None
    lr_scaling: str = AUTO
    memory_method: str = AUTO_METHOD
    trust_remote_code: bool = False
    task: str = AUTO
    num_labels: int | None = None
    peft: str = NO_ADAPTER
    lora_rank: int | None = None
    lora_alpha: float | None = None
    lora_targets: str | None = None
    lora_dropout: float | None = None
    no_double_quant: bool = False
    as_json: bool = False
    emit_dir: Path | None = None
    force: bool = False
    main_process_ip: str | None = None
    main_process_port: int = 29500
    machine_rank: int = 0
    hostnames: str | None = None
    probe: bool | None = None
    probe_budget: float = 60.0
    launch: bool = False
    dry_run: bool = False
    list_models: bool = False
    list_gpus: bool = False
    compare_gpus: str | None = None
    train_tokens: float | None = None
    train_steps: int | None = None
    price: list[str] | None = None
    compile: str = AUTO


_D = Flags()


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": False})
def main_command(
    ctx: typer.Context, model: Model = None, batch: Batch = None, seq_len: SeqLen = None, gpu: Gpu = None,
    gpus_per_node: GpusPerNode = None, nodes: Nodes = _D.nodes, optimizer: Optimizer = _D.optimizer,
    precision: Precision = _D.precision, micro_batch: MicroBatch = None, checkpointing: Checkpointing = None,
    zero_stage: ZeroStage = None, attention: Attention = _D.attention, engine: Engine = _D.engine,
    no_offload: NoOffload = False, offload: Offload = None, headroom: Headroom = None,
    host_memory: HostMemory = None, nic_gbps: NicGbps = None, lr: Lr = None, lr_batch: LrBatch = None,
    lr_scaling: LrScaling = _D.lr_scaling, memory_method: MemoryMethod = _D.memory_method,
    trust_remote_code: TrustRemoteCode = False, task: Task = AUTO, num_labels: NumLabels = None,
    peft: Peft = NO_ADAPTER, lora_rank: LoraRank = None, lora_alpha: LoraAlpha = None, lora_targets: LoraTargets = None,
    lora_dropout: LoraDropout = None, no_double_quant: NoDoubleQuant = False, as_json: AsJson = False,
    emit_dir: EmitDir = None, force: Force = False,
    main_process_ip: MainIp = None, main_process_port: MainPort = _D.main_process_port,
    machine_rank: MachineRank = _D.machine_rank, hostnames: Hostnames = None, probe: Probe = None,
    probe_budget: ProbeBudget = _D.probe_budget, launch: Launch = False, dry_run: DryRun = False,
    list_models: ListModels = False, list_gpus: ListGpus = False, compare_gpus: CompareGpus = None,
    train_tokens: TrainTokens = None, train_steps: TrainSteps = None, price: Price = None,
    compile: CompileFlag = AUTO,
) -> None:
    """Plan micro-batch, accumulation, precision, checkpointing, ZeRO and offload that fit and run fastest."""
    flags = Flags(**{k: v for k, v in locals().items() if k != "ctx"})
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        _run(flags, list(ctx.args))
    except NoFitError as err:
        _report_no_fit(err, flags.as_json)
        raise typer.Exit(1) from None
    except TrainplanError as err:
        _report_error(err, flags.as_json)
        raise typer.Exit(err.exit_code) from None


def _run(flags: Flags, script_args: list[str]) -> None:
    if flags.list_models or flags.list_gpus:
        _check_listing(flags, script_args)
        _listing(flags.list_models, flags.as_json)
        return
    _check_launch(flags, script_args)
    if flags.compare_gpus is not None or flags.price:
        _compare(flags, script_args)
        return
    request = _request(flags)
    options = _emit_options(flags, request.nodes)
    emit_dir = flags.emit_dir
    if emit_dir is not None:
        check_destination(emit_dir, flags.force)
    result = _run_plan(request, _prober(flags.probe, flags.probe_budget, flags.gpu), flags.probe_budget)
    if flags.launch and emit_dir is None:
        import tempfile

        emit_dir = Path(tempfile.mkdtemp(prefix="trainplan-"))
    if emit_dir is not None:
        result = result.model_copy(update={"files": tuple(emit(result, emit_dir, options))})
    command = _launch_command(emit_dir, script_args) if flags.launch else None
    _print_plan(result, flags.as_json)
    if command is not None:
        _launch(command, flags.dry_run)


def _compare(flags: Flags, script_args: list[str]) -> None:
    # lazy: planning imports torch and transformers (seconds); --help and input errors must not wait for them
    from planner.compare import compare_gpus, parse_prices

    if flags.compare_gpus is None:
        raise InputError("applies to --compare-gpus", flag="--price", hint="Add --compare-gpus A100-80GB,H100-80GB,...")
    for name, flag in (("gpu", "--gpu"), ("emit_dir", "--emit"), ("launch", "--launch"), ("probe", "--probe")):
        if getattr(flags, name) not in (None, False) or script_args:
            raise InputError(f"cannot be combined with {flag}", flag="--compare-gpus",
                             hint="Compare first, then plan (and emit) on the GPU you pick.")
    kwargs = _request(flags).plan_kwargs()
    kwargs.pop("train_tokens")
    gpus = [g.strip() for g in flags.compare_gpus.split(",") if g.strip()]
    prices = parse_prices(flags.price or [])
    with _stderr().status("planning...") as status:
        rows = compare_gpus(kwargs.pop("model"), kwargs.pop("global_batch"), gpus, train_tokens=flags.train_tokens,
                            prices=prices, progress=lambda g: status.update(f"planning on {g}"), **kwargs)
    if flags.as_json:
        sys.stdout.write(json.dumps({"comparison": [r.to_json() for r in rows]}, indent=2) + "\n")
        return
    from rich.console import Console

    Console(highlight=False).print(comparison_table(rows, flags.train_tokens, bool(prices)))


def _check_listing(flags: Flags, script_args: list[str]) -> None:
    """--list-models / --list-gpus take no planning flags: a flag given with them is a mistake to report."""
    allowed = {"list_models", "list_gpus", "as_json"}
    given = [name for name, value in asdict(flags).items() if name not in allowed and value != getattr(_D, name)]
    if given or script_args:
        name = given[0] if given else "arguments after --"
        which = "--list-models" if flags.list_models else "--list-gpus"
        raise InputError(f"cannot be combined with --{name.replace('_', '-')}" if given else
                         f"cannot be combined with {name}", flag=which, hint="List first, then plan.")


def _check_launch(flags: Flags, script_args: list[str]) -> None:
    if script_args and not flags.launch:
        raise InputError(f"unexpected arguments: {' '.join(script_args)}", flag="--launch",
                         hint="Arguments after -- are for the training script: add --launch.")
    if flags.dry_run and not flags.launch:
        raise InputError("--dry-run only applies to --launch", flag="--dry-run",
                         hint="Add --launch -- train.py ARGS, or drop --dry-run.")
    if flags.model is None:
        raise InputError("is required", flag="--model", hint="e.g. --model bigscience/bloom-560m")
    if flags.batch is None:
        raise InputError("is required", flag="--batch", hint="the global batch in samples, e.g. --batch 256")


def _request(flags: Flags):
    return build_request(
        model=flags.model, global_batch=flags.batch, seq_len=flags.seq_len, gpu=flags.gpu,
        gpus_per_node=flags.gpus_per_node, nodes=flags.nodes, optimizer=flags.optimizer, precision=flags.precision,
        micro_batch=flags.micro_batch, checkpointing=flags.checkpointing, zero_stage=flags.zero_stage,
        attention=flags.attention, offload=_offload(flags), headroom=flags.headroom, lr=flags.lr,
        host_memory_gb=flags.host_memory, nic_gbps=flags.nic_gbps, lr_batch=flags.lr_batch, lr_scaling=flags.lr_scaling,
        memory_method=flags.memory_method,
        engine=flags.engine, trust_remote_code=flags.trust_remote_code, task=flags.task, num_labels=flags.num_labels,
        peft=flags.peft, lora_rank=flags.lora_rank, lora_alpha=flags.lora_alpha, lora_targets=flags.lora_targets,
        lora_dropout=flags.lora_dropout, double_quant=not flags.no_double_quant, train_tokens=flags.train_tokens,
        train_steps=flags.train_steps, compile=flags.compile)


def _offload(flags: Flags) -> bool | str:
    if flags.offload is not None and flags.no_offload:
        raise InputError("cannot be combined with --no-offload", flag="--offload", hint="Use --offload none.")
    return flags.offload if flags.offload is not None else not flags.no_offload


def _emit_options(flags: Flags, nodes: int):
    hosts = tuple(h.strip() for h in flags.hostnames.split(",") if h.strip()) if flags.hostnames else ()
    options = EmitOptions(main_process_ip=flags.main_process_ip, main_process_port=flags.main_process_port,
                          machine_rank=flags.machine_rank, hostnames=hosts, force=flags.force)
    options.check(nodes, writes=flags.emit_dir is not None or flags.launch)
    return options


def _launch_command(folder: Path, script_args: list[str]) -> list[str]:
    return launch_command(folder.resolve() / ACCELERATE_CONFIG, list(script_args))


def _launch(command: list[str], dry_run: bool) -> None:
    import shlex

    if dry_run:
        sys.stdout.write(shlex.join(command) + "\n")
        return
    _stderr().print(f"[bold]launching:[/] {shlex.join(command)}")
    raise typer.Exit(run_launch(command))


def _prober(probe: bool | None, budget: float, gpu: str | None):
    """The probes' `measure` callable, or None: only with a local CUDA GPU, and only for that GPU."""
    if probe is False:
        return None
    if not budget > 0:
        raise InputError("must be a positive number of seconds", flag="--probe-budget")
    # lazy: the probes import torch
    from probes import Prober, cuda_available

    if not cuda_available():
        if probe:
            raise InputError("there is no CUDA GPU here to probe on", flag="--probe", hint="Use --no-probe.")
        return None
    if gpu:
        local = detect_gpus()
        if local is None or local.gpu.name != lookup_gpu(gpu).name:
            if probe:
                raise InputError(f"--gpu {gpu} is not the local GPU; probes measure the local one", flag="--probe",
                                 hint="Drop --gpu or use --no-probe.")
            return None
    return Prober(device="cuda")


def _run_plan(request, measure=None, probe_budget: float = 60.0):
    # lazy: planning imports torch and transformers (seconds); --help and input errors must not wait for them
    from planner.planning import plan

    kwargs = request.plan_kwargs()
    if measure is None:
        return plan(kwargs.pop("model"), kwargs.pop("global_batch"), **kwargs)
    from rich.console import Console

    with Console(stderr=True).status("probing...") as status:
        return plan(kwargs.pop("model"), kwargs.pop("global_batch"), measure=measure, probe_budget_s=probe_budget,
                    progress=lambda label: status.update(f"probing {label}"), **kwargs)


def _stderr():
    from rich.console import Console

    return Console(stderr=True, highlight=False)


def _print_plan(result, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(result.to_json(), indent=2) + "\n")
        return
    from rich.console import Console

    render_plan(result, Console(highlight=False))


def _report_error(err: TrainplanError, as_json: bool) -> None:
    if as_json:
        data = {"error": err.message, "flag": err.flag, "hint": err.hint, "exit_code": err.exit_code}
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
        return
    _stderr().print(f"[bold red]error:[/] {err}", markup=True, soft_wrap=True)


def _report_no_fit(err: NoFitError, as_json: bool) -> None:
    if as_json:
        data = err.plan.to_json() if err.plan is not None else {}
        data.update(error=err.message, suggestions=err.suggestions, exit_code=err.exit_code)
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
        return

    render_no_fit(err, _stderr())


def _listing(models: bool, as_json: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    if models:
        rows = [{"id": p.id, "aliases": list(p.aliases), "parameters": p.published_parameters} for p in presets()]
        headers = ("id", "aliases", "published parameters")
    else:
        rows = [{"name": g.name, "memory_GiB": round(g.memory_gib, 1), "bf16": g.bf16,
                 "peak_tflops_bf16": g.peak_tflops_bf16, "peak_tflops_fp16": g.peak_tflops_fp16} for g in catalog()]
        headers = ("name", "memory GiB", "bf16", "bf16 TFLOPS", "fp16 TFLOPS")
    if as_json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return
    table = Table(*headers)
    for row in rows:
        table.add_row(*(_cell(v) for v in row.values()))
    console = Console()
    if not console.is_terminal:  # piped: whole ids and aliases, not cells cut to a default 80 columns
        console = Console(width=10_000)
    console.print(table)


def _cell(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, list):
        return ", ".join(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def main() -> None:
    """Console-script entry point. An unexpected error prints one line (TRAINPLAN_DEBUG=1 shows the
    traceback) and exits 3, apart from the documented 0/1/2."""
    try:
        app(prog_name=Path(sys.argv[0]).name or "plan", standalone_mode=True)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    except Exception as err:  # noqa: BLE001 - the last line of defence against tracebacks
        if os.environ.get("TRAINPLAN_DEBUG"):
            raise
        _stderr().print(f"[bold red]internal error:[/] {type(err).__name__}: {err} "
                        "(rerun with TRAINPLAN_DEBUG=1 for the traceback, and please report it)")
        raise SystemExit(3) from None


if __name__ == "__main__":
    main()
