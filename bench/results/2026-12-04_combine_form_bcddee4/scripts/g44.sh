#!/bin/bash
R=$PWD
mkdir -p ib/flashpd
for f in $R/flashpd/*; do ln -sfn $f flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p flashpd/$p; done
export PYTHONPATH=ib FLASHPD_GIT_REV=$(cat scripts/rev) TORCHINDUCTOR_CACHE_DIR=ind TRITON_CACHE_DIR=tri
mkdir -p $OUT/walk && cd $OUT/walk
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 420 python $R/scripts/walk.py walk.json 256,1024,4096 > walk.log 2>&1; echo rc $? >> walk.log
grep -v -i warn walk.log | tail -30
true
