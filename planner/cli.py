"""`plan` / `trainplan`: parse -> request -> planner.plan() -> render / emit / launch. Thin by design.

Exit codes: 0 a plan was found; 1 nothing fits (with what would); 2 bad input (flag and fix).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from planner.errors import NoFitError, TrainplanError

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None,
                  context_settings={"help_option_names": ["-h", "--help"]})


def _stderr():
    from rich.console import Console

    return Console(stderr=True, highlight=False)


def _fail(err: TrainplanError) -> "typer.Exit":
    _stderr().print(f"[bold red]error:[/] {err}", markup=True, soft_wrap=True)
    return typer.Exit(err.exit_code)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": False})
def main_command(
    ctx: typer.Context,
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Hub id, local folder with config.json, or a bundled preset."),
    batch: Optional[int] = typer.Option(None, "--batch", "-b", help="Global batch size (samples per optimizer step)."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Training sequence length (default: the model's, at most 2048)."),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="GPU model, e.g. A100-80GB (default: detected, else the reference A100-80GB)."),
    gpus_per_node: Optional[int] = typer.Option(None, "--gpus-per-node", help="GPUs per node (default: detected count, else 1)."),
    nodes: int = typer.Option(1, "--nodes", help="Number of nodes."),
    optimizer: str = typer.Option("adamw", "--optimizer", help="adamw | adam | sgd | sgd-momentum | adafactor | adamw-8bit | lion"),
    precision: str = typer.Option("auto", "--precision", help="auto | fp32 | fp16-mixed | bf16-mixed | bf16-true"),
    micro_batch: Optional[int] = typer.Option(None, "--micro-batch", help="Pin the micro-batch size."),
    checkpointing: Optional[str] = typer.Option(None, "--checkpointing", help="Pin activation checkpointing: none | selective | full."),
    zero_stage: Optional[int] = typer.Option(None, "--zero-stage", help="Pin the DeepSpeed ZeRO stage (0-3)."),
    attention: str = typer.Option("sdpa", "--attention", help="eager | sdpa | flash"),
    no_offload: bool = typer.Option(False, "--no-offload", help="Never offload optimizer or parameters to the CPU."),
    headroom: Optional[float] = typer.Option(None, "--headroom", help="Fraction of GPU memory kept free (default 0.05)."),
    lr: Optional[float] = typer.Option(None, "--lr", help="Base learning rate, tuned at --lr-batch."),
    lr_batch: Optional[int] = typer.Option(None, "--lr-batch", help="Batch the base LR was tuned at (default: micro-batch x GPUs)."),
    lr_scaling: str = typer.Option("auto", "--lr-scaling", help="auto (sqrt for Adam, linear for SGD) | sqrt | linear | none"),
    memory_method: str = typer.Option("auto", "--memory-method", help="auto | trace | analytic"),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="Allow the model's own code (auto_map) to run."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
    emit_dir: Optional[Path] = typer.Option(None, "--emit", help="Write ds_config.json, accelerate_config.yaml, training_args.json, plan.json, launch.sh here."),
    force: bool = typer.Option(False, "--force", help="Overwrite files --emit would replace."),
    engine: str = typer.Option("deepspeed", "--engine", help="For ZeRO plans: deepspeed | fsdp (FULL_SHARD for ZeRO-3, SHARD_GRAD_OP for ZeRO-2)."),
    main_process_ip: Optional[str] = typer.Option(None, "--main-process-ip", help="Multi-node: address of machine rank 0."),
    main_process_port: int = typer.Option(29500, "--main-process-port", help="Multi-node: rendezvous port."),
    machine_rank: int = typer.Option(0, "--machine-rank", help="Multi-node: this machine's rank."),
    hostnames: Optional[str] = typer.Option(None, "--hostnames", help="Multi-node: comma-separated hosts for the DeepSpeed hostfile."),
    probe: Optional[bool] = typer.Option(None, "--probe/--no-probe", help="Confirm the top candidates with short real steps on the local GPU (default: on when CUDA is available)."),
    probe_budget: float = typer.Option(60.0, "--probe-budget", help="Seconds of probing at most."),
    launch: bool = typer.Option(False, "--launch", help="Run `accelerate launch` with the plan: plan ... --launch -- train.py ARGS"),
    dry_run: bool = typer.Option(False, "--dry-run", help="With --launch: print the command instead of running it."),
    list_models: bool = typer.Option(False, "--list-models", help="List the bundled model presets and exit."),
    list_gpus: bool = typer.Option(False, "--list-gpus", help="List the GPU catalog and exit."),
) -> None:
    """Plan micro-batch, accumulation, precision, checkpointing, ZeRO and offload that fit and run fastest."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if list_models or list_gpus:
        _listing(list_models, as_json)
        return
    if ctx.args and not launch:
        raise _fail(TrainplanError(f"unexpected arguments: {' '.join(ctx.args)}",
                                   hint="Arguments after -- are for the training script: add --launch."))
    from planner.errors import InputError
    from planner.request import build_request

    try:
        if model is None:
            raise InputError("is required", flag="--model", hint="e.g. --model bigscience/bloom-560m")
        if batch is None:
            raise InputError("is required", flag="--batch", hint="the global batch in samples, e.g. --batch 256")
        request = build_request(
            model=model, global_batch=batch, seq_len=seq_len, gpu=gpu, gpus_per_node=gpus_per_node, nodes=nodes,
            optimizer=optimizer, precision=precision, micro_batch=micro_batch, checkpointing=checkpointing,
            zero_stage=zero_stage, attention=attention, offload=not no_offload, headroom=headroom, lr=lr,
            lr_batch=lr_batch, lr_scaling=lr_scaling, memory_method=memory_method, trust_remote_code=trust_remote_code)
        options = _emit_options(engine, main_process_ip, main_process_port, machine_rank, hostnames, force)
        result = _run_plan(request, _prober(probe, probe_budget, gpu), probe_budget)
        if launch and emit_dir is None:
            import tempfile

            emit_dir = Path(tempfile.mkdtemp(prefix="trainplan-"))
        if emit_dir is not None:
            from emit import emit

            result = result.model_copy(update={"files": tuple(emit(result, emit_dir, options))})
        command = _launch_command(emit_dir, ctx.args) if launch else None
    except NoFitError as err:
        _report_no_fit(err, as_json)
        raise typer.Exit(1) from None
    except TrainplanError as err:
        raise _fail(err) from None
    _print_plan(result, as_json)
    if command is not None:
        _launch(command, dry_run)


