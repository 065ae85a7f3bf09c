#!/usr/bin/env bash
# Train 200 steps on 4 devices, then continue to 300 steps on 2. The second run
# finds the last checkpoint and loads it into 2 devices (--resume: fail if there is none).
set -euo pipefail
cd "$(dirname "$0")/.."
python examples/train_lm.py --devices 4 --steps 200 --out runs/resume_demo
python examples/train_lm.py --devices 2 --steps 300 --out runs/resume_demo --resume
