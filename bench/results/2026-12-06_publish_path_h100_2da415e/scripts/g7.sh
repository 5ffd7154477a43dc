#!/bin/bash
# Call 7 (34th session; g6.sh's first form ran call 6): ttft_hit at this session's start (913b6e8's kv_bridge and bench) and at HEAD, alternating,
# on one machine: publish and restore times per mode; then the publish probe.
T0=$(date +%s); R=$PWD; B=${B:-570}
mkdir -p /tmp/ib/flashpd /tmp/old/flashpd /tmp/site
for f in $R/flashpd/*; do ln -sfn $f /tmp/ib/flashpd/; ln -sfn $f /tmp/old/flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p /tmp/ib/flashpd/$p && ln -sfn $R/$p /tmp/old/flashpd/$p; done
ln -sfn $R/.diag/cur/old/kv_bridge /tmp/old/flashpd/kv_bridge; ln -sfn $R/.diag/cur/old/bench /tmp/old/flashpd/bench
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $R/.diag/cur/whl5/*.whl > /dev/null 2>&1; echo pip rc $?
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader; nproc
run() {  # tag root rev
  cd $2; PYTHONPATH=/tmp/site:$2 FLASHPD_GIT_REV=$3 timeout $(( B - ($(date +%s) - T0) )) python -m flashpd.bench.ttft_hit \
    --config qwen3-8b --prompts 3 --reps 3 --modes cold,memory,shm,arena --out $OUT/ttft_$1.json > $OUT/ttft_$1.log 2>&1
  echo "$1 rc $? at $(( $(date +%s) - T0 )) s"; grep -E "^prompt|geomean" $OUT/ttft_$1.log
}
run new1 /tmp/ib $(cat $R/.diag/cur/rev)
run old1 /tmp/old 913b6e8
run new2 /tmp/ib $(cat $R/.diag/cur/rev)
run old2 /tmp/old 913b6e8
bt() {  # tag root rev args
  cd $2; PYTHONPATH=/tmp/site:$2 FLASHPD_GIT_REV=$3 timeout $(( B - ($(date +%s) - T0) )) python -m flashpd.bench.bridge_throughput     --transports arena shm --chunk-tokens 256 --streams 1 --copy-out --total-mib 512 $4 --out $OUT/bt_$1.json > $OUT/bt_$1.log 2>&1
  echo "bt $1 rc $? at $(( $(date +%s) - T0 )) s"; grep -E "^(arena|shm) " $OUT/bt_$1.log
}
bt new /tmp/ib $(cat $R/.diag/cur/rev) ""
bt nopool /tmp/ib $(cat $R/.diag/cur/rev) "--shm-pool-mib 0"
bt old /tmp/old 913b6e8 ""
