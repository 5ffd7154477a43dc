#!/bin/bash
# Calls 10-12 (35th session): the profiles, one a call (the test step of call 10 only showed call 9's two setup
# errors: tests/dflash_fixtures.py needs the `dflash` reference package, which the device does not have).
#   call 11: restore_prof.py (a PrefixCache restore's fetch and apply, staging on and off, and the arena read's parts)
#   call 12: stage_prof.py (an arena Get of 10 chunks read plain, staged, into buffers allocated once, and copied
#            after the whole read; the MAC on all cores, 8 and 4 threads)
T0=$(date +%s); R=$PWD; PROF=${PROF:-stage_prof}
mkdir -p /tmp/ib/flashpd /tmp/site
for f in $R/flashpd/*; do ln -sfn $f /tmp/ib/flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p /tmp/ib/flashpd/$p; done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $R/.diag/cur/whl5/*.whl > /dev/null 2>&1; echo pip rc $?
export PYTHONPATH=/tmp/site:/tmp/ib TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri FLASHPD_GIT_REV=$(cat $R/.diag/cur/rev) PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
cd /tmp/ib
timeout 300 python $R/.diag/cur/$PROF.py $OUT/$PROF.json 2>&1 | grep -vE "Warning|preferred_blas"
echo "prof at $(( $(date +%s) - T0 )) s"
