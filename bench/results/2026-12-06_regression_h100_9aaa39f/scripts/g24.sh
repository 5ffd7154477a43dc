#!/bin/bash
# Call 24 (38th session): the GPU side of this session's changes (bridge, channels, router, workers over TLS, staging
# and arena pinning that CPU CI skips), on whatever GPU came. Usage: LIMIT_S=<seconds> bash g24.sh
T0=$(date +%s); R=$PWD; LIMIT=${LIMIT_S:-500}
mkdir -p /tmp/ib/flashpd /tmp/site
for f in $R/flashpd/*; do ln -sfn $f /tmp/ib/flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p /tmp/ib/flashpd/$p; done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $R/.diag/cur/whl5/*.whl $R/.diag/cur/whl6/*.whl > /dev/null 2>&1; echo pip rc $?
export PYTHONPATH=/tmp/site:/tmp/ib TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri PYTHONUNBUFFERED=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
mkdir -p /tmp/t && cp -r $R/tests $R/pyproject.toml /tmp/t/ && cd /tmp/t
for f in test_kv_bridge_arena test_stage test_closed_channels test_shm_ledger test_router_retry test_worker_tls test_bridge_fairness test_fault_isolation test_scheduler_overlap; do
  L=$(( LIMIT - ($(date +%s) - T0) ))
  [ $L -lt 30 ] && { echo "== $f: no time left"; continue; }
  echo "== $f"; timeout $(( L - 10 )) python -m pytest -q -p no:cacheprovider -o addopts="" -W ignore tests/$f.py 2>&1 | grep -E "passed|failed|error|Error" | tail -3
done 2>&1 | sed 's#/root/out/##g; s#/tmp/ib/##g' | tee $OUT/gpu_tests.txt
