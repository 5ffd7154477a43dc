#!/bin/bash
# One call (B s, default 540): the fold's GPU tests (plugin autoload off: the device's pytest-timeout breaks the
# carried pytest), quick on/off A/B, the full speed_8b run at the default (fold on), then a second quick off/on pair.
T0=$(date +%s); R=$PWD; B=${B:-540}
left() { echo $(( B - ($(date +%s) - T0) )); }
mkdir -p /tmp/ib/flashpd /tmp/site /tmp/w
for f in $R/flashpd/*; do ln -sfn $f /tmp/ib/flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p /tmp/ib/flashpd/$p; done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $R/.diag/cur/whl3/*.whl > /dev/null 2>&1; echo pip rc $?
export PYTHONPATH=/tmp/site:/tmp/ib TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri FLASHPD_GIT_REV=$(cat $R/.diag/cur/rev) PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv,noheader
mkdir -p /tmp/t && cp -r $R/tests /tmp/t/ && cp $R/pyproject.toml /tmp/t/ && cd /tmp/t
PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout 150 python -m pytest -q -p no:cacheprovider -o addopts="" tests/test_qkv_rope.py \
  tests/test_pdl.py tests/test_paged_attention.py > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc $? at $(( $(date +%s) - T0 )) s"
grep -E "passed|failed|FAILED|Error" $OUT/gpu_tests.log | tail -8
cd /tmp/ib
quick() {  # $1 on|off, $2 tag, $3 timeout
  timeout $3 python -m flashpd.bench.speed_8b --sections curve,dflash --batches 1,128 --profile-batches 1 --dflash-batches 1 \
    --stall-dump-s 80 --rope-in-attention $1 --out $OUT/ab_$2.json > $OUT/ab_$2.log 2>&1
  echo "quick $1 rc $? at $(( $(date +%s) - T0 )) s"
  grep "done:" $OUT/ab_$2.log | tr ',' '\n' | grep -E "native_b1_x_floor |native_b1_gpu_busy|kernels_per|native_step_ms_b1|dflash_step_ms_b1|dflash_over_native_step |b128_floor"
}
quick on on1 100
quick off off1 80
timeout $(( $(left) - 10 )) python -m flashpd.bench.speed_8b --exact-target $R/flashpd/assets/demo_pair/target \
  --exact-draft $R/flashpd/assets/demo_pair/drafter --sections exact,dflash,curve,scheduler,long,prefill \
  --profile-batches 1,32,128 --stall-dump-s 150 --draft-vocabs 0,16384 --draft-quantizations fp8 \
  --out $OUT/speed_8b_h200.json > $OUT/speed_8b_h200.log 2>&1
echo "full (default) rc $? at $(( $(date +%s) - T0 )) s"; grep "done:" $OUT/speed_8b_h200.log | tr ',' '\n' | grep -E "x_floor|fraction|dflash_over|bf16_exact|rope|gpu_busy|kernels|step_ms"
L=$(left); [ $L -gt 50 ] && quick off off2 $(( L - 5 )) || echo "no time for off2 ($L s left)"
L=$(left); [ $L -gt 50 ] && quick on on2 $(( L - 5 )) || echo "no time for on2 ($L s left)"
