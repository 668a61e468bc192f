# Shared by the one-GPU comparisons (gpu_compare.sh, gpu_savers.sh); sourced after the caller sets T_START,
# BUDGET_S, OUT, PY and W (a per-run dir: every process of the run has it in its command line). Defines
# left/say/min, installs the carried wheels (.whl/ into /tmp/site), puts a `deepspeed` runner and a no-op `pdsh`
# first on PATH (DeepSpeed's scheduler launches a bare `deepspeed` and runs `pdsh -w HOSTS pkill -f EXP` after each
# experiment: compare_deepspeed.py, D2), and gives gpu_idle, sweep and run_tuner.
mkdir -p "$OUT" "$W/bin" "$W/zt" "$W/ds" "$W/ext"
left() { echo $(( BUDGET_S - ($(date +%s) - T_START) )); }
say() { echo "[$(( $(date +%s) - T_START ))s] $*" | tee -a "$OUT/report.txt"; }
min() { if [ "$1" -lt "$2" ]; then echo "$1"; else echo "$2"; fi; }

if ls .whl/*.whl >/dev/null 2>&1; then
  timeout 150 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl > "$W/pip.log" 2>&1 || { say "wheel install failed"; tail -20 "$W/pip.log" | tee -a "$OUT/report.txt"; exit 3; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$W/ext}
printf '#!/bin/sh\nexec %s -m deepspeed.launcher.runner "$@"\n' "$PY" > "$W/bin/deepspeed"
printf '#!/bin/sh\necho "$(date +%%s) pdsh $*" >> %s/pdsh_calls.log\nexit 0\n' "$W" > "$W/bin/pdsh"
chmod +x "$W/bin/deepspeed" "$W/bin/pdsh"
export PATH=$W/bin:$PATH

gpu_idle() {  # wait (30 s at most) until no process holds the GPU
  for _ in $(seq 30); do
    [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ] && return 0
    sleep 1
  done
  say "the GPU is still held: $(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>&1 | tr '\n' ' ')"
}

sweep() {  # NAME: kill what this run left (processes with $W in their command line), then wait for the GPU
  local left_over; left_over=$(pgrep -f -- "$W/" | grep -vx "$$" | tr '\n' ' ')
  if [ -n "$left_over" ]; then say "$1: killing what it left: $left_over"; kill -KILL $left_over 2>/dev/null; fi
  gpu_idle
}

run_tuner() {  # NAME LIMIT_S CMD...: SIGTERM to its process group at LIMIT_S, SIGKILL 10 s later; sets RC WALL T0
  local name=$1 limit=$2; shift 2
  T0=$(date +%s.%N)
  timeout -s TERM -k 10 "$limit" "$@" > "$W/$name.log" 2>&1 &
  local pid=$!  # timeout leads its own process group
  wait "$pid"; RC=$?
  WALL=$(awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  kill -KILL -- "-$pid" 2>/dev/null
  sweep "$name"
  say "$name: exit $RC after $WALL s (limit $limit s)"
}
