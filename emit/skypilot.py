"""sky.yaml: the plan as a SkyPilot task. `sky launch --workdir DIR DIR/sky.yaml` syncs the run folder to each node's
~/sky_workdir (SkyPilot's SKY_REMOTE_WORKDIR, sky/skylet/constants.py), where `run` starts; `setup` installs
trainplan from its source, uploaded by file_mounts from TRAINPLAN_SOURCE, with the extras the plan needs.

SkyPilot sets on each node (docs "Distributed Jobs on Many Nodes"): SKYPILOT_NODE_IPS (the nodes' addresses, one a
line, the head's first), SKYPILOT_NODE_RANK, SKYPILOT_NUM_NODES and SKYPILOT_NUM_GPUS_PER_NODE. The run checks the
cluster's GPUs are the plan's, then launches with them. With --volume a bucket is mounted (file_mounts, MOUNT mode)
and node 0 copies receipt.json there, so that it outlives the cluster.
"""

from __future__ import annotations

import math
import re
import shlex
from pathlib import Path

from emit.kubernetes import job_name
from emit.names import ACCELERATE_CONFIG
from emit.nodes import RUN_VAR, TRIAL, FromEnv, Rendezvous, Word, accelerate_words, launch_and_report
from emit.write import yaml_text
from planner.errors import InputError
from planner.vocab import PACKAGE, SCRIPT_EXTRAS

#: SkyPilot's name for each catalog GPU: the AcceleratorName column of SkyPilot's catalog
#: (skypilot-org/skypilot-catalog catalogs/v6/common/accelerators.csv, read by sky/utils/accelerator_registry.py to
#: canonicalise names), and B200 and MI300X from `sky show-gpus -a` (skypilot docs/source/compute/show-gpus-all.txt).
#: None: SkyPilot has no name for that GPU alone (its "H100" is the SXM and the PCIe card alike; no MI250X).
SKYPILOT_GPU: dict[str, str | None] = {
    "V100-16GB": "V100", "V100-32GB": "V100-32GB", "T4-16GB": "T4", "A10G-24GB": "A10G", "L4-24GB": "L4",
    "L40S-48GB": "L40S", "A100-40GB": "A100", "A100-80GB": "A100-80GB", "H100-80GB": "H100",
    "H100-PCIe-80GB": None, "H200-141GB": "H200", "B200-192GB": "B200", "RTX3090-24GB": "RTX3090",
    "RTX4090-24GB": "RTX4090", "MI250X-128GB": None, "MI300X-192GB": "MI300X",
}
#: Where file_mounts puts trainplan's source and the --volume bucket on each node.
SOURCE_MOUNT = "/trainplan/src"
VOLUME_MOUNT = "/trainplan/volume"
#: SkyPilot's workdir on each node (sky/skylet/constants.py SKY_REMOTE_WORKDIR): where `run` starts; and the path it
#: has for the dry run's example user.
WORKDIR = "~/sky_workdir"
EXAMPLE_WORKDIR = "/home/ubuntu/sky_workdir"
#: Bucket URIs SkyPilot's storage mounts (sky/data/storage.py StoreType.store_prefix).
BUCKET_SCHEMES = ("s3", "gs", "r2", "cos", "oci", "nebius")
_BUCKET = re.compile(r"^(%s)://[a-z0-9][a-z0-9._-]{1,221}[a-z0-9](/[A-Za-z0-9._/-]*)?$" % "|".join(BUCKET_SCHEMES))
RENDEZVOUS_PORT = 29500
RENDEZVOUS = Rendezvous(nodes=FromEnv("SKYPILOT_NUM_NODES"), rank=FromEnv("SKYPILOT_NODE_RANK"),
                        address=FromEnv("MASTER_ADDR"), port=FromEnv("MASTER_PORT"))


def skypilot_gpu(gpu: str) -> str:
    """SkyPilot's accelerator name for catalog GPU `gpu`; an InputError naming --gpu where it has none."""
    name = SKYPILOT_GPU.get(gpu)
    if name is None:
        known = ", ".join(g for g, n in SKYPILOT_GPU.items() if n)
        raise InputError(f"SkyPilot has no name for the {gpu} alone", flag="--gpu",
                         hint=f"Plan for one of {known}, or write the task's accelerators yourself.")
    return name


def valid_bucket(text: str) -> bool:
    return bool(_BUCKET.match(text))


def trainplan_source() -> Path:
    """The trainplan source tree this code runs from (the folder with pyproject.toml), which the task uploads."""
    root = Path(__file__).resolve().parent.parent
    if not (root / "pyproject.toml").is_file():
        raise InputError("the SkyPilot task uploads trainplan's source, and this installation has none",
                         flag="--launcher", hint="Install trainplan from its source tree (pip install -e .).")
    return root


def install_line(plan) -> str:
    """setup's install: trainplan from the uploaded source with the extras the plan's requirements name and the shipped
    scripts need; a package no extra installs, by its own command."""
    packages = [PACKAGE[r.package] for r in plan.requirements]
    extras = sorted({p.extra for p in packages if p.extra} | set(SCRIPT_EXTRAS))
    commands = [p.command for p in packages if not p.extra and p.command]
    return " && ".join([f'pip install "{SOURCE_MOUNT}[{",".join(extras)}]"', *commands])


