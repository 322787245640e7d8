"""Render a plan's files and write them atomically; refuse to overwrite unless forced.

Only the files the plan needs: ds_config.json for DeepSpeed plans, peft_config.json for LoRA / QLoRA plans (the
LoraConfig and BitsAndBytesConfig arguments), the launcher's job (train.sbatch for Slurm, trainjob.yaml for Kubernetes,
sky.yaml for SkyPilot), the training scripts train.py and train_trl.py for a causal LM; accelerate_config.yaml,
training_args.json, plan.json (read back by `planner.load_plan`) and launch.sh always.
The files name each other by file name only, so the folder can be moved (emit/names.py).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import yaml

from emit.kubernetes import trainjob_yaml, valid_claim
from emit.names import (
    ACCELERATE_CONFIG, DS_CONFIG, LAUNCH, PEFT_CONFIG, PLAN_JSON, REPORT_HTML, SKY_YAML, TRAIN_SBATCH, TRAIN_SCRIPTS,
    TRAINING_ARGS, TRAINJOB_YAML,
    folder_files,
)
from emit.skypilot import sky_yaml, skypilot_gpu, valid_bucket
from emit.slurm import sbatch_script
from emit.write import atomic_write
from planner.errors import InputError
from planner.export import emit_problem
from planner.vocab import DEEPSPEED, KUBERNETES, LAUNCHER, SKYPILOT, SLURM

#: Every name `emit` may write, for the overwrite check made before planning.
ALL_FILES = (DS_CONFIG, ACCELERATE_CONFIG, TRAINING_ARGS, PLAN_JSON, LAUNCH, PEFT_CONFIG, TRAIN_SBATCH, TRAINJOB_YAML,
             SKY_YAML, REPORT_HTML, *TRAIN_SCRIPTS)
#: The task the shipped training scripts train (their collator makes next-token labels).
SCRIPT_TASK = "causal-lm"
#: accelerate's rendezvous port where none is given (accelerate/commands/launch.py `--main_process_port`).
DEFAULT_PORT = 29500
#: Files written executable.
EXECUTABLE = (LAUNCH, TRAIN_SBATCH)
#: Stands in for the rank-0 address while the accelerate config is built for a launcher, which learns it at job start.
_NO_ADDRESS = "0.0.0.0"
_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}"
                       r"[A-Za-z0-9])?)*$")


@dataclass(frozen=True)
class EmitOptions:
    main_process_ip: str | None = None
    #: None: 29500 (accelerate's default), and under Slurm a port from the job's id
    main_process_port: int | None = None
    machine_rank: int = 0
    #: the nodes' names, rank 0 first: its name is the rank-0 address where main_process_ip is not given
    hostnames: tuple[str, ...] = ()
    force: bool = False
    #: the same as launcher="slurm" (the older spelling)
    slurm: bool = False
    #: also write the job of a cluster engine (planner/vocab.py LAUNCHER); the rank-0 address then comes from the job
    launcher: str | None = None
    #: the container image the nodes run (kubernetes)
    image: str | None = None
    #: where the run folder lives and the run writes: a PersistentVolumeClaim (kubernetes), a bucket (skypilot)
    volume: str | None = None
    #: the training script and its arguments the job runs (kubernetes, skypilot; default: trainplan's trial script)
    script: tuple[str, ...] = ()
    #: also write plan.html (emit/report.py) where its extra, report, is installed
    report: bool = True

    def __post_init__(self):
        if self.slurm and self.launcher in (None, SLURM):
            object.__setattr__(self, "launcher", SLURM)
        elif self.slurm:
            raise InputError(f"cannot be combined with --launcher {self.launcher}", flag="--slurm",
                             hint="--slurm is --launcher slurm: give one launcher.")

    def check(self, nodes: int, writes: bool = True, gpu: str | None = None) -> None:
        """Raise InputError for options a `nodes`-node launch on `gpu` (a catalog name, where known) cannot use (the
        rank-0 address is needed only when files are written, and not with a launcher)."""
        self.check_launcher(gpu)
        if self.main_process_port is not None and not 0 < self.main_process_port < 65536:
            raise InputError(f"port {self.main_process_port} out of range", flag="--main-process-port",
                             hint="Use a port from 1 to 65535.")
        if not 0 <= self.machine_rank < nodes:
            raise InputError(f"machine rank {self.machine_rank} with {nodes} node(s)", flag="--machine-rank",
                             hint=f"Use a rank from 0 to {nodes - 1}.")
        if self.main_process_ip is not None and not valid_host(self.main_process_ip):
            raise InputError(f"{self.main_process_ip!r} is not an IP address or host name", flag="--main-process-ip")
        if writes and nodes > 1 and not self.rank0_address and not self.launcher:
            raise InputError(f"a {nodes}-node plan needs the address of machine rank 0", flag="--main-process-ip",
                             hint="e.g. --main-process-ip 10.0.0.1 (the first node's address on the training network), "
                             "or emit for a cluster engine (--launcher), which finds it when the job starts.")
        bad = [h for h in self.hostnames if not valid_host(h)]
        if bad:
            raise InputError(f"{bad[0]!r} is not a host name", flag="--hostnames")
        if self.hostnames and len(self.hostnames) != nodes:
            raise InputError(f"{len(self.hostnames)} hostnames for {nodes} nodes", flag="--hostnames",
                             hint="Give one hostname per node, comma-separated, rank 0 first.")

    def check_launcher(self, gpu: str | None = None) -> None:
        """--launcher and what goes with it: the image Kubernetes runs, a volume of the launcher's kind, a GPU
        SkyPilot has a name for."""
        if self.launcher is not None and self.launcher not in LAUNCHER:
            raise InputError(f"unknown value {self.launcher!r}", flag="--launcher",
                             hint=f"Use one of {', '.join(LAUNCHER)}.")
        info = LAUNCHER.get(self.launcher) if self.launcher else None
        if info is not None and info.image and not (self.image or "").strip():
            raise InputError(f"--launcher {self.launcher} needs the container image its nodes run", flag="--image",
                             hint="e.g. --image registry.example.com/team/train:1 (with trainplan and the plan's "
                                  "packages installed).")
        if self.image is not None and (info is None or not info.image):
            raise InputError("applies to --launcher kubernetes", flag="--image", hint="Add --launcher kubernetes.")
        if self.image is not None and any(c.isspace() for c in self.image):
            raise InputError(f"{self.image!r} is not a container image name", flag="--image",
                             hint="e.g. --image registry.example.com/team/train:1 (no spaces).")
        if self.volume is not None:
            self._check_volume(info)
        if self.launcher == SKYPILOT and gpu is not None:
            skypilot_gpu(gpu)

    def _check_volume(self, info) -> None:
        if info is None or not info.volume:
            raise InputError("applies to --launcher kubernetes (a PersistentVolumeClaim) or skypilot (a bucket)",
                             flag="--volume", hint="Add --launcher kubernetes or --launcher skypilot.")
        valid = valid_claim if self.launcher == KUBERNETES else valid_bucket
        if not valid(self.volume):
            raise InputError(f"{self.volume!r} is not {info.volume}", flag="--volume",
                             hint="e.g. --volume " + ("training-runs" if self.launcher == KUBERNETES else
                                                      "s3://my-bucket/runs"))

    @property
    def rank0_address(self) -> str | None:
        """--main-process-ip, else the first of --hostnames."""
        return self.main_process_ip or (self.hostnames[0] if self.hostnames else None)

    @property
    def port(self) -> int:
        return self.main_process_port or DEFAULT_PORT


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


def render_files(plan, opts: EmitOptions, folder: str | os.PathLike = ".") -> dict[str, str]:
    """File name -> contents for `folder`; the configs name each other by file name, relative to their folder, and
    plan.json names local paths (a model folder, the dataset) both relative to `folder` and absolute. Pure."""
    opts.check(plan.hardware.nodes, gpu=plan.hardware.gpu)

    problem = emit_problem(plan)
    if problem:
        raise InputError(problem, flag="--optimizer", hint="Plan with an optimizer the Trainer or DeepSpeed has, or "
                         "drop --emit and build it yourself.")
    deepspeed = plan.choice.config.engine == DEEPSPEED
    files = {
        ACCELERATE_CONFIG: _yaml(accelerate_file(plan, opts)),
        TRAINING_ARGS: _json(plan.to_training_args(ds_config_path=DS_CONFIG)),
        PLAN_JSON: _json(plan_json(plan, folder)),
        LAUNCH: launch_script(plan),
    }
    peft = plan.to_peft()
    if peft is not None:
        files[PEFT_CONFIG] = _json(peft)
    if deepspeed:
        files[DS_CONFIG] = _json(plan.to_deepspeed())
    if opts.launcher == SLURM:
        files[TRAIN_SBATCH] = sbatch_script(plan, opts)
    if plan.model.task == SCRIPT_TASK:
        files.update({name: (resources.files("emit") / "scripts" / name).read_text() for name in TRAIN_SCRIPTS})
    if opts.launcher == KUBERNETES:  # last: the ConfigMap carries the files above
        files[TRAINJOB_YAML] = trainjob_yaml(plan, opts, files)
    if opts.launcher == SKYPILOT:
        files[SKY_YAML] = sky_yaml(plan, opts)
    return dict(sorted(files.items()))


def plan_json(plan, folder: str | os.PathLike) -> dict:
    """plan.json: `plan --json` less the files list, with the local paths it names found from `folder`."""
    data = {k: v for k, v in plan.to_json().items() if k != "files"}
    paths = portable_paths(data, folder)
    return data | {"paths": paths} if paths else data


def accelerate_file(plan, opts: EmitOptions) -> dict:
    """accelerate_config.yaml's contents; for a launcher without an address given, no main_process_ip (the job passes
    the rank-0 node's when it starts)."""
    later = opts.launcher and not opts.rank0_address and plan.hardware.nodes > 1
    out = plan.to_accelerate(ds_config_path=DS_CONFIG, main_process_ip=_NO_ADDRESS if later else opts.rank0_address,
                             main_process_port=opts.port, machine_rank=opts.machine_rank)
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
        "# usage: <this folder>/launch.sh SCRIPT [script args...]"
        + ("   (run on every node with MACHINE_RANK=0..N-1)" if plan.hardware.nodes > 1 else ""),
        "# SCRIPT: <this folder>/train.py (or train_trl.py) --dataset FILE to train; your own script, with",
        "# planner.load_plan(\"<this folder>\").prepare(model); or a trial: -m probes.train --plan <this folder>",
        "set -euo pipefail",
        'here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"',
    ]
    rank = ' --machine_rank "${MACHINE_RANK:-0}"' if plan.hardware.nodes > 1 else ""
    paths = "".join(f' {flag} "$here/{name}"' for flag, name in folder_files(plan))
    lines.append(f'exec accelerate launch --quiet --config_file "$here/{ACCELERATE_CONFIG}"{rank}{paths} "$@"')
    return "\n".join(lines) + "\n"


