"""Per-process and busiest-thread CPU use of the sweep's client and the service, every 0.5 s (diagnosis)."""
import os, sys, time, subprocess
def pids():
    out = {}
    for p in os.listdir('/proc'):
        if not p.isdigit(): continue
        try: cmd = open(f'/proc/{p}/cmdline', 'rb').read().replace(b'\0', b' ').decode()
        except OSError: continue
        if 'flashpd.cli serve' in cmd or 'flashpd.cli' in cmd and 'serve' in cmd: out[int(p)] = 'serve'
        elif 'flashpd.bench.job_sweep' in cmd: out[int(p)] = 'client'
    return out
def ticks(path):
    f = open(path).read().rsplit(')', 1)[1].split()
    return int(f[11]) + int(f[12])
HZ = os.sysconf('SC_CLK_TCK'); prev = {}; t_prev = time.time()
end = time.time() + float(sys.argv[1])
while time.time() < end:
    time.sleep(0.5)
    now = time.time(); dt = now - t_prev; t_prev = now
    line = [time.strftime('%H:%M:%S', time.localtime(now)) + f'.{int(now % 1 * 10)}']
    for pid, name in pids().items():
        try:
            tot = ticks(f'/proc/{pid}/stat'); th = []
            for tid in os.listdir(f'/proc/{pid}/task'):
                try:
                    t = ticks(f'/proc/{pid}/task/{tid}/stat'); comm = open(f'/proc/{pid}/task/{tid}/comm').read().strip()
                except OSError: continue
                d = t - prev.get((pid, tid), t); prev[(pid, tid)] = t
                th.append((d, comm))
        except OSError: continue
        d = tot - prev.get(pid, tot); prev[pid] = tot
        th.sort(reverse=True)
        line.append(f"{name}:{100 * d / HZ / dt:.0f}% [" + " ".join(f"{c}:{100 * x / HZ / dt:.0f}" for x, c in th[:4] if x) + "]")
    print(" ".join(line), flush=True)
