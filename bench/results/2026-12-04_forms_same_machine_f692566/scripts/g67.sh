#!/bin/bash
# Same machine, alternating: colocated services with the engine in its own process (S*) and in one process (I*),
# the issue sweep against each with one client process; then optional engine_hop (HOP=1). Usage: bash g67.sh [cpu]
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
for form in ${FORMS:-S:true I:false S2:true}; do
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
  timeout ${SWEEP_T:-150} $PY -m flashpd.bench.job_sweep --address $ADDR --methods native,dflash --concurrency $LEVELS \
      --prompt-pool $POOL --requests $REQ --max-tokens $MAXT --client-procs 1 \
      --out serve_sweep_same_prompts_h200.json > sweep.log 2>&1; echo "$name sweep rc $?"
  grep "tok/s" sweep.log | sed 's/.*flashpd.job_sweep: //' | cut -c1-150
  kill $SVC; wait $SVC 2>/dev/null
  grep -i "warm-up\|compiled\|captured" serve.log | cut -c1-200 | tail -3
done
true
if [ -n "$HOP" ]; then
  cd $OUT && mkdir -p hop && cd hop
  if [ "$DEV" = cuda ]; then HA="--device cuda --dtype bfloat16 --requests 100 --rounds 2"; else HA="--requests 4 --rounds 1 --max-tokens 4"; fi
  timeout ${HOP_T:-240} $PY -m flashpd.bench.engine_hop $HA --out engine_hop.json > hop.log 2>&1; echo "hop rc $?"
  grep -v "^\s*$" hop.log | tail -12 | cut -c1-200
fi
