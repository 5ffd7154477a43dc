"""bench/chain_ws.py: the warp-specialized persistent chain.

Gluon has no CPU interpreter, so here a child process compiles the kernel for sm_90 (triton's own ptxas; no device
needed) and the test reads its PTX: the loader copies each weight tile by one TMA message whose completion the
ring's `ready` barrier counts; the consumers' barriers name only their own 128 threads (a CTA-wide one would wait
for the loader warp, which never comes); one thread arrives at a slot's `empty` barrier and at the grid's counter;
the grid barrier ends in an acquire fence; the input row is read past L1 in 16-byte vectors. The one-projection
kernel, launched with PDL, lets the next launch go before its first copy and waits only before reading its input
(the MMA form, engine/ws_gemm.py, has its PTX checked in tests/test_ws_gemm.py). The weight layout (two 2D buffers
that the chain's views alias) is checked on the CPU, and the bench's run methods build each kernel on the CPU as far
as the compile (tests/_launch_path.py); the kernels' results, on a GPU (the MMA launches bitwise
against the engine's few-row kernel).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from flashpd.bench import chain_ws

CHILD = r'''
import json, sys
import torch
torch.backends.cuda.is_built = lambda: True  # a CPU build of torch: import triton as a CUDA build would
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon import language as gl
from flashpd.bench import chain_ws as cw

kind = sys.argv[1]
bk, slots, flag = (int(a) for a in sys.argv[2:5])
lw, lx = cw.layouts(bk)
lay = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
desc = f"tensordesc<bf16[{cw.BN}, {bk}],{lay!r}>"
options = {"num_warps": 4}
if kind == "chain":  # flag: SYNC
    kernel, ptrs = cw._chain_ws_kernel, ("y0", "y1", "y2", "y3", "bar_ptr", "err_ptr")
    sig = {"wa_desc": desc, "wd_desc": desc, "y0": "*bf16", "y1": "*bf16", "y2": "*bf16", "y3": "*bf16",
           "bar_ptr": "*i32", "err_ptr": "*i32", "L": "i32"}
    const = dict(D=4096, QKV=6144, FF=12288, FFP=16384, BN=cw.BN, BK=bk, S=slots, SYNC=flag, SPIN=1 << 20, LW=lw,
                 LX=lx, LOADER_REGS=40)
else:  # one projection, down's shape; flag: PDL
    kernel, ptrs = cw._proj_ws_kernel, ("x_ptr", "y_ptr")
    sig = {"desc": desc, "x_ptr": "*bf16", "y_ptr": "*bf16", "row0": "i32"}
    const = dict(N=4096, K=12288, KP=16384, BN=cw.BN, BK=bk, S=slots, LW=lw, LX=lx, PDL=flag, LOADER_REGS=40)
    options.update(maxnreg=128, launch_pdl=bool(flag))
sig.update({k: "constexpr" for k in const})
names = list(sig)
attrs = {(names.index(p),): [["tt.divisibility", 16]] for p in ptrs}
cc = triton.compile(GluonASTSource(fn=kernel, signature=sig, constexprs=const, attrs=attrs),
                    target=GPUTarget("cuda", 90, 32), options=options)
print(json.dumps({"ptx": cc.asm["ptx"], "shared": cc.metadata.shared}))
'''


def compiled(kind: str, bk: int, slots: int, flag: int) -> dict:
    """The kernel `kind` ("chain": the persistent one, flag its SYNC; "proj": one projection, flag its PDL)
    compiled for sm_90 in a child process -> {"ptx", "shared"}."""
    pytest.importorskip("triton.experimental.gluon")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", CHILD, kind, str(bk), str(slots), str(flag)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def lines(ptx: str, *keys: str) -> list[str]:
    return [ln.strip() for ln in ptx.splitlines() if any(k in ln for k in keys)]


def test_the_compiled_kernel_synchronizes_as_designed() -> None:
    c = compiled("chain", 256, 24, 1)
    ptx = c["ptx"]
    assert c["shared"] <= chain_ws.SMEM_BYTES  # 24 slots of [16, 256] and the input's 32 KB fit one program
    tma = lines(ptx, "cp.async.bulk.tensor")
    assert len(tma) == 4 and all("mbarrier::complete_tx::bytes" in t and t.startswith("@%p") for t in tma)
    expect = lines(ptx, "mbarrier.arrive.expect_tx")
    assert len(expect) == 4 and all(e.endswith(f"{chain_ws.BN * 256 * 2};") for e in expect)  # a slot's bytes
    frees = lines(ptx, "mbarrier.arrive.shared")
    assert len(frees) == 4 and all(f.startswith("@%p") for f in frees)  # one thread frees a slot
    assert len(lines(ptx, "fence.proxy.async")) == 4  # the consumers' reads ordered before the next TMA write
    arrivals = lines(ptx, "atom.global.gpu.release.add")
    assert len(arrivals) == 4 and all(a.startswith("@%p") for a in arrivals)  # one arrival a program a barrier
    assert len(lines(ptx, "fence.acq_rel.gpu")) == 4
    named = lines(ptx, "bar.sync")
    assert named and all(n == "bar.sync \t0, 128;" or n == "bar.sync 0, 128;" for n in named), set(named)
    assert lines(ptx, "ld.global.cg.v4") and not lines(ptx, "ld.global.cg.b16")
    assert len(lines(ptx, "setmaxnreg.dec.sync.aligned.u32 \t40", "setmaxnreg.dec.sync.aligned.u32 40")) >= 1


def test_without_barriers_no_grid_arrival_is_compiled() -> None:
    ptx = compiled("chain", 128, 8, 0)["ptx"]
    assert not lines(ptx, "atom.global") and not lines(ptx, "fence.acq_rel")
    assert len(lines(ptx, "cp.async.bulk.tensor")) == 4


def test_a_projection_launch_lets_the_next_go_at_once_and_waits_only_to_read_its_input() -> None:
    c = compiled("proj", 256, 8, 1)
    ptx = c["ptx"].splitlines()
    at = lambda key: [i for i, ln in enumerate(ptx) if key in ln]  # noqa: E731
    assert c["shared"] <= chain_ws.SMEM_BYTES // 2  # two programs an SM: this launch and the next
    assert any(ln.strip() == ".maxnreg 128" for ln in ptx)  # and their registers fit one SM
    wait, release, tma, loads = (at("griddepcontrol.wait"), at("griddepcontrol.launch_dependents"),
                                 at("cp.async.bulk.tensor"), at("ld.global"))
    assert len(wait) == 1 and len(release) == 1 and len(tma) == 1 and loads
    assert wait[0] < min(loads)  # the input is read after the kernel ahead finished
    assert release[0] < tma[0]  # the loader lets the next launch go before its first copy, and never waits
    plain = compiled("proj", 256, 8, 0)["ptx"]
    assert "griddepcontrol" not in plain


def test_the_weights_lie_in_two_buffers_the_chain_reads() -> None:
    chain = chain_ws.WsChain(2, 64, 96, 128, "cpu", seed=3)
    ra = 96 + 64 + 2 * 128
    assert chain.wa.shape == (2 * ra, 64) and chain.wd.shape == (2 * 64, 128)
    assert chain.weight_bytes() == 2 * (2 * ra * 64 + 2 * 64 * 128)
    for layer in range(2):
        q, o, gu, d = chain.views[4 * layer:4 * layer + 4]
        assert [tuple(v.shape) for v in (q, o, gu, d)] == [(96, 64), (64, 64), (256, 64), (64, 128)]
        assert q.data_ptr() == chain.wa[layer * ra].data_ptr()
        assert o.data_ptr() == chain.wa[layer * ra + 96].data_ptr()
        assert gu.data_ptr() == chain.wa[layer * ra + 160].data_ptr()
        assert d.data_ptr() == chain.wd[layer * 64].data_ptr()
    assert all(v.abs().sum() > 0 for v in chain.views)  # every weight filled
    ref = chain.reference()
    assert ref.shape == (1, 64) and torch.isfinite(ref).all()
    if chain_ws.available():  # refused before any launch
        with pytest.raises(ValueError, match="tiles"):
            chain.run_ws(1, bk=256)  # K = 64 does not split into 256-column steps
        with pytest.raises(ValueError, match="one row"):
            chain_ws.WsChain(1, 64, 64, 64, "cpu", rows=2).run_ws_launches(1, bk=64)  # the FMA forms: one row
    with pytest.raises(ValueError, match="1 to 16"):
        chain_ws.WsChain(1, 64, 64, 64, "cpu", rows=17)


RUNS = r'''
from flashpd.bench import chain_ws as cw
from flashpd.engine import ws_gemm
ws_gemm._sms = lambda device: 132  # an H200's SMs (the CPU has no CUDA device to ask)
chain = cw.WsChain(1, 4096, 6144, 12288, "cpu")  # one layer at the Qwen3-8B shape: each kernel as the bench builds it
chain.run_ws(132, 256, 24)
chain.run_ws(132, 256, 24, sync=False)
chain.run_ws_launches(132, 256, 8, pdl=True)
chain.run_mma_launches(256, 8, 4, pdl=True)
'''


def test_the_benchs_runs_build_their_kernels_as_the_gpu_would_compile_them() -> None:
    """The bench's own run methods on a one-layer chain at the Qwen3-8B shape, on CPU tensors as far as the sm_90
    compile (tests/_launch_path.py): the persistent kernel with and without barriers in one program an SM's shared
    memory; the one-projection FMA launches, one kernel for each of a layer's four shapes, with PDL and two programs
    an SM; the MMA launches, the engine's ws_gemm kernel."""
    pytest.importorskip("triton.experimental.gluon")
    from _launch_path import compile_launches
    built = compile_launches(RUNS)
    names = [b["fn"] for b in built]
    assert names[:2] == ["_chain_ws_kernel"] * 2 and names[2:6] == ["_proj_ws_kernel"] * 4
    assert set(names[6:]) == {"_ws_kernel"}
    assert [b["constexprs"]["SYNC"] for b in built[:2]] == ["1", "0"]
    assert all(b["shared"] <= chain_ws.SMEM_BYTES for b in built[:2])
    assert [(b["constexprs"]["N"], b["constexprs"]["K"]) for b in built[2:6]] == [
        ("6144", "4096"), ("4096", "4096"), ("24576", "4096"), ("4096", "12288")]
    for b in built[2:]:
        assert b["shared"] <= 113 * 1024 and "griddepcontrol.launch_dependents" in b["ptx"]


