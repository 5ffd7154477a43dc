"""Which graph shapes a closed loop meets that the decode warm-up did not: on the CPU, with the GPU's padded
paths (RunnerConfig(cuda_graphs=True): every graphed function runs directly, with the shapes a GPU would capture).
Demo pair, float32; the warm-up as a decode worker runs it (max_running 128); then a closed loop of 128 requests
in flight (a finished request replaced at once), per method. Prints each key met after the warm-up."""
import collections, json, sys, time, torch
from flashpd.engine import cuda_graph, device_loop
from flashpd.engine.runner_config import RunnerConfig
from flashpd.engine.factory import load_engine
from flashpd.engine.warmup import lengths_for, warm_scheduler
from flashpd.engine.sampling import SamplingParams
from flashpd.bench.job_sweep import make_prompts, prompt_lengths
from flashpd.decode_node.scheduler import Scheduler

R, out = sys.argv[1], sys.argv[2]
conc = int(sys.argv[3]) if len(sys.argv) > 3 else 128
n_req = int(sys.argv[4]) if len(sys.argv) > 4 else 256
phase = ["warm"]
keys = collections.defaultdict(collections.Counter)


def norm(v):
    return v if isinstance(v, (int, bool, float, str, type(None))) else getattr(v, "__qualname__", type(v).__name__)


orig_g = cuda_graph.GraphedFn.__call__
def g_call(self, inputs, **kw):
    key = tuple((tuple(x.shape), str(x.dtype)) for x in inputs) + tuple(sorted((k, norm(v)) for k, v in kw.items()))
    keys[phase[0]][("graphed", getattr(self.fn, "__qualname__", "?"), key)] += 1
    return orig_g(self, inputs, **kw)
cuda_graph.GraphedFn.__call__ = g_call
orig_ip = device_loop.InPlaceGraph.__call__
def ip_call(self, key, bufs, reset):
    keys[phase[0]][("inplace", getattr(self.fn, "__qualname__", "?"), tuple(key))] += 1
    return orig_ip(self, key, bufs, reset)
device_loop.InPlaceGraph.__call__ = ip_call

t0 = time.time()
tgt, drf = f"{R}/flashpd/assets/demo_pair/target", f"{R}/flashpd/assets/demo_pair/drafter"
llm = load_engine(tgt, drf, device="cpu", dtype="float32", kv_cache_tokens=262144,
                  runner_config=RunnerConfig(cuda_graphs=True, compile=False))
sched = Scheduler(llm.runner, llm.drafter, tuple(llm.stop_ids), None, 128, "preempt", None)
new = 2 * sched.spec.draft_width + 1
w = warm_scheduler(sched, lengths_for(llm.runner.max_positions, new), new)
print(f"warm-up {w['requests']} requests in {w['seconds']:.0f} s; {len(keys['warm'])} keys", flush=True)
pool = make_prompts(tgt, prompt_lengths(256, 128, 0, 2048), 0)
res = {"warm_keys": len(keys["warm"]), "levels": {}}
for method in ("native", "dflash"):
    phase[0] = method
    params = SamplingParams(max_tokens=64, ignore_eos=False)
    sent = done = steps = 0
    for _ in range(conc):
        sched.add(pool[sent % 256], params, method); sent += 1
    t = time.time()
    while done < n_req:
        r = sched.step(); steps += 1
        for _ in r.finished:
            done += 1
            if sent < n_req:
                sched.add(pool[sent % 256], params, method); sent += 1
    new_keys = {k: v for k, v in keys[method].items() if k not in keys["warm"]}
    res["levels"][method] = {"steps": steps, "s": time.time() - t, "keys": len(keys[method]), "new_keys": len(new_keys),
                             "new_key_calls": sum(new_keys.values()),
                             "new": sorted([list(map(str, k)) + [v] for k, v in new_keys.items()], key=str)}
    print(f"{method}: {steps} steps, {len(keys[method])} keys, {len(new_keys)} not met in the warm-up "
          f"({sum(new_keys.values())} calls) {time.time() - t:.0f} s", flush=True)
    for k, v in sorted(new_keys.items(), key=lambda kv: -kv[1])[:40]:
        print("   ", v, k, flush=True)
    json.dump(res, open(out, "w"), indent=1)
