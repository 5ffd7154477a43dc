#!/bin/bash
# Call 17 (36th session): samp_gpu2.py (the uniforms third form, top-p kept sets), GPU tests of sampling files.
T0=$(date +%s); R=$PWD
mkdir -p /tmp/ib/flashpd /tmp/site
for f in $R/flashpd/*; do ln -sfn $f /tmp/ib/flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p /tmp/ib/flashpd/$p; done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $R/.diag/cur/whl5/*.whl $R/.diag/cur/whl6/*.whl > /dev/null 2>&1; echo pip rc $?
export PYTHONPATH=/tmp/site:/tmp/ib TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
cd /tmp/ib
timeout 200 python $R/.diag/cur/samp_gpu2.py $OUT/samp_gpu2.json 2>&1 | grep -vE "Warning|preferred_blas" | tail -30
echo "samp done at $(( $(date +%s) - T0 )) s"
mkdir -p /tmp/t && cp -r $R/tests $R/pyproject.toml /tmp/t/ && cd /tmp/t
for f in test_sampling test_dflash_sampling; do
  timeout 150 python -m pytest -q -p no:cacheprovider -o addopts="" -W ignore tests/$f.py 2>&1 | tail -3
done
echo "done at $(( $(date +%s) - T0 )) s"