def _emit_options(engine, ip, port, rank, hostnames, force):
    from emit import EmitOptions
    from planner.errors import InputError

    if engine not in ("deepspeed", "fsdp"):
        raise InputError(f"unknown engine {engine!r}", flag="--engine", hint="Use deepspeed or fsdp.")
    if not 0 < port < 65536:
        raise InputError(f"port {port} out of range", flag="--main-process-port")
    if rank < 0:
        raise InputError("must be >= 0", flag="--machine-rank")
    hosts = tuple(h.strip() for h in hostnames.split(",") if h.strip()) if hostnames else ()
    return EmitOptions(engine=engine, main_process_ip=ip, main_process_port=port, machine_rank=rank,
                       hostnames=hosts, force=force)


def _launch_command(folder: Path, script_args: list[str]) -> list[str]:
    from emit import launch_command
    from emit.files import ACCELERATE_CONFIG

    return launch_command(folder.resolve() / ACCELERATE_CONFIG, list(script_args))


def _launch(command: list[str], dry_run: bool) -> None:
    import shlex

    from emit import run_launch

    if dry_run:
        sys.stdout.write(shlex.join(command) + "\n")
        return
    _stderr().print(f"[bold]launching:[/] {shlex.join(command)}")
    raise typer.Exit(run_launch(command))


def _prober(probe: bool | None, budget: float, gpu: str | None):
    """The probes' `measure` callable, or None: only with a local CUDA GPU, and only for that GPU."""
    from planner.errors import InputError

    if probe is False:
        return None
    if budget <= 0:
        raise InputError("must be a positive number of seconds", flag="--probe-budget")
    from probes import Prober, cuda_available

    if not cuda_available():
        if probe:
            raise InputError("there is no CUDA GPU here to probe on", flag="--probe", hint="Use --no-probe.")
        return None
    if gpu:
        from planner.hardware import detect_gpus, lookup_gpu

        local = detect_gpus()
        if local is None or local.gpu.name != lookup_gpu(gpu).name:
            if probe:
                raise InputError(f"--gpu {gpu} is not the local GPU; probes measure the local one", flag="--probe",
                                 hint="Drop --gpu or use --no-probe.")
            return None
    return Prober(device="cuda")


def _run_plan(request, measure=None, probe_budget: float = 60.0):
    from planner.planning import plan

    kwargs = request.plan_kwargs()
    if measure is None:
        return plan(kwargs.pop("model"), kwargs.pop("global_batch"), **kwargs)
    from rich.console import Console

    with Console(stderr=True).status("probing...") as status:
        return plan(kwargs.pop("model"), kwargs.pop("global_batch"), measure=measure, probe_budget_s=probe_budget,
                    progress=lambda label: status.update(f"probing {label}"), **kwargs)


def _print_plan(result, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(result.to_json(), indent=2) + "\n")
        return
    from rich.console import Console

    from planner.render import render_plan

    render_plan(result, Console(highlight=False))


def _report_no_fit(err: NoFitError, as_json: bool) -> None:
    if as_json:
        data = err.plan.to_json() if err.plan is not None else {}
        data.update(error=err.message, suggestions=err.suggestions)
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
        return
    from planner.render import render_no_fit

    render_no_fit(err, _stderr())


def _listing(models: bool, as_json: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    if models:
        from planner.models.presets import presets

        rows = [{"id": p.id, "aliases": list(p.aliases), "parameters": p.published_parameters} for p in presets()]
        headers = ("id", "aliases", "published parameters")
    else:
        from planner.hardware import catalog

        rows = [{"name": g.name, "memory_GiB": round(g.memory_gib, 1), "bf16": g.bf16,
                 "peak_tflops_bf16": g.peak_tflops_bf16, "peak_tflops_fp16": g.peak_tflops_fp16} for g in catalog()]
        headers = ("name", "memory GiB", "bf16", "bf16 TFLOPS", "fp16 TFLOPS")
    if as_json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return
    table = Table(*headers)
    for row in rows:
        table.add_row(*(", ".join(v) if isinstance(v, list) else f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)
                        for v in row.values()))
    Console().print(table)


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