@pytest.mark.skipif(not torch.cuda.is_available() or not chain_ws.available(), reason="needs a CUDA GPU and Gluon")
@pytest.mark.parametrize("bk,slots", [(128, 4), (256, 16)])
def test_the_kernel_equals_the_chain_on_a_gpu(bk: int, slots: int) -> None:
    chain = chain_ws.WsChain(2, 512, 768, 512, "cuda", seed=bk)
    programs = 8
    got = chain.run_ws(programs, bk=bk, slots=slots).clone()
    torch.cuda.synchronize()
    assert chain.err.item() == 0 and chain.bar[0].item() == 8 * programs
    ref = chain.reference().float()
    torch.testing.assert_close(got.float(), ref, rtol=0.05, atol=0.05 * ref.abs().max().item())
    torch.testing.assert_close(got, chain.run_launches(), rtol=0.05, atol=0.05 * ref.abs().max().item())
    for pdl in (True, False):  # the same kernels a projection: the same sums, so the same bits
        assert torch.equal(chain.run_ws_launches(programs, bk=bk, slots=slots, pdl=pdl), got)


@pytest.mark.skipif(not torch.cuda.is_available() or not chain_ws.available(), reason="needs a CUDA GPU and Gluon")
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_the_mma_launches_are_bitwise_the_engines_few_row_kernel(rows: int) -> None:
    chain = chain_ws.WsChain(2, 512, 768, 512, "cuda", seed=rows, rows=rows)
    want = chain.run_launches().clone()
    for bk, slots, x_slots in ((256, 8, 4), (128, 4, 2)):
        for pdl in (True, False):
            assert torch.equal(chain.run_mma_launches(bk=bk, slots=slots, x_slots=x_slots, pdl=pdl), want)
