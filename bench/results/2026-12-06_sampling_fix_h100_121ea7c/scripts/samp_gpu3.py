"""GPU check at 3655875: top-p kept sets (stable sort, float32 scan) eager vs compiled vs row by row; the cost of a
compiled draw, the first form of the uniforms against the current one, at 16, 512 and 2,048 rows of 151,936."""
import json, sys, time
import torch
from flashpd.engine.sampling import TOKEN, _key, _mix, draw, filtered_probs

dev, V = "cuda", 151936
out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "vocab": V}

def old_draw(probs, seed, index):
    k = _key(seed, index, TOKEN)
    v = torch.arange(V, dtype=torch.int64, device=k.device)
    k = _mix((k[..., None] + v * 0x27D4EB2F) & 0xFFFFFFFF)
    return (probs / -torch.log(((k >> 8).float() + 0.5) * (1.0 / (1 << 24)))).argmax(-1)

def old_keep(logits, top_p):
    scores = logits.float()
    ranked, order = scores.sort(dim=-1, descending=True)
    probs = torch.softmax(scores - scores.amax(-1, keepdim=True), -1)
    sp = probs.gather(-1, order)
    keep = sp.cumsum(-1) - sp < top_p.view(-1, 1, 1)
    return torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, keep)

diff = lambda a, b: int((a != b).any(-1).sum())
cf = torch.compile(filtered_probs, fullgraph=True)
ok = torch.compile(old_keep, fullgraph=True)
for trial in range(3):
    g = torch.Generator(dev).manual_seed(1 + trial)
    L = (torch.randn(64, 8, V, device=dev, generator=g) * 2.5).bfloat16()
    tp = torch.rand(64, device=dev, generator=g) * 0.98 + 0.01
    one, zk = torch.ones(64, device=dev), torch.zeros(64, dtype=torch.int64, device=dev)
    ne, nc = filtered_probs(L, one, tp, zk) > 0, cf(L, one, tp, zk) > 0
    nr = torch.cat([filtered_probs(L[r:r + 1], one[r:r + 1], tp[r:r + 1], zk[r:r + 1]) > 0 for r in range(64)])
    oe, oc = old_keep(L, tp), ok(L, tp)
    orr = torch.cat([old_keep(L[r:r + 1], tp[r:r + 1]) for r in range(64)])
    out[f"topp_trial{trial}"] = dict(rows=512, new_eager_vs_compiled=diff(ne, nc), new_eager_vs_rowwise=diff(ne, nr),
                                     old_eager_vs_compiled=diff(oe, oc), old_eager_vs_rowwise=diff(oe, orr))
    print(trial, out[f"topp_trial{trial}"], flush=True)

cn, co = torch.compile(draw), torch.compile(old_draw)
for R in (16, 512, 2048):
    p = torch.softmax(torch.randn(R, V, device=dev), -1)
    seed = torch.arange(R, device=dev); index = torch.full((R,), 99, device=dev)
    res = {}
    for name, fn in (("old", co), ("new", cn), ("old2", co), ("new2", cn)):
        for _ in range(3):
            fn(p, seed, index)
        ts = []
        for _ in range(20):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); fn(p, seed, index); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
        res[name] = sorted(ts)[len(ts) // 2]
    out[f"draw_ms_rows{R}"] = res
    print(R, res, flush=True)
print(json.dumps(out, indent=1))
json.dump(out, open(sys.argv[1], "w"), indent=1)
