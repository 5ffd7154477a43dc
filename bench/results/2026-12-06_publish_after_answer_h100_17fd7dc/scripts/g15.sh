#!/bin/bash
# Call 15 (35th session): publish_after.py (a prefill's answer with the publish before and after it, 8B shape).
T0=$(date +%s); R=$PWD
mkdir -p /tmp/ib/flashpd /tmp/site
for f in $R/flashpd/*; do ln -sfn $f /tmp/ib/flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p /tmp/ib/flashpd/$p; done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $R/.diag/cur/whl5/*.whl > /dev/null 2>&1; echo pip rc $?
export PYTHONPATH=/tmp/site:/tmp/ib TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri FLASHPD_GIT_REV=$(cat $R/.diag/cur/rev) PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
cd /tmp/ib
timeout 280 python $R/.diag/cur/publish_after.py $OUT/publish_after.json 3 2>&1 | grep -vE "Warning|preferred_blas"
echo "done at $(( $(date +%s) - T0 )) s"
