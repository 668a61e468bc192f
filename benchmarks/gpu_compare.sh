#!/usr/bin/env bash
# zerotune against DeepSpeed's autotuner (`deepspeed --autotuning tune`) on one CUDA GPU: GPT-2 124M
# (examples/train_gpt.py, vocab 50257, seq 1024, d_model 768, 12 layers, 12 heads), bf16, torch AdamW, ZeRO stages
# 0-3, mbs 1..256, fast mode, metric throughput (benchmarks/gpu_gpt2_ds_config.json). zerotune first (ZT_S s, default
# 270), then DeepSpeed's autotuner (DS_S s, default 200), each in a fresh results dir; the whole script ends within
# BUDGET_S (default 540) s. Report (benchmarks/gpu_compare.py): per tuner launches, OOM launches, OOMs after a
# stage's first launch, wall time, the answer and its samples/s; per zerotune experiment the memory model's estimate
# against the probe's device peak. Run from the repository root:
#   OUT=/tmp/out bash benchmarks/gpu_compare.sh
# Where pip cannot reach PyPI, carry the wheels in .whl/ (benchmarks/gpu_check.sh's header says how to build them);
# they are installed into /tmp/site. Files under $OUT (8, flat): env.txt report.txt report.json zt.log ds.log
# zt_exps.tgz ds_exps.tgz results.tgz.
set -u
T_START=$(date +%s)
BUDGET_S=${BUDGET_S:-540}
OUT=${OUT:-/tmp/gpu_compare_out}
PY=${PY:-python3}
W=/tmp/gpucmp.$$  # every process of this run has this path in its command line (the sweep below relies on it)
# shellcheck source=benchmarks/gpu_lib.sh
source benchmarks/gpu_lib.sh

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  timeout 90 "$PY" -c "import deepspeed, torch, pydantic, hjson, tabulate; print('deepspeed', deepspeed.__version__,
'torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'pydantic', pydantic.__version__)" 2>&1 | grep -v WARNING
} > "$OUT/env.txt"
cat "$OUT/env.txt"
MODEL=(--vocab 50257 --seq-len 1024 --d-model 768 --n-layer 12 --n-head 12 --steps 30 ${MODEL_ARGS:-})

"$PY" -m benchmarks.gpu_compare config benchmarks/gpu_gpt2_ds_config.json "$W/zt/ds_config.json" "$W/zt/results" "$W/zt/exps"
"$PY" -m benchmarks.gpu_compare config benchmarks/gpu_gpt2_ds_config.json "$W/ds/ds_config.json" "$W/ds/results" "$W/ds/exps"

RESERVE=250  # DeepSpeed's turn and the report; SKIP_DS=1 (zerotune alone, e.g. to re-check a change) keeps 20
[ "${SKIP_DS:-0}" = 1 ] && RESERVE=20
ZT_LIMIT=$(min "${ZT_S:-270}" $(( $(left) - RESERVE )))
say "zerotune: limit $ZT_LIMIT s"
run_tuner zt "$ZT_LIMIT" "$PY" -m zerotune tune --num_gpus 1 --timeout 100 ${ZT_ARGS:-} examples/train_gpt.py "${MODEL[@]}" \
  --deepspeed_config "$W/zt/ds_config.json"
ZT_RC=$RC ZT_WALL=$WALL ZT_T0=$T0

DS_LIMIT=$(min "${DS_S:-200}" $(( $(left) - 40 )))
if [ "${SKIP_DS:-0}" = 1 ]; then
  say "DeepSpeed's autotuner: skipped (SKIP_DS=1)"
  DS_RC=0 DS_WALL=0 DS_T0=$(date +%s.%N)
else
  say "DeepSpeed's autotuner: limit $DS_LIMIT s"
  (cd "$W/ds" && run_tuner ds "$DS_LIMIT" deepspeed --autotuning tune --num_gpus 1 --master_port 29700 \
    "$OLDPWD/examples/train_gpt.py" "${MODEL[@]}" --deepspeed_config "$W/ds/ds_config.json"; \
    echo "$RC $WALL $T0" > "$W/ds.rc")
  read -r DS_RC DS_WALL DS_T0 < "$W/ds.rc"
fi

timeout 30 "$PY" -m benchmarks.gpu_compare report --zt "$W/zt" --zt-wall "$ZT_WALL" --zt-rc "$ZT_RC" --zt-t0 "$ZT_T0" \
  --ds "$W/ds" --ds-wall "$DS_WALL" --ds-rc "$DS_RC" --ds-t0 "$DS_T0" --json "$OUT/report.json" 2>&1 \
  | grep -v "WARNING.*accelerator" | tee -a "$OUT/report.txt"
tail -c 60000 "$W/zt.log" > "$OUT/zt.log"
{ tail -c 40000 "$W/ds.log"; for d in "$W"/ds/results/*/; do echo "== $d stderr (tail)"; tail -5 "$d/stderr.log" 2>/dev/null; done
  echo "== pdsh calls"; cat "$W/pdsh_calls.log" 2>/dev/null; } | tail -c 80000 > "$OUT/ds.log"
tar czf "$OUT/zt_exps.tgz" -C "$W/zt" --exclude='stdout.log' exps 2>/dev/null
tar czf "$OUT/ds_exps.tgz" -C "$W/ds" --exclude='*.log' results exps 2>/dev/null
tar czf "$OUT/results.tgz" -C "$W/zt" results 2>/dev/null
say "done in $(( $(date +%s) - T_START )) s; files in $OUT"
rm -rf "$W"
