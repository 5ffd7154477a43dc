#!/bin/bash
# Call 20 (36th session): pub_stream.py, the publisher's copies on their own stream (work tree) against the engine's
# stream (the code before: worker_old.py), alternating, then the GPU tests of the publish path.
T0=$(date +%s); R=$PWD
mkdir -p /tmp/ib/flashpd /tmp/ib_old/flashpd/prefill_node /tmp/site
for f in $R/flashpd/*; do ln -sfn $f /tmp/ib/flashpd/; ln -sfn $f /tmp/ib_old/flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p /tmp/ib/flashpd/$p; done
for p in engine decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p /tmp/ib_old/flashpd/$p; done
for f in $R/prefill_node/*; do ln -sfn $f /tmp/ib_old/flashpd/prefill_node/; done
rm /tmp/ib_old/flashpd/prefill_node/worker.py && cp $R/.diag/cur/worker_old.py /tmp/ib_old/flashpd/prefill_node/worker.py
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $R/.diag/cur/whl5/*.whl $R/.diag/cur/whl6/*.whl > /dev/null 2>&1; echo pip rc $?
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri PYTHONUNBUFFERED=1 REPS=4
nvidia-smi --query-gpu=name --format=csv,noheader
cd /tmp
for run in new1 old1 new2 old2; do
  tree=/tmp/ib; [[ $run == old* ]] && tree=/tmp/ib_old
  PYTHONPATH=/tmp/site:$tree timeout 110 python $R/.diag/cur/pub_stream.py $OUT/pub_$run.json $run 2>&1 | grep -vE "Warning|preferred_blas" | tail -9
  echo "$run done at $(( $(date +%s) - T0 )) s"
done
export PYTHONPATH=/tmp/site:/tmp/ib
mkdir -p /tmp/t && cp -r $R/tests $R/pyproject.toml /tmp/t/ && cd /tmp/t
for f in test_disaggregated test_publish_after_answer; do
  echo "== $f"; timeout 100 python -m pytest -q -p no:cacheprovider -o addopts="" -W ignore tests/$f.py 2>&1 | tail -2
done
echo "done at $(( $(date +%s) - T0 )) s"
