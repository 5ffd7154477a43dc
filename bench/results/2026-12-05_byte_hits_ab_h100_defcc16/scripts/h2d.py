"""H2D rate of one 8B-shape chunk (42.9 MB bf16): pageable .to(), pinned-staged (pin_memory + non_blocking), and an
already pinned source; plus the bytes -> bytearray copy and the keyed BLAKE3 verify of the same size."""
import time, torch, blake3
x = torch.randn(41, 2, 256, 8, 128).to(torch.bfloat16)
nb = x.numel() * 2
dev = torch.device("cuda")
def t(fn, n=10):
    fn(); torch.cuda.synchronize()
    s = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - s) / n
p = x.pin_memory()
for name, fn in [("pageable .to", lambda: x.to(dev)), ("pin_memory+nb", lambda: x.pin_memory().to(dev, non_blocking=True)),
                 ("pinned src", lambda: p.to(dev, non_blocking=True))]:
    dt = t(fn); print(f"{name:16s} {dt*1e3:6.2f} ms {nb/dt/1e9:6.1f} GB/s")
b = bytes(x.view(torch.uint8).numpy())
s = time.perf_counter(); bytearray(b); dt = time.perf_counter() - s; print(f"bytearray copy   {dt*1e3:6.2f} ms {nb/dt/1e9:6.1f} GB/s")
h = blake3.blake3(key=bytes(32), max_threads=blake3.blake3.AUTO)
s = time.perf_counter(); h.update(b); h.digest(); dt = time.perf_counter() - s; print(f"blake3 AUTO      {dt*1e3:6.2f} ms {nb/dt/1e9:6.1f} GB/s")
print("torch threads", torch.get_num_threads())
