#!/bin/bash
# One call: the README's walkthrough on a GPU (generate, demo, serve + client + HTTP, served tokens == generate's),
# the GPU-only tests, then speed_8b: the issue's full run on an H200, a quick batch-1 run on an H100. LIMIT_S total.
T0=$(date +%s); R=$PWD; LIMIT_S=${LIMIT_S:-560}
left() { echo $(( LIMIT_S - ($(date +%s) - T0) )); }
mkdir -p /tmp/ib/flashpd /tmp/site /tmp/w
for f in $R/flashpd/*; do ln -sfn $f /tmp/ib/flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p /tmp/ib/flashpd/$p; done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $R/.diag/cur/whl/*.whl > /dev/null 2>&1; echo pip rc $?
export PYTHONPATH=/tmp/site:/tmp/ib TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri FLASHPD_GIT_REV=$(cat $R/.diag/cur/rev) PYTHONUNBUFFERED=1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"; nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw --format=csv,noheader
FP="python3 -m flashpd.cli"; A=$R/flashpd/assets/demo_pair; W=$OUT; cd /tmp/w
P=$'import os\n\n\ndef read_file(path):\n'
{
if [ -z "$SKIP_GEN" ]; then echo "== generate dflash"; timeout 120 $FP generate --target $A/target --draft $A/drafter --prompt "$P" --max-tokens 32 --json | tee gen_d.json
echo "== generate native"; timeout 60 $FP generate --target $A/target --method native --prompt "$P" --max-tokens 32 --json | tee gen_n.json
echo "== demo"; timeout 120 $FP demo --device cuda 2>&1 | tail -12; else cp $R/.diag/cur/gen_d.json gen_d.json; cp $R/.diag/cur/gen_d.json gen_n.json; fi
echo '{"target": "'$A/target'", "draft": "'$A/drafter'", "port": 50051}' > serve.json
date +%s.%N > t_serve; $FP serve serve.json --http-port 8000 > serve.log 2>&1 & SP=$!
for i in $(seq 1 ${SERVE_WAIT:-240}); do grep -q 'listening on' serve.log && break; sleep 1; done; echo "serve up after ${i} s"; cat serve.log | head -5
echo "== client"; timeout 60 $FP client --address 127.0.0.1:50051 --prompt "$P" --max-tokens 32 | tee cli.json
echo "== client native"; timeout 60 $FP client --address 127.0.0.1:50051 --prompt "$P" --max-tokens 32 --method native | tee cli_n.json
echo "== client stream"; timeout 60 $FP client --address 127.0.0.1:50051 --prompt "$P" --max-tokens 32 --stream | tail -3
echo "== http"; curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' -d '{"model": "target", "prompt": "def add(a, b):", "max_tokens": 32, "temperature": 0}' | tee http.json; echo
curl -s localhost:8000/v1/chat/completions -H 'Content-Type: application/json' -d '{"model": "target", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "temperature": 0}' | head -c 600; echo
curl -s localhost:8000/health | head -c 600; echo; curl -s localhost:8000/metrics | grep -c flashpd
kill -INT $SP; sleep 5; kill -9 $SP 2>/dev/null; tail -4 serve.log; cp serve.log $W/serve.log
python3 - <<'PY'
import json
g = json.load(open("gen_d.json")); n = json.load(open("gen_n.json")); c = json.load(open("cli.json")); cn = json.load(open("cli_n.json"))
ids = lambda d: d.get("token_ids") or d.get("ids")
print("WALK generate dflash == native:", ids(g) == ids(n), "| served dflash == generate:", ids(c) == ids(g), "| served native == generate:", ids(cn) == ids(g), "| tau", c.get("stats", {}).get("tau"))
PY
} > $W/walk.log 2>&1; echo "walk done at $(( $(date +%s) - T0 )) s"; grep -E "WALK|serve up|Traceback|Error" $W/walk.log | head
mkdir -p /tmp/t && cp -r $R/tests /tmp/t/ && cp $R/pyproject.toml /tmp/t/ && cd /tmp/t
PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout ${TEST_S:-200} python3 -m pytest -q -p no:cacheprovider -p xdist -n 4 -o addopts="" ${TESTS:-tests/test_graph_capture_threads.py tests/test_host_store.py tests/test_kv_bridge_arena.py tests/test_paged_attention.py tests/test_stage.py tests/test_qkv_rope.py tests/test_greedy_argmax.py tests/test_skinny_gemm.py tests/test_pdl.py tests/test_attention_impl.py} > $W/gpu_tests.log 2>&1
echo "gpu tests rc $? at $(( $(date +%s) - T0 )) s"; grep -E "passed|failed|FAILED|rror" $W/gpu_tests.log | tail -12
cd /tmp/ib; L=$(left)
if echo "$GPU" | grep -q H200 && [ $L -gt 300 ]; then
  timeout $(( L - 10 )) python3 -m flashpd.bench.speed_8b --exact-target $A/target --exact-draft $A/drafter \
    --sections exact,dflash,curve,scheduler,long,prefill --profile-batches 1,32,128 --stall-dump-s 150 \
    --draft-vocabs 0,16384 --draft-quantizations fp8 --out $W/speed_8b_h200.json > $W/speed_8b_h200.log 2>&1
  echo "full rc $? at $(( $(date +%s) - T0 )) s"
  grep "done:" $W/speed_8b_h200.log | tr ',' '\n' | grep -E "x_floor|fraction|dflash_over|bf16_exact|gpu_busy|kernels|step_ms"
elif [ $L -gt 90 ]; then
  timeout $(( L - 5 )) python3 -m flashpd.bench.speed_8b --sections curve,dflash --batches 1,128 --profile-batches 1 \
    --dflash-batches 1 --stall-dump-s 80 --out $W/quick.json > $W/quick.log 2>&1
  echo "quick rc $? at $(( $(date +%s) - T0 )) s"
  grep "done:" $W/quick.log | tr ',' '\n' | grep -E "native_b1_x_floor |native_b1_gpu_busy|kernels_per|native_step_ms_b1|dflash_step_ms_b1|dflash_over_native_step |b128_floor"
fi
