"""engine/ws_gemm.py: the few-row projection, warp-specialized (off by default).

Gluon has no CPU interpreter: a child process compiles each fused form for sm_90 (triton's own ptxas) and the tests
read the PTX. The consumers wait for the kernel ahead before their first copy of x and before reading ss or the
residual; the loader lets the next kernel launch before its first weight copy and never waits; the MMAs run 16 a
256-column K step (32 with SwiGLU's gate and up) in each of two consumer warps, which read their operands by
ldmatrix from 128-byte-swizzled tiles (shared memory's bandwidth, the kernel's docstring); two programs fit an SM.
launch_fused itself also runs on the CPU as far as the compile (tests/_launch_path.py), at the Qwen3-8B shapes.
On a GPU: the plain form bitwise the
few-row Triton kernel, the fused forms within a rounding of it, and every form's row bits independent of the rows
beside it (a decode's one row and a verify's sixteen).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from flashpd.engine import skinny_gemm, ws_gemm

CHILD = r'''
import json, sys
import torch
torch.backends.cuda.is_built = lambda: True  # a CPU build of torch: import triton as a CUDA build would
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon import language as gl
from flashpd.engine import ws_gemm as wg

forms = {"plain": dict(RMS=False, SWIGLU=False, RESID=False, NEXT=False),
         "rms_swiglu": dict(RMS=True, SWIGLU=True, RESID=False, NEXT=False),
         "resid_next": dict(RMS=False, SWIGLU=False, RESID=True, NEXT=True)}
lay = wg._layout()  # the launch's own tile layout
assert wg.gluon is not None and lay.swizzle_byte_width == 128
out = {}
for name in sys.argv[1:]:
    f = forms[name]
    bk = wg.BKS[0]
    sig = {"w_desc": f"tensordesc<bf16[{wg.BN}, {wg.SUB}],{lay!r}>",
           "x_desc": f"tensordesc<bf16[16, {wg.SUB}],{lay!r}>",
           "y_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "sym": "i32", "ss_ptr": "*fp32", "P_SS": "i32",
           "eps": "fp32", "r_ptr": "*bf16", "srm": "i32", "g_ptr": "*bf16", "xg_ptr": "*bf16", "sso_ptr": "*fp32"}
    const = dict(BN=wg.BN, BK=bk, SUB=wg.SUB, S=wg.SLOTS // 2 if f["SWIGLU"] else wg.SLOTS, XS=wg.X_SLOTS,
                 P_PAD=256, PDL=1, WARPS=wg.WARPS, WORKER_REGS=wg.WORKER_REGS, **f)
    sig.update({c: "constexpr" for c in const})
    names = list(sig)
    attrs = {(names.index(p),): [["tt.divisibility", 16]]
             for p in ("y_ptr", "ss_ptr", "r_ptr", "g_ptr", "xg_ptr", "sso_ptr", "sym", "srm", "N", "K")}
    cc = triton.compile(GluonASTSource(fn=wg._ws_kernel, signature=sig, constexprs=const, attrs=attrs),
                        target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": wg.IDLE_WARPS, "maxnreg": 128, "launch_pdl": True})
    out[name] = {"shared": cc.metadata.shared, "ptx": cc.asm["ptx"]}
print(json.dumps(out))
'''

FORMS = ("plain", "rms_swiglu", "resid_next")


@pytest.fixture(scope="module")
def compiled() -> dict:
    pytest.importorskip("triton.experimental.gluon")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", CHILD, *FORMS], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("form", FORMS)
def test_the_consumers_wait_and_the_loader_never_does(compiled: dict, form: str) -> None:
    c = compiled[form]
    ptx = c["ptx"].splitlines()
    at = lambda key: [i for i, ln in enumerate(ptx) if key in ln]  # noqa: E731
    assert c["shared"] <= 113 * 1024  # two programs an SM: this launch and the next
    assert any(ln.strip() == ".maxnreg 128" for ln in ptx)
    assert any(ln.strip() == ".reqntid 256" for ln in ptx)  # 2 x 128 threads x 128 registers: two programs an SM
    wait, release = at("griddepcontrol.wait"), at("griddepcontrol.launch_dependents")
    assert len(wait) == 1 and len(release) == 1
    # the partitions in the text: the idle one, the loader (its release, then its copies), the consumers (their
    # wait, then x's copies); a slot is BK / SUB copies of [rows, SUB] tiles, twice for SwiGLU's gate and up rows
    tma, loads = at("cp.async.bulk.tensor"), at("ld.global")
    nsub = ws_gemm.BKS[0] // ws_gemm.SUB
    assert release[0] < wait[0] and min(tma) > release[0]
    assert len([t for t in tma if t < wait[0]]) == nsub * (2 if form == "rms_swiglu" else 1)
    assert len([t for t in tma if t > wait[0]]) == (ws_gemm.X_SLOTS + 1) * nsub  # fetched ahead, then in the loop
    assert all(i > wait[0] for i in loads)  # ss, the residual and g only after the kernel ahead
    stores = at("st.global")
    assert stores and all(i > wait[0] for i in stores)


@pytest.mark.parametrize("form", FORMS)
def test_no_warp_repeats_an_mma_or_reads_a_tile_unswizzled(compiled: dict, form: str) -> None:
    """Shared memory's bandwidth (ws_gemm's docstring): the consumers' barrier names 2 warps, each of which runs
    16 MMAs a 256-column step (32 with SwiGLU), so the two cover the [16, 16] tile once; operands come by ldmatrix
    (K-contiguous rows, no element-wise reads) from [rows, 64] tiles in the launch's 128-byte-swizzled layout."""
    ptx = compiled[form]["ptx"]
    assert re.search(rf"bar\.sync\s+\d+, {32 * ws_gemm.WARPS};", ptx)
    mmas = [ln for ln in ptx.splitlines() if "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ln]
    swiglu = form == "rms_swiglu"
    assert len(mmas) == (2 if swiglu else 1) * ws_gemm.BKS[0] // 16
    ld = [ln for ln in ptx.splitlines() if "ldmatrix" in ln]
    nsub = ws_gemm.BKS[0] // ws_gemm.SUB
    assert all("ldmatrix.sync.aligned.m8n8.x4.shared.b16" in ln for ln in ld)  # not .trans: K-contiguous rows
    assert len(ld) == nsub * (4 + 2 * (2 if swiglu else 1))  # x's [16, 64] tile: 4; a [64, 8] half: 2
    assert "ld.shared.v4" not in ptx  # no operand read element-wise


LAUNCHES = r'''
from flashpd.engine import ws_gemm
ws_gemm._sms = lambda device: 132  # an H200's SMs (the CPU has no CUDA device to ask)
t = lambda *shape: torch.empty(*shape, dtype=torch.bfloat16)  # nothing runs: shapes, strides and dtypes only
x, h, ss = t(1, 4096), t(1, 12288), torch.rand(1, 256)
ws_gemm.launch_fused(x, t(6144, 4096), None, 0.0, False, None, None, True)  # q/k/v, one row
ws_gemm.launch_fused(x, t(6144, 4096), ss, 1e-6, False, None, None, True)  # q/k/v after the norm
ws_gemm.launch_fused(x, t(2 * 12288, 4096), ss, 1e-6, True, None, None, True)  # gate/up, SwiGLU
ws_gemm.launch_fused(h, t(4096, 12288), None, 0.0, False, t(1, 4096), t(4096), True)  # down + residual + next
ws_gemm.launch_fused(t(16, 4096), t(4096, 4096), None, 0.0, False, None, None, True)  # a verify's 16 rows
ws_gemm.launch_fused(t(3, 192), t(256, 192), None, 0.0, False, None, None, False)  # the demo pair's K, no PDL
'''


def test_the_launch_path_builds_each_form_as_the_gpu_would_compile_it() -> None:
    """launch_fused itself, on CPU tensors at the Qwen3-8B shapes (and the demo pair's K = 192), as far as the
    compile (tests/_launch_path.py): the descriptors are [rows, 64] boxes in the 128-byte swizzle, the ring's
    constexprs follow K, the kernel has the idle warpgroup and the workers' (8 warps), two programs fit an SM, and
    PDL appears exactly where the call asked for it."""
    pytest.importorskip("triton.experimental.gluon")
    from _launch_path import compile_launches
    built = compile_launches(LAUNCHES)
    assert [b["fn"] for b in built] == ["_ws_kernel"] * 6
    for i, b in enumerate(built):
        c = b["constexprs"]
        for desc in ("w_desc", "x_desc"):  # bf16[16, 64] boxes, swizzle_byte_width=128 (as each triton spells it)
            assert "[16, 64]" in b["signature"][desc] and re.search(r"swizzl[^,=]*=\s*128", b["signature"][desc])
        assert (c["BK"], c["SUB"], c["WARPS"]) == ("64" if i == 5 else "256", "64", "2")
        assert c["S"] == ("4" if i == 2 else "8") and c["SWIGLU"] == str(i == 2)
        assert c["RMS"] == str(i in (1, 2)) and c["RESID"] == c["NEXT"] == str(i == 3)
        assert b["num_warps"] == 8 and b["shared"] <= 113 * 1024
        pdl = "griddepcontrol.wait" in b["ptx"], "griddepcontrol.launch_dependents" in b["ptx"]
        assert pdl == ((i != 5),) * 2


def test_it_is_off_by_default_and_never_takes_a_cpu_call() -> None:
    assert ws_gemm.ENABLED is False
    assert [ws_gemm.block_k(k) for k in (4096, 12288, 896, 192, 100)] == [256, 256, 128, 64, None]
    x, w = torch.zeros(1, 256, dtype=torch.bfloat16), torch.zeros(64, 256, dtype=torch.bfloat16)
    assert not ws_gemm.applies(x, w, None)
    ws_gemm.ENABLED = True
    try:
        assert not ws_gemm.applies(x, w, None)  # CPU tensors: skinny_gemm's kernel or F.linear
    finally:
        ws_gemm.ENABLED = False


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or not ws_gemm.available()
                               or torch.cuda.get_device_capability()[0] < 9, reason="needs an sm_90 GPU and Gluon")


