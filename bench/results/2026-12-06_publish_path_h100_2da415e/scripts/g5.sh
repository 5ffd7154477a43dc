#!/bin/bash
# Call 5 (34th session): publish parts (pinned D2H, numpy join, segment pool), ttft_hit with the pool on and off.
T0=$(date +%s); R=$PWD; B=${B:-560}
mkdir -p /tmp/ib/flashpd /tmp/site
for f in $R/flashpd/*; do ln -sfn $f /tmp/ib/flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p /tmp/ib/flashpd/$p; done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $R/.diag/cur/whl5/*.whl > /dev/null 2>&1; echo pip rc $?
export PYTHONPATH=/tmp/site:/tmp/ib TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri FLASHPD_GIT_REV=$(cat $R/.diag/cur/rev) PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader; nproc; uname -r; cat /sys/kernel/mm/transparent_hugepage/defrag
mkdir -p /tmp/t && cp -r $R/tests /tmp/t/ && cp $R/pyproject.toml /tmp/t/ && cd /tmp/t
PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout 90 python -m pytest -q -p no:cacheprovider -o addopts="" tests/test_host_store.py tests/test_shm_pool.py -k "cuda or pool or client" 2>&1 | tail -3
cd /tmp/ib; echo "tests at $(( $(date +%s) - T0 )) s"
timeout 120 python $R/.diag/cur/publish_prof.py $OUT/publish_prof.json > $OUT/publish_prof.log 2>&1; echo "prof rc $? at $(( $(date +%s) - T0 )) s"
timeout $(( (B - ($(date +%s) - T0)) / 2 )) python -m flashpd.bench.ttft_hit --config qwen3-8b --prompts 3 --reps 3 \
  --modes cold,memory,shm,arena --out $OUT/ttft_pool.json > $OUT/ttft_pool.log 2>&1
echo "ttft pool rc $? at $(( $(date +%s) - T0 )) s"; tail -8 $OUT/ttft_pool.log
timeout $(( B - ($(date +%s) - T0) )) python -m flashpd.bench.ttft_hit --config qwen3-8b --prompts 3 --reps 3 \
  --modes cold,shm,arena --shm-pool-mib 0 --out $OUT/ttft_nopool.json > $OUT/ttft_nopool.log 2>&1
echo "ttft nopool rc $? at $(( $(date +%s) - T0 )) s"; tail -7 $OUT/ttft_nopool.log
