#!/bin/bash
# One call (B s): fp8 activations (skinny_gemm.FP8_ACTIVATIONS, WQ 3). GPU tests of test_skinny_gemm; gemm_shapes fp8
# at 16 rows, A8 tiles against the weights-only form; quick batch-1 DFlash steps with fp8 drafts, A8 on / off / on;
# the demo pair's tau with fp8 drafts and A8 on.
T0=$(date +%s); R=$PWD; B=${B:-585}
left() { echo $(( B - ($(date +%s) - T0) )); }
mkdir -p /tmp/ib/flashpd /tmp/site
for f in $R/flashpd/*; do ln -sfn $f /tmp/ib/flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p /tmp/ib/flashpd/$p; done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $R/.diag/cur/whl3/*.whl > /dev/null 2>&1; echo pip rc $?
export PYTHONPATH=/tmp/site:/tmp/ib TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri FLASHPD_GIT_REV=$(cat $R/.diag/cur/rev) PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv,noheader
mkdir -p /tmp/t && cp -r $R/tests /tmp/t/ && cp $R/pyproject.toml /tmp/t/ && cd /tmp/t
PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout 95 python -m pytest -q -p no:cacheprovider -o addopts="" tests/test_skinny_gemm.py \
  > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc $? at $(( $(date +%s) - T0 )) s"
grep -E "passed|failed|FAILED|Error" $OUT/gpu_tests.log | tail -12
cd /tmp/ib
timeout 70 python -m flashpd.bench.gemm_shapes --weights fp8 --rows 16 --shapes qkv,o_proj,gate_up,down,fc,head16k,lm_head \
  --variants skinny,skinny:64-128-4-6,skinny:128-256-8-3 --out $OUT/gemm_a8.json \
  > $OUT/gemm_a8.log 2>&1; echo "gemm a8 rc $? at $(( $(date +%s) - T0 )) s"
grep -E "skinny" $OUT/gemm_a8.log | head -40
timeout 35 python -m flashpd.bench.gemm_shapes --weights fp8 --fp8-activations off --rows 16 \
  --shapes qkv,o_proj,gate_up,down,fc,head16k,lm_head --variants skinny --out $OUT/gemm_w8.json \
  > $OUT/gemm_w8.log 2>&1; echo "gemm w8 rc $? at $(( $(date +%s) - T0 )) s"
grep -E "skinny" $OUT/gemm_w8.log | head -20
quick() {  # $1 on/off, $2 tag, $3 timeout
  timeout $3 python -m flashpd.bench.speed_8b --sections curve,dflash --batches 1 --profile-batches 1 --dflash-batches 1 \
    --draft-quantizations fp8 --stall-dump-s 100 --fp8-activations $1 --out $OUT/ab_$2.json > $OUT/ab_$2.log 2>&1
  echo "quick a8 $1 rc $? at $(( $(date +%s) - T0 )) s"
  grep "done:" $OUT/ab_$2.log | tr ',' '\n' | grep -E "native_b1_x_floor |native_step_ms_b1|dflash_step_ms_b1|dflash_over_native_step"
}
for t in "on a8a" "off w8a"; do
  set -- $t; L=$(left); [ $L -gt 100 ] && quick $1 $2 $(( L > 150 ? 145 : L - 5 )) || echo "no time for $2 ($L s left)"
done
L=$(left); if [ $L -gt 70 ]; then
  timeout $(( L - 5 )) python -m flashpd.bench.demo_eval --dtype bfloat16 --draft-quantization fp8 --fp8-activations on \
    --out $OUT/demo_fp8_on.json > $OUT/demo_fp8_on.log 2>&1; echo "demo on rc $? at $(( $(date +%s) - T0 )) s"
  tail -1 $OUT/demo_fp8_on.log
fi
L=$(left); [ $L -gt 100 ] && quick on a8b $(( L - 5 ))
echo end at $(( $(date +%s) - T0 )) s
