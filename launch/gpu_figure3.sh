#!/bin/bash
# Figure 3 and 4's curves on one GPU in one command of under 10 minutes: configs/omniglot_t{1..4}.py:fast
# and ConstPN (configs/omniglot_constpn.py:5,fast) trained at the same time on the one GPU,
# each scored with the full protocol on 5-task episodes (past its own T: extrapolation),
# then the paper-style figure (cht_jax/plots.py). T=5 comes from launch/gpu_check.sh: pass
# its evaluation file in EXTRA_RESULTS to draw it too.
#
#   OUT=results/figure3 DATA_DIR=~/tensorflow_datasets bash launch/gpu_figure3.sh [seconds]
#   EXTRA_RESULTS=results/fast_t5/eval/test_T5_step5400.json ... bash launch/gpu_figure3.sh
#   # the next GPU session's check, with the T=5 run of docs/results.md section 9:
#   CHT_COMMIT=<commit> EXTRA_RESULTS=docs/recipe_t5_h200_full_eval.json OUT=$OUT \
#       DATA_DIR=.gpu_data bash launch/gpu_figure3.sh 585
#   # the same at 16 channels (configs/omniglot_channels.py:16,T,fast; ConstPN as wide),
#   # with the T=5 evaluation file of the 16-channel launch/gpu_check.sh run:
#   CHANNELS=16 EXTRA_RESULTS=<its eval/test_T5_step*.json> ... bash launch/gpu_figure3.sh 585
#
# Why at the same time: much of each run is compilation on the host's CPUs, which runs
# in parallel; the GPU is shared (each process may take GPU_FRACTION of its memory). At T=5
# the validation curve of `:fast` flattens well before the end of its schedule
# (docs/results.md section 9), so STEPS=2200 for every run, with warmup and cosine decay
# over them. Each run is stopped (checkpointed) after the time left less the evaluation's
# share, and evaluated all the same.
# Needs what launch/gpu_check.sh needs (no TensorFlow or TFDS: an Omniglot cache in
# DATA_DIR). Writes at most 8 files to $OUT: log.txt, figure3.png, results.tar.gz (each
# run's results.json / .md, curve, metrics and evaluation files) and table.md.
# A dry run on a CPU (a few minutes):
#   RUNS="t1 t2" CONFIG_VARIANT=tiny STEPS=20 EVAL_EPISODES=8 OUT=/tmp/fig3 bash launch/gpu_figure3.sh 400
set -u
TOTAL=${1:-585}
OUT=${OUT:-gpu_figure3_out}
DATA_DIR=${DATA_DIR:-$HOME/tensorflow_datasets}
RUNS=${RUNS:-t1 t2 t3 t4 constpn}
STEPS=${STEPS:-2200}
EVAL_TASKS=${EVAL_TASKS:-5}
EVAL_EPISODES=${EVAL_EPISODES:-1024}  # The paper's protocol; lower only for a dry run.
CONFIG_VARIANT=${CONFIG_VARIANT:-fast}
CHANNELS=${CHANNELS:-}  # The CNN's width, e.g. 16; empty: the configs' own (8).
GPU_FRACTION=${GPU_FRACTION:-0.18}
EXTRA_RESULTS=${EXTRA_RESULTS:-}
WORK=${WORK:-/tmp/figure3}
mkdir -p "$WORK"
. launch/gpu_env.sh
export XLA_PYTHON_CLIENT_MEM_FRACTION=$GPU_FRACTION
{ nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
  git rev-parse HEAD 2>/dev/null; } 2>&1 | tee -a "$LOG"

# The last 190 s go to evaluation; five runs at once share the GPU.
TRAIN_SECONDS=$(( TOTAL - ($(date +%s) - START) - 190 ))
say "training $RUNS at once, $STEPS steps each, stopped after $TRAIN_SECONDS s at most"
for run in $RUNS; do
  width=
  case $run in
    constpn) config=configs/omniglot_constpn.py:$EVAL_TASKS,$CONFIG_VARIANT
             width=${CHANNELS:+--config.model.channels=$CHANNELS} ;;
    t*) if [ -n "$CHANNELS" ]; then
          config=configs/omniglot_channels.py:$CHANNELS,${run#t},$CONFIG_VARIANT
        else
          config=configs/omniglot_${run}.py:$CONFIG_VARIANT
        fi ;;
  esac
  python3 launch/fast_table1.py --workdir="$WORK/$run" --train_seconds="$TRAIN_SECONDS" -- \
      --config=$config --config.data.data_dir="$DATA_DIR" --config.train.num_steps=$STEPS $width \
      --eval_tasks=$EVAL_TASKS --eval_episodes=$EVAL_EPISODES --eval_batch_size=64 \
      > "$WORK/$run.log" 2>&1 &
done
wait
say "runs done"
for run in $RUNS; do
  echo "== $run" >> "$LOG"
  grep -v -E '^[IW][0-9]{4} |^  |^[a-z_]+:$' "$WORK/$run.log" | tail -12 >> "$LOG"
done

# The figure (one column per CHT run, ConstPN as the dashed baseline) and one table.
results=$(ls "$WORK"/t*/eval/test_T${EVAL_TASKS}_step*.json 2>/dev/null | tr '\n' ',')
results=${results%,}${EXTRA_RESULTS:+,$EXTRA_RESULTS}
baseline=$(ls "$WORK"/constpn/eval/test_T${EVAL_TASKS}_step*.json 2>/dev/null | head -1)
python3 -m cht_jax.plots --results="${results#,}" --baselines="$baseline" \
    --output="$ABS_OUT/figure3.png" 2>&1 | tail -2 | tee -a "$LOG"
python3 -m cht_jax.reports runs_table --work="$WORK" --runs="$RUNS" \
    --output="$ABS_OUT/table.md" 2>&1 | tee -a "$LOG"
(cd "$WORK" && tar czf "$ABS_OUT/results.tar.gz" $(for run in $RUNS; do
   ls -d $run/results.json $run/results.md $run/curve.png $run/metrics.jsonl $run/eval \
       2>/dev/null; done))
say "done"
