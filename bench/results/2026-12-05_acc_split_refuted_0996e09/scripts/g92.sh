#!/bin/bash
# One call (B s, default 560): the few-row kernel's split accumulators (skinny_gemm.ACC_SPLIT). The GPU tests of
# test_skinny_gemm (acc-split case included), gemm_shapes per shape at 1 and 16 rows for splits 1/2/4, then quick
# batch-1 steps (curve + DFlash at batch 1) at split 1, 2, 4, 1 (the base twice: drift).
T0=$(date +%s); R=$PWD; B=${B:-560}
left() { echo $(( B - ($(date +%s) - T0) )); }
mkdir -p /tmp/ib/flashpd /tmp/site
for f in $R/flashpd/*; do ln -sfn $f /tmp/ib/flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p /tmp/ib/flashpd/$p; done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $R/.diag/cur/whl3/*.whl > /dev/null 2>&1; echo pip rc $?
export PYTHONPATH=/tmp/site:/tmp/ib TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri FLASHPD_GIT_REV=$(cat $R/.diag/cur/rev) PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv,noheader
mkdir -p /tmp/t && cp -r $R/tests /tmp/t/ && cp $R/pyproject.toml /tmp/t/ && cd /tmp/t
PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout 100 python -m pytest -q -p no:cacheprovider -o addopts="" tests/test_skinny_gemm.py \
  > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc $? at $(( $(date +%s) - T0 )) s"
grep -E "passed|failed|FAILED|Error" $OUT/gpu_tests.log | tail -8
cd /tmp/ib
timeout 90 python -m flashpd.bench.gemm_shapes --rows 1,16 --shapes qkv,o_proj,gate_up,down,lm_head \
  --variants skinny,skinny:16-128-2-6-2,skinny:16-128-2-6-4,skinny:32-128-2-6-2 --out $OUT/gemm_split.json \
  > $OUT/gemm_split.log 2>&1; echo "gemm_shapes rc $? at $(( $(date +%s) - T0 )) s"
grep -E "skinny" $OUT/gemm_split.log | head -60
quick() {  # $1 split, $2 tag, $3 timeout
  timeout $3 python -m flashpd.bench.speed_8b --sections curve,dflash --batches 1 --profile-batches 1 --dflash-batches 1 \
    --stall-dump-s 80 --acc-split $1 --out $OUT/ab_$2.json > $OUT/ab_$2.log 2>&1
  echo "quick split $1 rc $? at $(( $(date +%s) - T0 )) s"
  grep "done:" $OUT/ab_$2.log | tr ',' '\n' | grep -E "native_b1_x_floor |native_b1_gpu_busy|kernels_per|native_step_ms_b1|dflash_step_ms_b1|dflash_over_native_step "
}
for t in "2 s2a" "1 s1a" "4 s4a" "2 s2b" "1 s1b"; do
  set -- $t; L=$(left); [ $L -gt 75 ] && quick $1 $2 $(( L > 110 ? 105 : L - 5 )) || echo "no time for $2 ($L s left)"
done
