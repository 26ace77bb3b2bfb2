#!/bin/bash
# The ':fast' recipe's levers, one at a time, on the CPU (docs/recipe.md): Omniglot T=2,
# one episode a step, STEPS steps each, validation accuracy every STEPS/10 steps on the
# 50 validation classes (never test). Then plots every run's curve into one figure.
#
#   DATA_DIR=~/tensorflow_datasets ROOT=workdirs/levers STEPS=2000 bash launch/recipe_levers.sh
set -u
DATA_DIR=${DATA_DIR:-$HOME/tensorflow_datasets}
ROOT=${ROOT:-workdirs/levers}
STEPS=${STEPS:-2000}
ONLY=${ONLY:-}
BASE="--config=configs/omniglot_t2.py:fast --config.data.data_dir=$DATA_DIR
  --config.train.episodes_per_step=1 --config.train.num_steps=$STEPS
  --config.train.eval_episodes=64"
declare -A RUNS=(
  [smoke_recipe]="--config.model.head_scale=0 --config.optim.schedule=exponential --config.optim.warmup_steps=0"
  [head_scale_only]="--config.optim.schedule=exponential --config.optim.warmup_steps=0"
  [schedule_only]="--config.model.head_scale=0"
  [fast]=""
  [fast_lr3e-3]="--config.optim.learning_rate=0.003"
  [fast_clip1]="--config.optim.grad_clip_norm=1.0"
  [fast_adamw]="--config.optim.name=adamw --config.optim.weight_decay=1e-4"
  [fast_queries6]="--config.episode.queries_per_class=6"
)
for name in smoke_recipe head_scale_only schedule_only fast fast_lr3e-3 fast_clip1 fast_adamw fast_queries6; do
  if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]]; then continue; fi
  echo "== $name: ${RUNS[$name]}"
  python -m cht_jax.main $BASE ${RUNS[$name]} --workdir="$ROOT/$name" 2>&1 \
      | grep -E "Preempted|Error|error" | head -5
done
# $ROOT/levers.png and the table, $ROOT/levers.md (printed too).
python -m cht_jax.reports levers --root="$ROOT"
