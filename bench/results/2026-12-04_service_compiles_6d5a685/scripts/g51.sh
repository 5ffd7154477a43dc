#!/bin/bash
R=$PWD
mkdir -p ib/flashpd
for f in $R/flashpd/*; do ln -sfn $f flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p flashpd/$p; done
export PYTHONPATH=ib FLASHPD_GIT_REV=$(cat scripts/rev) TORCHINDUCTOR_CACHE_DIR=ind TRITON_CACHE_DIR=tri
mkdir -p $OUT/ab4 && cd $OUT/ab4
timeout 420 python $R/scripts/ab4.py ab4.json 256 > ab4.log 2>&1; echo rc $? >> ab4.log
grep -v -i warn ab4.log | tail -22
true
