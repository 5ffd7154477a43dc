#!/bin/bash
R=$PWD; mkdir -p /tmp/ib/flashpd /tmp/site
for f in $R/flashpd/*; do ln -sfn $f /tmp/ib/flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p /tmp/ib/flashpd/$p; done
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site $R/.diag/cur/whl/*.whl > /dev/null 2>&1; echo pip rc $?
export PYTHONPATH=/tmp/site:/tmp/ib TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri FLASHPD_GIT_REV=$(cat $R/.diag/cur/rev) PYTHONUNBUFFERED=1
cd /tmp && timeout ${LIMIT_S:-200} python3 $R/.diag/cur/g33.py $R/flashpd/assets/demo_pair 2>&1 | grep -v "preferred_blas_library" | tee $OUT/g33.log
mkdir -p /tmp/t && cp -r $R/tests /tmp/t/ && cp $R/pyproject.toml /tmp/t/ && cd /tmp/t
PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout 120 python3 -m pytest -q -p no:cacheprovider -p xdist -n 4 -o addopts="" tests/test_graph_capture_threads.py tests/test_graph_path.py > $OUT/gpu_tests.log 2>&1
echo "gpu tests rc $?"; tail -3 $OUT/gpu_tests.log
