#!/usr/bin/env bash
# trainplan: mb 2 x N 16 x 8 GPU, bf16-mixed, DDP
# usage: ./launch.sh train.py [script args...]
# in train.py: model = planner.load_plan("<this folder>/plan.json").prepare(model)  (applies what the
# Trainer arguments cannot say); or run the shipped script: ./launch.sh -m probes.train --plan <this folder>
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec accelerate launch --config_file "$here/accelerate_config.yaml" "$@"
