"""Where an arena restore's time goes at the Qwen3-8B / DFlash-b16 chunk shape: the Get (handles + MAC over the
mapped bytes), the MAC alone, and the host -> device copies; minor page faults of each phase."""
import json, resource, sys, time
import torch
from flashpd.bench.bridge_throughput import start_server
from flashpd.kv_bridge.client import BridgeClient
from flashpd.kv_bridge.chunk import KVChunk
from flashpd.kv_bridge.auth import process_secret

cuda = torch.cuda.is_available()
dt = torch.bfloat16
N, T = int(sys.argv[2]) if len(sys.argv) > 2 else 10, 256
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
out = {"cuda": cuda, "chunks": N, "bytes": nbytes}
flt = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
try:
    with BridgeClient(addr, timeout_s=600) as w:
        t = time.perf_counter(); s = w.put(chunks, "shm"); out["put_s"] = time.perf_counter() - t
    for pin, streams in ([(True, 4), (True, 1), (False, 4)] if cuda else [(False, 4), (False, 1)]):
        with BridgeClient(addr, timeout_s=600, pin_arenas=pin, streams=streams) as c:
            got = list(c.iter_get(keys, "arena"))
            assert len(got) == N
            del got
            t0 = time.perf_counter()
            while pin and c.arena_stats()["pinned"] < 1:
                time.sleep(0.01)
            row = {"pin": pin, "streams": streams, "pin_wait_s": time.perf_counter() - t0, "reps": []}
            mac = process_secret().mac_key
            for rep in range(5):
                f0, t0 = flt(), time.perf_counter()
                got = list(c.iter_get(keys, "arena"))
                f1, t1 = flt(), time.perf_counter()
                views = [c._arenas._maps[next(iter(c._arenas._maps))].mm]  # the mapping
                # the MAC alone, over each chunk's mapped bytes (as from_bytes does)
                t2 = time.perf_counter()
                for ch in got:
                    pass
                r = {"get_ms": (t1 - t0) * 1e3, "get_faults": f1 - f0}
                if cuda:
                    f2, t3 = flt(), time.perf_counter()
                    for ch in got:
                        a = ch.target_kv.to("cuda"); b = ch.draft_kv.to("cuda")
                    torch.cuda.synchronize()
                    r["copy_ms"] = (time.perf_counter() - t3) * 1e3; r["copy_faults"] = flt() - f2
                    r["pinned_tensor"] = bool(got[0].target_kv.is_pinned())
                r["fresh"] = all(ch.fresh() for ch in got)
                row["reps"].append(r)
                del got, views
            # MAC alone over the mapped bytes, through the same API the Get uses
            from flashpd.kv_bridge import arena as A
            m = next(iter(c._arenas._maps.values()))
            mv = memoryview(m.mm)
            t0 = time.perf_counter()
            for _ in range(3):
                mac.tag([mv[:nbytes]])
            row["mac_gbps_whole"] = 3 * nbytes / (time.perf_counter() - t0) / 1e9
            per = nbytes // N
            t0 = time.perf_counter()
            for i in range(N):
                mac.tag([mv[i * per:(i + 1) * per]])
            row["mac_ms_per_chunk_sequential"] = (time.perf_counter() - t0) * 1e3 / N
            del mv, m
            out[f"pin_{pin}_streams_{streams}"] = row
            print(json.dumps(row), flush=True)
finally:
    proc.terminate(); proc.wait(30)
json.dump(out, open(sys.argv[1], "w"), indent=1)
