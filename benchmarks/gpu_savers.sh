#!/usr/bin/env bash
# Issue 30, models that do not fit: zerotune against DeepSpeed's autotuner (`deepspeed --autotuning tune`) on one
# CUDA GPU (H100 80GB or H200) under a 24 GiB budget per device (BUDGET_GIB). The model: a GPT-2 of
# 1,313,626,112 parameters (24 layers, d_model 2048, 16 heads, seq 1024, vocab 50257, tied embedding; random
# weights, nothing downloaded) trained by a Hugging Face Trainer (examples/train_hf.py, bf16, torch AdamW), ZeRO
# stages 0-3, mbs 1..64, fast mode, metric throughput (benchmarks/gpu_savers_ds_config.json). Its model states
# alone (16-20 bytes per parameter, one GPU: nothing to partition) are 19.6-24.5 GiB, so no stage fits without a
# saver: zerotune's savers phase may answer with the Trainer's --gradient_checkpointing (its
# "gradient_checkpointing" key), offload_optimizer cpu (stages 1-3) and/or offload_param cpu (stage 3); DeepSpeed's
# autotuner tunes stage and mbs only, and reads the device's whole memory.
# The budget: both tuners tune benchmarks/gpu_savers_train.py (train_hf.py run unchanged); zerotune gets
# --device-memory and its probe caps each experiment's allocator; DeepSpeed's experiments get the same cap from that
# script (GPU_SAVERS_DEVICE_BUDGET, zerotune's own capping rule). Offload with the config's optimizer: DeepSpeed
# builds torch.optim.AdamW on the host partitions when "torch_adam" is true (engine.py, get_optimizer_configuration;
# no cpu_adam JIT build), and "zero_force_ds_cpu_optimizer" is read only for a client optimizer, which the Trainer
# does not pass when the config names one: neither key needs more.
# zerotune first (ZT_S s, default 270), then DeepSpeed's autotuner (DS_S, default 150; SKIP_DS=1: not run), each in
# a fresh results dir; then each answer is re-measured (benchmarks/gpu_savers.py measure: a plain run of its
# command, MEASURE_STEPS optimizer steps, samples/s after the first 2, under the same cap, MEASURE_S s at most).
# The whole script ends within BUDGET_S (default 540) s. Run from the repository root:
#   OUT=/tmp/out bash benchmarks/gpu_savers.sh
# Where pip cannot reach PyPI, carry the wheels in .whl/: gpu_check.sh's header, plus the Trainer's (no torch):
#   .venv/bin/python -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl transformers==5.23.0
#   .venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl accelerate==1.15.0 psutil; rm .whl/numpy-*  # the machine's numpy
# They are installed into /tmp/site. Files under $OUT (8, flat): env.txt report.txt report.json zt.log ds.log
# remeasure.log zt_exps.tgz ds_exps.tgz.
set -u
T_START=$(date +%s)
BUDGET_S=${BUDGET_S:-540}
BUDGET_GIB=${BUDGET_GIB:-24}
BUDGET=$(( BUDGET_GIB * 1073741824 ))  # bytes
OUT=${OUT:-/tmp/gpu_savers_out}
PY=${PY:-python3}
W=/tmp/gpusav.$$  # every process of this run has this path in its command line (the sweep below relies on it)
# shellcheck source=benchmarks/gpu_lib.sh
source benchmarks/gpu_lib.sh
export TOKENIZERS_PARALLELISM=false
unset GPU_SAVERS_DEVICE_BUDGET GPU_SAVERS_CLOCK

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  timeout 90 "$PY" -c "import deepspeed, torch, transformers, accelerate, pydantic, hjson, tabulate
print('deepspeed', deepspeed.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available(),
      'transformers', transformers.__version__, 'accelerate', accelerate.__version__)" 2>&1 | grep -v WARNING
} > "$OUT/env.txt"
cat "$OUT/env.txt"
grep -q "^deepspeed .* transformers" "$OUT/env.txt" || { say "an import failed (see env.txt): not run"; exit 3; }
MODEL=(--n_layer 24 --n_embd 2048 --n_head 16 --seq_len 1024 --vocab_size 50257 --num_samples 4096 ${MODEL_ARGS:-})
trainer() {  # the Trainer's flags as a user runs it (each tuner sets the batch flags per experiment); the parser takes
  # a flag's last occurrence, so MODEL_ARGS and TRAINER_ARGS override (a CPU rehearsal: a tiny model, --bf16 false)
  echo --output_dir "$1" --max_steps 200 --bf16 true --report_to none --save_strategy no --disable_tqdm true \
    --per_device_train_batch_size 1 --gradient_accumulation_steps 1 ${TRAINER_ARGS:-}
}

