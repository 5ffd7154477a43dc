#!/bin/bash
# fp8 tiles at 16 rows, second sweep: fewer warps a column (each warp of a program reads x's whole tile from shared
# memory, so 4 warps over 32 columns read it 4 times a K step), at the drafter's shapes.
R=$PWD
mkdir -p /tmp/ib/flashpd /tmp/w
for f in $R/flashpd/*; do ln -sfn $f /tmp/ib/flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p /tmp/ib/flashpd/$p; done
export PYTHONPATH=/tmp/ib TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri FLASHPD_GIT_REV=$(cat $R/.diag/cur/rev)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv,noheader
cd /tmp/w
S=qkv,o_proj,gate_up,down,fc,head16k
V=skinny,skinny:32-256-2-4,skinny:32-256-2-6,skinny:64-256-2-4,skinny:64-256-4-4,skinny:64-256-4-3,skinny:16-256-1-6,skinny:32-256-1-4,skinny:64-128-2-6,skinny:64-128-4-6,skinny:32-512-2-3,skinny:128-128-4-4
timeout 300 python -m flashpd.bench.gemm_shapes --weights fp8 --rows 16 --shapes $S --variants $V \
  --out $OUT/gemm_shapes_fp8_warps.json > $OUT/gemm_fp8_warps.log 2>&1; echo "fp8 rc $?"
grep -v Warning $OUT/gemm_fp8_warps.log
