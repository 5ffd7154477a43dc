#!/bin/bash
# closed loops sampled as Qwen3's generation_config samples, after the decode warm-up: main's warm-up (16-block
# pass in three modes) against the old one (greedy only), graphs captured inside each level and warm-up seconds
R=$PWD; mkdir -p /tmp/ib/flashpd /tmp/site
for f in $R/flashpd/*; do ln -sfn $f /tmp/ib/flashpd/; done
for p in prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p /tmp/ib/flashpd/$p; done
rm -rf /tmp/eng_old && cp -r $R/engine /tmp/eng_old && cp $R/.diag/cur/warmup_old.py /tmp/eng_old/warmup.py
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site $R/.diag/cur/whl/*.whl > /dev/null 2>&1; echo pip rc $?
export PYTHONPATH=/tmp/site:/tmp/ib TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri FLASHPD_GIT_REV=$(cat $R/.diag/cur/rev) PYTHONUNBUFFERED=1
cd /tmp
for tag in ${TAGS:-new old new2}; do
  case $tag in old*) ln -sfn /tmp/eng_old /tmp/ib/flashpd/engine;; *) ln -sfn $R/engine /tmp/ib/flashpd/engine;; esac
  timeout ${LIMIT_S:-200} python3 -m flashpd.bench.closed_loop --concurrency ${CONC:-32,64} --methods native,dflash \
    --rounds 2 --temperature 0.6 --top-p 0.95 --top-k 20 --device cuda --dtype bfloat16 --out $OUT/cl_$tag.json \
    > $OUT/cl_$tag.log 2>&1
  echo "$tag rc $?"; grep -E "warm-up:|round" $OUT/cl_$tag.log | sed 's/^.*INFO //'
done
