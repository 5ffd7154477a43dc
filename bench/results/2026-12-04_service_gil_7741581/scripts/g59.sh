#!/bin/bash
R=$PWD
mkdir -p ib/flashpd site
for f in $R/flashpd/*; do ln -sfn $f flashpd/; done
for p in engine prefill_node decode_node kv_bridge cluster training bench proto; do [ -e $R/$p ] && ln -sfn $R/$p flashpd/$p; done
python3 -m pip install -q --no-index --no-deps --no-compile --target site $R/scripts/whl/*.whl $R/scripts/whl2/*.whl > /dev/null 2>&1; echo pip rc $?
export PYTHONPATH=site:ib FLASHPD_GIT_REV=$(cat scripts/rev) TORCHINDUCTOR_CACHE_DIR=ind TRITON_CACHE_DIR=tri
mkdir -p $OUT/sweep && cd $OUT/sweep
spy() {  # $1: log line to wait for (file $2), $3: name
  while ! grep -q "$1" $2 2>/dev/null; do sleep 0.1; done
  sleep 1.0
  s=$(pgrep -f "flashpd.cli serve" | head -1); c=$(pgrep -f "flashpd.bench.job_sweep" | head -1)
  site/bin/py-spy record --pid $s --duration 3 --rate 40 --gil --threads --format raw -o $3_serve.txt > $3_serve.spy.log 2>&1 &
  site/bin/py-spy record --pid $c --duration 3 --rate 40 --gil --threads --format raw -o $3_client.txt > $3_client.spy.log 2>&1 &
  wait
}
python3 $R/scripts/cpumon.py 330 > cpu.log 2>&1 &
(spy "decode warm-up" "serve_sweep_same_prompts_h200.json.serve-colocated.log" native) &
(spy "native c=128:" sweep.log dflash) &
timeout 330 python -m flashpd.bench.job_sweep --modes colocated --methods native,dflash --concurrency 128 --prompt-pool 256 --requests 1024 --warmup 768 --max-tokens 64 --device cuda --dtype bfloat16 --kv-cache-tokens 262144 --out sweep128.json > sweep.log 2>&1; echo rc $? >> sweep.log
grep -v -i warn sweep.log | tail -4 | cut -c1-300
grep -i "warm-up\|engine:" *.serve-colocated.log | cut -c1-300 | tail -8
tail -3 *.spy.log
for f in native_serve native_client dflash_serve dflash_client; do [ -f $f.txt ] && python3 - $f.txt <<'PY'
import sys, collections
tot = 0; th = collections.Counter(); top = collections.Counter()
for ln in open(sys.argv[1]):
    stack, _, n = ln.rstrip().rpartition(' ')
    n = int(n); tot += n; fr = stack.split(';')
    th[fr[0][:60]] += n
    names = [f.split(' (')[0] for f in fr]
    key = next((x for x in names if x in ('Scheduler.step', '_stream_response_in_pool', '_serve', 'EngineLoop._take', 'EngineLoop._step', 'client', 'GenerationClient.generate')), names[min(4, len(names)-1)])
    top[key] += n
print(sys.argv[1], 'samples holding the GIL', tot, '(of 120 a thread-second at 40 Hz x 3 s)')
for k, v in top.most_common(10): print('  %5.1f%% %s' % (100*v/tot, k))
PY
done
grep -c . cpu.log; awk 'NR%4==0' cpu.log | tail -60 | cut -c1-250
true
