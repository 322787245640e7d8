"""What each node of a cluster job runs: the plan's `accelerate launch`, its rendezvous read from the variables the
launcher's runtime sets on the node (Slurm's SLURM_NODEID, Kubeflow Trainer's PET_*, SkyPilot's SKYPILOT_*).

A launch line is a list of words, each literal or read from the node's environment, written once and used twice:
as shell in the job's script, and resolved with a node's variables for `plan --launch --dry-run`. The tests run the
scripts with those variables and check that both give the same arguments.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from emit.names import ACCELERATE_CONFIG, folder_files
from planner.export import DS_MULTINODE_LAUNCHER
from planner.receipts import RECEIPT
from planner.vocab import DEEPSPEED

#: The variable naming the run folder on a node, as train.sbatch has it (emit/slurm.py).
RUN_VAR = "TRAINPLAN_RUN"
#: What a job runs without a script given: trainplan's trial script (probes/train.py) on the run folder's plan.
TRIAL = ("-m", "probes.train", "--plan")


@dataclass(frozen=True)
class FromEnv:
    """A word the node's shell expands: the variable `name`, then `suffix` (`"$TRAINPLAN_RUN/ds_config.json"`)."""

    name: str
    suffix: str = ""


Word = str | FromEnv
#: "$@": the training script and its arguments, as the job's script was given them.
SCRIPT_ARGS = FromEnv("@")


@dataclass(frozen=True)
class Rendezvous:
    """How a node finds its place: the words for the node count, its rank, the rank-0 address and port."""

    nodes: Word
    rank: Word
    address: Word
    port: Word


def accelerate_words(plan, rendezvous: Rendezvous) -> list[Word]:
    """`accelerate launch` with the plan's files from the run folder and the node's rendezvous; DeepSpeed plans through
    accelerate's "standard" multi-node launcher, torchrun on each node (accelerate/utils/launch.py:488-496), never
    DeepSpeed's pdsh, which would start the other nodes itself."""
    cfg = plan.choice.config
    words: list[Word] = ["accelerate", "launch", "--quiet", "--config_file", FromEnv(RUN_VAR, "/" + ACCELERATE_CONFIG),
                         "--num_machines", rendezvous.nodes, "--machine_rank", rendezvous.rank,
                         "--main_process_ip", rendezvous.address, "--main_process_port", rendezvous.port,
                         "--num_processes", str(cfg.world_size)]
    if cfg.engine == DEEPSPEED and plan.hardware.nodes > 1:
        words += ["--deepspeed_multinode_launcher", DS_MULTINODE_LAUNCHER]
    for flag, name in folder_files(plan):
        words += [flag, FromEnv(RUN_VAR, "/" + name)]
    return [*words, SCRIPT_ARGS]


def shell(word: Word) -> str:
    """The word as the node's shell reads it (variables in double quotes: expanded, never split)."""
    return f'"${word.name}{word.suffix}"' if isinstance(word, FromEnv) else shlex.quote(word)


def shell_line(words: list[Word], wrap: str = " ") -> str:
    """The words as one command; `wrap` goes before each flag (" \\\\\\n  " for one flag a line)."""
    return "".join((wrap if i and shell(w).startswith("--") else (" " if i else "")) + shell(w)
                   for i, w in enumerate(words))


def resolve(words: list[Word], env: dict[str, str], script: tuple[str, ...]) -> list[str]:
    """The arguments a node runs: each variable from `env`, "$@" as `script`."""
    out: list[str] = []
    for word in words:
        if word == SCRIPT_ARGS:
            out += script
        elif isinstance(word, FromEnv):
            out.append(env[word.name] + word.suffix)
        else:
            out.append(word)
    return out


def stage_plan(source: str, compressed: tuple[str, ...] = ()) -> list[str]:
    """Shell lines copying the plan's files from `source` (a folder) into $TRAINPLAN_RUN, where the run writes
    (receipt.json, out/), and `compressed` files (NAME.gz there) unpacked: each file is replaced whole (a rename), so
    nodes sharing one run folder on a volume never read a half-written one."""
    unpack = [f'python3 -m gzip -d "$staging/{name}.gz" && rm "$staging/{name}.gz"' for name in compressed]
    return [
        "# the plan's files, copied where the run writes; each replaced whole (nodes may share the folder)",
        f'mkdir -p "${RUN_VAR}"',
        f'staging="$(mktemp -d "${RUN_VAR}/.plan.XXXXXX")"',
        f'for f in "{source}"/*; do if [ -f "$f" ]; then cp -L "$f" "$staging"/; fi; done',
        *unpack,
        f'for f in "$staging"/*; do mv -f "$f" "${RUN_VAR}"/; done',
        'rmdir "$staging"',
    ]


def launch_and_report(words: list[Word], rank: str, keep: str | None = None) -> list[str]:
    """Shell lines running the launch line, then, on node 0, printing the run's receipt.json into the job's log (the
    way back for a run folder that goes with the job) and copying it into the folder `keep`, and exiting with the
    launch's status."""
    copy = [f'  mkdir -p "{keep}" && cp "${RUN_VAR}/{RECEIPT}" "{keep}"/'] if keep else []
    return [
        "status=0",
        shell_line(words, " \\\n  ") + " || status=$?",
        f'if [ "${rank}" = 0 ] && [ -f "${RUN_VAR}/{RECEIPT}" ]; then',
        f'  echo "trainplan: {RECEIPT} of this run:"',
        f'  cat "${RUN_VAR}/{RECEIPT}"',
        *copy,
        "fi",
        'exit "$status"',
    ]


__all__ = ["FromEnv", "Rendezvous", "RUN_VAR", "SCRIPT_ARGS", "TRIAL", "Word", "accelerate_words", "launch_and_report",
           "resolve", "shell", "shell_line", "stage_plan"]
