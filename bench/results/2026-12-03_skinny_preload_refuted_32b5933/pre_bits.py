"""The few-row GEMM with PRELOAD_TILES 0 against 2 and 4: the same bits in every form, at 1 and 16 rows, 8B shapes."""
import torch
from flashpd.engine import skinny_gemm as sg
torch.manual_seed(0)
dev = "cuda"
ok = True
for n, k in ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)):
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    for m in (1, 16):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ss = torch.rand(m, 3, device=dev, dtype=torch.float32) * k
        sw = n == 24576
        outs = {}
        for pre in (0, 2, 4):
            sg.PRELOAD_TILES = pre
            tile = sg.fused_tile(w, sw)
            y_plain = sg.launch(x, w, *sg.tile(n, k))
            y_rms = sg.launch_fused(x, w, *tile, ss=ss, eps=1e-6, swiglu=sw)[0]
            if not sw:
                r = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
                g = torch.randn(n, device=dev, dtype=torch.bfloat16)
                torch.manual_seed(1)
                res = sg.launch_fused(x, w, *tile, residual=r.clone(), g_next=g)
            else:
                res = ()
            torch.cuda.synchronize()
            outs[pre] = (y_plain, y_rms)
        for pre in (2, 4):
            same = all(torch.equal(a, b) for a, b in zip(outs[0], outs[pre]))
            ok &= same
            print(f"n={n} k={k} rows={m} pre={pre}: plain/rms forms equal to pre 0: {same}", flush=True)
# the residual form, the same inputs each time
w = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16) * 0.02
for m in (1, 16):
    x = torch.randn(m, 4096, device=dev, dtype=torch.bfloat16)
    r = torch.randn(m, 4096, device=dev, dtype=torch.bfloat16)
    g = torch.randn(4096, device=dev, dtype=torch.bfloat16)
    got = {}
    for pre in (0, 4):
        sg.PRELOAD_TILES = pre
        got[pre] = sg.launch_fused(x, w, *sg.fused_tile(w, False), residual=r, g_next=g)
    same = all(torch.equal(a, b) for a, b in zip(got[0], got[4]))
    ok &= same
    print(f"residual form rows={m} pre=4: equal to pre 0: {same}", flush=True)
print("ALL EQUAL" if ok else "DIFFER")
