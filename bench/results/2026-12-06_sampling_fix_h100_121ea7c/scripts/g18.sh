#!/bin/bash
# Call 18 (36th session): samp_gpu3.py at 3655875 (top-p kept sets, the cost of a compiled draw).
T0=$(date +%s); R=$PWD
mkdir -p /tmp/ib/flashpd /tmp/site
for f in $R/flashpd/*; do ln -sfn $f /tmp/ib/flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p /tmp/ib/flashpd/$p; done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $R/.diag/cur/whl5/*.whl $R/.diag/cur/whl6/*.whl > /dev/null 2>&1; echo pip rc $?
export PYTHONPATH=/tmp/site:/tmp/ib TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
cd /tmp/ib
timeout 200 python $R/.diag/cur/samp_gpu3.py $OUT/samp_gpu3.json 2>&1 | grep -vE "Warning|preferred_blas" | tail -30
echo "samp done at $(( $(date +%s) - T0 )) s"
echo "done at $(( $(date +%s) - T0 )) s"
