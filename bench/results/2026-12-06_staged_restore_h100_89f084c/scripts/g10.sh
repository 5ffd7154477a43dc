#!/bin/bash
# Call 10 (35th session): the test errors of call 9, then restore_prof.py (a staged arena restore's parts).
T0=$(date +%s); R=$PWD
mkdir -p /tmp/ib/flashpd /tmp/site
for f in $R/flashpd/*; do ln -sfn $f /tmp/ib/flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p /tmp/ib/flashpd/$p; done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $R/.diag/cur/whl5/*.whl > /dev/null 2>&1; echo pip rc $?
export PYTHONPATH=/tmp/site:/tmp/ib TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri FLASHPD_GIT_REV=$(cat $R/.diag/cur/rev) PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/t && cp -r $R/tests /tmp/t/ && cp $R/pyproject.toml /tmp/t/ && cd /tmp/t
echo skip tests
cd /tmp/ib; echo "tests at $(( $(date +%s) - T0 )) s"
timeout 300 python $R/.diag/cur/stage_prof.py $OUT/stage_prof.json 2>&1 | grep -vE "Warning|preferred_blas"
echo "prof at $(( $(date +%s) - T0 )) s"
