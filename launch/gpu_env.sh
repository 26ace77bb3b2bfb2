# Sourced by the one-command GPU checks (launch/gpu_check.sh, launch/gpu_figure3.sh), after
# they set OUT: the clock, the log, and a Python environment on a machine that lacks the
# pure-Python packages (wheels in .whl/, installed to /tmp/site, never into the system).
#   START      the check's start (seconds since the epoch)
#   ABS_OUT    $OUT as an absolute path, so that it survives a cd
#   LOG        $ABS_OUT/log.txt
#   say MSG    prints MSG with the seconds since START and appends it to LOG
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
