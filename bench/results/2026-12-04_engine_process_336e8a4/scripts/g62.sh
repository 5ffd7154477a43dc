#!/bin/bash
# One service (colocated, prefix cache off, warm-up on), then the issue's sweep against it with 1 and with 4 client
# processes, alternating, and (if HOLD is set) the same with a held session in a second service is not possible in
# one call: HOLD picks this call's service setting. Usage: bash g62.sh [cpu]
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
  PY=$R/.venv/bin/python; DT=float32; KV=8192; MR=8; LEVELS=2,4; LAST=4; REQ=8; POOL=8; MAXT=8; OUT=${OUT:-g62out}
fi
export FLASHPD_GIT_REV=$(cat $R/scripts/rev)
mkdir -p $OUT/svc && cd $OUT/svc
cat > serve.json <<JSON
{"target": "$R/flashpd/assets/demo_pair/target", "draft": "$R/flashpd/assets/demo_pair/drafter", "mode": "colocated",
 "device": "$DEV", "dtype": "$DT", "kv_cache_tokens": $KV, "max_running": $MR, "device_cache_bytes": 0,
 "host_cache_bytes": 0, "port": 0, "metrics_port": null, "session_hold_fraction": ${HOLD:-0.0}}
JSON
$PY -m flashpd.cli serve --config serve.json > serve.log 2>&1 &
SVC=$!
for i in $(seq 1 600); do grep -q "^listening on" serve.log && break; sleep 1; done
ADDR=$(grep "^listening on" serve.log | awk '{print $3}'); echo "service at $ADDR after ${i}s"
for run in 1:$LEVELS 4:$LEVELS 1:${LAST:-128} 4:${LAST:-128}; do
  procs=${run%%:*}; lv=${run#*:}
  n=$((n + 1))
  timeout 150 $PY -m flashpd.bench.job_sweep --address $ADDR --methods native,dflash --concurrency $lv \
      --prompt-pool $POOL --requests $REQ --max-tokens $MAXT --client-procs $procs \
      --out sweep_p${procs}_$n.json > sweep_p${procs}_$n.log 2>&1; echo "procs $procs run $n rc $?"
  grep "tok/s" sweep_p${procs}_$n.log | sed 's/.*flashpd.job_sweep: //' | cut -c1-160
done
kill $SVC; wait $SVC 2>/dev/null
grep -i "warm-up\|engine:\|compiled\|captured" serve.log | cut -c1-250 | tail -12
true
