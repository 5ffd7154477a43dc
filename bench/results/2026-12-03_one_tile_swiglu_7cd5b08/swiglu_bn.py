"""The one-tile SwiGLU form's tile: BN (gate rows = up rows a program), warps, stages; at 1 and 16 rows, 24 gate/up
weights of the Qwen3-8B shape a CUDA graph; the plain gate/up matmul beside it."""
import json, os
import torch
from flashpd.bench.gemm_shapes import graph_us
from flashpd.engine import skinny_gemm as sg

res = {}
for m in (1, 16):
    h = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    gw = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
    xg, ss = sg.norm_input(h, gw)
    ws = [torch.randn(24576, 4096, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(24)]
    ref = sg.launch_fused(xg, ws[0], 16, 128, 2, 6, ss=ss, eps=1e-6, swiglu=True)[0]
    res[f"m{m}_plain"] = graph_us([lambda w=w: sg.launch(xg, w, *sg.tile(24576, 4096)) for w in ws], reps=50)
    for bn, warps, stages in ((16, 2, 6), (32, 2, 6), (32, 4, 6), (16, 4, 6), (16, 2, 4), (32, 4, 4), (16, 2, 8)):
        key = f"m{m}_bn{bn}_w{warps}_s{stages}"
        out = sg.launch_fused(xg, ws[0], bn, 128, warps, stages, ss=ss, eps=1e-6, swiglu=True)[0]
        res[key + "_bits_equal_bn16"] = bool(torch.equal(out, ref))
        res[key] = graph_us([lambda w=w: sg.launch_fused(xg, w, bn, 128, warps, stages, ss=ss, eps=1e-6,
                                                         swiglu=True) for w in ws], reps=50)
    print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in res.items() if k.startswith(f"m{m}")}), flush=True)
    del ws
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "swiglu_bn.json"), "w"), indent=1)
