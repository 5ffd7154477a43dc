#!/bin/bash
# A/B in one call: byte-store hits (memory, shm, grpc) against cold at the Qwen3-8B shape, with this tree's restore path
# (immutable bytes aliased, pinned-staged H2D) and then with the previous one (.diag/cur/base/: HEAD's chunk.py and
# kv_transfer.py copied over this call's copy of the tree). Then the H2D and copy rates of one chunk.
T0=$(date +%s); R=$PWD
mkdir -p /tmp/ib/flashpd /tmp/site
for f in $R/flashpd/*; do ln -sfn $f /tmp/ib/flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p /tmp/ib/flashpd/$p; done
python3 -c "import blake3" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $R/.diag/cur/whl4/*.whl > /dev/null 2>&1
python3 -c "import grpc,sys; sys.exit(grpc.__version__ < '1.85.1')" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $R/.diag/cur/whl5/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:/tmp/ib TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri FLASHPD_GIT_REV=$(cat $R/.diag/cur/rev) PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv,noheader
cd /tmp/ib
M=cold,device,host,memory,shm,grpc
timeout 200 python -m flashpd.bench.ttft_hit --config qwen3-8b --prompts 3 --reps 3 --modes $M --out $OUT/ttft_hit_new.json > $OUT/ttft_hit_new.log 2>&1
echo "new rc $? at $(( $(date +%s) - T0 )) s"; grep -E "^prompt|geomean" $OUT/ttft_hit_new.log
cp $R/.diag/cur/base/chunk.py $R/kv_bridge/chunk.py; cp $R/.diag/cur/base/kv_transfer.py $R/engine/kv_transfer.py
FLASHPD_GIT_REV=$(cat $R/.diag/cur/base_rev) timeout 200 python -m flashpd.bench.ttft_hit --config qwen3-8b --prompts 3 --reps 3 --modes $M --out $OUT/ttft_hit_base.json > $OUT/ttft_hit_base.log 2>&1
echo "base rc $? at $(( $(date +%s) - T0 )) s"; grep -E "^prompt|geomean" $OUT/ttft_hit_base.log
timeout 60 python $R/.diag/cur/h2d.py 2>&1 | tee $OUT/h2d.log
