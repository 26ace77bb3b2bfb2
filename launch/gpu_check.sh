#!/bin/bash
# The GPU check of issues 16 and 17 as one command of under 10 minutes on one GPU.
#
#   OUT=results/gpu DATA_DIR=~/tensorflow_datasets bash launch/gpu_check.sh [seconds]
#   SPEED=0 ... bash launch/gpu_check.sh 560   # the recipe alone, with the whole budget
#   SPEED=0 STEPS_PER_S=25 FAST_FLAGS=--config.train.episodes_per_step=16 ... 560
#   SPEED=0 STEPS_PER_S=12 FAST_CONFIG=configs/omniglot_channels.py:16,5,fast ... 585
#                                               # the 16-channel CNN (docs/results.md, 13)
#   ... bash launch/gpu_check.sh 330            # the speed part alone
# CHT_COMMIT=<commit> names the commit in results.json where the tree has no git history.
#
# 1. Speed: the T=5 step (64, 256 episodes; float32, bfloat16; profiled) and T=1. 2. Recipe:
# omniglot_t5.py:fast for the rest of the budget, then launch/fast_table1.py's evaluation.
# 3. diagnostics/task_specificity.py. Needs the pure-Python dependencies (or their wheels in
# .whl/) and <DATA_DIR>/cht_jax_cache/omniglot_ht_2022_28.npz; no TensorFlow. 8 files in $OUT.
set -u
TOTAL=${1:-560}
OUT=${OUT:-gpu_check_out}
DATA_DIR=${DATA_DIR:-$HOME/tensorflow_datasets}
# Smaller settings for a dry run on a CPU (a minute or two):
#   BENCH_CONFIG=configs/omniglot_t2.py:tiny BENCH_TASKS=2 BATCH_SIZES=2,4 T1_BATCH_SIZES=2 \
#   FAST_CONFIG=configs/omniglot_t2.py:tiny OUT=/tmp/dry bash launch/gpu_check.sh 200
BENCH_CONFIG=${BENCH_CONFIG:-configs/omniglot_t5.py}
BENCH_TASKS=${BENCH_TASKS:-5}
BATCH_SIZES=${BATCH_SIZES:-64,256}
T1_BATCH_SIZES=${T1_BATCH_SIZES:-256,1024}
B=${BATCH_SIZES%%,*}
FAST_CONFIG=${FAST_CONFIG:-configs/omniglot_t5.py:fast}
FAST_FLAGS=${FAST_FLAGS:-}
SPEED=${SPEED:-1}  # 0: skip part 1; the recipe's steps are sized from an H200's speed.
# The recipe's steps/s, to size its schedule (default: part 1's at the first batch size,
# else an H200's at 64 episodes per step). Set it when FAST_FLAGS changes the batch.
STEPS_PER_S=${STEPS_PER_S:-}
. launch/gpu_env.sh
left() { echo $(( TOTAL - ($(date +%s) - START) )); }
quiet() { grep -v -E '^[IW][0-9]{4} |^WARNING: All log|oneDNN'; }

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import jax, jaxlib, flax, optax, orbax.checkpoint as o; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'orbax', o.__version__); print(jax.devices())"
  python3 -c "import tensorflow" 2>&1 | tail -1
  git rev-parse HEAD 2>/dev/null; } 2>&1 | tee -a "$LOG"

if [ "$SPEED" = 1 ]; then
say "1. speed: T=$BENCH_TASKS, remat off, float32, $BATCH_SIZES episodes per step, profiled"
timeout 150 python3 -m cht_jax.tools.bench --config=$BENCH_CONFIG --tasks=$BENCH_TASKS \
    --config.model.remat=False --batch_sizes=$BATCH_SIZES --min_seconds=2 --extras=false \
    --count_flops=false --profile_steps=3 --trace_dir=/tmp/cht_trace \
    --output="$OUT/bench_f32.json" 2>&1 | quiet | tee -a "$LOG"
