"""`accelerate launch --config_file ... train.py ARGS` as a subprocess: no shell, signals forwarded, its exit code
returned; or, with a launcher, the command that submits the folder's job (sbatch, kubectl apply, sky launch) and what
each node of the job will run, for `--launch --dry-run`."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from emit import kubernetes, skypilot, slurm
from emit.names import LAUNCHER_FILE, PATH_FLAGS
from emit.nodes import RUN_VAR, TRIAL, resolve
from planner.errors import InputError
from planner.vocab import KUBERNETES, LAUNCHER, SLURM

_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


#: accelerate's launcher re-raises a failed run as its own traceback unless quiet (accelerate/commands/launch.py
#: `simple_launcher`, `deepspeed_launcher`); the run's own error is still shown.
QUIET = ["--quiet"]


def launch_command(config_file: str | Path, script_args: list[str]) -> list[str]:
    if not script_args:
        raise InputError("no training script given", flag="--launch", hint="e.g. plan ... --launch -- train.py --epochs 1")
    exe = shutil.which("accelerate")
    prefix = [exe, "launch"] if exe else [sys.executable, "-m", "accelerate.commands.launch"]
    return [*prefix, *QUIET, *folder_flags(config_file), "--config_file", str(config_file), *script_args]


def folder_flags(config_file: str | Path) -> list[str]:
    """`--deepspeed_config_file FOLDER/ds_config.json` for each relative path the accelerate
    config names: the emitted config names files of its own folder, which accelerate would look for in the current
    directory (emit/names.py PATH_FLAGS). No flags when the config cannot be read (accelerate will say why)."""
    path = Path(config_file)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return []
    deepspeed = data.get("deepspeed_config") if isinstance(data, dict) else None
    if not isinstance(deepspeed, dict):
        return []
    flags = []
    for key, flag in PATH_FLAGS.items():
        name = deepspeed.get(key)
        if isinstance(name, str) and name and not os.path.isabs(name):
            flags += [flag, os.path.join(os.path.dirname(os.path.abspath(path)), name)]
    return flags


#: A Slurm allocation for the dry run: its nodes' names and its job id.
EXAMPLE_HOSTS = "node-{}"
EXAMPLE_JOB_ID = 4242


@dataclass(frozen=True)
class NodeCommand:
    """What node `rank` of a job runs: the launcher's variables on it (example values where the job has its own) and
    the command they resolve to."""

    rank: int
    variables: dict[str, str]
    argv: list[str]


def submit_command(plan, folder: Path, options, script_args: list[str]) -> list[str]:
    """The command that submits the job `options.launcher` wrote into `folder` (script_args go to sbatch; the other
    jobs carry them in their file). SkyPilot's cluster is named as the job, for `sky logs NAME`."""
    job, program = str(folder / LAUNCHER_FILE[options.launcher]), LAUNCHER[options.launcher].program
    if options.launcher == SLURM:
        return [program, job, *script_args]
    if options.launcher == KUBERNETES:
        return [program, "apply", "--server-side", "-f", job]
    return [program, "launch", "--cluster", kubernetes.job_name(plan), "--workdir", str(folder), job]


def node_commands(plan, options, folder: Path, script_args: list[str]) -> list[NodeCommand]:
    """What each node of the job runs, its rendezvous from example values (each launcher's `example_nodes`)."""
    if options.launcher == SLURM:
        hosts = tuple(EXAMPLE_HOSTS.format(i + 1) for i in range(plan.hardware.nodes))
        envs, words = slurm.example_nodes(options, str(folder), hosts, EXAMPLE_JOB_ID), slurm.node_words(plan)
    elif options.launcher == KUBERNETES:
        envs, words = kubernetes.example_nodes(plan), kubernetes.node_words(plan)
    else:
        envs, words = skypilot.example_nodes(plan, options), skypilot.node_words(plan)
    out = []
    for rank, env in enumerate(envs):
        script = tuple(script_args) or (*TRIAL, env[RUN_VAR])
        out.append(NodeCommand(rank, {k: v for k, v in env.items() if k != RUN_VAR}, resolve(words, env, script)))
    return out


def check_program(command: list[str], folder: Path) -> None:
    """The launcher's program must be here to submit the job."""
    if shutil.which(command[0]) is None:
        raise InputError(f"{command[0]} is not installed here", flag="--launch",
                         hint=f"Install it, or submit the job in {folder} yourself; --dry-run shows what runs.")


def run_launch(command: list[str], env: dict | None = None) -> int:
    """Run the launcher; SIGINT/SIGTERM/SIGHUP sent to us go to it; returns its exit code."""
    proc = subprocess.Popen(command, env=env)  # noqa: S603 - argument list, no shell
    previous = {}

    def forward(signum, _frame):
        if proc.poll() is None:
            proc.send_signal(signum)

    for sig in _FORWARDED:
        previous[sig] = signal.signal(sig, forward)
    try:
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
