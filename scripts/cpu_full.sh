#!/usr/bin/env bash
# The cpu_full recipe end to end (issue 11), resumable: rerun this script after a kill or at the start of
# a new session and every stage continues where it stopped (regeneration row by row, feature capture
# shard by shard, training from its last checkpoint, the curve checkpoint by checkpoint, a finished
# evaluation skipped). Order: both drafters, the scaling curve and the speed table, then the math drafters.
#   nohup scripts/cpu_full.sh > checkpoints/logs/cpu_full.log 2>&1 &
# The curve and the evaluations read GSM8K, HumanEval, MGSM, LM1B and Alpaca from the hub, or offline from
# local copies: SPECBLOCK_DATASETS=<folder> scripts/cpu_full.sh (a curve point missing a set stops the curve).
# Steps per drafter: about 90 minutes each on 2 cores (measured step times in the README); override with
# SPECBLOCK_STEPS=... EAGLE3_STEPS=... scripts/cpu_full.sh
# Another experiment with the same stages (runs checkpoints/<experiment>-<drafter>, its evaluation and
# curve named after it; the math fine-tunes belong to cpu_full alone):
#   CPU_FULL_EXPERIMENT=cpu_full_6k scripts/cpu_full.sh   # three times the distinct regenerated data
# (then cpu_full_6k_cut, answers cut where they repeat, and cpu_full_6k_more, a warm restart: MORE_STEPS=...)
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
export WANDB_MODE="${WANDB_MODE:-offline}"
export PYTHONUNBUFFERED=1  # the log shows each line as it is written (validation results included)
# Steps for about 90 minutes each on this session's 2-core AMD EPYC (measured at the start of session 6,
# shared with test runs: ~28-40 s per SpecBlock step of 8 rows of ~350 tokens; EAGLE-3 ~1/3 of that).
# The curriculum ends halfway; milestones every ~20 minutes of training for the scaling curve.
# Session 17: SpecBlock trains one TTT block a step; session 18: 600 such steps in ~69 min on a quiet 2-core EPYC.
# Session 19: EAGLE-3 900 steps, about the same minutes (its step costs ~0.7x SpecBlock's one-block step).
steps_specblock="${SPECBLOCK_STEPS:-600}"; milestones_specblock=120
steps_eagle3="${EAGLE3_STEPS:-900}"; milestones_eagle3=120
experiment="${CPU_FULL_EXPERIMENT:-cpu_full}"
curve="docs/scaling_curve${experiment#cpu_full}"  # docs/scaling_curve, docs/scaling_curve_6k, ...

for drafter in specblock eagle3; do
  steps_var="steps_${drafter}"; keep_var="milestones_${drafter}"
  if [ -f "checkpoints/${experiment}-${drafter}/drafter/config.json" ]; then
    echo "${experiment}-${drafter}: exported already, skipped"
    continue
  fi
  echo "== $(date -u +%H:%M) training ${experiment}-${drafter} (${!steps_var} steps)"
  "$py" -m specblock.train experiment="$experiment" drafter="$drafter" resume=latest trainer.max_steps="${!steps_var}" \
    trainer.keep_every="${!keep_var}" loss.curriculum.end="$(( ${!steps_var} / 2 ))"
done

echo "== $(date -u +%H:%M) scaling curve"
earlier=()  # another experiment's curve shows cpu_full's points beside its own
if [ "$experiment" != cpu_full ] && [ -f docs/scaling_curve.json ]; then earlier=(--earlier docs/scaling_curve.json); fi
curve_steps=()  # CURVE_STEPS="120 360 600 900": those checkpoints first (the rest on a later run, all by default)
if [ -n "${CURVE_STEPS:-}" ]; then read -ra curve_steps <<< "--steps ${CURVE_STEPS}"; fi
"$py" scripts/scaling_curve.py "checkpoints/${experiment}-specblock" "checkpoints/${experiment}-eagle3" \
  "${earlier[@]}" "${curve_steps[@]}" --out "$curve"

# an evaluation writes its config.json last: present means done, and a rerun of this script skips it
if [ -f "checkpoints/eval/${experiment}/config.json" ]; then
  echo "${experiment} evaluation: done already (checkpoints/eval/${experiment}/results.md), skipped"
else
  echo "== $(date -u +%H:%M) speed of the best checkpoints (deployment precision, sizes from measured costs)"
  "$py" -m specblock.evaluate run_name="$experiment" target.dtype=auto limit=3 max_new_tokens=64 \
    "drafters={specblock: checkpoints/${experiment}-specblock/drafter, eagle3: checkpoints/${experiment}-eagle3/drafter}" \
    draft_length=auto trees.specblock.budget=auto trees.eagle3.budget=auto \
    'methods=[autoregressive,lookup,chain-token,tree,tree+lookup]'
