#!/bin/bash
# Batch 32-256 projections at the 8B shape: cuBLASLt/cuBLAS against a Triton GEMM sweep (gemm_mid.py).
R=$PWD
export TRITON_CACHE_DIR=tri
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv
timeout 540 python $R/scripts/gemm_mid.py $OUT/gemm_mid.json 2>&1 | tail -40
echo rc $?