def _both(fn):
    """fn() with the Triton kernel, then with this one -> (triton's, ws's)."""
    ws_gemm.ENABLED = False
    a = fn()
    ws_gemm.ENABLED = True
    try:
        return a, fn()
    finally:
        ws_gemm.ENABLED = False


@needs_gpu
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_on_a_gpu_the_forms_match_the_triton_kernel(rows: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(rows)
    dt = torch.bfloat16
    k, n = 1024, 768
    x = torch.randn(rows, k, generator=g, device="cuda").to(dt)
    w = (torch.randn(n, k, generator=g, device="cuda") * k ** -0.5).to(dt)
    wgu = (torch.randn(2 * n, k, generator=g, device="cuda") * k ** -0.5).to(dt)
    wd = (torch.randn(k, n, generator=g, device="cuda") * n ** -0.5).to(dt)
    ss = torch.rand(rows, 64, generator=g, device="cuda") * 4
    r = torch.randn(rows, k, generator=g, device="cuda").to(dt)
    gn = torch.rand(k, generator=g, device="cuda").to(dt)
    ws_gemm.ENABLED = True
    try:
        assert ws_gemm.applies(x, w, None) and ws_gemm.applies(x, wgu, None)
        assert ws_gemm.applies(torch.empty(rows, n, dtype=dt, device="cuda"), wd, None)
    finally:
        ws_gemm.ENABLED = False
    plain = _both(lambda: skinny_gemm.launch(x, w, *skinny_gemm.tile(n, k)))
    assert torch.equal(*plain)  # the same MMAs in the same order
    rms = _both(lambda: skinny_gemm.fused_linear(x, w, ss, 1e-6))
    torch.testing.assert_close(rms[1], rms[0], rtol=1e-2, atol=1e-2)
    swiglu = _both(lambda: skinny_gemm.fused_linear(x, wgu, ss, 1e-6, swiglu=True))
    torch.testing.assert_close(swiglu[1], swiglu[0], rtol=1e-2, atol=1e-2)
    act = swiglu[0]
    resid = _both(lambda: skinny_gemm.fused_residual(act, wd, r, gn))
    for got, want in zip(resid[1], resid[0]):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


@needs_gpu
def test_on_a_gpu_a_rows_bits_do_not_depend_on_the_rows_beside_it() -> None:
    g = torch.Generator(device="cuda").manual_seed(7)
    dt = torch.bfloat16
    k, n = 1024, 768
    x = torch.randn(16, k, generator=g, device="cuda").to(dt)
    wgu = (torch.randn(2 * n, k, generator=g, device="cuda") * k ** -0.5).to(dt)
    wd = (torch.randn(k, n, generator=g, device="cuda") * n ** -0.5).to(dt)
    ss = torch.rand(16, 64, generator=g, device="cuda") * 4
    r = torch.randn(16, k, generator=g, device="cuda").to(dt)
    gn = torch.rand(k, generator=g, device="cuda").to(dt)
    ws_gemm.ENABLED = True
    try:
        many = skinny_gemm.fused_linear(x, wgu, ss, 1e-6, swiglu=True)
        one = skinny_gemm.fused_linear(x[:1], wgu, ss[:1], 1e-6, swiglu=True)
        assert torch.equal(one, many[:1])
        h16, xg16, ss16 = skinny_gemm.fused_residual(many, wd, r, gn)
        h1, xg1, ss1 = skinny_gemm.fused_residual(many[:1], wd, r[:1], gn)
        assert torch.equal(h1, h16[:1]) and torch.equal(xg1, xg16[:1]) and torch.equal(ss1, ss16[:1])
    finally:
        ws_gemm.ENABLED = False