fi

# cpu_full_6k goes on with two SpecBlock runs on its features, each drawn on the curve and evaluated:
# cpu_full_6k_cut (from scratch, answers cut where they start to repeat: configs/experiment/cpu_full_6k_cut.yaml)
# and cpu_full_6k_more (a warm restart on the same rows, drawn at its cumulative compute; MORE_STEPS=...).
if [ "$experiment" = cpu_full_6k ]; then
  runs=("checkpoints/${experiment}-specblock" "checkpoints/${experiment}-eagle3")
  for next in cpu_full_6k_cut cpu_full_6k_more; do
    extra=(); if [ "$next" = cpu_full_6k_more ]; then extra=(trainer.max_steps="${MORE_STEPS:-900}"); fi
    if [ -f "checkpoints/${next}-specblock/drafter/config.json" ]; then
      echo "${next}-specblock: exported already, skipped"
    else
      echo "== $(date -u +%H:%M) training ${next}-specblock"
      "$py" -m specblock.train experiment="$next" drafter=specblock resume=latest "${extra[@]}"
    fi
    runs+=("checkpoints/${next}-specblock")
    echo "== $(date -u +%H:%M) scaling curve with ${next}"
    "$py" scripts/scaling_curve.py "${runs[@]}" "${earlier[@]}" "${curve_steps[@]}" --out "$curve"
    if [ ! -f "checkpoints/eval/${next}/config.json" ]; then
      echo "== $(date -u +%H:%M) speed of ${next}-specblock"
      "$py" -m specblock.evaluate run_name="$next" target.dtype=auto limit=3 max_new_tokens=64 \
        "drafters={specblock: checkpoints/${next}-specblock/drafter, eagle3: checkpoints/${experiment}-eagle3/drafter}" \
        draft_length=auto trees.specblock.budget=auto trees.eagle3.budget=auto \
        'methods=[autoregressive,lookup,chain-token,tree,tree+lookup]'
    fi
  done
fi

# The math drafters: each fine-tuned on GSM8K's train split answered again by the target (README section
# "A math drafter"; configs/experiment/cpu_full_math.yaml): 1,600 questions, 200 steps, ~15-22 minutes each on
# 2 cores. Offline the split comes from $SPECBLOCK_DATASETS.
if [ "$experiment" != cpu_full ]; then
  echo "== $(date -u +%H:%M) done (${experiment}: no math fine-tunes)"
  exit 0
fi
gsm8k=()
if [ -n "${SPECBLOCK_DATASETS:-}" ]; then gsm8k=(data.corpus.source="$SPECBLOCK_DATASETS/gsm8k/train.jsonl"); fi
for drafter in eagle3 specblock; do
  if [ -f "checkpoints/cpu_full_math-${drafter}/drafter/config.json" ]; then
    echo "cpu_full_math-${drafter}: exported already, skipped"
    continue
  fi
  echo "== $(date -u +%H:%M) fine-tuning cpu_full_math-${drafter}"
  "$py" -m specblock.train experiment=cpu_full_math drafter="$drafter" resume=latest \
    init_from="checkpoints/cpu_full-${drafter}/drafter" "${gsm8k[@]}"
done

if [ ! -f checkpoints/eval/cpu_full_math/config.json ]; then
  "$py" -m specblock.evaluate run_name=cpu_full_math target.dtype=auto limit=3 max_new_tokens=64 '~drafters.specblock' \
    drafters.eagle3=checkpoints/cpu_full-eagle3/drafter +drafters.eagle3_math=checkpoints/cpu_full_math-eagle3/drafter \
    +drafters.specblock_math=checkpoints/cpu_full_math-specblock/drafter draft_length=auto trees.eagle3.budget=auto \
    trees.specblock.budget=auto 'methods=[autoregressive,lookup,tree,tree+lookup]'
fi
# GSM8K alone with 16 prompts (3 prompts a set leave ~0.1x of noise per cell): issue 12's 1.6x on GSM8K
if [ ! -f checkpoints/eval/cpu_full_math-gsm8k/config.json ]; then
  "$py" -m specblock.evaluate run_name=cpu_full_math-gsm8k target.dtype=auto limit=16 max_new_tokens=64 \
    'datasets=[gsm8k]' '~drafters.specblock' '~drafters.eagle3' +drafters.eagle3_math=checkpoints/cpu_full_math-eagle3/drafter \
    +drafters.specblock_math=checkpoints/cpu_full_math-specblock/drafter draft_length=auto trees.eagle3.budget=auto \
    trees.specblock.budget=auto 'methods=[autoregressive,lookup,tree,tree+lookup]'
fi
echo "== $(date -u +%H:%M) done"
