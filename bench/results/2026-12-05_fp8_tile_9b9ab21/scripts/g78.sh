#!/bin/bash
# The full speed_8b run (every section, exactness with compile on) with the fp8 draft rows, then the
# few-row kernel's GPU tests. Usage: bash g78.sh
R=$PWD
mkdir -p /tmp/ib/flashpd /tmp/site /tmp/w
for f in $R/flashpd/*; do ln -sfn $f /tmp/ib/flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p /tmp/ib/flashpd/$p; done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $R/.diag/cur/whl3/*.whl > /dev/null 2>&1; echo pip rc $?
export PYTHONPATH=/tmp/site:/tmp/ib TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri FLASHPD_GIT_REV=$(cat $R/.diag/cur/rev)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv,noheader
cd /tmp/ib
timeout 420 python -m flashpd.bench.speed_8b --exact-target flashpd/assets/demo_pair/target \
  --exact-draft flashpd/assets/demo_pair/drafter --sections exact,dflash,curve,scheduler,long,prefill \
  --profile-batches 1,32,128 --stall-dump-s 150 --draft-vocabs 0,16384 --draft-quantizations fp8 \
  --out $OUT/speed_8b_h200.json > $OUT/speed_8b_h200.log 2>&1; echo "speed rc $?"
grep -v Warning $OUT/speed_8b_h200.log | grep -v _warn_once | tail -14
mkdir -p /tmp/t && cp -r $R/tests /tmp/t/ && cd /tmp/t
timeout 110 python -m pytest -q -p no:cacheprovider -o addopts="" tests/test_skinny_gemm.py -k "fp8 or applies" > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc $?"; tail -3 $OUT/gpu_tests.log
