# Sourced by launch/gpu_check.sh and launch/gpu_figure3.sh once they set OUT: START (the
# epoch seconds), ABS_OUT ($OUT made absolute), LOG ($ABS_OUT/log.txt), `say MSG` (MSG with
# the seconds since START, to LOG too), and the wheels of .whl/ installed to /tmp/site.
START=$(date +%s)
mkdir -p "$OUT"
ABS_OUT=$(cd "$OUT" && pwd)
LOG="$ABS_OUT/log.txt"
say() { echo "[$(( $(date +%s) - START )) s] $*" | tee -a "$LOG"; }
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
