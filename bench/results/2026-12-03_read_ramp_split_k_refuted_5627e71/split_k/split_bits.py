"""Split-K few-row GEMM on the GPU: a row's bits alone and among 16, every form, at the 8B shapes; vs unsplit."""
import sys, torch, torch.nn.functional as F
import flashpd.engine.skinny_gemm as sg
dev = "cuda"
torch.manual_seed(0)
ok = True
for target in (512, 1024, 2048):
    sg.SPLIT_TARGET_PROGRAMS = target
    for name, (n, k) in {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}.items():
        h = torch.randn(16, k, device=dev, dtype=torch.bfloat16)
        g = (torch.rand(k, device=dev) + 0.5).to(torch.bfloat16)
        w = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
        bn, bk = sg.tile(n, k)[:2]
        split = sg.split_k(-(-n // bn), k, bk)
        plain = sg.skinny_linear(h, w)
        eq = all(torch.equal(sg.skinny_linear(h[r:r + 1], w), plain[r:r + 1]) for r in (0, 7, 15))
        eq &= torch.equal(sg.skinny_linear(h[3:10], w), plain[3:10])
        ref = F.linear(h.float(), w.float())
        err = (plain.float() - ref).abs().max().item()
        xg, ss = sg.norm_input(h, g)
        if name == "gate_up":
            y = sg.fused_linear(xg, w, ss, 1e-6, swiglu=True)
            eq &= all(torch.equal(sg.fused_linear(xg[r:r + 1], w, ss[r:r + 1], 1e-6, swiglu=True), y[r:r + 1]) for r in (0, 9))
        else:
            y = sg.fused_linear(xg, w, ss, 1e-6)
            eq &= all(torch.equal(sg.fused_linear(xg[r:r + 1], w, ss[r:r + 1], 1e-6), y[r:r + 1]) for r in (0, 9))
        if n == 4096:
            r = torch.randn(16, n, device=dev, dtype=torch.bfloat16)
            gn = (torch.rand(n, device=dev) + 0.5).to(torch.bfloat16)
            a, b, c = sg.fused_residual(h, w, r, gn)
            for row in (0, 12):
                a1, b1, c1 = sg.fused_residual(h[row:row + 1], w, r[row:row + 1], gn)
                eq &= torch.equal(a1, a[row:row + 1]) and torch.equal(b1, b[row:row + 1]) and torch.equal(c1, c[row:row + 1])
        # repeated calls give the same bits (counters reset, no stale partials)
        eq &= all(torch.equal(sg.skinny_linear(h, w), plain) for _ in range(5))
        ok &= eq
        print(f"target {target} {name}: split {split} rows invariant {eq} err vs fp32 {err:.2e}", flush=True)
sg.SPLIT_TARGET_PROGRAMS = 0
print("ALL OK" if ok else "FAILED")
sys.exit(0 if ok else 1)