def node_words(plan) -> list[Word]:
    return accelerate_words(plan, RENDEZVOUS)


def kept(plan, options) -> str | None:
    """The folder on the --volume bucket that receives the run's receipt.json (None without one)."""
    return f"{VOLUME_MOUNT}/{job_name(plan)}" if options.volume else None


def run_script(plan, options) -> str:
    """`run`: in the run folder (the workdir), the rendezvous from SkyPilot's variables, a check that the cluster has
    the plan's GPUs, the launch; node 0's receipt into the log and onto the --volume bucket. The nodes write nothing
    else to the bucket (a mounted bucket is no shared file system: a script's --output-dir there keeps checkpoints)."""
    hw, world = plan.hardware, plan.choice.config.world_size
    script = shlex.join(options.script) if options.script else f'{shlex.join(TRIAL)} "${RUN_VAR}"'
    lines = ["set -euo pipefail",
             f'if [ ! -f {ACCELERATE_CONFIG} ]; then echo "sky.yaml: no {ACCELERATE_CONFIG} in $PWD: launch with '
             '--workdir <this folder>" >&2; exit 2; fi']
    lines += [
        f'export {RUN_VAR}="$PWD"',
        'gpus="$((SKYPILOT_NUM_NODES * SKYPILOT_NUM_GPUS_PER_NODE))"',
        f'if [ "$gpus" != {world} ]; then echo "sky.yaml: the plan is for {hw.nodes} x {hw.gpus_per_node} GPUs, '
        'the cluster has $SKYPILOT_NUM_NODES x $SKYPILOT_NUM_GPUS_PER_NODE" >&2; exit 2; fi',
        "# the head node (the first address) is machine rank 0",
        'MASTER_ADDR="$(printf "%s\\n" "$SKYPILOT_NODE_IPS" | head -n 1)"',
        f"MASTER_PORT={options.main_process_port or RENDEZVOUS_PORT}",
        f"set -- {script}",
        *launch_and_report(node_words(plan), "SKYPILOT_NODE_RANK", kept(plan, options)),
    ]
    return "\n".join(lines) + "\n"


def task(plan, options) -> dict:
    """The task: the plan's nodes and GPUs (and host memory for CPU offload), setup, run, the mounts."""
    hw = plan.hardware
    resources = {"accelerators": f"{skypilot_gpu(hw.gpu)}:{hw.gpus_per_node}"}
    offloaded = plan.choice.memory.cpu_offload_bytes if plan.choice.memory else 0
    if offloaded:  # SkyPilot's memory is GB per node, "N+" at least N (sky/resources.py `memory`)
        resources["memory"] = f"{math.ceil(offloaded / 1e9)}+"
    mounts: dict = {SOURCE_MOUNT: "$TRAINPLAN_SOURCE"}
    if options.volume:
        mounts[VOLUME_MOUNT] = {"source": options.volume, "mode": "MOUNT"}
    return {"name": job_name(plan), "num_nodes": hw.nodes,
            "resources": resources, "envs": {"TRAINPLAN_SOURCE": str(trainplan_source())}, "file_mounts": mounts,
            "setup": f"set -euo pipefail\n{install_line(plan)}\n", "run": run_script(plan, options)}


def sky_yaml(plan, options) -> str:
    """sky.yaml, with how to launch it and where the receipt lands."""
    where = (f"{options.volume}/{job_name(plan)}/receipt.json" if options.volume else
             f"at the end of the job's log (sky logs), and in {WORKDIR} on the head node")
    head = [f"# trainplan: {plan.choice.config.label()}",
            "# launch: sky launch --workdir <this folder> <this folder>/sky.yaml",
            "# TRAINPLAN_SOURCE: trainplan's source on the launching machine (sky launch --env TRAINPLAN_SOURCE=...)",
            f"# receipt.json: {where}"]
    return "\n".join(head) + "\n" + yaml_text(task(plan, options))


def example_nodes(plan, options) -> list[dict[str, str]]:
    """The variables SkyPilot sets on each node, with example addresses, and those the run derives from them."""
    hw = plan.hardware
    ips = [f"10.0.0.{i + 1}" for i in range(hw.nodes)]
    return [{"SKYPILOT_NODE_IPS": "\n".join(ips), "SKYPILOT_NODE_RANK": str(rank), "SKYPILOT_NUM_NODES": str(hw.nodes),
             "SKYPILOT_NUM_GPUS_PER_NODE": str(hw.gpus_per_node), "MASTER_ADDR": ips[0],
             "MASTER_PORT": str(options.main_process_port or RENDEZVOUS_PORT), RUN_VAR: EXAMPLE_WORKDIR}
            for rank in range(hw.nodes)]


__all__ = ["SKYPILOT_GPU", "example_nodes", "install_line", "node_words", "sky_yaml", "skypilot_gpu", "task",
           "valid_bucket"]
