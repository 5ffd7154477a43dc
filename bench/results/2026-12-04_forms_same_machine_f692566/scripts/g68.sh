#!/bin/bash
# Which kernel each batch-128 projection takes, eager and in the compiled attn_mlp (probe128.py).
R=$PWD
mkdir -p ib/flashpd; for f in $R/flashpd/*; do ln -sfn $f flashpd/; done; for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p flashpd/$p; done
export TRITON_CACHE_DIR=tri
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv
cd /tmp && PYTHONPATH=ib timeout 300 python $R/scripts/probe128.py 2>&1 | grep -v Warning | tail -60
echo rc $?
