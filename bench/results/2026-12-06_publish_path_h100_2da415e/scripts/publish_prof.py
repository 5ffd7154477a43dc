"""Where a publish's time goes at the Qwen3-8B shape: 10 chunks of 256 positions (target 36 layers, draft 5; 43 MB
each) from CUDA tensors to host bytes, timed by step: the pageable copy (the old body_parts), the page-locked copy
(the new), the MAC, the join, to_bytes whole, MemoryStore.put whole, a segment write. Medians of 3 passes (ms for
the 10 chunks), after one warm-up pass."""
import json, os, statistics, sys, time
import torch
from flashpd.kv_bridge import shm
from flashpd.kv_bridge.auth import process_secret
from flashpd.kv_bridge.chunk import KVChunk, _host, join_parts
from flashpd.kv_bridge.shm_pool import SegmentPool, MAX_FILES, ROUND
from flashpd.kv_bridge.store import MemoryStore

mac = process_secret().mac_key  # MemoryStore() uses the same process secret
dev = "cuda"
N = 10
tk = [torch.randn(36, 2, 256, 8, 128, device=dev).to(torch.bfloat16) for _ in range(N)]
dk = [torch.randn(5, 2, 256, 8, 128, device=dev).to(torch.bfloat16) for _ in range(N)]
chunks = [KVChunk(f"{i:064x}", f"{i - 1:064x}" if i else "", "fp", list(range(256)), tk[i], dk[i]) for i in range(N)]
torch.cuda.synchronize()


def timed(fn, reps=3):
    fn()
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return {"median_ms": statistics.median(out), "all_ms": [round(x, 2) for x in out]}


res = {"gpu": torch.cuda.get_device_name(), "chunk_mb": chunks[0].nbytes() / 1e6, "cpu_count": os.cpu_count()}
res["pageable_cpu"] = timed(lambda: [(c.target_kv.contiguous().cpu(), c.draft_kv.contiguous().cpu()) for c in chunks])
res["pinned_host"] = timed(lambda: [(_host(c.target_kv), _host(c.draft_kv)) for c in chunks])
parts = [c.body_parts() for c in chunks]
res["mac_auto"] = timed(lambda: [mac.tag(p) for p in parts])
res["mac_1thread"] = timed(lambda: [(lambda h: [h.update(x) for x in p])(mac.hasher(1)) for p in parts])
res["join"] = timed(lambda: [b"".join(p) for p in parts], 6)
res["body_parts"] = timed(lambda: [c.body_parts() for c in chunks])
res["to_bytes"] = timed(lambda: [c.to_bytes(mac) for c in chunks])
res["join_np"] = timed(lambda: [join_parts(p) for p in parts], 6)
res["to_view"] = timed(lambda: [c.to_view(mac) for c in chunks], 6)
for f in ("enabled", "defrag", "shmem_enabled"):
    try:
        res["thp_" + f] = open(f"/sys/kernel/mm/transparent_hugepage/{f}").read().strip()
    except OSError:
        pass


def mem_put():
    s = MemoryStore(8 << 30)
    for c in chunks:
        s.put(c)


res["memory_store_put"] = timed(mem_put)
if shm.available():
    blobs = [b"".join(p) for p in parts]

    def seg():
        names = [shm.write_segment(b) for b in blobs]
        for n in names:
            shm.unlink_segment(n)
    res["segment_write"] = timed(seg)
    pool = SegmentPool()
    owner = shm.SegmentOwner.generate()

    def pooled():  # 10 chunks in a burst, the pool full at the start (MAX_FILES files), refilling meanwhile
        t0 = time.perf_counter()
        while pool.stats_now()["held_bytes"] < full and time.perf_counter() - t0 < 5:
            time.sleep(0.01)
        t = time.perf_counter()
        names = [pool.write(list(p), owner.put_tag) for p in parts_b]
        dt = (time.perf_counter() - t) * 1e3
        for n in names:
            shm.unlink_segment(n)
        return dt
    parts_b = [[b] for b in blobs]
    full = MAX_FILES * (-(-len(blobs[0]) // ROUND) * ROUND)
    shm.unlink_segment(pool.write(parts_b[0], owner.put_tag))
    pr = [pooled() for _ in range(4)]
    res["segment_write_pooled"] = {"median_ms": statistics.median(pr[1:]), "all_ms": [round(x, 2) for x in pr],
                                   "stats": pool.stats_now()}
    pool.close()
    del blobs
print(json.dumps(res, indent=1))
json.dump(res, open(sys.argv[1], "w"), indent=1)
