"""Host -> device copies out of a read-only memfd mapping (the arena reader's view): pageable against
cudaHostRegister'd (ReadOnly | Portable), and what registering costs (whole arena, per chunk, per extent)."""
import json
import mmap
import os
import sys
import time

import numpy as np
import torch

MB = 1 << 20
CHUNK = 43 * MB  # a 256-token chunk at the Qwen3-8B / DFlash-b16 shape (42.9 MB)
ARENA = 2048 * MB
PORTABLE, READONLY = 1, 8
rt = torch.cuda.cudart()
out = {"device": torch.cuda.get_device_name()}


def reg(ptr: int, n: int, flags: int = PORTABLE | READONLY) -> float:
    t = time.perf_counter()
    e = rt.cudaHostRegister(ptr, n, flags)
    dt = time.perf_counter() - t
    if int(e) != 0:
        raise RuntimeError(f"cudaHostRegister({n}) -> {e}")
    return dt


def unreg(ptr: int) -> float:
    t = time.perf_counter()
    e = rt.cudaHostUnregister(ptr)
    if int(e) != 0:
        raise RuntimeError(f"cudaHostUnregister -> {e}")
    return time.perf_counter() - t


def arena(touch: bool):
    fd = os.memfd_create("a", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, ARENA)
    w = mmap.mmap(fd, ARENA, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    if touch:
        np.frombuffer(w, dtype=np.uint8)[:] = 7
    r = mmap.mmap(fd, ARENA, mmap.MAP_SHARED, mmap.PROT_READ)
    return fd, w, r, np.frombuffer(r, dtype=np.uint8).ctypes.data


dev = torch.empty(CHUNK, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()


def copies(r, n: int = 24, nb: bool = False) -> float:
    """GB/s of n chunk copies at distinct offsets (blocking unless nb; nb syncs once at the end)."""
    views = [torch.frombuffer(memoryview(r)[i * CHUNK:(i + 1) * CHUNK], dtype=torch.uint8) for i in range(n)]
    dev.copy_(views[0])
    torch.cuda.synchronize()
    t = time.perf_counter()
    for v in views:
        dev.copy_(v, non_blocking=nb)
    torch.cuda.synchronize()
    return n * CHUNK / (time.perf_counter() - t) / 1e9


import warnings
warnings.filterwarnings("ignore")
fd, w, r, ptr = arena(True)
out["pageable_gbps"] = [copies(r) for _ in range(3)]
out["pageable_to_gbps"] = []
for _ in range(2):
    v = torch.frombuffer(memoryview(r)[:CHUNK], dtype=torch.uint8)
    t = time.perf_counter(); x = v.to("cuda"); torch.cuda.synchronize()
    out["pageable_to_gbps"].append(CHUNK / (time.perf_counter() - t) / 1e9)
# per chunk: register, copy, unregister
per = []
for i in range(8):
    p = ptr + i * CHUNK
    v = torch.frombuffer(memoryview(r)[i * CHUNK:(i + 1) * CHUNK], dtype=torch.uint8)
    t0 = time.perf_counter(); a = reg(p, CHUNK); t1 = time.perf_counter(); dev.copy_(v); torch.cuda.synchronize()
    t2 = time.perf_counter(); b = unreg(p)
    per.append(dict(register_ms=a * 1e3, copy_ms=(t2 - t1) * 1e3, unregister_ms=b * 1e3, pinned=bool(v.is_pinned()) if False else None))
out["per_chunk"] = per
# extents of 64 MiB
ext = []
for i in range(4):
    ext.append(dict(register_ms=reg(ptr + i * 64 * MB, 64 * MB) * 1e3))
for i in range(4):
    ext[i]["unregister_ms"] = unreg(ptr + i * 64 * MB) * 1e3
out["extent_64mib"] = ext
# the whole 2 GiB, populated
out["whole_populated_register_ms"] = reg(ptr, ARENA) * 1e3
out["pinned_is_pinned"] = bool(torch.frombuffer(memoryview(r)[:CHUNK], dtype=torch.uint8).is_pinned())
out["registered_gbps"] = [copies(r) for _ in range(3)]
out["registered_nb_gbps"] = [copies(r, nb=True) for _ in range(2)]
out["whole_unregister_ms"] = unreg(ptr) * 1e3
# the whole 2 GiB, never written (a fresh arena's holes)
fd2, w2, r2, ptr2 = arena(False)
out["whole_unpopulated_register_ms"] = reg(ptr2, ARENA) * 1e3
out["unpopulated_unregister_ms"] = unreg(ptr2) * 1e3
# a torch pinned buffer, for reference
pin = torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True)
pin.fill_(3)
dev.copy_(pin); torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(24):
    dev.copy_(pin)
torch.cuda.synchronize()
out["torch_pinned_gbps"] = 24 * CHUNK / (time.perf_counter() - t) / 1e9
# the chunk MAC's rate on this host (keyed BLAKE3, AUTO threads), over the mapped bytes
try:
    import blake3
    key = b"k" * 32
    mv = memoryview(r)[:CHUNK]
    blake3.blake3(mv, key=key, max_threads=blake3.blake3.AUTO).digest()
    t = time.perf_counter()
    for _ in range(5):
        blake3.blake3(mv, key=key, max_threads=blake3.blake3.AUTO).digest()
    out["blake3_auto_gbps"] = 5 * CHUNK / (time.perf_counter() - t) / 1e9
    t = time.perf_counter()
    blake3.blake3(mv, key=key, max_threads=1).digest()
    out["blake3_1t_gbps"] = CHUNK / (time.perf_counter() - t) / 1e9
except ImportError as e:
    out["blake3"] = str(e)
out["cpus"] = os.cpu_count()
json.dump(out, open(sys.argv[1], "w"), indent=1)
print(json.dumps(out, indent=1))
