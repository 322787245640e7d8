"""train.sbatch: the plan as a Slurm batch job, one `accelerate launch` per node under srun.

The rank-0 address is the allocation's first node, known only when the job starts; a node's rank is its
SLURM_NODEID. DeepSpeed plans go through accelerate too, with the launcher the emitted accelerate_config.yaml names
("standard": accelerate runs torchrun on each node with the node's rank and the rank-0 address,
accelerate/utils/launch.py:488-496), never DeepSpeed's pdsh or slurm launchers, which start the other nodes
themselves (accelerate/utils/launch.py:452-460) and would do so once per srun task.

Slurm runs a copy of the batch script from its spool folder, so the script finds its run folder from the path it was
submitted by (`scontrol show job` names it, relative to the submit directory), else from its own path (run by bash),
else the submit directory, unless $TRAINPLAN_RUN names it. The user's script and its arguments are resolved from the
job's working directory, the submit directory, as they would be by hand.
"""

from __future__ import annotations

import re
import shlex

from emit.names import ACCELERATE_CONFIG
from emit.nodes import RUN_VAR, TRIAL, FromEnv, Rendezvous, Word, accelerate_words, shell_line

#: The job's log, in the job's working directory (the submit directory): %x the job name, %j its id.
LOG = "%x-%j.log"
#: Without --main-process-port, each job takes a port from its id, so that jobs sharing a node do not collide.
JOB_PORT = "$((20000 + ${SLURM_JOB_ID:-0} % 20000))"

#: Finds the run folder: $TRAINPLAN_RUN, else the folder of the file submitted, else the submit directory.
FIND_FOLDER = [
    "# the run folder: $TRAINPLAN_RUN, else the folder of the file submitted (Slurm runs a copy), else the",
    "# submit directory",
    'if [ -z "${TRAINPLAN_RUN:-}" ]; then',
    '  here="$(dirname "${BASH_SOURCE[0]}")"',
    f'  if [ ! -f "$here/{ACCELERATE_CONFIG}" ] && [ -n "${{SLURM_JOB_ID:-}}" ]; then',
    '    submitted="$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n \'s/^ *Command=\\([^ ]*\\).*/\\1/p\' '
    '| head -n 1 || true)"',
    '    here="$(dirname "${submitted:-.}")"',
    "  fi",
    f'  [ -f "$here/{ACCELERATE_CONFIG}" ] || here="${{SLURM_SUBMIT_DIR:-.}}"',
    '  TRAINPLAN_RUN="$here"',
    "fi",
]


def job_name(plan) -> str:
    """trainplan-<model>, in the characters every Slurm accepts."""
    model = plan.model.name.rstrip("/").rsplit("/", 1)[-1]
    return "trainplan-" + (re.sub(r"[^A-Za-z0-9._-]+", "-", model).strip("-") or "run")


def sbatch_script(plan, options, script: tuple[str, ...] = ()) -> str:
    """The batch script: `sbatch FOLDER/train.sbatch [script args...]` trains with the script's arguments, or with
    `script` (the shipped script, `-m probes.train --plan <folder>`, when empty)."""
    hw, cfg = plan.hardware, plan.choice.config
    default = shlex.join(script) if script else f'{shlex.join(TRIAL)} "${RUN_VAR}"'
    port = str(options.main_process_port) if options.main_process_port else JOB_PORT
    lines = [
        "#!/usr/bin/env bash",
        f"#SBATCH --job-name={job_name(plan)}",
        f"#SBATCH --nodes={hw.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={hw.gpus_per_node}",
        f"#SBATCH --output={LOG}",
        f"# trainplan: {cfg.label()}",
        "# usage: sbatch <this folder>/train.sbatch [script args...], from any directory: the script and its",
        "# arguments are resolved from there; without arguments: "
        + default.replace('"$TRAINPLAN_RUN"', "<this folder>"),
        "# the one task per node starts every GPU's process: give it CPUs (--cpus-per-task or --exclusive) as your",
        "# cluster expects, and add --time, --partition, --account likewise",
        "set -euo pipefail",
        *FIND_FOLDER,
        'export TRAINPLAN_RUN="$(cd "$TRAINPLAN_RUN" && pwd)"',
        f'if [ ! -f "$TRAINPLAN_RUN/{ACCELERATE_CONFIG}" ]; then',
        f'  echo "train.sbatch: no {ACCELERATE_CONFIG} in $TRAINPLAN_RUN: submit the train.sbatch plan --emit wrote '
        '(sbatch FOLDER/train.sbatch), or set TRAINPLAN_RUN=FOLDER" >&2',
        "  exit 2",
        "fi",
        f'if [ "$#" -eq 0 ]; then set -- {default}; fi',
        "# the first node of the allocation is machine rank 0",
        'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        f'export MASTER_PORT="{port}"',
        "# one task per node; single quotes: each node reads its own SLURM_NODEID",
        "srun --ntasks-per-node=1 bash -c 'exec " + shell_line(node_words(plan), " \\\n  ") + "' bash \"$@\"",
    ]
    return "\n".join(lines) + "\n"


#: The rendezvous each node reads: the allocation's node count and the node's id; the address and port train.sbatch
#: exports before srun.
RENDEZVOUS = Rendezvous(nodes=FromEnv("SLURM_NNODES"), rank=FromEnv("SLURM_NODEID"), address=FromEnv("MASTER_ADDR"),
                        port=FromEnv("MASTER_PORT"))


def node_words(plan) -> list[Word]:
    """The `accelerate launch` each node runs under srun."""
    return accelerate_words(plan, RENDEZVOUS)


def example_nodes(options, folder: str, hosts: tuple[str, ...], job_id: int) -> list[dict[str, str]]:
    """The variables each node's launch line reads in a job on `hosts` with id `job_id`, the run folder `folder`
    (what train.sbatch and srun set), for `plan --launch --dry-run`."""
    port = str(options.main_process_port or 20000 + job_id % 20000)  # JOB_PORT
    return [{"SLURM_NNODES": str(len(hosts)), "SLURM_NODEID": str(rank), "MASTER_ADDR": hosts[0], "MASTER_PORT": port,
             RUN_VAR: folder} for rank in range(len(hosts))]


__all__ = ["sbatch_script", "job_name", "node_words", "example_nodes"]
