#!/bin/bash
# fp8 tiles of the few-row kernel at 16 rows (the draft pass), the drafter's shapes; bf16's engine tile beside.
R=$PWD
mkdir -p /tmp/ib/flashpd /tmp/w
for f in $R/flashpd/*; do ln -sfn $f /tmp/ib/flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p /tmp/ib/flashpd/$p; done
export PYTHONPATH=/tmp/ib TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri FLASHPD_GIT_REV=$(cat $R/.diag/cur/rev)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv,noheader
cd /tmp/w
S=qkv,o_proj,gate_up,down,fc,head16k
V=skinny,skinny:16-256-2-6,skinny:16-256-2-4,skinny:16-256-4-6,skinny:16-256-4-4,skinny:32-256-4-4,skinny:32-256-4-6,skinny:16-512-4-4,skinny:16-512-4-3,skinny:16-128-4-8,skinny:32-128-2-6,skinny:32-128-4-6
timeout 300 python -m flashpd.bench.gemm_shapes --weights fp8 --rows 16 --shapes $S --variants $V \
  --out $OUT/gemm_shapes_fp8.json > $OUT/gemm_fp8.log 2>&1; echo "fp8 rc $?"
grep -v Warning $OUT/gemm_fp8.log
timeout 120 python -m flashpd.bench.gemm_shapes --weights bf16 --rows 16 --shapes $S --variants skinny \
  --out $OUT/gemm_shapes_bf16.json > $OUT/gemm_bf16.log 2>&1; echo "bf16 rc $?"
grep -v Warning $OUT/gemm_bf16.log
