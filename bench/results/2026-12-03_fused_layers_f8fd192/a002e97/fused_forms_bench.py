# The script behind a002e97/fused_forms.json (diagnosis; runs at a002e97, whose engine/skinny_gemm.py had the
# fused forms): python fused_forms_bench.py, with OUT set to the output folder.
"""fused skinny forms vs plain at the 8B shapes, 36 copies a graph (diagnosis)."""
import json, os, sys, torch
from flashpd.engine import skinny_gemm as sg
from flashpd.bench.gemm_shapes import graph_us
torch.manual_seed(0)
dev = "cuda"
res = {}
BAD = []
for name, n, k, form in (("qkv", 6144, 4096, "norm"), ("o_proj", 4096, 4096, "resid"), ("gate_up", 24576, 4096, "norm"),
                         ("down", 4096, 12288, "swiglu_resid")):
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(36)]
    g = torch.ones(k, device=dev, dtype=torch.bfloat16)
    for m in (1, 16):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        gu = torch.randn(m, 2 * k, device=dev, dtype=torch.bfloat16)
        r = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        tl_ = sg.tile(n, k)
        plain = graph_us([lambda w=w: sg.launch(x, w, *tl_) for w in ws])
        if form == "norm":
            f = [lambda w=w: sg.launch(x, w, *tl_, norm=g, eps=1e-6) for w in ws]
        elif form == "resid":
            f = [lambda w=w: sg.launch(x, w, *tl_, residual=r) for w in ws]
        else:
            f = [lambda w=w: sg.launch(gu, w, *tl_, swiglu=True, residual=r) for w in ws]
        fused = graph_us(f)
        import torch.nn.functional as F
        from flashpd.engine.layers import rms_norm
        w0 = ws[0]
        if form == "norm":
            ref = F.linear(rms_norm(x.float(), g.float(), 1e-6), w0.float()); got = sg.launch(x, w0, *tl_, norm=g, eps=1e-6)
        elif form == "resid":
            ref = (r + sg.launch(x, w0, *tl_)).float(); got = sg.launch(x, w0, *tl_, residual=r)
        else:
            a, b = gu.float().chunk(2, -1); ref = r.float() + F.linear(F.silu(a) * b, w0.float()); got = sg.launch(gu, w0, *tl_, swiglu=True, residual=r)
        err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
        bad = err > 2e-2 or (form == "resid" and err != 0)
        if bad:
            print("WRONG", name, m, form, err, flush=True); BAD.append(name)
        res[f"{name}_m{m}"] = {"plain_us": plain, "fused_us": fused, "form": form}
        print(f"err {err:.2e} {name:8s} M={m:2d} plain {plain:7.2f} us  {form} {fused:7.2f} us  x{fused/plain:.3f}", flush=True)
json.dump(res, open(os.environ["OUT"] + "/fused_forms.json", "w"), indent=1)
p = sum(v["plain_us"] for k_, v in res.items() if k_.endswith("m1"))
f = sum(v["fused_us"] for k_, v in res.items() if k_.endswith("m1"))
print("m1 total plain", p, "fused", f)
sys.exit(4 if BAD else (0 if f <= 1.04 * p else 3))
