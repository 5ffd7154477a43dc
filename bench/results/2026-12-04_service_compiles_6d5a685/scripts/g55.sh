#!/bin/bash
R=$PWD
mkdir -p ib/flashpd site
for f in $R/flashpd/*; do ln -sfn $f flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p flashpd/$p; done
python3 -m pip install -q --no-index --no-deps --no-compile --target site $R/scripts/whl/*.whl > /dev/null 2>&1
export PYTHONPATH=site:ib FLASHPD_GIT_REV=$(cat scripts/rev) TORCHINDUCTOR_CACHE_DIR=ind TRITON_CACHE_DIR=tri
mkdir -p $OUT/s128 && cd $OUT/s128
timeout 118 python $R/scripts/sched128.py $R s128.json > s128.log 2>&1; echo rc $? >> s128.log
grep -v -i warn s128.log | tail -8 | cut -c1-1500
true
