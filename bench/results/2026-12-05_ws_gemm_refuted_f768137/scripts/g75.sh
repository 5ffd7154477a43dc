#!/bin/bash
# engine/ws_gemm.py (the warp-specialized few-row projection, off by default): its GPU tests, then speed_8b at batch 1
# (native step, DFlash step) without and with --ws-gemm, and bf16 exactness with it. Usage: bash g75.sh
R=$PWD
mkdir -p /tmp/ib/flashpd /tmp/site /tmp/w
for f in $R/flashpd/*; do ln -sfn $f /tmp/ib/flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p /tmp/ib/flashpd/$p; done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $R/.diag/cur/whl3/*.whl > /dev/null 2>&1; echo pip rc $?
export PYTHONPATH=/tmp/site:/tmp/ib TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri FLASHPD_GIT_REV=$(cat $R/.diag/cur/rev)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv,noheader
mkdir -p /tmp/t && cp -r $R/tests /tmp/t/ && cd /tmp/t
timeout 90 python -m pytest -q -p no:cacheprovider -o addopts="" tests/test_ws_gemm.py > $OUT/gpu_tests.log 2>&1; rc=$?; echo "gpu tests rc $rc"; tail -8 $OUT/gpu_tests.log
[ $rc = 124 ] && { echo "the GPU tests hung: no step run"; exit 0; }
cd /tmp/w
for run in base ws; do
  flag=""; secs="curve,dflash"; lim=170; [ $run = ws ] && { flag="--ws-gemm"; secs="curve,dflash,exact"; lim=280; }
  timeout $lim python -m flashpd.bench.speed_8b --sections $secs --batches 1 --profile-batches 1 --dflash-batches 1 \
    --exact-prompts 4 --stall-dump-s 100 $flag --out $OUT/speed_$run.json > $OUT/speed_$run.log 2>&1; echo "speed $run rc $?"
  python - $OUT/speed_$run.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for k in ("ws_gemm", "native_step_ms_b1", "native_b1_x_floor", "native_b1_kernels_per_step", "dflash_step_ms_b1",
          "dflash_over_native_step", "bf16_exact"):
    print(f"  {k}: {d.get(k)}")
PY
done
