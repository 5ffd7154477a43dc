#!/bin/bash
# The fused forms' row tiles past 16 rows: GPU kernel tests, then speed_8b's curve (32/64/128) and scheduler (32/128)
# with FUSED_MAX_ROWS 16 (before) and 128 (after), alternating, two runs each. Usage: bash g69.sh
R=$PWD
mkdir -p ib/flashpd site
for f in $R/flashpd/*; do ln -sfn $f flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p flashpd/$p; done
python3 -m pip install -q --no-index --no-deps --no-compile --target site $R/scripts/whl3/*.whl > /dev/null 2>&1; echo pip rc $?
export PYTHONPATH=site:ib TORCHINDUCTOR_CACHE_DIR=ind TRITON_CACHE_DIR=tri FLASHPD_GIT_REV=$(cat $R/scripts/rev)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv,noheader
cd $R
timeout 120 python -m pytest -q -p no:cacheprovider -o addopts="" tests/test_skinny_gemm.py > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc $?"
tail -3 $OUT/gpu_tests.log
for r in 1 2; do
  for F in 16 128; do
    timeout ${RUN_T:-120} python $R/scripts/ab_mid.py $F --sections curve,scheduler --batches 32,64,128 \
      --profile-batches 128 --scheduler-batches 32,128 --out $OUT/ab_F${F}_r$r.json > $OUT/ab_F${F}_r$r.log 2>&1
    echo "F=$F r=$r rc $?"
    python - $OUT/ab_F${F}_r$r.json <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print("  no json:", e); sys.exit()
for c in d.get("native_curve", []):
    print(f"  curve b{c['batch']}: {c['ms_per_step']:.3f} ms, floor fraction {c.get('floor_fraction', 0):.3f}",
          f"kernels {c.get('kernels_per_step')}" if c.get('kernels_per_step') else "")
for c in d.get("scheduler", []):
    print(f"  scheduler b{c['batch']}: {c['ms_per_step']:.3f} ms, floor fraction {c['floor_fraction']:.3f}")
print("  copy", round(d.get("copy_bandwidth", {}).get("gb_per_s", 0)))
PY
  done
done
