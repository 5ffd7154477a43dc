#!/bin/bash
# The persistent chain with the next projection's first weight columns preloaded into registers before each
# barrier (bench/chain_bound.py --preload-cols), and its GPU test. Usage: bash g71.sh
R=$PWD
mkdir -p ib/flashpd site
for f in $R/flashpd/*; do ln -sfn $f ib/flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p ib/flashpd/$p; done
python3 -m pip install -q --no-index --no-deps --no-compile --target site $R/scripts/whl3/*.whl > /dev/null 2>&1; echo pip rc $?
export PYTHONPATH=site:ib TORCHINDUCTOR_CACHE_DIR=ind TRITON_CACHE_DIR=tri FLASHPD_GIT_REV=$(cat $R/scripts/rev)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv,noheader
mkdir -p t && cp -r $R/tests t/ && cd t
timeout 200 python -m pytest -q -p no:cacheprovider -o addopts="" tests/test_chain_bound.py > $OUT/gpu_test.log 2>&1; echo "gpu test rc $?"; tail -3 $OUT/gpu_test.log
cd /tmp
for r in 1 2; do
timeout 240 python -m flashpd.bench.chain_bound --programs-per-sm 2,3 --prefetch-lines 8 --preload-cols 256,512,1024 \
  --out $OUT/chain_preload_r$r.json > $OUT/chain_preload_r$r.log 2>&1; echo "chain r$r rc $?"
cat $OUT/chain_preload_r$r.log | grep -v Warning | tail -20
done
