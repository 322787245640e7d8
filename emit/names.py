"""The run folder's file names, and the `accelerate launch` flags that give accelerate those files by path.

Every path inside the emitted files is a name in the folder, so the folder can be planned on one machine and copied
to another. Whoever reads a file resolves the names against the folder: `LoadedPlan` for training_args.json, and the
launchers (launch.sh, train.sbatch, `plan --launch`) for accelerate_config.yaml, whose paths accelerate itself would
resolve against the current directory (see `folder_files`).
"""

from __future__ import annotations

from planner.vocab import DEEPSPEED, KUBERNETES, SKYPILOT, SLURM

DS_CONFIG = "ds_config.json"
ACCELERATE_CONFIG = "accelerate_config.yaml"
TRAINING_ARGS = "training_args.json"
PLAN_JSON = "plan.json"
LAUNCH = "launch.sh"
PEFT_CONFIG = "peft_config.json"
TRAIN_SBATCH = "train.sbatch"
TRAINJOB_YAML = "trainjob.yaml"
SKY_YAML = "sky.yaml"
#: The file each launcher submits (planner/vocab.py LAUNCHER).
LAUNCHER_FILE = {SLURM: TRAIN_SBATCH, KUBERNETES: TRAINJOB_YAML, SKYPILOT: SKY_YAML}
REPORT_HTML = "plan.html"
#: The training scripts shipped into a causal LM's folder (emit/scripts/): the Trainer's and TRL's SFTTrainer's.
TRAIN_SCRIPTS = ("train.py", "train_trl.py")
#: accelerate_config.yaml's keys (under deepspeed_config) that name a file, and the launch flag that overrides each.
#: accelerate copies them into its arguments (accelerate/commands/launch.py:1265-1277, a flag given on the command
#: line wins) and exports deepspeed_config_file to the training processes as written
#: (accelerate/utils/launch.py:581-582, ACCELERATE_DEEPSPEED_CONFIG_FILE), where accelerate's DeepSpeedPlugin opens it
#: relative to the current directory (accelerate/utils/dataclasses.py:1264-1273, accelerate/utils/deepspeed.py:141).
PATH_FLAGS = {"deepspeed_config_file": "--deepspeed_config_file"}


def folder_files(plan) -> list[tuple[str, str]]:
    """(launch flag, file name) for each file of the folder that the plan's accelerate config names; a launcher
    passes `flag FOLDER/name` so that the run works from any directory."""
    if plan.choice.config.engine != DEEPSPEED:
        return []
    return [(PATH_FLAGS["deepspeed_config_file"], DS_CONFIG)]


__all__ = ["ACCELERATE_CONFIG", "DS_CONFIG", "LAUNCH", "LAUNCHER_FILE", "PATH_FLAGS", "PEFT_CONFIG", "PLAN_JSON",
           "REPORT_HTML", "SKY_YAML", "TRAINING_ARGS", "TRAINJOB_YAML", "TRAIN_SBATCH", "TRAIN_SCRIPTS",
           "folder_files"]
