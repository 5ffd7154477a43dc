#!/bin/bash
R=$PWD
mkdir -p ib/flashpd
for f in $R/flashpd/*; do ln -sfn $f flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p flashpd/$p; done
export PYTHONPATH=ib FLASHPD_GIT_REV=$(cat scripts/rev) TORCHINDUCTOR_CACHE_DIR=ind TRITON_CACHE_DIR=tri
mkdir -p $OUT/ab
(cd $OUT/ab && timeout 100 python -c "
import json, torch; from flashpd.engine import paged_attention as pa
r = pa.check_against_reference('cuda', torch.bfloat16); r32 = pa.check_against_reference('cuda', torch.float32)
print(json.dumps({'bf16': r, 'fp32': r32}))" > selfcheck.json 2> selfcheck.err; echo selfcheck rc $?; cat selfcheck.json)
(timeout 150 python -m pytest -q -p no:cacheprovider tests/test_paged_attention.py > $OUT/ab/pytest_paged.log 2>&1; echo pytest rc $?; tail -5 $OUT/ab/pytest_paged.log)
cd $OUT/ab
timeout 300 python $R/scripts/ab.py ab.json 256,1024,4096 > ab.log 2>&1; echo rc $? >> ab.log
grep -v -i warn ab.log | tail -14
true
