#!/usr/bin/env bash
# trainplan: mb 2 x N 16 x 8 GPU, bf16-mixed, DDP
# usage: <this folder>/launch.sh SCRIPT [script args...]
# SCRIPT: <this folder>/train.py (or train_trl.py) --dataset FILE to train; your own script, with
# planner.load_plan("<this folder>").prepare(model); or a trial: -m probes.train --plan <this folder>
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec accelerate launch --quiet --config_file "$here/accelerate_config.yaml" "$@"
