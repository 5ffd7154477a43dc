#!/bin/bash
# Call 8 (34th session): GPU tests of the session's code at HEAD, then the Put segment pool on and off, alternating
# on one machine: bridge_throughput (arena Puts, 12 chunks back to back) and ttft_hit (cold and arena: a prompt's
# publish, 10 chunks in one Put). Only JSON files come back (at most 8); the logs' summary lines go to stdout.
T0=$(date +%s); R=$PWD; B=${B:-380}
mkdir -p /tmp/ib/flashpd /tmp/site
for f in $R/flashpd/*; do ln -sfn $f /tmp/ib/flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p /tmp/ib/flashpd/$p; done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $R/.diag/cur/whl5/*.whl > /dev/null 2>&1; echo pip rc $?
export PYTHONPATH=/tmp/site:/tmp/ib TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri FLASHPD_GIT_REV=$(cat $R/.diag/cur/rev) PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader; nproc
mkdir -p /tmp/t && cp -r $R/tests /tmp/t/ && cp $R/pyproject.toml /tmp/t/ && cd /tmp/t
PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout 120 python -m pytest -q -p no:cacheprovider -o addopts="" tests/test_host_store.py tests/test_shm_pool.py 2>&1 | tail -2
cd /tmp/ib; echo "tests at $(( $(date +%s) - T0 )) s"
for i in 1 2; do for tag in pool nopool; do
  [ $tag = pool ] && MIB=256 || MIB=0
  timeout 60 python -m flashpd.bench.bridge_throughput --transports arena --chunk-tokens 256 --streams 1 --copy-out \
    --total-mib 512 --shm-pool-mib $MIB --out $OUT/bt_${tag}$i.json 2>&1 | grep -E "^arena "
  echo "bt $tag$i at $(( $(date +%s) - T0 )) s"
done; done
for i in 1 2; do for tag in pool nopool; do
  [ $tag = pool ] && MIB=256 || MIB=0
  timeout $(( B - ($(date +%s) - T0) )) python -m flashpd.bench.ttft_hit --config qwen3-8b --prompts 3 --reps 3 \
    --modes cold,arena --shm-pool-mib $MIB --out $OUT/ttft_${tag}$i.json 2>&1 | grep -E "^prompt|geomean"
  echo "ttft $tag$i at $(( $(date +%s) - T0 )) s"
done; done
