"""`plan` / `trainplan`: parse -> PlanRequest -> planner.plan() -> render / emit / launch. Thin by design.

The options are generated from the fields of `planner.request.PlanRequest` (what to plan) and `RunOptions` (what to
do with the plan), so a flag is defined once, with its help. Exit codes: 0 a plan was found; 1 nothing fits (with
what would); 2 bad input (flag and fix); 3 an internal error (a bug: please report it).
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Optional, get_args, get_origin

import typer
from pydantic import BaseModel, ConfigDict, ValidationError
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

from emit import EmitOptions, check_destination, emit, launch_command, run_launch
from emit.launch import check_program, node_commands, submit_command
from emit.files import ACCELERATE_CONFIG
from emit.report import check_report, receipt_rows, report_available, write_comparison_report, write_report
from planner.errors import InputError, NoFitError, TrainplanError
from planner.hardware import catalog, detect_gpus, lookup_gpu
from planner.hardware.systems import usual_system
from planner.models.presets import presets
from planner.render import comparison_table, launch_preview, render_no_fit, render_plan, written
from planner.request import PlanRequest, flag_of, input_error, option
from planner.vocab import LAUNCHER, NO_OFFLOAD, PACKAGE, SLURM, Launcher, choices_text

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None,
                  context_settings={"help_option_names": ["-h", "--help"]})


class RunOptions(BaseModel):
    """What to do with the plan: print it, write its files, launch it, probe it; or list and compare instead."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    no_offload: bool = option(False, help="Never offload optimizer or parameters to the CPU (--offload none).")
    as_json: bool = option(False, help="Print the plan (or the error) as JSON.", flag="--json")
    explain: bool = option(False, help="Show every alternative, every rejected faster option and every note.")
    emit_dir: Path | None = option(help="Write accelerate_config.yaml, training_args.json, plan.json, launch.sh (and "
                                        "ds_config.json, peft_config.json where needed) here.", flag="--emit")
    force: bool = option(False, help="Overwrite files --emit or --report would replace.")
    report: Path | None = option(help='Write the plan as one self-contained HTML page with its charts (needs pip '
                                      'install -e ".[report]"; plan.html is also written into --emit folders).')
    main_process_ip: str | None = option(help="Multi-node: address of machine rank 0 (required with --nodes > 1 "
                                              "when emitting, unless --launcher).")
    main_process_port: int | None = option(help="Multi-node: rendezvous port (default 29500; with --slurm, one "
                                                "from the job's id).")
    machine_rank: int = option(0, help="Multi-node: this machine's rank (0 to nodes - 1).")
    hostnames: str | None = option(help="Multi-node: comma-separated hosts, rank 0 first (its name is the rank-0 "
                                        "address unless --main-process-ip).")
    slurm: bool = option(False, help="The same as --launcher slurm: also write train.sbatch (sbatch "
                                     "DIR/train.sbatch).")
    launcher: Launcher | None = option(help="With --emit: also write the job of a cluster engine, whose nodes find "
                                            "the rank-0 address when it starts: " + choices_text(LAUNCHER) + " ("
                                            "train.sbatch, trainjob.yaml, sky.yaml; docs/clusters.md). --launch "
                                            "submits it.")
    image: str | None = option(help="--launcher kubernetes: the container image the nodes run (with trainplan and "
                                    "the plan's packages installed).")
    volume: str | None = option(help="--launcher kubernetes: a PersistentVolumeClaim holding the run folder; "
                                     "skypilot: a bucket (s3://...) receiving receipt.json. Without it the run folder "
                                     "goes with the job (receipt.json in node 0's log).")
    probe: bool | None = option(help="Confirm the top candidates with short real steps on the local GPU (default: on "
                                     "when CUDA is available).", flag="--probe/--no-probe")
    probe_budget: float = option(60.0, help="Seconds of probing at most: a probe still running then is stopped.")
    launch: bool = option(False, help="Run `accelerate launch` with the plan: plan ... --launch -- train.py ARGS; "
                                      "with --launcher, submit its job (sbatch, kubectl apply, sky launch).")
    dry_run: bool = option(False, help="With --launch: print the command instead of running it (with --launcher, "
                                       "and what each node runs, from example values).")
    list_models: bool = option(False, help="List the bundled model presets and exit.")
    list_gpus: bool = option(False, help="List the GPU catalog and exit.")
    compare_gpus: str | None = option(help="Plan the same job on each of these GPUs (comma-separated, e.g. "
                                           "A100-80GB,H100-80GB) and print one table.")
    price: list[str] | None = option(help="With --compare-gpus: GPU=USD_PER_HOUR per GPU-hour; repeat for each GPU.")


