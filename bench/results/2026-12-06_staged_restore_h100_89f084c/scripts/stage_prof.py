"""An arena Get of 10 Qwen3-8B-shape chunks (43 MB, both halves) read with and without staging, and with the MAC
on fewer threads: where the staged fetch's extra time comes from."""
import json, statistics, sys, time
import torch
from flashpd.bench.bridge_throughput import start_server
from flashpd.kv_bridge.client import BridgeClient
from flashpd.kv_bridge.chunk import KVChunk
from flashpd.kv_bridge.stage import Stager
from flashpd.kv_bridge import auth

dt = torch.bfloat16
N, T = 10, 256
g = torch.Generator().manual_seed(0)
chunks, parent = [], ""
for i in range(N):
    tk = torch.randint(-30000, 30000, (36, 2, T, 8, 128), dtype=torch.int16, generator=g).view(dt)
    dk = torch.randint(-30000, 30000, (5, 2, T, 8, 128), dtype=torch.int16, generator=g).view(dt)
    c = KVChunk(f"{i + 1:064x}", parent, "fp", list(range(i * T, (i + 1) * T)), tk, dk)
    chunks.append(c); parent = c.key
keys = [c.key for c in chunks]
nbytes = sum(c.nbytes() for c in chunks)
proc, addr = start_server(nbytes * 2 + (256 << 20), arena=True)
dev = torch.device("cuda")
res = {}
ms = lambda t: (time.perf_counter() - t) * 1e3
real_hasher = auth.MacKey.hasher
try:
    with BridgeClient(addr, timeout_s=600) as w:
        w.put(chunks, "shm")
    with BridgeClient(addr, timeout_s=600, pin_device=dev) as c:
        list(c.iter_get(keys, "arena"))
        while c.arena_stats()["pinned"] < 1:
            time.sleep(0.01)
        stager = Stager(2 << 30)
        pre = [(torch.empty_like(x.target_kv, device=dev), torch.empty_like(x.draft_kv, device=dev)) for x in chunks]
        side = torch.cuda.Stream()

        def plain():
            return list(c.iter_get(keys, "arena"))

        def staged():
            run = stager.run(); out = []; adds = []
            for x in c.iter_get(keys, "arena"):
                t = time.perf_counter(); out.append(run.add(x, dev, dev)); adds.append(ms(t))
            run.finish()
            return adds

        def prealloc():  # the same copies into buffers allocated once
            ev = None
            for i, x in enumerate(c.iter_get(keys, "arena")):
                with torch.cuda.stream(side):
                    pre[i][0].copy_(x.target_kv, non_blocking=True); pre[i][1].copy_(x.draft_kv, non_blocking=True)
            side.synchronize()

        def after():  # read all, then copy (what apply did)
            got = plain()
            for i, x in enumerate(got):
                pre[i][0].copy_(x.target_kv); pre[i][1].copy_(x.draft_kv)
            torch.cuda.synchronize()

        forms = {"plain": plain, "staged": staged, "prealloc": prealloc, "after": after}
        for threads in (0, 8, 4):
            if threads:
                auth.MacKey.hasher = lambda self, max_threads=threads: real_hasher(self, threads)
            for name, f in forms.items():
                f()
                times, extra = [], []
                for rep in range(7):
                    torch.cuda.synchronize()
                    t = time.perf_counter(); r = f(); times.append(ms(t))
                    if name == "staged":
                        extra.append(sum(r))
                key = f"{name}_t{threads or 'auto'}"
                res[key] = {"median_ms": statistics.median(times), "all": [round(x, 2) for x in times]}
                if extra:
                    res[key]["add_ms_sum_median"] = statistics.median(extra)
                print(key, res[key], flush=True)
            auth.MacKey.hasher = real_hasher
finally:
    proc.terminate(); proc.wait(30)
json.dump(res, open(sys.argv[1], "w"), indent=1)
