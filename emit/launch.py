"""`accelerate launch --config_file ... train.py ARGS` as a subprocess: no shell, signals forwarded,
its exit code returned."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from emit.names import PATH_FLAGS
from planner.errors import InputError

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
