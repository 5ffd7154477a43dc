"""Where a colocated scheduler's time goes at 128 closed-loop requests, native against DFlash (demo pair, bf16):
per method, waves of a closed loop (a finished request is replaced at once, as the sweep's clients do), the
scheduler's phases timed by wrapping its methods (diagnosis only)."""
import json, sys, time, collections, torch
from flashpd.engine.factory import load_engine
from flashpd.bench.job_sweep import make_prompts, prompt_lengths
from flashpd.decode_node.scheduler import Scheduler
from flashpd.engine.sampling import SamplingParams
R, out = sys.argv[1], sys.argv[2]
t0 = time.time()
tgt, drf = f"{R}/flashpd/assets/demo_pair/target", f"{R}/flashpd/assets/demo_pair/drafter"
llm = load_engine(tgt, drf, device="cuda", dtype="bfloat16", kv_cache_tokens=262144)
pool = make_prompts(tgt, prompt_lengths(256, 128, 0, 2048), 0)
print(f"loaded {time.time() - t0:.0f}s", flush=True)
res = {}
for method in ("native", "dflash", "native", "dflash"):
    sched = Scheduler(llm.runner, llm.drafter, tuple(llm.stop_ids), None, 128, "preempt", None)
    timers, counts = collections.Counter(), collections.Counter()
    for name in ("_admit", "_advance", "_end_session", "_finish", "_prepare"):
        f = getattr(sched, name)
        def wrap(*a, _f=f, _n=name, **k):
            t = time.perf_counter()
            try:
                return _f(*a, **k)
            finally:
                timers[_n] += time.perf_counter() - t; counts[_n] += 1
        setattr(sched, name, wrap)
    params = SamplingParams(max_tokens=64, ignore_eos=False)
    n_req, sent, done, toks = 256, 0, 0, 0
    for _ in range(128):
        sched.add(pool[sent % 256], params, method); sent += 1
    t = time.perf_counter(); steps = 0; admitted_sizes = collections.Counter()
    while done < n_req:
        r = sched.step(); steps += 1
        toks += sum(len(v) for v in r.new_tokens.values())
        for _ in r.finished:
            done += 1
            if sent < n_req:
                sched.add(pool[sent % 256], params, method); sent += 1
        if time.perf_counter() - t > 20:
            break
    torch.cuda.synchronize(); dt = time.perf_counter() - t
    row = {"method": method, "requests_done": done, "tokens": toks, "s": dt, "tok_per_s": toks / dt, "steps": steps,
           "timers_s": dict(timers), "calls": dict(counts), "overlapped_steps": getattr(sched, "overlapped_steps", None),
           "stats": {k: v for k, v in vars(sched.stats).items() if isinstance(v, (int, float))}}
    res.setdefault(method, []).append(row)
    print(json.dumps(row), flush=True)
    json.dump(res, open(out, "w"), indent=1)
