#!/bin/bash
# Figure 3 and 4's curves on one GPU in under 10 minutes: configs/omniglot_t{1..4}.py:fast
# and ConstPN (configs/omniglot_constpn.py:5,fast) trained at once (much of each run is
# compilation on the host's CPUs; each process may take GPU_FRACTION of the GPU's memory),
# each scored with the full protocol on 5-task episodes, then the paper-style figure
# (cht_jax/plots.py), with T=5 from launch/gpu_check.sh's evaluation file in EXTRA_RESULTS.
#
#   OUT=results/figure3 DATA_DIR=~/tensorflow_datasets bash launch/gpu_figure3.sh [seconds]
#   CHT_COMMIT=<commit> EXTRA_RESULTS=docs/recipe_t5_h200_full_eval.json OUT=$OUT \
#       DATA_DIR=.gpu_data bash launch/gpu_figure3.sh 585   # docs/results.md section 9
#   CHANNELS=16 EXTRA_RESULTS=<16-channel gpu_check.sh's eval/test_T5_step*.json> ... 585
#   RUNS="t1 t2" CONFIG_VARIANT=tiny STEPS=20 EVAL_EPISODES=8 OUT=/tmp/fig3 \
#       bash launch/gpu_figure3.sh 400                      # a dry run on a CPU
#
# STEPS=2200: the T=5 `:fast` curve flattens well before (docs/results.md section 9). Needs
# what launch/gpu_check.sh needs. Writes log.txt, figure3.png, table.md, results.tar.gz.
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