say "1. speed: T=$BENCH_TASKS, remat off, bfloat16 convolutions (model.compute_dtype)"
timeout 120 python3 -m cht_jax.tools.bench --config=$BENCH_CONFIG --tasks=$BENCH_TASKS \
    --config.model.remat=False --config.model.compute_dtype=bfloat16 \
    --batch_sizes=$BATCH_SIZES --min_seconds=2 --extras=false --count_flops=false \
    --output="$OUT/bench_bf16.json" 2>&1 | quiet | tee -a "$LOG"
say "1. speed: T=1, remat off, float32, $T1_BATCH_SIZES episodes per step"
timeout 90 python3 -m cht_jax.tools.bench --config=$BENCH_CONFIG --tasks=1 \
    --config.model.remat=False --batch_sizes=$T1_BATCH_SIZES --min_seconds=2 --extras=false \
    --count_flops=false --output="$OUT/bench_t1.json" 2>&1 | quiet | tee -a "$LOG"
# The first batch size's trace and HLO (only the HLO if the archive would be too big).
TRACE=cht_trace/T${BENCH_TASKS}_B$B
(cd /tmp && tar czf "$ABS_OUT/trace.tar.gz" $TRACE 2>/dev/null)
if [ -f "$OUT/trace.tar.gz" ] && [ "$(stat -c %s "$OUT/trace.tar.gz")" -gt 15000000 ]; then
  (cd /tmp && tar czf "$ABS_OUT/trace.tar.gz" $(find $TRACE -name '*.hlo.txt.gz'))
fi
fi

# As many steps as fit the time left after startup, compilation and evaluation.
TRAIN_SECONDS=$(( $(left) - 160 ))
if [ "$TRAIN_SECONDS" -lt 120 ]; then
  say "2. recipe skipped: $(left) s left, too little to train (give the check more seconds, or SPEED=0)"
  exit 0
fi
read STEPS < <(python3 - "$OUT" "$TRAIN_SECONDS" "$B" "$STEPS_PER_S" <<'EOF'
import json, os, sys
out, seconds, batch = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
given = float(sys.argv[4]) if sys.argv[4] else 0.0
try:
  rows = json.load(open(os.path.join(out, 'bench_f32.json')))['rows']
except (OSError, ValueError, KeyError):
  rows = []
measured = [row['steps_per_s'] for row in rows if row['episodes_per_step'] == batch]
# Without part 1: one H200's steps/s at T=5, 64 episodes, remat off (docs/performance.md).
steps_per_s = given or max(measured, default=0.0) or 18.4
print(max(200, int(0.85 * steps_per_s * (seconds - 70)) // 100 * 100))
EOF
)
say "2. recipe: $FAST_CONFIG, $STEPS steps, stopped after $TRAIN_SECONDS s at most"
python3 launch/fast_table1.py --workdir=/tmp/fast_t5 --train_seconds="$TRAIN_SECONDS" -- \
    --config=$FAST_CONFIG --config.data.data_dir="$DATA_DIR" \
    --config.train.num_steps="$STEPS" \
    --eval_batch_size=64 $FAST_FLAGS 2>&1 | quiet | tee -a "$LOG"
cp /tmp/fast_t5/curve.png "$OUT/" 2>/dev/null
# Results first, then the last checkpoint (to resume or study later), then part 3: a
# check cut by the time limit still returns what it finished.
pack_results() {
  (cd /tmp && tar czf "$ABS_OUT/fast_t5.tar.gz" fast_t5/results.json fast_t5/results.md \
      fast_t5/metrics.jsonl fast_t5/config.json fast_t5/eval 2>/dev/null)
}
pack_results
LAST=$(ls /tmp/fast_t5/checkpoints 2>/dev/null | grep -E '^[0-9]+$' | sort -n | tail -1)
[ -n "$LAST" ] && (cd /tmp && tar czf "$ABS_OUT/checkpoint.tar.gz" fast_t5/checkpoints/$LAST)
say "3. does the generated CNN depend on the task? (diagnostics/task_specificity.py)"
timeout 60 python3 diagnostics/task_specificity.py --workdir=/tmp/fast_t5 --data_dir="$DATA_DIR" \
    --num_pairs=100 2>&1 | quiet | tee -a "$LOG"
pack_results
say "done"
