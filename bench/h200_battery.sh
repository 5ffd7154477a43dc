#!/usr/bin/env bash
# The GPU runs of a session in one or two commands (device time is scarce): each step has its own time
# limit and writes into $OUT, so a step cut short never costs the others. From the repository root:
#   FLASHPD_GIT_REV=<rev> STEPS="ttft sweep1 sweep2" bash bench/h200_battery.sh
# Steps: ttft (issue 5: TTFT of a hit vs cold, Qwen3-8B shape), cache (issue 5: 20 prompts of 2,048 tokens, a
# hit through every tier vs cold: same tokens and acceptance lengths, and the target-only control), speedup (issue 4: DFlash vs native on the
# demo pair), sweep1 (issue 6: the service on one GPU, demo pair), sweep2 (issue 7: prefill and decode on
# two GPUs vs colocated, demo pair), sweep8b (issues 6/7: Qwen3-8B-shape dummy weights), draft (issue 5:
# draft-state import), pair (issue 4: the demo pair's whole recipe, about 8 minutes), attn (attention
# implementations at batch 1), profile (issue 4: wall vs GPU-busy time of a native and a DFlash step), anatomy (issue 4: a whole request's phases, native and DFlash, and a Chrome trace of each). Default: all of them (more than one 10-minute command holds).
# Wheels carried in .whl (all of it fits one 64 MiB carry beside the repository):
#   ../shared/tools/gpu-wheels.sh .whl ray prometheus_client blake3   (blake3: the bridge's chunk MACs)
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl grpcio==1.85.1 protobuf==7.36.2
#   python3 bench/trim_ray_wheel.py .whl/ray-*.whl
# CACHE_STORES=memory,device,disk,grpc,shm,lmcache adds the LMCache tier to the cache step: carry the lmcache group
# (../shared/tools/gpu-wheels.sh .whl-lm lmcache, about 28 MB, plus the grpcio and protobuf wheels above) instead of
# Ray's, as both do not fit one carry, and set WHEELS=.whl-lm.
# BRIDGE=shm moves the sweeps' KV through shared memory (gRPC carries handles) instead of inside the gRPC messages.
# probe (the bf16 exactness lead in the README: exact_probe with compile as is, without it, with static shapes, without split reductions).
# PROFILE_ARGS adds flags to the profile step (e.g. "--prompts heldout --block 8"). PROMPTS sets the speedup step's prompts per set (default 8, as the headline runs). RECIPE_ARGS adds flags to the pair step (e.g. "--drafter-steps 9000"); PAIR=new points profile and speedup at
# the pair that step made (STEPS="pair speedup" PAIR=new: a candidate pair judged under the protocol in one call).
# LAUNCHER=local runs the sweeps with local processes instead of Ray (fractional GPUs on one, whole GPUs on two).
set -u
export PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
# On the device machine $OUT is already the folder that comes back: leave it so, and whatever a step writes before
# a time limit cuts the call still returns (results packed at a command's end are lost with it)
OUT=${OUT:-bench/results/battery}; mkdir -p "$OUT"
STEPS=${STEPS:-ttft cache profile speedup sweep1 sweep2 sweep8b draft}
L=${LAUNCHER:-ray}
want() { [[ " $STEPS " == *" $1 "* ]]; }
step() { local name=$1 limit=$2; shift 2; echo "=== $(date +%T) $name (limit ${limit}s)"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "=== $(date +%T) $name rc=$?"; grep -v "Warning\|warn(" "$OUT/$name.log" | tail -${TAIL:-6}; }
# two batteries may run side by side (one per GPU): install once, each into its own site dir
python3 -c "import flashpd.engine" 2> /dev/null || python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /dev/null 2>&1 || echo "pip -e failed"
G=${GPU:-0}  # the GPU of the one-GPU steps
# what the image has, before any carried wheel shadows it (the generated gRPC code needs grpcio >= 1.85.1
# and protobuf >= 7.35.1)
python3 -c "import google.protobuf, grpc; print('image: protobuf', google.protobuf.__version__, 'grpcio', grpc.__version__)" || true
W=${WHEELS:-.whl}  # the carried wheel group (.whl: Ray's; a second folder for LMCache's)
if ls "$W"/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-$$ "$W"/*.whl && export PYTHONPATH=/tmp/site-$$
fi
python3 -c "import google.protobuf, grpc, torch; print('protobuf', google.protobuf.__version__, 'grpc', grpc.__version__, 'torch', torch.__version__, 'gpus', torch.cuda.device_count())"
NG=$(python3 -c "import torch; print(torch.cuda.device_count())")
SWEEP="--device cuda --dtype bfloat16 --kv-cache-tokens 262144 --max-tokens 64 --long-every 8 --bridge-transport ${BRIDGE:-inline}"  # 1 prompt in 8 of 2,048 tokens
# the training checkpoints go only once the recipe finished (eval.json written): a run its limit cut keeps them
want pair && CUDA_VISIBLE_DEVICES=$G step make_demo_pair ${PAIR_LIMIT:-570} flashpd make-demo-pair --out "$OUT/pair" ${RECIPE_ARGS:-} && [ -f "$OUT/pair/eval.json" ] && rm -rf "$OUT/pair/drafter-train"
# the pair the profile and speedup steps measure: the shipped one, or (PAIR=new) the one the pair step just made
P=flashpd/assets/demo_pair; [ "${PAIR:-}" = new ] && P="$OUT/pair"
want attn && CUDA_VISIBLE_DEVICES=$G step attn_micro 120 python3 -m flashpd.bench.attn_micro --out "$OUT/attn_micro_h200.json"
want ttft && CUDA_VISIBLE_DEVICES=$G step ttft_hit 150 python3 -m flashpd.bench.ttft_hit --config qwen3-8b --prompts 3 --reps 3 --modes ${TTFT_MODES:-cold,device,memory,shm,grpc} --out "$OUT/ttft_hit_h200.json"
want cache && CUDA_VISIBLE_DEVICES=$G step cache_runs ${CACHE_LIMIT:-200} python3 -m flashpd.bench.cache_runs --device cuda --prompts 20 --prompt-tokens 2048 --new-tokens 64 --stores ${CACHE_STORES:-memory,device,disk,grpc,shm} --out "$OUT/cache_runs_demo_pair_h200.json"
want profile && CUDA_VISIBLE_DEVICES=$G step profile ${PROFILE_LIMIT:-150} python3 -m flashpd.bench.profile_step --target $P/target --draft $P/drafter ${PROFILE_ARGS:-} --out "$OUT/profile_step_h200.json"
want anatomy && CUDA_VISIBLE_DEVICES=$G step anatomy ${ANATOMY_LIMIT:-200} python3 -m flashpd.bench.request_anatomy --target $P/target --draft $P/drafter --prompts ${PROMPTS:-8} --trace "$OUT" --out "$OUT/request_anatomy_h200.json"
want speedup && CUDA_VISIBLE_DEVICES=$G step speedup ${SPEEDUP_LIMIT:-200} python3 -m flashpd.bench.speedup --target $P/target --draft $P/drafter --prompts ${PROMPTS:-8} --widths ${WIDTHS:-4,8,12,16} --reps 3 --out "$OUT/speedup_demo_pair_h200.json"
want sweep1 && CUDA_VISIBLE_DEVICES=$G step sweep_1gpu ${SWEEP1_LIMIT:-200} python3 -m flashpd.bench.job_sweep $SWEEP --long-every 16 --launcher $L --concurrency 1,8,32,128 --out "$OUT/serve_sweep_demo_h200.json"
if [ "$NG" -ge 2 ]; then
  want sweep2 && CUDA_VISIBLE_DEVICES=0,1 step sweep_2gpu ${SWEEP2_LIMIT:-230} python3 -m flashpd.bench.job_sweep $SWEEP --launcher $L --concurrency 1,8,32 --out "$OUT/serve_sweep_demo_2gpu_h200.json"
fi
if want sweep8b; then
  step dummy8b 80 python3 -m flashpd.bench.make_dummy_pair --config qwen3-8b --tokenizer flashpd/assets/demo_pair/target/tokenizer.json --out .dummy8b
  GPUS=0; [ "$NG" -ge 2 ] && GPUS=0,1
  CUDA_VISIBLE_DEVICES=$GPUS step sweep_8b ${SWEEP8B_LIMIT:-230} python3 -m flashpd.bench.job_sweep --device cuda --dtype bfloat16 --kv-cache-tokens 65536 --max-tokens 32 --long-every 8 --bridge-transport ${BRIDGE:-inline} --launcher $L --concurrency 1,8,32 --requests 16 --target .dummy8b/target --draft .dummy8b/drafter --out "$OUT/serve_sweep_8b_dummy_h200.json"
fi
# probe: where bf16 DFlash and native part, with the runner's compile as is, without compile, with every shape
# specialised, and with Inductor's split reductions off (four processes side by side on one GPU; exactness only)
if want probe; then
  for v in default no-compile static-shapes no-split-reductions; do
    f=""; [ $v != default ] && f="--$v"
    CUDA_VISIBLE_DEVICES=$G timeout ${PROBE_LIMIT:-150} python3 -m flashpd.bench.exact_probe --prompts 8 --paths fresh $f \
      --out "$OUT/exact_probe_$v.json" > "$OUT/probe_$v.log" 2>&1 &
  done
  wait; for v in default no-compile static-shapes no-split-reductions; do echo "probe $v: $(tail -1 "$OUT/probe_$v.log")"; done
fi
want draft && CUDA_VISIBLE_DEVICES=$G step draft_state 40 python3 -m flashpd.bench.draft_state --device cuda --reps 3 --out "$OUT/draft_state_h200.json"
ls -la "$OUT"
