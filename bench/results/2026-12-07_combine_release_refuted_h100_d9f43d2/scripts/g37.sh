#!/bin/bash
# A/B at batch 1 (H200/H100): the one-row decode's combine kernel letting o_proj launch after its wait
# (paged_attention.COMBINE_RELEASES) against main's never. Alternating quick runs: off, on, off, on.
T0=$(date +%s); R=$PWD
mkdir -p /tmp/ib/flashpd /tmp/site
for f in $R/flashpd/*; do ln -sfn $f /tmp/ib/flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p /tmp/ib/flashpd/$p; done
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site $R/.diag/cur/whl/*.whl > /dev/null 2>&1; echo pip rc $?
export PYTHONPATH=/tmp/site:/tmp/ib TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri FLASHPD_GIT_REV=$(cat $R/.diag/cur/rev) PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
cd /tmp/ib
quick() {  # $1 True|False, $2 tag
  timeout $3 python -c "
import sys
from flashpd.engine import paged_attention as pa
pa.COMBINE_RELEASES = $1
from flashpd.bench import speed_8b
sys.argv = ['speed_8b', '--sections', 'curve,dflash', '--batches', '1', '--profile-batches', '1', '--dflash-batches', '1',
            '--stall-dump-s', '80', '--out', '$OUT/ab_$2.json']
sys.exit(speed_8b.main())
" > $OUT/ab_$2.log 2>&1
  echo "quick $1 rc $? at $(( $(date +%s) - T0 )) s"
  grep "done:" $OUT/ab_$2.log | tr ',' '\n' | grep -E "native_b1_x_floor |native_b1_gpu_busy|kernels_per|native_step_ms_b1|dflash_step_ms_b1|dflash_over_native_step |copy"
}
quick False off1 130
quick True on1 130
quick False off2 120
quick True on2 120
