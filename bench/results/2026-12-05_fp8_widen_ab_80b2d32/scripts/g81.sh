#!/bin/bash
# fp8 widening A/B at the fp8 tile: the DFlash step with fp8 draft weights, widened by bits (the engine) and by
# triton's conversion, alternating on one machine (bits, triton, bits).
R=$PWD
mkdir -p /tmp/ib/flashpd /tmp/w
for f in $R/flashpd/*; do ln -sfn $f /tmp/ib/flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p /tmp/ib/flashpd/$p; done
export PYTHONPATH=/tmp/ib TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri FLASHPD_GIT_REV=$(cat $R/.diag/cur/rev)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv,noheader
cd /tmp/w
i=0
for w in bits triton bits; do
  i=$((i+1))
  timeout 120 python -m flashpd.bench.speed_8b --sections curve,dflash --batches 1 --dflash-batches 1 \
    --draft-vocabs 0,16384 --draft-quantizations fp8 --fp8-widen $w --stall-dump-s 100 \
    --out $OUT/widen_${i}_$w.json > $OUT/widen_${i}_$w.log 2>&1
  echo "run $i $w rc $?"; grep "done:" $OUT/widen_${i}_$w.log | tr ',' '\n' | grep -E "native_step_ms_b1|fp8"
done
