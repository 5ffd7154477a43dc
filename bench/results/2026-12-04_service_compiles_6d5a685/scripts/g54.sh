#!/bin/bash
R=$PWD
mkdir -p ib/flashpd site
for f in $R/flashpd/*; do ln -sfn $f flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p flashpd/$p; done
python3 -m pip install -q --no-index --no-deps --no-compile --target site $R/scripts/whl/*.whl > /dev/null 2>&1; echo pip rc $?
export PYTHONPATH=site:ib FLASHPD_GIT_REV=$(cat scripts/rev) TORCHINDUCTOR_CACHE_DIR=ind TRITON_CACHE_DIR=tri
mkdir -p $OUT/sweep $OUT/curve
cd $OUT/sweep
timeout 400 python -m flashpd.bench.job_sweep --modes colocated --methods native,dflash --concurrency 1,8,32,128 --prompt-pool 256 --requests 512 --max-tokens 64 --device cuda --dtype bfloat16 --kv-cache-tokens 262144 --out serve_sweep_same_prompts_h200.json > sweep.log 2>&1; echo rc $? >> sweep.log
grep -v -i warn sweep.log | tail -10
grep -i "triton compiled\|warm-up" *.serve-colocated.log | cut -c1-400
cd $OUT/curve
timeout 110 python -m flashpd.bench.speed_8b --sections curve --batches 1,128 --profile-batches 1,128 --out speed_8b_curve.json > curve.log 2>&1; echo rc $? >> curve.log
grep "speed_8b\|rc " curve.log | tail -8
true
