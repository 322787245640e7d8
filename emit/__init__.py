"""Writers: a Plan as DeepSpeed / Accelerate / Trainer configs, plan.json and launch.sh, and the launcher.

Deterministic (sorted keys, trailing newline), atomic, and never overwriting without `force`.
"""

from emit.files import EmitOptions, check_destination, emit, render_files
from emit.launch import launch_command, run_launch

__all__ = ["EmitOptions", "check_destination", "emit", "render_files", "launch_command", "run_launch"]
