#!/bin/bash
# Call 2: where an arena restore's time goes (pinned / not), then ttft_hit cold,host,memory,arena (pinned), then
# cold,arena unpinned.
T0=$(date +%s); R=$PWD; B=${B:-420}
left() { echo $(( B - ($(date +%s) - T0) )); }
mkdir -p /tmp/ib/flashpd /tmp/site
for f in $R/flashpd/*; do ln -sfn $f /tmp/ib/flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p /tmp/ib/flashpd/$p; done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $R/.diag/cur/whl5/*.whl > /dev/null 2>&1; echo pip rc $?
export PYTHONPATH=/tmp/site:/tmp/ib TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri FLASHPD_GIT_REV=$(cat $R/.diag/cur/rev) PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
cd /tmp/ib
timeout 90 python $R/.diag/cur/arena_prof.py $OUT/arena_prof.json 10 > $OUT/arena_prof.log 2>&1; echo "prof rc $? at $(( $(date +%s) - T0 )) s"
python3 -c "
import json; d=json.load(open('$OUT/arena_prof.json'))
for k,v in d.items():
    if isinstance(v,dict): print(k, 'get', [round(r['get_ms'],1) for r in v['reps']], 'copy', [round(r.get('copy_ms',0),1) for r in v['reps']], 'faults', [r['get_faults'] for r in v['reps']], 'mac/chunk', round(v['mac_ms_per_chunk_sequential'],2), 'pinwait', round(v['pin_wait_s'],2))"
timeout $(( $(left) - 110 )) python -m flashpd.bench.ttft_hit --config qwen3-8b --prompts 3 --reps 3 \
  --modes cold,host,memory,arena --out $OUT/ttft_hit.json > $OUT/ttft_hit.log 2>&1
echo "ttft rc $? at $(( $(date +%s) - T0 )) s"; tail -9 $OUT/ttft_hit.log
timeout $(( $(left) - 3 )) python -m flashpd.bench.ttft_hit --config qwen3-8b --prompts 3 --reps 3 \
  --modes cold,arena --arena-pin off --out $OUT/ttft_nopin.json > $OUT/ttft_nopin.log 2>&1
echo "ttft nopin rc $? at $(( $(date +%s) - T0 )) s"; tail -5 $OUT/ttft_nopin.log
