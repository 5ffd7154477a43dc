"""Prefix hits after the decode warm-up: graph keys met and dynamo graphs compiled, on the CPU with the GPU's graph
paths and dynamo's eager backend (demo pair, float32, max_running 64, a MemoryStore prefix cache of 32-token chunks).
Per method, three turns of one prompt and of four prompts (180 tokens, then 30 more a turn). Adapted from
bench/results/2026-12-04_service_compiles_6d5a685/scripts/graph_keys.py; its unused positional arguments stay."""
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
                  runner_config=RunnerConfig(cuda_graphs=True, compile=True, compile_backend='eager'))
MAXR = int(sys.argv[6]) if len(sys.argv) > 6 else 64
from flashpd.kv_bridge.keys import MethodFingerprint
from flashpd.kv_bridge.prefix_cache import PrefixCache
from flashpd.kv_bridge.store import MemoryStore
fp = MethodFingerprint("t", "d", tuple(llm.drafter.cfg.target_layer_ids), "float32").digest()
pc = PrefixCache(MemoryStore(1 << 30), fp, 32)
sched = Scheduler(llm.runner, llm.drafter, tuple(llm.stop_ids), pc, MAXR, "preempt", None)
new = 2 * sched.spec.draft_width + 1
w = warm_scheduler(sched, lengths_for(llm.runner.max_positions, new), new)
from torch._dynamo.utils import counters
print("after warm-up: dynamo", dict(counters["stats"]), flush=True)
print(f"warm-up {w['requests']} requests in {w['seconds']:.0f} s; {len(keys['warm'])} keys", flush=True)

g = torch.Generator().manual_seed(5)
res = {}
for method in ("native", "dflash"):
    for nb, base in ((1, 180), (4, 180)):
        phase[0] = f"{method}-b{nb}-{base}"
        bases = [torch.randint(0, llm.model.cfg.vocab_size, (base,), generator=g).tolist() for _ in range(nb)]
        for turn in range(3):
            for b in bases:
                sched.add(b, SamplingParams(max_tokens=16, ignore_eos=True), method)
            sched.run_until_idle()
            bases = [b + torch.randint(0, llm.model.cfg.vocab_size, (30,), generator=g).tolist() for b in bases]
        new_keys = {k: v for k, v in keys[phase[0]].items() if k not in keys["warm"]}
        from torch._dynamo.utils import counters
        print("dynamo unique graphs", counters["stats"]["unique_graphs"], dict(counters["stats"]), flush=True)
        print(phase[0], "hits", pc.stats, len(new_keys), "new keys", flush=True)
        for k, v in new_keys.items():
            print("   ", v, k, flush=True)
print("WARM fresh=False keys:")
for k, v in keys["warm"].items():
    if k[0] == "graphed" and ("fresh", False) in k[2]:
        print("   ", v, k)
