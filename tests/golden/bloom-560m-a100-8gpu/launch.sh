#!/usr/bin/env bash
# trainplan: mb 4 x N 8 x 8 GPU, bf16-mixed, selective ckpt, DDP
# usage: ./launch.sh train.py [script args...]
# selective checkpointing: call planner.memory.step.enable_checkpointing(model, 'selective') in train.py (the Trainer's flag is full checkpointing)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec accelerate launch --config_file "$here/accelerate_config.yaml" "$@"
