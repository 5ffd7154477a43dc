#!/bin/bash
# Call 25 (39th session): the device path on a GPU after host_share (bench/handoff, CUDA IPC caches + host files),
# the handoff tests, then issue 23's full speed_8b run at HEAD. Usage: LIMIT_S=<seconds> bash g25.sh
T0=$(date +%s); R=$PWD; LIMIT=${LIMIT_S:-560}
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
mkdir -p /tmp/ib/flashpd /tmp/site
for f in $R/flashpd/*; do ln -sfn $f /tmp/ib/flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p /tmp/ib/flashpd/$p; done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $R/.diag/cur/whl5/*.whl $R/.diag/cur/whl6/*.whl > /dev/null 2>&1; echo pip rc $?
export PYTHONPATH=/tmp/site:/tmp/ib TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri FLASHPD_GIT_REV=$(cat $R/.diag/cur/rev) PYTHONUNBUFFERED=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv,noheader | tee $OUT/gpu.txt
cd /tmp/ib
timeout 90 python -m flashpd.bench.handoff --config qwen3-8b --tokens 2048 --reps 10 --out $OUT/handoff.json 2>&1 | tail -3 | tee $OUT/handoff.txt
mkdir -p /tmp/t && cp -r $R/tests $R/pyproject.toml /tmp/t/ && cd /tmp/t
timeout 100 python -m pytest -q -p no:cacheprovider -o addopts="" -W ignore tests/test_host_share.py tests/test_handoff.py tests/test_handoff_bench.py 2>&1 | tail -3 | sed 's#/root/out/##g' | tee $OUT/gpu_tests.txt
cd /tmp/ib
L=$(left); echo "left $L s for speed_8b"
timeout $(( L - 15 )) python -m flashpd.bench.speed_8b --exact-target $R/flashpd/assets/demo_pair/target \
  --exact-draft $R/flashpd/assets/demo_pair/drafter --sections exact,dflash,curve,scheduler,long,prefill \
  --profile-batches 1,32,128 --stall-dump-s 150 --draft-vocabs 0,16384 --draft-quantizations fp8 \
  --out $OUT/speed_8b.json > $OUT/speed_8b.log 2>&1
echo "full rc $? at $(( $(date +%s) - T0 )) s"; grep "done:" $OUT/speed_8b.log | tr ',' '\n' | grep -E "x_floor|fraction|dflash_over|bf16_exact|gpu_busy|kernels|step_ms"
sed -i 's#/root/out/##g; s#/tmp/ib/##g' $OUT/speed_8b.log
