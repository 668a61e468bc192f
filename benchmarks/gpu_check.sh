#!/usr/bin/env bash
# A real tuning on one CUDA GPU: zerotune tune (fast mode, bf16, all ZeRO stages, mbs up to 1024) on the bundled
# GPT example, then a per-experiment report (status, metric, the memory model's estimate against the probe's peaks).
# Run from the repository root on a machine with CUDA, PyTorch and DeepSpeed:
#   N_LAYER=4 TUNE_S=420 OUT=/tmp/out bash benchmarks/gpu_check.sh
# Where pip cannot reach PyPI (the lent GPU machines), carry wheels in .whl/ (ignored by git), built here:
#   .venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl pydantic==<ver> pydantic-core==<ver> annotated-types typing-inspection hjson
#   (cd .whl && DS_BUILD_OPS=0 ../.venv/bin/python -m pip wheel --no-deps --no-build-isolation deepspeed==0.19.8)
# and they are installed into /tmp/site first. Results: benchmarks/results/gpu_h200_2026-11-26/ and benchmarks/README.md.
set -u
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT" /tmp/gpu
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 -c "import deepspeed, torch; print('deepspeed', deepspeed.__version__, 'torch', torch.__version__, torch.cuda.is_available())"
start=$(date +%s)
timeout "${TUNE_S:-400}" python3 -m zerotune tune --num_gpus 1 --timeout 100 examples/train_gpt.py --steps 30 \
  --d-model 1024 --n-layer "${N_LAYER:-4}" --seq-len 512 --deepspeed_config benchmarks/gpu_ds_config.json > "$OUT/tune.log" 2>&1
echo "tune rc=$? in $(( $(date +%s) - start )) s"
tail -60 "$OUT/tune.log"
python3 benchmarks/gpu_report.py /tmp/gpu/exps | tee "$OUT/report.txt"
cp /tmp/gpu/results/summary.txt /tmp/gpu/results/ds_config_optimal.json "$OUT/" 2>/dev/null
tar czf "$OUT/exps.tgz" -C /tmp/gpu exps 2>/dev/null
