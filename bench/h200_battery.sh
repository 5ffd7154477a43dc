#!/usr/bin/env bash
# The GPU runs of one session in one command (device time is scarce): each step has its own time limit
# and writes into $OUT, so a step cut short never costs the others. Run from the repository root:
#   FLASHPD_GIT_REV=<rev> bash bench/h200_battery.sh            (2 GPUs: the two-GPU step runs too)
# Wheels carried in .whl (all of it fits one 64 MiB carry beside the repository):
#   ../shared/tools/gpu-wheels.sh .whl ray prometheus_client
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl grpcio==1.85.1 protobuf==7.36.2
#   python3 bench/trim_ray_wheel.py .whl/ray-*.whl
# LAUNCHER=local runs the one-GPU sweep without Ray (the default is Ray's fractional GPUs).
set -u
export PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
OUT=${OUT:-bench/results/battery}; mkdir -p "$OUT"
step() { local name=$1 limit=$2; shift 2; echo "=== $(date +%T) $name (limit ${limit}s)"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "=== $(date +%T) $name rc=$?"; grep -v "Warning\|warn(" "$OUT/$name.log" | tail -${TAIL:-6}; }
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /dev/null 2>&1 || echo "pip -e failed"
# what the image has, before any carried wheel shadows it (the generated gRPC code needs grpcio >= 1.85.1
# and protobuf >= 7.35.1; if the image has them, Ray's wheels fit the 64 MiB carry without gRPC's)
python3 -c "import google.protobuf, grpc; print('image: protobuf', google.protobuf.__version__, 'grpcio', grpc.__version__)" || true
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -c "import google.protobuf, grpc, torch; print('protobuf', google.protobuf.__version__, 'grpc', grpc.__version__, 'torch', torch.__version__, 'gpus', torch.cuda.device_count())"
NG=$(python3 -c "import torch; print(torch.cuda.device_count())")
# issue 5: TTFT of a method-aware hit vs a cold prefill, Qwen3-8B shape, 2,723-token prompt
CUDA_VISIBLE_DEVICES=0 step ttft_hit 150 python3 -m flashpd.bench.ttft_hit --config qwen3-8b --prompts 3 --reps 3 --modes ${TTFT_MODES:-cold,device,memory,shm,grpc} --out "$OUT/ttft_hit_h200.json"
# issue 4: DFlash over native on the shipped demo pair, batch 1, experiments.md protocol
[ -n "${SPEEDUP:-}" ] && CUDA_VISIBLE_DEVICES=0 step speedup 200 python3 -m flashpd.bench.speedup --target flashpd/assets/demo_pair/target --draft flashpd/assets/demo_pair/drafter --prompts 4 --widths 8,16 --reps 3 --out "$OUT/speedup_demo_pair_h200.json"
# issue 6: the service on one GPU (prefill and decode workers share it: Ray's fractional GPUs), demo pair
SWEEP="--device cuda --dtype bfloat16 --kv-cache-tokens 262144 --max-tokens 64"
CUDA_VISIBLE_DEVICES=0 step sweep_1gpu 200 python3 -m flashpd.cluster.job_sweep $SWEEP --launcher ${LAUNCHER:-ray} --concurrency 1,8,32,128 --out "$OUT/serve_sweep_demo_h200.json"
# issue 7: prefill on GPU 0, decode on GPU 1 (local launcher) against colocated on one GPU
if [ "$NG" -ge 2 ]; then
  CUDA_VISIBLE_DEVICES=0,1 step sweep_2gpu 150 python3 -m flashpd.cluster.job_sweep $SWEEP --launcher local --concurrency 1,8,32 --out "$OUT/serve_sweep_demo_2gpu_h200.json"
fi
CUDA_VISIBLE_DEVICES=0 step draft_state 40 python3 -m flashpd.bench.draft_state --device cuda --reps 3 --out "$OUT/draft_state_h200.json"
ls -la "$OUT"
