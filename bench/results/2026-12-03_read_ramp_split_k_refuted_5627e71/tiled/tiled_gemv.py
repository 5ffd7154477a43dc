"""Few-row GEMM over a weight stored tile by tile ([N/BN, K/BK, BN, BK] contiguous: each stage's [BN, BK] tile one
contiguous piece) against the engine's kernel on the row-major weight: same arithmetic, so the same bits."""
import json, sys, torch
import triton, triton.language as tl
from flashpd.engine import skinny_gemm, triton_env
from flashpd.engine.triton_env import pdl_wait, pdl_release
from flashpd.bench.attn_micro import graph_time
from flashpd.bench.common import copy_bandwidth_gbs

@triton.jit
def _tiled(x_ptr, w_ptr, y_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    rm = tl.arange(0, BM)
    rn = pid * BN + tl.arange(0, BN)
    pdl_wait(PDL)
    rk = tl.arange(0, BK)
    m_ok = rm < M
    x_base = x_ptr + rm[:, None] * K + rk[None, :]
    w_base = w_ptr + pid.to(tl.int64) * BN * K + tl.arange(0, BN)[:, None] * BK + rk[None, :]
    acc = tl.zeros([BM, BN], tl.float32)
    for k in range(0, K, BK):
        a = tl.load(x_base + k, mask=m_ok[:, None], other=0.0)
        w = tl.load(w_base + k * BN)
        acc = tl.dot(a, tl.trans(w), acc)
    pdl_release(PDL)
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & (rn < N)[None, :])

def tiled(w, bn, bk):
    n, k = w.shape
    return w.view(n // bn, bn, k // bk, bk).permute(0, 2, 1, 3).contiguous()

def run_tiled(x, wt, n, k, bn, bk, warps, stages):
    y = x.new_empty((x.shape[0], n))
    _tiled[(n // bn,)](x, wt, y, x.shape[0], n, k, BM=16, BN=bn, BK=bk, num_warps=warps, num_stages=stages,
                       **triton_env.pdl_args(x.device))
    return y

dev = torch.device("cuda")
copy = copy_bandwidth_gbs()["gb_per_s"]
rows = []
SH = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "down": (4096, 12288), "gate_up": (24576, 4096)}
for name, (n, k) in SH.items():
    copies = 36 if n * k * 2 < 300e6 else 24
    ws = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(copies)]
    x = torch.randn(1, k, dtype=torch.bfloat16, device=dev)
    x16 = torch.randn(16, k, dtype=torch.bfloat16, device=dev)
    tile = skinny_gemm.tile(n, k)
    i = [0]
    def base():
        skinny_gemm.launch(x, ws[i[0] % copies], *tile); i[0] += 1
    us = graph_time(base, reps=max(5, 200 // copies), inner=copies)
    print(f"{name} engine tile {tile}: {us:.2f} us ({n*k*2/us/1e3/copy:.3f} of copy)", flush=True)
    rows.append({"shape": name, "variant": "engine", "tile": list(tile), "us": us, "of_copy": n*k*2/us/1e3/copy})
    for bn, bk, warps, stages in ((tile[0], 128, 2, 6), (tile[0], 128, 2, 4), (tile[0], 256, 2, 4), (tile[0], 128, 4, 6), (tile[0], 64, 2, 8)):
        wts = [tiled(w, bn, bk) for w in ws]
        same = torch.equal(run_tiled(x16, wts[0], n, k, bn, bk, warps, stages), skinny_gemm.launch(x16, ws[0], bn, bk, warps, stages)) if bk == 128 else None
        j = [0]
        def tf():
            run_tiled(x, wts[j[0] % copies], n, k, bn, bk, warps, stages); j[0] += 1
        us = graph_time(tf, reps=max(5, 200 // copies), inner=copies)
        print(f"{name} tiled bn{bn} bk{bk} w{warps} s{stages}: {us:.2f} us ({n*k*2/us/1e3/copy:.3f} of copy) same bits as engine kernel {same}", flush=True)
        rows.append({"shape": name, "variant": f"tiled-n{bn}-k{bk}-w{warps}-s{stages}", "us": us, "of_copy": n*k*2/us/1e3/copy, "same_bits": same})
        del wts
    del ws
json.dump({"copy_gbs": copy, "rows": rows}, open(sys.argv[1], "w"), indent=1)
