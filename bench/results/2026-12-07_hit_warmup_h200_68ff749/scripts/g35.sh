#!/bin/bash
R=$PWD; mkdir -p /tmp/ib/flashpd /tmp/site
for f in $R/flashpd/*; do ln -sfn $f /tmp/ib/flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p /tmp/ib/flashpd/$p; done
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site $R/.diag/cur/whl/*.whl > /dev/null 2>&1; echo pip rc $?
export PYTHONPATH=/tmp/site:/tmp/ib TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri FLASHPD_GIT_REV=$(cat $R/.diag/cur/rev) PYTHONUNBUFFERED=1
cd /tmp && for tag in ${TAGS:-old new}; do
  timeout $( [ $tag = old ] && echo ${LIMIT_OLD:-170} || echo ${LIMIT_NEW:-125}) python3 $R/.diag/cur/g35.py $R/flashpd/assets/demo_pair $tag > $OUT/g35_$tag.log 2>&1
  echo "$tag rc $?"; grep -E "^\{|warm-up|^hits|Error" $OUT/g35_$tag.log | tail -14
done