_FORMS = (PlanRequest, RunOptions)
#: library loggers whose import-time warnings are not about the plan (torchao's CUDA-only extensions on a CPU box)
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")


def _base(annotation):
    """A field's type without Optional."""
    args = [a for a in get_args(annotation) if a is not type(None)] if get_origin(annotation) is not None else []
    return args[0] if len(args) == 1 and get_origin(annotation) is not list else annotation


def _cli_type(annotation) -> type:
    """The type typer parses a field as: its own for bool, Path and lists; text for the rest, numbers included, so
    that a bad value gets our error naming the flag (`_typed`), not the CLI library's usage block."""
    base = _base(annotation)
    if get_origin(base) is list or base in (bool, Path):
        return base
    return str


def _typed(form, values: dict) -> dict:
    """`values` with the form's numbers (typed as text on the command line) as int or float; a value that is not one
    is an InputError naming its flag."""
    out = dict(values)
    for name, info in form.model_fields.items():
        value, scale = out.get(name), (info.json_schema_extra or {}).get("scale")
        kind = float if scale is not None else _base(info.annotation)
        if not isinstance(value, str) or kind not in (int, float):
            continue
        try:
            out[name] = kind(value)
        except ValueError:
            what = "a whole number" if kind is int else "a number"
            raise InputError(f"{value!r} is not {what}", flag=flag_of(form, name),
                             hint=f"Give {what} (without units or suffixes).") from None
    return out


def _parameters() -> list[inspect.Parameter]:
    params = [inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)]
    for form in _FORMS:
        for name, info in form.model_fields.items():
            extra = info.json_schema_extra or {}
            if extra.get("cli") is False:
                continue
            kind = _cli_type(info.annotation)
            default = info.default if isinstance(info.default, (bool, int, float, str)) else None
            annotation = kind if kind is bool and default is not None else Optional[kind]
            option_ = typer.Option(*str(extra.get("flag", flag_of(form, name))).split(","), help=info.description)
            params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                            annotation=Annotated[annotation, option_]))
    return params


