"""Render a plan's files and write them atomically; refuse to overwrite unless forced.

Only the files the plan's engine needs: ds_config.json for DeepSpeed plans, a hostfile for multi-node DeepSpeed,
peft_config.json for LoRA / QLoRA plans (the LoraConfig and BitsAndBytesConfig arguments), train.sbatch with Slurm,
accelerate_config.yaml, training_args.json, plan.json (read back by `planner.load_plan`) and launch.sh always.
The files name each other by file name only, so the folder can be moved (emit/names.py).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from emit.names import (
    ACCELERATE_CONFIG, DS_CONFIG, HOSTFILE, LAUNCH, PEFT_CONFIG, PLAN_JSON, TRAIN_SBATCH, TRAINING_ARGS, folder_files,
)
from emit.slurm import sbatch_script
from planner.errors import InputError
from planner.export import emit_problem
from planner.vocab import DEEPSPEED

#: Every name `emit` may write, for the overwrite check made before planning.
ALL_FILES = (DS_CONFIG, ACCELERATE_CONFIG, TRAINING_ARGS, PLAN_JSON, LAUNCH, HOSTFILE, PEFT_CONFIG, TRAIN_SBATCH)
#: Files written executable.
EXECUTABLE = (LAUNCH, TRAIN_SBATCH)
#: Stands in for the rank-0 address while the accelerate config is built for Slurm, which learns it at job start.
_NO_ADDRESS = "0.0.0.0"
_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}"
                       r"[A-Za-z0-9])?)*$")


@dataclass(frozen=True)
class EmitOptions:
    main_process_ip: str | None = None
    main_process_port: int = 29500
    machine_rank: int = 0
    hostnames: tuple[str, ...] = ()
    force: bool = False
    #: also write train.sbatch; the rank-0 address then comes from the Slurm allocation, not main_process_ip
    slurm: bool = False

    def check(self, nodes: int, writes: bool = True) -> None:
        """Raise InputError for options a `nodes`-node launch cannot use (the rank-0 address is needed only when
        files are written, and not with Slurm)."""
        if not 0 < self.main_process_port < 65536:
            raise InputError(f"port {self.main_process_port} out of range", flag="--main-process-port",
                             hint="Use a port from 1 to 65535.")
        if not 0 <= self.machine_rank < nodes:
            raise InputError(f"machine rank {self.machine_rank} with {nodes} node(s)", flag="--machine-rank",
                             hint=f"Use a rank from 0 to {nodes - 1}.")
        if self.main_process_ip is not None and not valid_host(self.main_process_ip):
            raise InputError(f"{self.main_process_ip!r} is not an IP address or host name", flag="--main-process-ip")
        if writes and nodes > 1 and not self.main_process_ip and not self.slurm:
            raise InputError(f"a {nodes}-node plan needs the address of machine rank 0", flag="--main-process-ip",
                             hint="e.g. --main-process-ip 10.0.0.1 (the first node's address on the training network), "
                             "or emit for Slurm, which finds it when the job starts.")
        bad = [h for h in self.hostnames if not valid_host(h)]
        if bad:
            raise InputError(f"{bad[0]!r} is not a host name", flag="--hostnames")
        if self.hostnames and len(self.hostnames) != nodes:
            raise InputError(f"{len(self.hostnames)} hostnames for {nodes} nodes", flag="--hostnames",
                             hint="Give one hostname per node, comma-separated.")


def valid_host(text: str) -> bool:
    """An IP address, or a host name (RFC 1123; a name of digits only must be an IP address)."""
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return bool(_HOSTNAME.match(text)) and not text.replace(".", "").isdigit()


def check_destination(directory: str | os.PathLike, force: bool) -> Path:
    """The emit folder, checked before any planning: it must be (or can become) a writable folder, and must not
    hold files we would overwrite unless `force`. Raises InputError naming --emit."""
    folder = Path(directory).expanduser()
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if folder.exists() and not folder.is_dir():
        raise InputError(f"{folder} exists and is not a folder", flag="--emit", hint="Choose a folder path.")
    if existing is not None and not existing.is_dir():
        raise InputError(f"{existing} is a file, so {folder} cannot be a folder", flag="--emit")
    if existing is not None and not _writable(existing):
        raise InputError(f"cannot write into {existing}", flag="--emit", hint="Choose a folder you can write to.")
    clash = [name for name in ALL_FILES if (folder / name).exists()]
    if clash and not force:
        raise InputError(f"{folder} already has {', '.join(clash)}", flag="--emit",
                         hint="Pass --force to overwrite them, or choose another folder.")
    return folder


def _writable(folder: Path) -> bool:
    """Whether a file can be created in `folder` (tried, not inferred from permission bits, which root ignores)."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".trainplan-", dir=folder)
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def _json(data) -> str:
    return json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n"


