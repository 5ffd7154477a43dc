#!/bin/bash
# fp8 draft weights: the few-row kernel's GPU tests, then speed_8b's batch-1 native and DFlash steps with the
# drafter in bf16 and fp8 (whole head and 16,384 hot ids); the demo pair's tau with the drafter in bf16 and fp8.
# Usage: bash g73.sh
R=$PWD
mkdir -p /tmp/ib/flashpd /tmp/site /tmp/w
for f in $R/flashpd/*; do ln -sfn $f /tmp/ib/flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p /tmp/ib/flashpd/$p; done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $R/.diag/cur/whl3/*.whl > /dev/null 2>&1; echo pip rc $?
export PYTHONPATH=/tmp/site:/tmp/ib TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri FLASHPD_GIT_REV=$(cat $R/.diag/cur/rev)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv,noheader
mkdir -p /tmp/t && cp -r $R/tests /tmp/t/ && cd /tmp/t
timeout 150 python -m pytest -q -p no:cacheprovider -o addopts="" tests/test_skinny_gemm.py > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc $?"; tail -3 $OUT/gpu_tests.log
cd /tmp/w
timeout 330 python -m flashpd.bench.speed_8b --sections curve,dflash --batches 1 --profile-batches 1 \
  --draft-vocabs 0,16384 --draft-quantizations fp8 --dflash-batches 1 --stall-dump-s 120 \
  --out $OUT/speed_fp8.json > $OUT/speed_fp8.log 2>&1; echo "speed rc $?"
grep -v Warning $OUT/speed_fp8.log | tail -12
python - $OUT/speed_fp8.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for k, v in d.items():
    if k.startswith("dflash_over") or k.startswith("native_b1") or k == "verify_shapes_cost":
        print(f"  {k}: {v:.4f}" if isinstance(v, float) else f"  {k}: {v}")
PY
for q in none fp8; do
  extra=""; [ $q = fp8 ] && extra="--draft-quantization fp8"
  timeout 110 python -m flashpd.bench.demo_eval --device cuda --dtype bfloat16 --prompts 16 --max-tokens 256 $extra \
    --out $OUT/demo_eval_bf16_$q.json > $OUT/demo_eval_bf16_$q.log 2>&1; echo "demo $q rc $?"
  grep -v Warning $OUT/demo_eval_bf16_$q.log | tail -2
done