def main_command(ctx: typer.Context, **values) -> None:
    """Plan micro-batch, accumulation, precision, checkpointing, ZeRO and offload that fit and run fastest."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    for name in QUIET_LOGGERS:  # transformers imports torchao where it is installed; its import warns on a CPU box
        logging.getLogger(name).setLevel(logging.ERROR)
    run = RunOptions.model_construct(as_json=values.get("as_json", False))  # how to report an error in the options
    try:
        values = _typed(PlanRequest, _typed(RunOptions, values))
        run = _run_options(values)
        _run(values, run, list(ctx.args))
    except NoFitError as err:
        _report_no_fit(err, run.as_json)
        raise typer.Exit(1) from None
    except TrainplanError as err:
        _report_error(err, run.as_json)
        raise typer.Exit(err.exit_code) from None


def _run_options(values: dict) -> RunOptions:
    try:
        return RunOptions(**{k: values[k] for k in RunOptions.model_fields})
    except ValidationError as err:
        raise input_error(RunOptions, err.errors()[0]) from None


main_command.__signature__ = inspect.Signature(_parameters())
main_command.__annotations__ = {p.name: p.annotation for p in main_command.__signature__.parameters.values()}
app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": False})(main_command)


def _run(values: dict, run: RunOptions, script_args: list[str]) -> None:
    if run.list_models or run.list_gpus:
        _check_listing(values, run, script_args)
        _listing(run.list_models, run.as_json)
        return
    _check_launch(run, script_args)
    request = _request(values, run)
    if run.compare_gpus is not None or run.price:
        _compare(request, run, script_args)
        return
    options = _emit_options(run, request, script_args)
    emit_dir = run.emit_dir
    if emit_dir is not None:
        check_destination(emit_dir, run.force)
    if run.report is not None:
        check_report(run.report, run.force)
    result = _run_plan(request, _prober(run.probe, run.probe_budget, request.gpu), run.probe_budget)
    if run.launch and emit_dir is None:
        emit_dir = Path(tempfile.mkdtemp(prefix="trainplan-"))
    if emit_dir is not None:
        result = result.model_copy(update={"files": tuple(emit(result, emit_dir, options))})
        if run.emit_dir is not None and not report_available():
            _stderr().print(f"note: plan.html not written: {escape(PACKAGE['matplotlib'].install)} writes it")
    if run.report is not None:
        page = write_report(result, run.report, receipts=receipt_rows(result), force=run.force)
        result = result.model_copy(update={"files": (*result.files, page)})
    command = _launch_command(emit_dir, script_args, result, options) if run.launch else None
    _print_plan(result, run.as_json, run.explain)
    if command is not None:
        _launch(command, run.dry_run, result, options, emit_dir)


def _request(values: dict, run: RunOptions) -> PlanRequest:
    """The flags of `PlanRequest`, validated; a flag given in another unit (`scale`) converted first."""
    fields: dict[str, Any] = {}
    for name, info in PlanRequest.model_fields.items():
        value, scale = values.get(name), (info.json_schema_extra or {}).get("scale")
        if value is None or value == info.default:
            continue
        if scale is not None:
            if not (math.isfinite(value) and value > 0):
                raise InputError(f"must be a positive number, got {value}", flag=flag_of(PlanRequest, name))
            value = int(value * scale)
        fields[name] = value
    if run.no_offload:
        if "offload" in fields:
            raise InputError("cannot be combined with --no-offload", flag="--offload", hint="Use --offload none.")
        fields["offload"] = NO_OFFLOAD
    for required in ("model", "global_batch"):
        fields.setdefault(required, None)
    return PlanRequest.of(**fields)


def _compare(request: PlanRequest, run: RunOptions, script_args: list[str]) -> None:
    # lazy: planning imports torch and transformers (seconds); --help and input errors must not wait for them
    from planner.compare import compare_gpus, parse_prices

    if run.compare_gpus is None:
        raise InputError("applies to --compare-gpus", flag="--price", hint="Add --compare-gpus A100-80GB,H100-80GB,...")
    for given, flag in ((request.gpu, "--gpu"), (run.emit_dir, "--emit"), (run.launch, "--launch"),
                        (run.probe, "--probe")):
        if given not in (None, False) or script_args:
            raise InputError(f"cannot be combined with {flag}", flag="--compare-gpus",
                             hint="Compare first, then plan (and emit) on the GPU you pick.")
    gpus = [g.strip() for g in run.compare_gpus.split(",") if g.strip()]
    prices = parse_prices(run.price or [])
    if run.report is not None:
        check_report(run.report, run.force)
    with _status("planning...") as update:
        rows = compare_gpus(request, gpus, prices=prices, progress=lambda g: update(f"planning on {g}"))
    files = [write_comparison_report(rows, run.report, train_tokens=request.train_tokens, priced=bool(prices),
                                     force=run.force)] if run.report is not None else []
    if run.as_json:
        sys.stdout.write(json.dumps({"comparison": [r.to_json() for r in rows], "files": files}, indent=2) + "\n")
        return
    console = Console(highlight=False)
    console.print(comparison_table(rows, request.train_tokens, bool(prices)))
    written(console, files)


def _check_listing(values: dict, run: RunOptions, script_args: list[str]) -> None:
    """--list-models / --list-gpus take no planning flags: a flag given with them is a mistake to report."""
    allowed = {"list_models", "list_gpus", "as_json"}
    defaults = {name: info.default for form in _FORMS for name, info in form.model_fields.items()}
    given = [name for name, value in values.items()
             if name not in allowed and value is not None and value != defaults.get(name)]
    if given or script_args:
        which = "--list-models" if run.list_models else "--list-gpus"
        what = next((flag_of(form, given[0]) for form in _FORMS if given[0] in form.model_fields), "") if given else \
            "arguments after --"
        raise InputError(f"cannot be combined with {what}", flag=which, hint="List first, then plan.")


def _check_launch(run: RunOptions, script_args: list[str]) -> None:
    if script_args and not run.launch:
        raise InputError(f"unexpected arguments: {' '.join(script_args)}", flag="--launch",
                         hint="Arguments after -- are for the training script: add --launch.")
    if run.dry_run and not run.launch:
        raise InputError("--dry-run only applies to --launch", flag="--dry-run",
                         hint="Add --launch -- train.py ARGS, or drop --dry-run.")


def _emit_options(run: RunOptions, request: PlanRequest, script_args: list[str]) -> EmitOptions:
    flag = "--slurm" if run.slurm else "--launcher"
    if (run.slurm or run.launcher) and run.emit_dir is None and not run.launch:
        raise InputError("applies to --emit (or --launch)", flag=flag, hint="Add --emit DIR to write the job there.")
    if (run.slurm or run.launcher == SLURM) and run.launch and run.emit_dir is None:
        raise InputError("a Slurm job runs its folder from the cluster's shared file system", flag="--emit",
                         hint="Add --emit DIR with DIR on that file system.")
    hosts = tuple(h.strip() for h in run.hostnames.split(",") if h.strip()) if run.hostnames else ()
    options = EmitOptions(main_process_ip=run.main_process_ip, main_process_port=run.main_process_port,
                          machine_rank=run.machine_rank, hostnames=hosts, force=run.force, slurm=run.slurm,
                          launcher=run.launcher, image=run.image, volume=run.volume, script=tuple(script_args))
    options.check(request.nodes, writes=run.emit_dir is not None or run.launch,
                  gpu=lookup_gpu(request.gpu).name if request.gpu else None)
    return options


def _launch_command(folder: Path, script_args: list[str], plan, options: EmitOptions) -> list[str]:
    """`accelerate launch` of the folder here, or the command submitting its launcher's job."""
    if options.launcher:
        return submit_command(plan, folder.resolve(), options, list(script_args))
    return launch_command(folder.resolve() / ACCELERATE_CONFIG, list(script_args))


