#!/usr/bin/env bash
# Issue 54's CUDA-only checks on one lent GPU (H100 80GB or H200), within BUDGET_S (default 530) s:
#   1. ZeRO++'s quantized collectives (D338): benchmarks/train_hf_loop.py --arch llama (a 4-layer LLaMA, random
#      weights) at ZeRO-3 with zero_quantized_weights, zero_quantized_gradients and both, 6 optimizer steps each (one
#      rank: the kernels run, the collectives have nobody to talk to); each run's exit status and last lines.
#   2. Partial optimizer offload on a real device (D337) and MFU against the device's peak (D332): zerotune tune on a
#      LLaMA of about 0.8B parameters (16 layers, width 2048, 512 tokens), bf16, ZeRO-3 with offload_optimizer cpu
#      (torch's AdamW on the host: "torch_adam", no cpu_adam JIT build), sub_group_size 1e8 (about 8 sub-groups),
#      mbs at most 4, under --device-memory BUDGET_GIB (default 12): no config fits without the offload, and the
#      partial offload should be proposed at the full offload's best mbs. The summary (its savers lines, the memory
#      table against the measured peaks, the MFU line) is the result.
# Not run yet: no device was lent when it was written (stop 63). Run from the repository root:
#   OUT=/tmp/out bash benchmarks/gpu_dimensions.sh
# Where pip cannot reach PyPI, carry the wheels in .whl/ as benchmarks/gpu_savers.sh's header says (transformers,
# accelerate, psutil, pydantic, hjson, deepspeed). Files under $OUT: env.txt report.txt zeropp_*.log tune.log
# summary.txt exps.tgz.
set -u
T_START=$(date +%s)
BUDGET_S=${BUDGET_S:-530}
BUDGET_GIB=${BUDGET_GIB:-12}
OUT=${OUT:-/tmp/gpu_dims_out}
PY=${PY:-python3}
W=/tmp/gpudims.$$  # every process of this run has this path in its command line (gpu_lib.sh's sweep relies on it)
# shellcheck source=benchmarks/gpu_lib.sh
source benchmarks/gpu_lib.sh

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  timeout 90 "$PY" -c "import deepspeed, torch, transformers, pydantic, hjson
print('deepspeed', deepspeed.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available(),
      'transformers', transformers.__version__)" 2>&1 | grep -v WARNING
} > "$OUT/env.txt"
cat "$OUT/env.txt"
grep -q "^deepspeed .* transformers" "$OUT/env.txt" || { say "an import failed (see env.txt): not run"; exit 3; }

# 1. ZeRO++'s kernels: 100 s at most each
SMALL=(--arch llama --n-layer 4 --n-embd 1024 --n-head 16 --seq-len 512 --vocab 32000 --steps 6)
for variant in qw qg qwqg; do
  case $variant in
    qw) keys='"zero_quantized_weights": true' ;;
    qg) keys='"zero_quantized_gradients": true' ;;
    *) keys='"zero_quantized_weights": true, "zero_quantized_gradients": true' ;;
  esac
  cat > "$W/zeropp_$variant.json" <<EOF
{"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "bf16": {"enabled": true},
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
 "zero_optimization": {"stage": 3, $keys}}
EOF
  timeout -k 10 100 deepspeed --num_gpus 1 --master_port 29710 benchmarks/train_hf_loop.py "${SMALL[@]}" \
    --deepspeed_config "$W/zeropp_$variant.json" > "$W/zeropp_$variant.log" 2>&1
  rc=$?
  say "ZeRO++ $variant: exit $rc; $(grep -E '^step [0-9]+ loss' "$W/zeropp_$variant.log" | tail -1)"
  grep -E "Error|error:" "$W/zeropp_$variant.log" | grep -v WARNING | tail -3 | tee -a "$OUT/report.txt"
  tail -c 20000 "$W/zeropp_$variant.log" > "$OUT/zeropp_$variant.log"
  sweep "ZeRO++ $variant"
done

# 2. partial offload and MFU: what is left, 30 s kept for the files
cat > "$W/offload.json" <<'EOF'
{"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": true},
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": true}},
 "zero_optimization": {"stage": 3, "sub_group_size": 100000000, "offload_optimizer": {"device": "cpu"}},
 "autotuning": {"enabled": true, "fast": true, "start_profile_step": 3, "end_profile_step": 6,
                "max_train_micro_batch_size_per_gpu": 4}}
EOF
BIG=(--arch llama --n-layer 16 --n-embd 2048 --n-head 16 --seq-len 512 --vocab 32000 --steps 40)
TUNE_LIMIT=$(( $(left) - 30 ))
say "zerotune (partial offload, MFU): limit $TUNE_LIMIT s, --device-memory ${BUDGET_GIB}GiB"
run_tuner tune "$TUNE_LIMIT" "$PY" -m zerotune tune --num_gpus 1 --device-memory "${BUDGET_GIB}GiB" --timeout 120 \
  --results-dir "$W/results" benchmarks/train_hf_loop.py "${BIG[@]}" --deepspeed_config "$W/offload.json"
grep -E "ratio|offload|MFU|tokens/s|Optimal" "$W/results/summary.txt" 2>/dev/null | tee -a "$OUT/report.txt"
sed -n '/memory per rank/,$p' "$W/results/summary.txt" 2>/dev/null | head -30 | tee -a "$OUT/report.txt"
cp "$W/results/summary.txt" "$OUT/" 2>/dev/null
tail -c 60000 "$W/tune.log" > "$OUT/tune.log"
tar czf "$OUT/exps.tgz" -C "$W/results" --exclude='stdout.log' exps 2>/dev/null
say "done in $(( $(date +%s) - T_START )) s; files in $OUT"
rm -rf "$W"
