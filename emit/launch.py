"""`accelerate launch --config_file ... train.py ARGS` as a subprocess: no shell, signals forwarded,
its exit code returned."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

from planner.errors import InputError

_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def launch_command(config_file: str | Path, script_args: list[str]) -> list[str]:
    if not script_args:
        raise InputError("no training script given", flag="--launch", hint="e.g. plan ... --launch -- train.py --epochs 1")
    exe = shutil.which("accelerate")
    prefix = [exe, "launch"] if exe else [sys.executable, "-m", "accelerate.commands.launch"]
    return [*prefix, "--config_file", str(config_file), *script_args]


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
