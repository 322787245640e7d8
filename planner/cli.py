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
    list_models: bool = typer.Option(False, "--list-models", help="List the bundled model presets and exit."),
    list_gpus: bool = typer.Option(False, "--list-gpus", help="List the GPU catalog and exit."),
) -> None:
    """Plan micro-batch, accumulation, precision, checkpointing, ZeRO and offload that fit and run fastest."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if list_models or list_gpus:
        _listing(list_models, as_json)
        return
    if ctx.args:
        raise _fail(TrainplanError(f"unexpected arguments: {' '.join(ctx.args)}"))
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
        result = _run_plan(request)
    except NoFitError as err:
        _report_no_fit(err, as_json)
        raise typer.Exit(1)
    except TrainplanError as err:
        raise _fail(err)
    _print_plan(result, as_json)


def _run_plan(request):
    from planner.planning import plan

    kwargs = request.plan_kwargs()
    return plan(kwargs.pop("model"), kwargs.pop("global_batch"), **kwargs)


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
    """Console-script entry point."""
    app(prog_name=Path(sys.argv[0]).name or "plan")


if __name__ == "__main__":
    main()