def emit(plan, directory: str | os.PathLike, opts: EmitOptions = EmitOptions()) -> list[str]:
    """Write the files into `directory`; returns their paths. Raises InputError before writing anything if a
    file exists and `opts.force` is False."""
    folder = check_destination(directory, opts.force)
    files = render_files(plan, opts, folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in files.items():
        path = folder / name
        atomic_write(path, text, executable=name in EXECUTABLE)
        written.append(str(path))
    # lazy: the report's modules load matplotlib's settings and the planner's renderers only where a page is written
    from emit.report import report_available, write_report

    if opts.report and report_available():
        listed = plan.model_copy(update={"files": tuple(Path(p).name for p in written)})
        written.append(write_report(listed, folder / REPORT_HTML, force=True))
    return written


def portable_paths(data: dict, folder: str | os.PathLike) -> dict:
    """plan.json's `paths`: each local path the plan names (a model folder, a dataset file or folder, a tokenizer
    folder) relative to the emit folder and absolute, so that `LoadedPlan.local_path` finds it after either moves."""
    dataset = data.get("dataset") or {}
    named = {"model": data["model"]["name"] if data["model"].get("source") == "folder" else None,
             "dataset": dataset.get("source"), "tokenizer": dataset.get("tokenizer")}
    paths = {}
    for kind, given in named.items():
        if given and os.path.exists(given):
            absolute = os.path.abspath(given)
            paths[kind] = {"relative": os.path.relpath(absolute, os.path.abspath(folder)), "absolute": absolute}
    return paths


__all__ = ["EmitOptions", "emit", "render_files", "check_destination", "valid_host", "ALL_FILES", "ACCELERATE_CONFIG",
           "DS_CONFIG", "LAUNCH", "PEFT_CONFIG", "PLAN_JSON", "SKY_YAML", "TRAINING_ARGS", "TRAINJOB_YAML",
           "TRAIN_SBATCH"]
