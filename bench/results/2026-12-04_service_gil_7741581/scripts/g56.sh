#!/bin/bash
R=$PWD
mkdir -p ib/flashpd site
for f in $R/flashpd/*; do ln -sfn $f flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p flashpd/$p; done
python3 -m pip install -q --no-index --no-deps --no-compile --target site $R/scripts/whl/*.whl $R/scripts/whl3/*.whl > /dev/null 2>&1; echo pip rc $?
export PYTHONPATH=site:ib FLASHPD_GIT_REV=$(cat scripts/rev) TORCHINDUCTOR_CACHE_DIR=ind TRITON_CACHE_DIR=tri
mkdir -p $OUT/s128 $OUT/gt && cd $OUT/gt
timeout 100 python -m pytest -q -p no:cacheprovider -o addopts="" $R/tests/test_paged_attention.py -k "a_new_table_width" > gt.log 2>&1; echo rc $? >> gt.log
tail -5 gt.log
cd $OUT/s128
timeout 330 python $R/scripts/sched128b.py $R s128.json > s128.log 2>&1; echo rc $? >> s128.log
grep -v -i warn s128.log | grep -v "^{" | head -120 | cut -c1-220
python3 -c "
import json;d=json.load(open('s128.json'))
for m,rows in d.items():
  for r in rows: print(m, r['round'], 'tok/s %.0f ms/step %.2f steps %d ov %d ends %d adm %d' % (r['tok_per_s'], r['ms_per_step'], r['steps'], r['overlapped_steps'], r['sessions_ended'], r['admitted']), {k: round(v,2) for k,v in r['timers_ms_per_step'].items()}, r['admission_sizes'])
"
true
