"""Does torch's CPU work just before a restore slow the reader's MAC (OpenMP threads spinning after a parallel region
while BLAKE3's threads want the cores)? The chunk MAC over 430 MB, alone and right after a CPU matmul; a pageable
copy's rate, to tell the machine."""
import json, sys, time
import numpy as np, torch
from flashpd.kv_bridge.auth import process_secret

mac = process_secret().mac_key
buf = np.random.default_rng(0).integers(0, 255, size=430 << 20, dtype=np.uint8)
mv = memoryview(buf)
C = 43 << 20
a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
out = {"threads": torch.get_num_threads()}
def macs():
    t = time.perf_counter()
    for i in range(10):
        mac.tag([mv[i * C:(i + 1) * C]])
    return (time.perf_counter() - t) * 1e3
macs()
out["alone_ms"] = [macs() for _ in range(3)]
res = []
for _ in range(3):
    (a @ b).sum()
    res.append(macs())
out["after_matmul_ms"] = res
res = []
for _ in range(3):
    (a @ b).sum(); time.sleep(0.5)
    res.append(macs())
out["after_matmul_sleep_ms"] = res
if torch.cuda.is_available():
    dev = torch.empty(C, dtype=torch.uint8, device="cuda")
    t = time.perf_counter()
    for i in range(10):
        dev.copy_(torch.from_numpy(buf[i * C:(i + 1) * C])); torch.cuda.synchronize()
    out["pageable_gbps"] = 10 * C / (time.perf_counter() - t) / 1e9
print(json.dumps(out)); json.dump(out, open(sys.argv[1], "w"))
