"""Writers: a Plan as DeepSpeed / Accelerate / Trainer configs, plan.json, launch.sh and a cluster engine's job (a
Slurm batch script, a Kubeflow TrainJob, a SkyPilot task), and the launcher.

Deterministic (sorted keys, trailing newline), atomic, and never overwriting without `force`. The files name each
other by file name, so the folder can be copied elsewhere (emit/names.py).
"""

from emit.files import EmitOptions, check_destination, emit, render_files
from emit.launch import launch_command, run_launch
from emit.slurm import sbatch_script

__all__ = ["EmitOptions", "check_destination", "emit", "render_files", "launch_command", "run_launch", "sbatch_script"]
