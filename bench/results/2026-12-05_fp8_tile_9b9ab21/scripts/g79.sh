#!/bin/bash
# A second batch-1 reading of the DFlash step with fp8 draft weights (whole head, 16,384 hot ids) at this revision,
# and the demo pair's tau in bf16 under a hot-id map (1,024 of 4,096 ids) with the drafter in bf16 and in fp8.
R=$PWD
mkdir -p /tmp/ib/flashpd /tmp/w
for f in $R/flashpd/*; do ln -sfn $f /tmp/ib/flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p /tmp/ib/flashpd/$p; done
export PYTHONPATH=/tmp/ib TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri FLASHPD_GIT_REV=$(cat $R/.diag/cur/rev)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv,noheader
MAP=$R/bench/results/2026-12-04_draft_vocab_3a7f046/maps/hot1024.json
cd /tmp/ib
timeout 200 python -m flashpd.bench.speed_8b --sections curve,dflash --batches 1 --profile-batches 1 --dflash-batches 1 \
  --draft-vocabs 0,16384 --draft-quantizations fp8 --stall-dump-s 120 --out $OUT/speed_fp8_b1.json > $OUT/speed_fp8_b1.log 2>&1
echo "speed rc $?"; grep "done:" $OUT/speed_fp8_b1.log | tr ',' '\n' | grep -E "native_b1_x_floor |dflash_over"
for q in none fp8; do
  extra=""; [ $q = fp8 ] && extra="--draft-quantization fp8"
  timeout 110 python -m flashpd.bench.demo_eval --device cuda --dtype bfloat16 --prompts 16 --max-tokens 256 \
    --token-map $MAP $extra --out $OUT/demo_eval_bf16_hot1024_$q.json > $OUT/demo_eval_bf16_hot1024_$q.log 2>&1
  echo "demo $q rc $?"; tail -n 1 $OUT/demo_eval_bf16_hot1024_$q.log
done
