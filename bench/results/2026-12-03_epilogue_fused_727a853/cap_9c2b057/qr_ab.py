"""A/B of qkv_rope's kernel (HEAD) against 7c4b84b's parent, alone at the Qwen3-8B shape: bits and time.

Its old module is made from git beside this script first (its op renamed, so that both register):

    git show 7c4b84b^:engine/qkv_rope.py | sed 's/flashpd::qkv_rope_write/flashpd_old::qkv_rope_write/;
        s/torch.ops.flashpd.qkv_rope_write/torch.ops.flashpd_old.qkv_rope_write/' > qkv_rope_old.py
    OUT=. python qr_ab.py                                                   # qkv_rope_ab.json
"""
import json, os, sys, importlib.util
import torch
from flashpd.engine import qkv_rope as new
spec = importlib.util.spec_from_file_location("qkv_rope_old", os.path.join(os.path.dirname(__file__), "qkv_rope_old.py"))
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
nq, nkv, d, eps = 32, 8, 128, 1e-6
dev = "cuda"; dt = torch.bfloat16
res = {}
for b, t in ((1, 1), (1, 16), (32, 1), (128, 1)):
    g = torch.Generator(device=dev).manual_seed(b * 100 + t)
    L = 36
    qkv = [torch.randn(b, t, (nq + 2 * nkv) * d, device=dev, dtype=dt, generator=g) for _ in range(L)]
    ang = torch.rand(b, t, d // 2, device=dev, generator=g) * 6
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(dt); sin = torch.cat([ang.sin(), ang.sin()], -1).to(dt)
    wq = torch.randn(d, device=dev, dtype=dt, generator=g); wk = torch.randn(d, device=dev, dtype=dt, generator=g)
    slots = torch.randperm(4096, device=dev)[: b * t].contiguous()
    outs = {}
    for name, mod in (("new", new), ("old", old)):
        kc = [torch.zeros(4096, nkv, d, device=dev, dtype=dt) for _ in range(L)]
        vc = [torch.zeros(4096, nkv, d, device=dev, dtype=dt) for _ in range(L)]
        qs = [mod.qkv_rope_write(qkv[i], cos, sin, wq, wk, eps, nq, nkv, kc[i], vc[i], slots) for i in range(L)]
        outs[name] = (qs[0].clone(), kc[0].clone(), vc[0].clone())
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            for _ in range(3):
                [mod.qkv_rope_write(qkv[i], cos, sin, wq, wk, eps, nq, nkv, kc[i], vc[i], slots) for i in range(L)]
        torch.cuda.synchronize()
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            [mod.qkv_rope_write(qkv[i], cos, sin, wq, wk, eps, nq, nkv, kc[i], vc[i], slots) for i in range(L)]
        outs[name + "_graph"] = gr
        outs[name + "_keep"] = (kc, vc, qs)  # the graph writes these: they must outlive it
    same = all(torch.equal(a, c) for a, c in zip(outs["new"], outs["old"]))
    times = {"new": [], "old": []}
    for rep in range(4):
        for name in ("new", "old") if rep % 2 == 0 else ("old", "new"):
            gr = outs[name + "_graph"]
            for _ in range(20): gr.replay()
            e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
            torch.cuda.synchronize(); e0.record()
            for _ in range(200): gr.replay()
            e1.record(); torch.cuda.synchronize()
            times[name].append(e0.elapsed_time(e1) / 200 / L * 1000)
    res[f"b{b}_t{t}"] = {"bits_equal": same, "us_per_call_new": times["new"], "us_per_call_old": times["old"],
                         "new_min": min(times["new"]), "old_min": min(times["old"])}
    print(b, t, res[f"b{b}_t{t}"], flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "qkv_rope_ab.json"), "w"), indent=1)
