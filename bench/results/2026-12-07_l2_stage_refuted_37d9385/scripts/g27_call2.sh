#!/bin/bash
# Call 27 (42nd session): l2_stage A/B at batch 1 (curve + DFlash at batch 1), H200 only. Usage: LIMIT_S=<s> bash g27.sh
T0=$(date +%s); R=$PWD; LIMIT=${LIMIT_S:-560}
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
mkdir -p /tmp/ib/flashpd /tmp/site
for f in $R/flashpd/*; do ln -sfn $f /tmp/ib/flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p /tmp/ib/flashpd/$p; done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $R/.diag/cur/whl5/*.whl > /dev/null 2>&1; echo pip rc $?
export PYTHONPATH=/tmp/site:/tmp/ib TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri FLASHPD_GIT_REV=$(cat $R/.diag/cur/rev) PYTHONUNBUFFERED=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv,noheader | tee $OUT/gpu.txt
[ -n "$ANY" ] || grep -q H200 $OUT/gpu.txt || { echo 'not an H200: nothing run'; exit 0; }
cd /tmp/ib
quick() {  # $1 tag, $2 stage spec, $3 evict-last on/off
  L=$(left); [ $L -gt 70 ] || { echo "no time for $1 ($L s)"; return; }
  timeout $(( L > 120 ? 115 : L - 5 )) python -m flashpd.bench.speed_8b --sections curve,dflash --batches 1 --profile-batches 1 \
    --dflash-batches 1 --stall-dump-s 80 --l2-stage "$2" --l2-stage-evict-last $3 --out $OUT/ab_$1.json > $OUT/ab_$1.log 2>&1
  echo "$1 [$2 last=$3] rc $? at $(( $(date +%s) - T0 )) s: $(grep 'done:' $OUT/ab_$1.log | tr ',' '\n' | grep -E 'native_b1_x_floor |gpu_busy|kernels_per|native_step_ms_b1|dflash_step_ms_b1|dflash_over_native_step ' | tr '\n' ' ')"
  grep -E "Error|error:" $OUT/ab_$1.log | head -3
  sed -i 's#/tmp/ib/##g' $OUT/ab_$1.log
}
quick off_c "" off
quick gu16 "gate_up:16" off
quick o1536L "o_proj:1536" on
quick off_d "" off
