#!/usr/bin/env bash
# The GPU checks of issues 2, 4 and 11, as one short script for a lent device (see README). Writes logs to
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
# issue 11: both drafters trained on far more tokens than the CPU recipe (online features on the GPU),
# then evaluated with the real loop. Sizes fit a few minutes of an H200; GPU_ROWS / GPU_STEPS scale them.
rows="${GPU_ROWS:-4000}"; steps="${GPU_STEPS:-1500}"; [ "$device" = cpu ] && rows=48 && steps=4
for drafter in specblock eagle3; do
  "$py" -m specblock.train experiment=cpu_full drafter="$drafter" run_name="device-gpu-$drafter" \
      features=online data.features.enabled=false data.run_name="device-regen-$rows" data.corpus.limit="$rows" \
      data.regenerate.batch_size=256 data.target.device="$device" data.target.attn_implementation=sdpa \
      trainer.max_steps="$steps" trainer.micro_batch_size=16 trainer.grad_accum=1 trainer.mixed_precision="$precision" \
      trainer.eval_every=250 trainer.logger=none 2>&1 | tail -30 | tee "$out/train_$drafter.txt"
done
"$py" -m specblock.evaluate run_name=device-gpu target.device="$device" target.dtype=float32 limit=4 \
    'drafters={specblock: checkpoints/device-gpu-specblock/drafter, eagle3: checkpoints/device-gpu-eagle3/drafter}' \
    'methods=[autoregressive,lookup,chain-token,tree,tree+lookup]' 2>&1 | tail -40 | tee "$out/eval.md"
