"""Where a colocated scheduler's time goes at 128 closed-loop requests, native against DFlash (demo pair, bf16):
per method, a closed loop (a finished request is replaced at once, as the sweep's clients do) with the
scheduler's and the device loop's phases timed by wrapping their methods (diagnosis only). Round 1 warms up
(compiles, graph captures: the closed loop's own shapes), rounds 2-3 are timed, round 4 runs DFlash under cProfile."""
import json, sys, time, collections, cProfile, pstats, io, torch
from flashpd.engine.factory import load_engine
from flashpd.bench.job_sweep import make_prompts, prompt_lengths
from flashpd.decode_node.scheduler import Scheduler
from flashpd.engine.sampling import SamplingParams
R, out = sys.argv[1], sys.argv[2]
conc = int(sys.argv[3]) if len(sys.argv) > 3 else 128
t0 = time.time()
tgt, drf = f"{R}/flashpd/assets/demo_pair/target", f"{R}/flashpd/assets/demo_pair/drafter"
llm = load_engine(tgt, drf, device="cuda", dtype="bfloat16", kv_cache_tokens=262144)
pool = make_prompts(tgt, prompt_lengths(256, 128, 0, 2048), 0)
print(f"loaded {time.time() - t0:.0f}s", flush=True)
res = {}

SCHED = Scheduler(llm.runner, llm.drafter, tuple(llm.stop_ids), None, conc, "preempt", None)
WRAPPED = {}

def run(method, timed, prof=None, n_req=384, cap=15):
    sched = SCHED
    timers, counts = collections.Counter(), collections.Counter()
    for (obj, name), f in WRAPPED.items():
        setattr(obj, name, f)
    WRAPPED.clear()
    ov0, se0, ad0 = sched.overlapped_steps, sched.sessions_ended, sched.admitted
    def wrap_obj(obj, names, pre):
        for name in names:
            f = getattr(obj, name)
            WRAPPED[(obj, name)] = f
            def wrap(*a, _f=f, _n=pre + name, **k):
                t = time.perf_counter()
                try:
                    return _f(*a, **k)
                finally:
                    timers[_n] += time.perf_counter() - t; counts[_n] += 1
            setattr(obj, name, wrap)
    if timed:
        wrap_obj(sched, ("_admit", "_advance", "_end_session", "_finish", "_prepare", "_pick"), "")
        for g, p in ((sched.native, "nloop."), (sched.spec, "sloop.")):
            wrap_obj(g.loop(), ("begin", "launch", "read", "end", "begin_after_prefill"), p)
            wrap_obj(g, ("prefill", "finish"), p.replace("loop", "gen"))
    params = SamplingParams(max_tokens=64, ignore_eos=False)
    sent = done = toks = 0
    for _ in range(conc):
        sched.add(pool[sent % 256], params, method); sent += 1
    sizes = collections.Counter()
    t = time.perf_counter(); steps = 0
    if prof: prof.enable()
    while done < n_req:
        a0 = sched.admitted
        r = sched.step(); steps += 1
        sizes[sched.admitted - a0] += 1
        toks += sum(len(v) for v in r.new_tokens.values())
        for _ in r.finished:
            done += 1
            if sent < n_req:
                sched.add(pool[sent % 256], params, method); sent += 1
        if time.perf_counter() - t > cap:
            break
    torch.cuda.synchronize(); dt = time.perf_counter() - t
    if prof: prof.disable()
    row = {"method": method, "conc": conc, "requests_done": done, "tokens": toks, "s": dt, "tok_per_s": toks / dt,
           "steps": steps, "ms_per_step": dt * 1e3 / steps, "timers_ms_per_step": {k: v * 1e3 / steps for k, v in timers.items()},
           "calls": dict(counts), "overlapped_steps": sched.overlapped_steps - ov0, "sessions_ended": sched.sessions_ended - se0,
           "admitted": sched.admitted - ad0, "admission_sizes": dict(sorted(sizes.items())),
           "stats": {k: v for k, v in vars(sched.stats).items() if isinstance(v, (int, float))}}
    sched.run_until_idle()
    return row

for rnd, method in [(1, "native"), (1, "dflash"), (2, "native"), (2, "dflash"), (3, "native"), (3, "dflash")]:
    row = run(method, rnd >= 2, cap=60 if rnd == 1 else 15)
    row["round"] = rnd
    res.setdefault(method, []).append(row)
    print(json.dumps(row), flush=True)
    json.dump(res, open(out, "w"), indent=1)
prof = cProfile.Profile()
row = run("dflash", False, prof, cap=10)
row["round"] = 4; row["profiled"] = True
res["dflash"].append(row)
json.dump(res, open(out, "w"), indent=1)
s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(45); print(s.getvalue()[:9000])
s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(45); print(s.getvalue()[:9000])
