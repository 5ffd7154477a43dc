#!/bin/bash
# Timing-only bounds at batch 1: the step without qkv_rope, without the combine, without attention. Usage: bash g82.sh
R=$PWD
mkdir -p /tmp/ib/flashpd /tmp/w
for f in $R/flashpd/*; do ln -sfn $f /tmp/ib/flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p /tmp/ib/flashpd/$p; done
export PYTHONPATH=/tmp/ib TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri FLASHPD_GIT_REV=$(cat $R/.diag/cur/rev)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv,noheader
cd /tmp/ib
for v in base qkv combine attn base qkv; do
  t0=$(date +%s)
  timeout 150 python $R/.diag/cur/skipvar.py ${v//,/ } -- --sections curve --batches 1 --profile-batches 1 --stall-dump-s 100 \
    --out $OUT/skip_${v//,/_}_$t0.json > $OUT/skip_${v//,/_}_$t0.log 2>&1; echo "$v rc $? $(( $(date +%s) - t0 )) s"
  python - $OUT/skip_${v//,/_}_$t0.json <<'P'
import json, sys
d = json.load(open(sys.argv[1])); c = d["native_curve"][0]
print("  ms %.4f busy %.4f kernels %d copy %.0f x %.4f" % (c["ms_per_step"], c["gpu_busy_ms_per_step"], c["kernels_per_step"], d["copy_bandwidth"]["gb_per_s"], d["native_b1_x_floor"]))
P
done
