"""Which cuBLASLt kernel each batch-128 projection takes, eager alone and inside the compiled attn_mlp (the
engine's b>16 layer tail), with the compiled call's kernel list and times. Usage: python probe128.py"""
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from flashpd.engine import qwen3
from flashpd.engine.runner import inductor_options
from flashpd.engine.runner_config import RunnerConfig

dev, dt = "cuda", torch.bfloat16
torch.backends.cuda.preferred_blas_library("cublaslt")
H, I, HKV, G, D, B = 4096, 12288, 8, 4, 128, 128
shapes = {"qkv": (6144, H), "o": (H, H), "gate_up": (2 * I, H), "down": (H, I)}


def kernels(fn, n=3):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA], record_shapes=True) as p:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    ev = [e for e in p.events() if e.device_type.name == "CUDA"]
    return [(e.name, e.device_time if hasattr(e, "device_time") else e.cuda_time) for e in ev]


for m in (32, 128):
    for name, (n, k) in shapes.items():
        x = torch.randn(m, k, device=dev, dtype=dt)
        w = torch.randn(n, k, device=dev, dtype=dt) * 0.02
        ks = kernels(lambda: F.linear(x, w), 1)
        print(f"eager m={m} {name}: {[(a[:60], round(b, 1)) for a, b in ks]}")

bs, nblk = 16, 18
blocks = B * nblk + 1
kc = torch.randn(blocks, bs, HKV, D, device=dev, dtype=dt) * 0.5
vc = torch.randn(blocks, bs, HKV, D, device=dev, dtype=dt) * 0.5
bt = (torch.arange(B * nblk, device=dev) + 1).view(B, nblk).to(torch.int64)
pos = torch.full((B, 1), 281, device=dev, dtype=torch.int64)
h = torch.randn(B, 1, H, device=dev, dtype=dt)
q = torch.randn(HKV, B, G, D, device=dev, dtype=dt)
w_o = torch.randn(H, H, device=dev, dtype=dt) * 0.02
w_gu = torch.randn(2 * I, H, device=dev, dtype=dt) * 0.02
w_d = torch.randn(H, I, device=dev, dtype=dt) * 0.02
w_post = torch.ones(H, device=dev, dtype=dt)
w_next = torch.ones(H, device=dev, dtype=dt)
cfg = RunnerConfig().resolved(torch.device(dev))
fn = torch.compile(qwen3.attn_mlp, fullgraph=True, dynamic=True, options=inductor_options(cfg))
call = lambda: fn(h, q, kc, vc, bt, pos, None, w_o, w_post, w_gu, w_d, w_next, 1e-6, D ** -0.5, None)
ks = kernels(call, 1)
tot = sum(b for _, b in ks)
print(f"compiled attn_mlp b={B}: {len(ks)} kernels, {tot:.1f} us")
for a, b in ks:
    print(f"   {b:8.1f} us  {a[:110]}")
# the same with every intermediate in a graph, 36 calls, wall time a call
g = torch.cuda.CUDAGraph()
s = torch.cuda.Stream()
with torch.cuda.stream(s):
    call()
torch.cuda.synchronize()
with torch.cuda.graph(g):
    for _ in range(36):
        call()
g.replay(); torch.cuda.synchronize()
a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
a.record(); g.replay(); b.record(); torch.cuda.synchronize()
print(f"graph: {a.elapsed_time(b) * 1e3 / 36:.1f} us a call (weights shared: L2-warm)")