for t in zt ds; do
  "$PY" -m benchmarks.gpu_compare config benchmarks/gpu_savers_ds_config.json "$W/$t/ds_config.json" "$W/$t/results" \
    "$W/$t/exps"
done

MEASURE_S=${MEASURE_S:-90}
RESERVE=$(( ${DS_S:-150} + MEASURE_S + 20 ))  # DeepSpeed's turn, the re-measure and the report
[ "${SKIP_DS:-0}" = 1 ] && RESERVE=$(( MEASURE_S + 20 ))
ZT_LIMIT=$(min "${ZT_S:-270}" $(( $(left) - RESERVE )))
say "zerotune: limit $ZT_LIMIT s, --device-memory ${BUDGET_GIB}GiB"
# shellcheck disable=SC2046  # trainer's words split on purpose (no spaces in $W)
run_tuner zt "$ZT_LIMIT" "$PY" -m zerotune tune --num_gpus 1 --device-memory "${BUDGET_GIB}GiB" \
  --timeout "${EXP_TIMEOUT:-150}" ${ZT_ARGS:-} benchmarks/gpu_savers_train.py "${MODEL[@]}" $(trainer "$W/zt/hf") --deepspeed "$W/zt/ds_config.json"
ZT_RC=$RC ZT_WALL=$WALL ZT_T0=$T0

DS_LIMIT=$(min "${DS_S:-150}" $(( $(left) - MEASURE_S - 20 )))
if [ "${SKIP_DS:-0}" = 1 ]; then
  say "DeepSpeed's autotuner: skipped (SKIP_DS=1)"
  DS_RC=0 DS_WALL=0 DS_T0=$(date +%s.%N)
else
  say "DeepSpeed's autotuner: limit $DS_LIMIT s, the cap set by benchmarks/gpu_savers_train.py"
  # shellcheck disable=SC2046
  (cd "$W/ds" && run_tuner ds "$DS_LIMIT" env GPU_SAVERS_DEVICE_BUDGET="$BUDGET" deepspeed --autotuning tune \
    --num_gpus 1 --master_port 29700 "$OLDPWD/benchmarks/gpu_savers_train.py" "${MODEL[@]}" $(trainer "$W/ds/hf") \
    --deepspeed "$W/ds/ds_config.json"; echo "$RC $WALL $T0" > "$W/ds.rc")
  read -r DS_RC DS_WALL DS_T0 < "$W/ds.rc"
fi

for t in zt ds; do  # each answer, end to end; zerotune's first (DeepSpeed's is likely none: its runs OOM)
  [ "$t" = ds ] && [ "${SKIP_DS:-0}" = 1 ] && continue
  lim=$(min "$MEASURE_S" $(( $(left) - 20 )))
  if [ "$lim" -lt 40 ]; then say "re-measure $t: skipped, $(left) s left"; continue; fi
  timeout -k 10 $(( lim + 20 )) "$PY" -m benchmarks.gpu_savers measure --tool "$t" --root "$W/$t" --limit "$lim" \
    --steps "${MEASURE_STEPS:-7}" --budget-bytes "$BUDGET" --port 29800 --out "$W/$t/remeasure.json" 2>&1 \
    | grep -v "WARNING.*accelerator" | tee -a "$OUT/report.txt"
  sweep "re-measure $t"
done

timeout 30 "$PY" -m benchmarks.gpu_savers report --zt "$W/zt" --zt-wall "$ZT_WALL" --zt-rc "$ZT_RC" --zt-t0 "$ZT_T0" \
  --ds "$W/ds" --ds-wall "$DS_WALL" --ds-rc "$DS_RC" --ds-t0 "$DS_T0" --json "$OUT/report.json" 2>&1 \
  | grep -v "WARNING.*accelerator" | tee -a "$OUT/report.txt"
tail -c 60000 "$W/zt.log" > "$OUT/zt.log"
{ tail -c 40000 "$W/ds.log" 2>/dev/null; for d in "$W"/ds/results/*/; do echo "== $d stderr (tail)"
  tail -5 "$d/stderr.log" 2>/dev/null; done; echo "== pdsh calls"; cat "$W/pdsh_calls.log" 2>/dev/null
} | tail -c 80000 > "$OUT/ds.log"
for t in zt ds; do echo "== $t"; tail -c 20000 "$W/$t/remeasure/run.log" 2>/dev/null; done > "$OUT/remeasure.log"
tar czf "$OUT/zt_exps.tgz" -C "$W/zt" --exclude='stdout.log' exps results 2>/dev/null
tar czf "$OUT/ds_exps.tgz" -C "$W/ds" --exclude='*.log' results exps 2>/dev/null
say "done in $(( $(date +%s) - T_START )) s; files in $OUT"
rm -rf "$W"
