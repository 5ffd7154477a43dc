"""GPU: the first prefix hits of two requests admitted together, after the decode warm-up without (old) or with
(new) its hit pass. bf16 demo pair; a MemoryStore prefix cache (chunks of 32 tokens); restores inside admission
so that the two hit tails prefill as one forward of two rows. Times each turn: two fresh prompts, then the same two
24 tokens longer (the hits), twice with new prompts."""
import json, os, sys, time
import torch
from flashpd.engine.factory import load_engine
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.warmup import lengths_for, warm_scheduler
from flashpd.decode_node.scheduler import Scheduler
from flashpd.decode_node.worker import scratch_cache
from flashpd.kv_bridge.keys import MethodFingerprint
from flashpd.kv_bridge.prefix_cache import PrefixCache
from flashpd.kv_bridge.store import MemoryStore
from flashpd.engine import cuda_graph
from torch._dynamo.utils import counters

A, tag = sys.argv[1], sys.argv[2]
llm = load_engine(f"{A}/target", f"{A}/drafter", device=os.environ.get("DEV", "cuda"), dtype=os.environ.get("DT", "bfloat16"), kv_cache_tokens=65536)
fp = MethodFingerprint("t", "d", tuple(llm.drafter.cfg.target_layer_ids), "bfloat16").digest()
pc = PrefixCache(MemoryStore(1 << 30), fp, 32)
sched = Scheduler(llm.runner, llm.drafter, tuple(llm.stop_ids), pc, 4, "preempt", None)
new = 2 * sched.spec.draft_width + 1
t0 = time.perf_counter()
w = warm_scheduler(sched, lengths_for(llm.runner.max_positions, new), new,
                   scratch_cache=scratch_cache(pc, sched) if tag == "new" else None)
print(f"{tag}: warm-up {w['requests']} requests {time.perf_counter() - t0:.1f} s hit_batches {w['hit_batches']}", flush=True)
sched.async_load = False
g = torch.Generator().manual_seed(3)
rows = []
for method in ("native", "dflash"):
    for rep in range(2):
        base = [torch.randint(0, 4000, (200,), generator=g).tolist() for _ in range(2)]
        longer = [p + torch.randint(0, 4000, (24,), generator=g).tolist() for p in base]
        for name, group in (("fresh", base), ("hits", longer)):
            c0, d0 = cuda_graph.captures(), counters["stats"]["unique_graphs"]
            t = time.perf_counter()
            for p in group:
                sched.add(p, SamplingParams(max_tokens=1, ignore_eos=True), method)
            sched.run_until_idle()
            torch.cuda.synchronize() if torch.cuda.is_available() else None
            rows.append({"method": method, "rep": rep, "turn": name, "ms": (time.perf_counter() - t) * 1e3,
                         "graphs": cuda_graph.captures() - c0, "dynamo": counters["stats"]["unique_graphs"] - d0})
            print(rows[-1], flush=True)
print("hits", pc.stats.per_request_hits, flush=True)
json.dump({"tag": tag, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "git": os.environ.get("FLASHPD_GIT_REV"),
           "warmup_s": w["seconds"], "rows": rows}, open(os.path.join(os.environ["OUT"], f"hits_{tag}.json"), "w"), indent=1)
