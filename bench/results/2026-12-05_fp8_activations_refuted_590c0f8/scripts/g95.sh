#!/bin/bash
# One call (B s): e4m3 activations on wide fp8 weights only (TILE_FP8_A8). GPU tests (fp8 / grid / invariance cases of
# test_skinny_gemm, the launch tests); gemm_shapes fp8 16 rows A8 vs off on the wide shapes; quick batch-1 DFlash steps
# with fp8 drafts (whole head and 16,384 hot ids), A8 on / off / on / off.
T0=$(date +%s); R=$PWD; B=${B:-585}
left() { echo $(( B - ($(date +%s) - T0) )); }
mkdir -p /tmp/ib/flashpd /tmp/site
for f in $R/flashpd/*; do ln -sfn $f /tmp/ib/flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p /tmp/ib/flashpd/$p; done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $R/.diag/cur/whl3/*.whl > /dev/null 2>&1; echo pip rc $?
export PYTHONPATH=/tmp/site:/tmp/ib TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri FLASHPD_GIT_REV=$(cat $R/.diag/cur/rev) PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv,noheader
mkdir -p /tmp/t && cp -r $R/tests /tmp/t/ && cp $R/pyproject.toml /tmp/t/ && cd /tmp/t
PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout 150 python -m pytest -q -p no:cacheprovider -o addopts="" tests/test_skinny_gemm.py \
  -k "fp8 or grid or invariance or dispatch" > /tmp/gpu_tests.log 2>&1; echo "gpu tests rc $? at $(( $(date +%s) - T0 )) s"
grep -E "passed|failed|FAILED|Error|^E " /tmp/gpu_tests.log | head -30
cd /tmp/ib
timeout 45 python -m flashpd.bench.gemm_shapes --weights fp8 --rows 16 --shapes gate_up,head16k,lm_head \
  --variants skinny,skinny:64-256-4-4,skinny:128-128-8-4 --out /tmp/gemm_a8.json > /tmp/gemm_a8.log 2>&1; echo "gemm a8 rc $?"
grep -E "skinny" /tmp/gemm_a8.log
timeout 30 python -m flashpd.bench.gemm_shapes --weights fp8 --fp8-activations off --rows 16 --shapes gate_up,head16k,lm_head \
  --variants skinny --out /tmp/gemm_w8.json > /tmp/gemm_w8.log 2>&1; echo "gemm w8 rc $? at $(( $(date +%s) - T0 )) s"
grep -E "skinny" /tmp/gemm_w8.log
quick() {  # $1 on/off, $2 tag, $3 timeout
  timeout $3 python -m flashpd.bench.speed_8b --sections curve,dflash --batches 1 --profile-batches 1 --dflash-batches 1 \
    --draft-quantizations fp8 --draft-vocabs 0,16384 --stall-dump-s 100 --fp8-activations $1 --out $OUT/ab_$2.json > $OUT/ab_$2.log 2>&1
  echo "quick a8 $1 rc $? at $(( $(date +%s) - T0 )) s"
  grep "done:" $OUT/ab_$2.log | tr ',' '\n' | grep -E "native_b1_x_floor |native_step_ms_b1|dflash_step_ms_b1|dflash_over_native_step"
}
for t in "on a8a" "off w8a" "on a8b" "off w8b"; do
  set -- $t; L=$(left); [ $L -gt 80 ] && quick $1 $2 $(( L > 120 ? 115 : L - 5 )) || echo "no time for $2 ($L s left)"
done
echo end at $(( $(date +%s) - T0 )) s