def _yaml(data) -> str:
    return yaml.safe_dump(data, sort_keys=True, default_flow_style=False)


def render_files(plan, opts: EmitOptions) -> dict[str, str]:
    """File name -> contents; the configs name each other by file name, relative to their folder. Pure."""
    opts.check(plan.hardware.nodes)

    problem = emit_problem(plan)
    if problem:
        raise InputError(problem, flag="--optimizer", hint="Plan with an optimizer the Trainer or DeepSpeed has, or "
                         "drop --emit and build it yourself.")
    deepspeed = plan.choice.config.engine == DEEPSPEED
    files = {
        ACCELERATE_CONFIG: _yaml(accelerate_file(plan, opts)),
        TRAINING_ARGS: _json(plan.to_training_args(ds_config_path=DS_CONFIG)),
        PLAN_JSON: _json({k: v for k, v in plan.to_json().items() if k != "files"}),
        LAUNCH: launch_script(plan),
    }
    peft = plan.to_peft()
    if peft is not None:
        files[PEFT_CONFIG] = _json(peft)
    if deepspeed:
        files[DS_CONFIG] = _json(plan.to_deepspeed())
        if plan.hardware.nodes > 1:
            files[HOSTFILE] = hostfile(plan, opts.hostnames)
    if opts.slurm:
        files[TRAIN_SBATCH] = sbatch_script(plan, opts)
    return dict(sorted(files.items()))


def accelerate_file(plan, opts: EmitOptions) -> dict:
    """accelerate_config.yaml's contents; for Slurm without an address given, no main_process_ip (train.sbatch passes
    the allocation's first node)."""
    later = opts.slurm and not opts.main_process_ip and plan.hardware.nodes > 1
    out = plan.to_accelerate(ds_config_path=DS_CONFIG, hostfile_path=HOSTFILE,
                             main_process_ip=_NO_ADDRESS if later else opts.main_process_ip,
                             main_process_port=opts.main_process_port, machine_rank=opts.machine_rank)
    if later:
        del out["main_process_ip"]
    return out


def launch_script(plan) -> str:
    """launch.sh: `accelerate launch` with the folder's files given by their path from the script's own folder, so
    it runs from any directory and after the folder has moved."""
    cfg = plan.choice.config
    lines = [
        "#!/usr/bin/env bash",
        f"# trainplan: {cfg.label()}",
        "# usage: ./launch.sh train.py [script args...]"
        + ("   (run on every node with MACHINE_RANK=0..N-1)" if plan.hardware.nodes > 1 else ""),
        "# in train.py: model = planner.load_plan(\"<this folder>/plan.json\").prepare(model)  (applies what the",
        "# Trainer arguments cannot say); or run the shipped script: ./launch.sh -m probes.train --plan <this folder>",
        "set -euo pipefail",
        'here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"',
    ]
    rank = ' --machine_rank "${MACHINE_RANK:-0}"' if plan.hardware.nodes > 1 else ""
    paths = "".join(f' {flag} "$here/{name}"' for flag, name in folder_files(plan))
    lines.append(f'exec accelerate launch --config_file "$here/{ACCELERATE_CONFIG}"{rank}{paths} "$@"')
    return "\n".join(lines) + "\n"


def hostfile(plan, hostnames: tuple[str, ...]) -> str:
    """DeepSpeed hostfile: one `host slots=N` line per node."""
    nodes = plan.hardware.nodes
    names = list(hostnames) or [f"node-{i}" for i in range(nodes)]
    head = [] if hostnames else ["# replace node-i with your hosts' names (or pass --hostnames)"]
    return "\n".join(head + [f"{h} slots={plan.hardware.gpus_per_node}" for h in names]) + "\n"


def emit(plan, directory: str | os.PathLike, opts: EmitOptions = EmitOptions()) -> list[str]:
    """Write the files into `directory`; returns their paths. Raises InputError before writing anything if a
    file exists and `opts.force` is False."""
    folder = check_destination(directory, opts.force)
    files = render_files(plan, opts)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in files.items():
        path = folder / name
        _atomic_write(path, text, executable=name in EXECUTABLE)
        written.append(str(path))
    return written


def _atomic_write(path: Path, text: str, executable: bool = False) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.chmod(tmp, 0o755 if executable else 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


__all__ = ["EmitOptions", "emit", "render_files", "check_destination", "valid_host", "ALL_FILES", "ACCELERATE_CONFIG",
           "DS_CONFIG", "HOSTFILE", "LAUNCH", "PEFT_CONFIG", "PLAN_JSON", "TRAINING_ARGS", "TRAIN_SBATCH"]
