#!/bin/bash
R=$PWD
mkdir -p ib/flashpd site
for f in $R/flashpd/*; do ln -sfn $f flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p flashpd/$p; done
python3 -m pip install -q --no-index --no-deps --no-compile --target site $R/scripts/whl/*.whl $R/scripts/whl2/*.whl > /dev/null 2>&1; echo pip rc $?
export PYTHONPATH=site:ib FLASHPD_GIT_REV=$(cat scripts/rev) TORCHINDUCTOR_CACHE_DIR=ind TRITON_CACHE_DIR=tri
SPY=$(ls site/bin/py-spy 2>/dev/null || echo site/py_spy*/bin/py-spy); ls -la site/bin 2>/dev/null | head
mkdir -p $OUT/sweep && cd $OUT/sweep
watch() {  # $1: the log line that starts the level before; $2: output name
  while ! grep -q "$1" sweep.log 2>/dev/null; do sleep 0.2; done
  pid=$(pgrep -f "flashpd.cli serve" | head -1)
  sleep 0.5
  site/bin/py-spy record --pid $pid --duration 4 --rate 250 --format raw -o $2.txt > $2.spy.log 2>&1
}
(watch "native c=32:" native128) &
(watch "dflash c=32:" dflash128) &
timeout 560 python -m flashpd.bench.job_sweep --modes colocated --methods native,dflash --concurrency 1,8,32,128 --prompt-pool 256 --requests 1024 --max-tokens 64 --device cuda --dtype bfloat16 --kv-cache-tokens 262144 --out serve_sweep_same_prompts_h200.json > sweep.log 2>&1; echo rc $? >> sweep.log
grep -v -i warn sweep.log | tail -12
cat *.spy.log | tail -6
for f in native128 dflash128; do [ -f $f.txt ] && python3 - $f.txt <<'PY'
import sys, collections
tot = 0; own = collections.Counter(); incl = collections.Counter()
for ln in open(sys.argv[1]):
    stack, _, n = ln.rstrip().rpartition(' ')
    n = int(n); tot += n; frames = stack.split(';')
    own[frames[-1][:110]] += n
    for fr in set(f.split(' (')[0] for f in frames): incl[fr[:80]] += n
print(sys.argv[1], 'samples', tot)
for k, v in own.most_common(12): print('  own %5.1f%% %s' % (100*v/tot, k))
for k, v in incl.most_common(30): print('  incl %5.1f%% %s' % (100*v/tot, k))
PY
done
true
