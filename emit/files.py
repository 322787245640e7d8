"""Render a plan's files and write them atomically; refuse to overwrite unless forced."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from planner.errors import InputError

DS_CONFIG = "ds_config.json"
ACCELERATE_CONFIG = "accelerate_config.yaml"
TRAINING_ARGS = "training_args.json"
PLAN_JSON = "plan.json"
LAUNCH = "launch.sh"
HOSTFILE = "hostfile"


@dataclass(frozen=True)
class EmitOptions:
    engine: str = "deepspeed"                # deepspeed | fsdp (for ZeRO plans)
    main_process_ip: str | None = None
    main_process_port: int = 29500
    machine_rank: int = 0
    hostnames: tuple[str, ...] = ()
    force: bool = False


def _json(data) -> str:
    return json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n"


def _yaml(data) -> str:
    return yaml.safe_dump(data, sort_keys=True, default_flow_style=False)


def render_files(plan, opts: EmitOptions, folder: str = ".") -> dict[str, str]:
    """File name -> contents, with the configs referring to each other inside `folder`. Pure."""
    if opts.engine not in ("deepspeed", "fsdp"):
        raise InputError(f"unknown engine {opts.engine!r}", flag="--engine", hint="Use deepspeed or fsdp.")
    ds_path = f"{folder.rstrip('/')}/{DS_CONFIG}"
    files = {
        DS_CONFIG: _json(plan.to_deepspeed()),
        ACCELERATE_CONFIG: _yaml(plan.to_accelerate(engine=opts.engine, ds_config_path=ds_path,
                                                    main_process_ip=opts.main_process_ip,
                                                    main_process_port=opts.main_process_port,
                                                    machine_rank=opts.machine_rank)),
        TRAINING_ARGS: _json(plan.to_training_args(ds_config_path=ds_path)),
        PLAN_JSON: _json({k: v for k, v in plan.to_json().items() if k != "files"}),
        LAUNCH: launch_script(plan),
    }
    if plan.hardware.nodes > 1:
        files[HOSTFILE] = hostfile(plan, opts.hostnames)
    return files


def launch_script(plan) -> str:
    cfg = plan.choice.config
    lines = [
        "#!/usr/bin/env bash",
        f"# trainplan: {cfg.label()}",
        "# usage: ./launch.sh train.py [script args...]"
        + ("   (run on every node with MACHINE_RANK=0..N-1)" if plan.hardware.nodes > 1 else ""),
        "set -euo pipefail",
        'here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"',
    ]
    rank = ' --machine_rank "${MACHINE_RANK:-0}"' if plan.hardware.nodes > 1 else ""
    lines.append(f'exec accelerate launch --config_file "$here/{ACCELERATE_CONFIG}"{rank} "$@"')
    if cfg.checkpointing == "selective":
        lines.insert(3, "# selective checkpointing: call planner.memory.step.enable_checkpointing(model, 'selective') "
                        "in train.py (the Trainer's flag is full checkpointing)")
    return "\n".join(lines) + "\n"


def hostfile(plan, hostnames: tuple[str, ...]) -> str:
    """DeepSpeed hostfile: one `host slots=N` line per node."""
    nodes = plan.hardware.nodes
    names = list(hostnames) or [f"node-{i}" for i in range(nodes)]
    if len(names) != nodes:
        raise InputError(f"{len(names)} hostnames for {nodes} nodes", flag="--hostnames",
                         hint="Give one hostname per node, comma-separated.")
    head = [] if hostnames else ["# replace node-i with your hosts' names (or pass --hostnames)"]
    return "\n".join(head + [f"{h} slots={plan.hardware.gpus_per_node}" for h in names]) + "\n"


def emit(plan, directory: str | os.PathLike, opts: EmitOptions = EmitOptions()) -> list[str]:
    """Write the files into `directory`; returns their paths. Raises InputError before writing anything if a
    file exists and `opts.force` is False."""
    folder = Path(directory).expanduser()
    if folder.exists() and not folder.is_dir():
        raise InputError(f"{folder} exists and is not a folder", flag="--emit")
    files = render_files(plan, opts, str(folder.resolve()))
    clash = [name for name in files if (folder / name).exists()]
    if clash and not opts.force:
        raise InputError(f"{folder} already has {', '.join(clash)}", flag="--emit",
                         hint="Pass --force to overwrite them, or choose another folder.")
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in files.items():
        path = folder / name
        _atomic_write(path, text, executable=name == LAUNCH)
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


__all__ = ["EmitOptions", "emit", "render_files"]