def _launch(command: list[str], dry_run: bool, plan, options: EmitOptions, folder: Path) -> None:
    if dry_run:
        nodes = node_commands(plan, options, folder.resolve(), list(options.script)) if options.launcher else None
        sys.stdout.write(launch_preview(command, nodes) if nodes else shlex.join(command) + "\n")
        return
    if options.launcher:
        check_program(command, folder)
    _stderr().print(f"[bold]launching:[/] {escape(shlex.join(command))}")
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


def _run_plan(request: PlanRequest, measure=None, probe_budget: float = 60.0):
    # lazy: planning imports torch and transformers (seconds); --help and input errors must not wait for them
    from planner.planning import plan_request

    if measure is None:
        with _status(f"planning {request.model} ...") as update:
            return plan_request(request, progress=update)
    with _status("probing...") as update:
        return plan_request(request, measure=measure, probe_budget_s=probe_budget,
                            progress=lambda label: update(f"probing {label}"))


@contextmanager
def _status(text: str) -> Iterator[Callable[[str], None]]:
    """A spinner line on stderr, redrawn (at most `_STATUS_REDRAW_S` apart) when the planner reports progress. Not
    rich's `Console.status`: its refresh thread would keep the planner from forking trace workers
    (planner/program/forked.py)."""
    line = _StatusLine(text)
    drawn = [time.monotonic()]
    with Live(line, console=_stderr(), auto_refresh=False, transient=True) as live:
        def update(label: str) -> None:
            line.spinner.update(text=Text(label))
            if time.monotonic() - drawn[0] >= _STATUS_REDRAW_S:
                drawn[0] = time.monotonic()
                live.refresh()

        yield update


