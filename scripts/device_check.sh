#!/usr/bin/env bash
# The GPU checks of issues 2 and 4, as one short script for a lent device (see README). Writes logs to
# ${OUT:-checkpoints/device_check}. DEVICE=cpu runs the same commands here (as a dry run of the script).
#   bash scripts/device_check.sh            # on the GPU machine, from the repository root
set -euo pipefail
cd "$(dirname "$0")/.."
device="${DEVICE:-cuda}"
out="${OUT:-checkpoints/device_check}"
mkdir -p "$out"
py="${PYTHON:-.venv/bin/python}"
export PYTHONUNBUFFERED=1 WANDB_MODE=offline HF_HUB_OFFLINE=1
nvidia-smi > "$out/nvidia_smi.txt" 2>&1 || true
# issue 2: verifier timings on the device
"$py" scripts/bench_verify.py --device "$device" --repeats "${REPEATS:-20}" 2>&1 | tee "$out/bench_verify.md"
# issue 4: the debug experiment in bf16, and the training benchmark
precision=bf16; [ "$device" = cpu ] && precision=no
"$py" -m specblock.train experiment=debug run_name="device-debug-$device" data.target.device="$device" \
    trainer.mixed_precision="$precision" 2>&1 | tail -40 | tee "$out/debug_train.txt"
"$py" scripts/bench_train.py --device "$device" --dtype bfloat16 --autocast --length "${LENGTH:-1024}" 2>&1 \
    | tee "$out/bench_train.md"
