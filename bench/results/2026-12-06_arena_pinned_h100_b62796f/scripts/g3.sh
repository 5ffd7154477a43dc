#!/bin/bash
# Call 3: ttft_hit with every mode at the session's final code (hits and publishes).
T0=$(date +%s); R=$PWD; B=${B:-330}
mkdir -p /tmp/ib/flashpd /tmp/site
for f in $R/flashpd/*; do ln -sfn $f /tmp/ib/flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p /tmp/ib/flashpd/$p; done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $R/.diag/cur/whl5/*.whl > /dev/null 2>&1; echo pip rc $?
export PYTHONPATH=/tmp/site:/tmp/ib TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri FLASHPD_GIT_REV=$(cat $R/.diag/cur/rev) PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
cd /tmp/ib
timeout $(( B - ($(date +%s) - T0) )) python -m flashpd.bench.ttft_hit --config qwen3-8b --prompts 3 --reps 3 \
  --modes cold,device,host,memory,shm,grpc,arena --out $OUT/ttft_hit.json > $OUT/ttft_hit.log 2>&1
echo "ttft rc $? at $(( $(date +%s) - T0 )) s"; tail -12 $OUT/ttft_hit.log
