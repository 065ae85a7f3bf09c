#!/usr/bin/env bash
# Train 200 steps on 4 devices, then continue to 300 steps on 2. --resume finds the last
# checkpoint, reshards it for 2 devices with consolidate_sharded_ckpts, and loads it.
set -euo pipefail
cd "$(dirname "$0")/.."
python examples/train_lm.py --devices 4 --steps 200 --out runs/resume_demo
python examples/train_lm.py --devices 2 --steps 300 --out runs/resume_demo --resume
