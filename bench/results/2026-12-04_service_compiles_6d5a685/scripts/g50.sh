#!/bin/bash
R=$PWD
mkdir -p ib/flashpd
for f in $R/flashpd/*; do ln -sfn $f flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p flashpd/$p; done
export PYTHONPATH=ib FLASHPD_GIT_REV=$(cat scripts/rev) TORCHINDUCTOR_CACHE_DIR=ind TRITON_CACHE_DIR=tri
mkdir -p $OUT/head
cd $OUT/head
timeout 540 python -m flashpd.bench.speed_8b --exact-target $R/flashpd/assets/demo_pair/target --exact-draft $R/flashpd/assets/demo_pair/drafter --sections exact,dflash,curve,scheduler,long,prefill --profile-batches 1,32,128 --stall-dump-s 150 --draft-vocabs 0,16384 --out speed_8b_h200.json > speed_8b_h200.log 2>&1; echo rc $? >> speed_8b_h200.log
grep "speed_8b\|rc " speed_8b_h200.log | tail -40
true