_STATUS_REDRAW_S = 0.08


class _StatusLine:
    """A spinner and its label on one line, cut to the terminal's width."""

    def __init__(self, text: str):
        self.spinner = Spinner("dots", Text(text), style="status.spinner")  # plain text: no markup in names

    def __rich_console__(self, console, options):
        line = self.spinner.render(console.get_time())
        line.truncate(options.max_width, overflow="ellipsis")
        yield line


def _stderr() -> Console:
    return Console(stderr=True, highlight=False)


def _print_plan(result, as_json: bool, explain: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(result.to_json(), indent=2) + "\n")
        return
    render_plan(result, Console(highlight=False), explain)


def _report_error(err: TrainplanError, as_json: bool) -> None:
    if as_json:
        data = {"error": err.message, "flag": err.flag, "hint": err.hint, "exit_code": err.exit_code}
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
        return
    _stderr().print(f"[bold red]error:[/] {escape(err.cli_text() if isinstance(err, InputError) else str(err))}",
                    markup=True, soft_wrap=True)


def _report_no_fit(err: NoFitError, as_json: bool) -> None:
    if as_json:
        data = err.plan.to_json() if err.plan is not None else {}
        data.update(fits=False, error=err.message, suggestions=err.suggestions, exit_code=err.exit_code)
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
        return
    render_no_fit(err, _stderr())


def _listing(models: bool, as_json: bool) -> None:
    if models:
        rows = [{"id": p.id, "aliases": list(p.aliases), "parameters": p.published_parameters} for p in presets()]
        headers = ("id", "aliases", "published parameters")
    else:
        rows = [{"name": g.name, "memory_GiB": round(g.memory_gib, 1), "bf16": g.bf16,
                 "peak_tflops_bf16": g.peak_tflops_bf16, "peak_tflops_fp16": g.peak_tflops_fp16,
                 "host_memory_GB": round(usual_system(g.name).host_memory_bytes / 1e9, 1),
                 "host_system": usual_system(g.name).system, "host_system_gpus": usual_system(g.name).gpus}
                for g in catalog()]
        headers = ("name", "memory GiB", "bf16", "bf16 TFLOPS", "fp16 TFLOPS", "host RAM GB per node (assumed)",
                   "usual system", "its GPUs")
    if as_json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return
    table = Table(*headers)
    for row in rows:
        table.add_row(*(escape(_cell(v)) for v in row.values()))
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
    """Console-script entry point. An unexpected error prints one line (TRAINPLAN_DEBUG=1 shows the traceback) and
    exits 3, apart from the documented 0/1/2. The process ends once its output is flushed (`_end`)."""
    try:
        app(prog_name=Path(sys.argv[0]).name or "plan", standalone_mode=True)
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    except KeyboardInterrupt:
        code = 130
    except Exception as err:  # noqa: BLE001 - the last line of defence against tracebacks
        if os.environ.get("TRAINPLAN_DEBUG"):
            raise
        _stderr().print(f"[bold red]internal error:[/] {escape(f'{type(err).__name__}: {err}')} "
                        "(rerun with TRAINPLAN_DEBUG=1 for the traceback, and please report it)")
        code = 3
    _end(code)


def _end(code) -> None:
    """Exit with `code` (as SystemExit reads it) without the interpreter's teardown: freeing the modules torch and
    transformers loaded takes about a second after the work is done. Every file is closed by now; the standard
    streams and logging's handlers are flushed first (what teardown would have done for them)."""
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`plan | head`): nothing more can reach it
            pass
    os._exit(code or 0)


if __name__ == "__main__":
    main()
