#!/bin/bash
# TMA loads for the few-row GEMM against the engine's pointer loads (tma.py). Usage: bash g70.sh
R=$PWD
mkdir -p ib/flashpd site
for f in $R/flashpd/*; do ln -sfn $f ib/flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p ib/flashpd/$p; done
export PYTHONPATH=site:ib TORCHINDUCTOR_CACHE_DIR=ind TRITON_CACHE_DIR=tri FLASHPD_GIT_REV=$(cat $R/scripts/rev)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv,noheader
cd /tmp
python -c "import triton; print('triton', triton.__version__)"
timeout 420 python $R/scripts/tma.py $OUT/tma.json > $OUT/tma.log 2>&1; echo "tma rc $?"
python - $OUT/tma.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    if "error" in r:
        print(r["shape"], r["m"], r["variant"], r["tile"], "ERR", r["error"][:120])
    else:
        print(f'{r["shape"]:8s} m={r["m"]:2d} {r["variant"]:7s} {str(r["tile"]):18s} {r["us"]:8.2f} us {r["tb_s"]:.3f} TB/s eq={r["equal_base"]}')
PY
