#!/bin/bash
# One call: LLM warm-up then short prompts' TTFT (g30.py), the README's serve walkthrough (served == generate's
# tokens, gRPC client, HTTP), then GPU tests for the arena and staging. LIMIT_S total.
T0=$(date +%s); R=$PWD; LIMIT_S=${LIMIT_S:-570}
left() { echo $(( LIMIT_S - ($(date +%s) - T0) )); }
mkdir -p /tmp/ib/flashpd /tmp/site /tmp/w
for f in $R/flashpd/*; do ln -sfn $f /tmp/ib/flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p /tmp/ib/flashpd/$p; done
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site $R/.diag/cur/whl/*.whl > /dev/null 2>&1; echo pip rc $?
export PYTHONPATH=/tmp/site:/tmp/ib TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri FLASHPD_GIT_REV=$(cat $R/.diag/cur/rev) PYTHONUNBUFFERED=1
python3 -c "import grpc, google.protobuf as p, fastapi, uvicorn, opentelemetry; print('grpc', grpc.__version__, 'protobuf', p.__version__, 'fastapi', fastapi.__version__)"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
echo "== g30 at $(( $(date +%s) - T0 )) s"
(cd /tmp && timeout 220 python3 $R/.diag/cur/g30.py $R/flashpd/assets/demo_pair 2>&1 | grep -v "preferred_blas_library" > $OUT/g30.log); tail -12 $OUT/g30.log
FP="python3 -m flashpd.cli"; A=$R/flashpd/assets/demo_pair; W=$OUT; cd /tmp/w
P=$'import os\n\n\ndef read_file(path):\n'
echo "== walk at $(( $(date +%s) - T0 )) s"
{
cp $R/.diag/cur/gen_d.json gen_d.json
echo '{"target": "'$A/target'", "draft": "'$A/drafter'", "port": 50051}' > serve.json
$FP serve serve.json --http-port 8000 > serve.log 2>&1 & SP=$!
for i in $(seq 1 ${SERVE_WAIT:-420}); do grep -q 'listening on' serve.log && break; kill -0 $SP 2>/dev/null || break; sleep 1; done; echo "serve up after ${i} s"; head -8 serve.log
echo "== client"; timeout 60 $FP client --address 127.0.0.1:50051 --prompt "$P" --max-tokens 32 | tee cli.json
echo "== client native"; timeout 60 $FP client --address 127.0.0.1:50051 --prompt "$P" --max-tokens 32 --method native | tee cli_n.json
echo "== client stream"; timeout 60 $FP client --address 127.0.0.1:50051 --prompt "$P" --max-tokens 32 --stream | tail -2
echo "== http"; curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' -d '{"model": "target", "prompt": "def add(a, b):", "max_tokens": 32, "temperature": 0}'; echo
curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' -d '{"model": "target", "prompt": "def add(a, b):", "max_tokens": 32, "temperature": 0, "method": "native"}'; echo
curl -s localhost:8000/v1/chat/completions -H 'Content-Type: application/json' -d '{"model": "target", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "temperature": 0, "stream": true}' | tail -3; echo
curl -s localhost:8000/health | head -c 300; echo; curl -s localhost:8000/metrics | grep -c flashpd
kill -TERM $SP; for i in $(seq 1 20); do kill -0 $SP 2>/dev/null || break; sleep 0.5; done; kill -0 $SP 2>/dev/null && echo "serve still alive after SIGTERM" && kill -9 $SP; tail -3 serve.log; cp serve.log $W/serve.log
python3 - <<'PY'
import json
g = json.load(open("gen_d.json")); c = json.load(open("cli.json")); cn = json.load(open("cli_n.json"))
print("WALK served dflash == generate:", c["token_ids"] == g["token_ids"], "| served native == generate:", cn["token_ids"] == g["token_ids"], "| tau", c["stats"]["tau"], "ttft_ms", round(c["stats"]["ttft_ms"], 1))
PY
} > $W/walk.log 2>&1; echo "walk done at $(( $(date +%s) - T0 )) s"; grep -E "WALK|serve up|flashpd: warm|Traceback|Error|alive" $W/walk.log | head
exit 0
[ $L -gt 40 ] && PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout $(( L - 5 )) python3 -m pytest -q -p no:cacheprovider -p xdist -n 4 -o addopts="" tests/test_kv_bridge_arena.py tests/test_stage.py > $W/gpu_tests.log 2>&1
echo "gpu tests rc $? at $(( $(date +%s) - T0 )) s"; grep -E "passed|failed|FAILED|rror" $W/gpu_tests.log | tail -8
