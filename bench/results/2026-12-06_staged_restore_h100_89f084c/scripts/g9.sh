#!/bin/bash
# Call 9 (35th session): GPU tests of the staged restore (tests/test_stage.py) and of the 34th session's untested CUDA
# forms, then ttft_hit with staging on and off, alternating on one machine (cold, arena, shm). Only JSON files come
# back (at most 8); the logs' summary lines go to stdout.
T0=$(date +%s); R=$PWD; B=${B:-540}
mkdir -p /tmp/ib/flashpd /tmp/site
for f in $R/flashpd/*; do ln -sfn $f /tmp/ib/flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p /tmp/ib/flashpd/$p; done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $R/.diag/cur/whl5/*.whl > /dev/null 2>&1; echo pip rc $?
export PYTHONPATH=/tmp/site:/tmp/ib TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri FLASHPD_GIT_REV=$(cat $R/.diag/cur/rev) PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader; nproc
mkdir -p /tmp/t && cp -r $R/tests /tmp/t/ && cp $R/pyproject.toml /tmp/t/ && cd /tmp/t
PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout 150 python -m pytest -q -p no:cacheprovider -o addopts="" -rs tests/test_stage.py tests/test_host_store.py tests/test_kv_bridge_arena.py tests/test_shm_pool.py 2>&1 | tail -12
cd /tmp/ib; echo "tests at $(( $(date +%s) - T0 )) s"
for i in 1 2; do for tag in stage nostage; do
  [ $tag = stage ] && MIB=1024 || MIB=0
  left=$(( B - ($(date +%s) - T0) )); [ $left -lt 60 ] && { echo "skip $tag$i: $left s left"; continue; }
  timeout $left python -m flashpd.bench.ttft_hit --config qwen3-8b --prompts 3 --reps 3 \
    --modes cold,arena,shm --stage-mib $MIB --out $OUT/ttft_${tag}$i.json 2>&1 | grep -E "^prompt|geomean|Error|error"
  echo "ttft $tag$i at $(( $(date +%s) - T0 )) s"
done; done
