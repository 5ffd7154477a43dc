#!/bin/bash
# Call 14 (35th session): the review's fixes on the GPU (tests/test_stage.py and the files around it), then one
# ttft_hit pair, staging on and off, at the final code.
T0=$(date +%s); R=$PWD
mkdir -p /tmp/ib/flashpd /tmp/site
for f in $R/flashpd/*; do ln -sfn $f /tmp/ib/flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p /tmp/ib/flashpd/$p; done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $R/.diag/cur/whl5/*.whl $R/.diag/cur/whl6/*.whl > /dev/null 2>&1; echo pip rc $?
export PYTHONPATH=/tmp/site:/tmp/ib TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri FLASHPD_GIT_REV=$(cat $R/.diag/cur/rev) PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/t && cp -r $R/tests /tmp/t/ && cp $R/pyproject.toml /tmp/t/ && cd /tmp/t
for f in test_stage test_host_store test_kv_bridge_arena; do
  PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout 150 python -m pytest -q -p no:cacheprovider -o addopts="" -W ignore -rfEs tests/$f.py 2>&1 \
    | grep -E "passed|failed|^FAILED|^ERROR|^SKIPPED|^E  " | head -12
  echo "$f at $(( $(date +%s) - T0 )) s"
done
cd /tmp/ib
for tag in stage nostage; do
  [ $tag = stage ] && MIB=1024 || MIB=0
  timeout 150 python -m flashpd.bench.ttft_hit --config qwen3-8b --prompts 3 --reps 3 \
    --modes cold,arena,shm --stage-mib $MIB --out $OUT/ttft_${tag}3.json 2>&1 | grep -E "^prompt|geomean|Error|error"
  echo "ttft $tag at $(( $(date +%s) - T0 )) s"
done
