#!/bin/bash
R=$PWD
mkdir -p ib/flashpd
for f in $R/flashpd/*; do ln -sfn $f flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p flashpd/$p; done
ln -sfn $R/tests ib/tests
export PYTHONPATH=ib FLASHPD_GIT_REV=$(cat scripts/rev) TORCHINDUCTOR_CACHE_DIR=ind TRITON_CACHE_DIR=tri
mkdir -p $OUT/ab2
(cd $OUT/ab2 && timeout 100 python -c "
import json, torch; from flashpd.engine import paged_attention as pa
r = pa.check_against_reference('cuda', torch.bfloat16); r32 = pa.check_against_reference('cuda', torch.float32)
print(json.dumps({'bf16': r, 'fp32': r32}))" > selfcheck.json 2> selfcheck.err; echo selfcheck rc $?; cat selfcheck.json)
(cd ib && timeout 200 python -m pytest -q -p no:cacheprovider tests/test_paged_attention.py tests/test_attention_impl.py > $OUT/ab2/pytest_gpu.log 2>&1; echo pytest rc $?; tail -4 $OUT/ab2/pytest_gpu.log)
cd $OUT/ab2
timeout 260 python $R/scripts/ab2.py ab2.json 256,1024 > ab2.log 2>&1; echo rc $? >> ab2.log
grep -v -i warn ab2.log | tail -10
true
