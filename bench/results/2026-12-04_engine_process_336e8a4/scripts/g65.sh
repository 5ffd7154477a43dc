#!/bin/bash
# One colocated service with its engine in a child process (engine_process; prefix cache off, warm-up on), the
# issue sweep against it with one client process. Usage: bash g65.sh [cpu]
R=$PWD
DEV=${1:-cuda}
if [ "$DEV" = cuda ]; then
  mkdir -p ib/flashpd site
  for f in $R/flashpd/*; do ln -sfn $f flashpd/; done
  for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p flashpd/$p; done
  python3 -m pip install -q --no-index --no-deps --no-compile --target site $R/scripts/whl/*.whl > /dev/null 2>&1; echo pip rc $?
  export PYTHONPATH=site:ib TORCHINDUCTOR_CACHE_DIR=ind TRITON_CACHE_DIR=tri
  PY=python; DT=bfloat16; KV=262144; MR=128; LEVELS=1,8,32,128; REQ=512; POOL=256; MAXT=64
else
  PY=$R/.venv/bin/python; DT=float32; KV=8192; MR=8; LEVELS=2,4; REQ=8; POOL=8; MAXT=8; OUT=${OUT:-g64out}
fi
export FLASHPD_GIT_REV=$(cat $R/scripts/rev)
for form in ${FORMS:-S:true}; do
  name=${form%%:*}; ep=${form#*:}
  mkdir -p $OUT/$name && cd $OUT/$name
  cat > serve.json <<JSON
{"target": "$R/flashpd/assets/demo_pair/target", "draft": "$R/flashpd/assets/demo_pair/drafter", "mode": "colocated",
 "device": "$DEV", "dtype": "$DT", "kv_cache_tokens": $KV, "max_running": $MR, "device_cache_bytes": 0,
 "host_cache_bytes": 0, "port": 0, "metrics_port": null, "engine_process": $ep}
JSON
  t0=$(date +%s)
  $PY -m flashpd.cli serve --config serve.json > serve.log 2>&1 &
  SVC=$!
  for i in $(seq 1 600); do grep -q "^listening on" serve.log && break; sleep 1; done
  ADDR=$(grep "^listening on" serve.log | awk '{print $3}'); echo "$name: service at $ADDR after $(( $(date +%s) - t0 ))s"
  timeout 200 $PY -m flashpd.bench.job_sweep --address $ADDR --methods native,dflash --concurrency $LEVELS \
      --prompt-pool $POOL --requests $REQ --max-tokens $MAXT --client-procs 1 \
      --out serve_sweep_same_prompts_h200.json > sweep.log 2>&1; echo "$name sweep rc $?"
  grep "tok/s" sweep.log | sed 's/.*flashpd.job_sweep: //' | cut -c1-150
  kill $SVC; wait $SVC 2>/dev/null
  grep -i "warm-up\|compiled\|captured" serve.log | cut -c1-200 | tail -3
done
true
