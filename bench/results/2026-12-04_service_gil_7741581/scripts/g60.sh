#!/bin/bash
R=$PWD
mkdir -p ib/flashpd site
for f in $R/flashpd/*; do ln -sfn $f flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p flashpd/$p; done
python3 -m pip install -q --no-index --no-deps --no-compile --target site $R/scripts/whl/*.whl > /dev/null 2>&1; echo pip rc $?
export PYTHONPATH=site:ib FLASHPD_GIT_REV=$(cat scripts/rev) TORCHINDUCTOR_CACHE_DIR=ind TRITON_CACHE_DIR=tri
mkdir -p $OUT/sweep && cd $OUT/sweep
python3 $R/scripts/cpumon.py 420 > cpu.log 2>&1 &
MON=$!
timeout 400 python -m flashpd.bench.job_sweep --modes colocated --methods native,dflash --concurrency 1,8,32,128 --prompt-pool 256 --requests 512 --max-tokens 64 --device cuda --dtype bfloat16 --kv-cache-tokens 262144 --gil-switch-interval-s 0.0005 --out serve_sweep_same_prompts_h200.json > sweep.log 2>&1; echo rc $? >> sweep.log
kill $MON
grep -v -i warn sweep.log | tail -10 | cut -c1-300
grep -i "warm-up\|engine:\|compiled\|captured" *.serve-colocated.log | cut -c1-300 | tail -12
true
