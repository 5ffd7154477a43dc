#!/bin/bash
# Call 1: H2D from a read-only memfd mapping (pageable vs registered); the pinned-arena GPU test; ttft_hit at the
# 8B shape, every byte mode (arena page-locked: the new default on a GPU); then cold,arena with --arena-pin off.
T0=$(date +%s); R=$PWD; B=${B:-560}
left() { echo $(( B - ($(date +%s) - T0) )); }
mkdir -p /tmp/ib/flashpd /tmp/site
for f in $R/flashpd/*; do ln -sfn $f /tmp/ib/flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p /tmp/ib/flashpd/$p; done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $R/.diag/cur/whl5/*.whl > /dev/null 2>&1; echo pip rc $?
export PYTHONPATH=/tmp/site:/tmp/ib TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri FLASHPD_GIT_REV=$(cat $R/.diag/cur/rev) PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv,noheader; uname -r; nproc
timeout 90 python $R/.diag/cur/h2d.py $OUT/h2d.json > $OUT/h2d.log 2>&1; echo "h2d rc $? at $(( $(date +%s) - T0 )) s"; tail -45 $OUT/h2d.log
mkdir -p /tmp/t && cp -r $R/tests /tmp/t/ && cp $R/pyproject.toml /tmp/t/ && cd /tmp/t
PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout 90 python -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kv_bridge_arena.py \
  > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc $? at $(( $(date +%s) - T0 )) s"; tail -4 $OUT/gpu_tests.log
cd /tmp/ib; timeout 60 python $R/.diag/cur/pin_check.py 2>&1 | tail -3
timeout $(( $(left) - 150 )) python -m flashpd.bench.ttft_hit --config qwen3-8b --prompts 3 --reps 3 \
  --modes cold,device,host,memory,shm,grpc,arena --out $OUT/ttft_hit.json > $OUT/ttft_hit.log 2>&1
echo "ttft rc $? at $(( $(date +%s) - T0 )) s"; tail -12 $OUT/ttft_hit.log
timeout $(( $(left) - 5 )) python -m flashpd.bench.ttft_hit --config qwen3-8b --prompts 3 --reps 3 \
  --modes cold,memory,arena --arena-pin off --out $OUT/ttft_nopin.json > $OUT/ttft_nopin.log 2>&1
echo "ttft nopin rc $? at $(( $(date +%s) - T0 )) s"; tail -8 $OUT/ttft_nopin.log
