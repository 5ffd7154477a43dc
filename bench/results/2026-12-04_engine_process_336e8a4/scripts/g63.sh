#!/bin/bash
# The engine alone under the closed loop: hold 0 against 0.25 at c = 32 and 128, two alternating rounds.
R=$PWD
mkdir -p ib/flashpd site
for f in $R/flashpd/*; do ln -sfn $f flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p flashpd/$p; done
python3 -m pip install -q --no-index --no-deps --no-compile --target site $R/scripts/whl/*.whl > /dev/null 2>&1; echo pip rc $?
export PYTHONPATH=site:ib FLASHPD_GIT_REV=$(cat scripts/rev) TORCHINDUCTOR_CACHE_DIR=ind TRITON_CACHE_DIR=tri
mkdir -p $OUT/cl && cd $OUT/cl
timeout 280 python -m flashpd.bench.closed_loop --concurrency 32,128 --hold-fractions 0.5,1.0 --rounds 1 --methods dflash --device cuda \
    --dtype bfloat16 --out closed_loop_h200_a.json > cl.log 2>&1; echo rc $? >> cl.log
grep "round\|warm-up\|rc " cl.log | sed 's/.*closed_loop: //' | tail -20
true
timeout 200 python -m flashpd.bench.closed_loop --concurrency 32,128 --hold-fractions 0.5,1.0 --hold-steps 8 --rounds 1 --methods dflash --device cuda \
    --dtype bfloat16 --out closed_loop_h200_b.json > cl_b.log 2>&1; echo rc $? >> cl_b.log
grep "round\|warm-up\|rc " cl_b.log | sed 's/.*closed_loop: //' | tail -20
