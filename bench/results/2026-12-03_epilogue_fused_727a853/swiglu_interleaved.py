"""Diagnosis, not run yet: the SwiGLU form on gate/up interleaved in blocks of BN rows (and, on the engine's own
layout, with the two tiles joined into one dot's operand), against the engine's form.

The engine's SwiGLU form (engine/skinny_gemm.py, 8bcc2a0) streams BN rows of gate and BN rows of up through two
dots a K step; alone it took 8% more than plain gate/up at one row (forms_8bcc2a0/forms.log). Here the weight's
rows are [gate block 0; up block 0; gate block 1; ...], so a program streams 2*BN contiguous rows through one dot,
as the plain kernel does, and splits the accumulator's columns in the epilogue. Same arithmetic a column, so the
script checks the bits against the engine's form before it times both (24 weights a CUDA graph, 1 and 16 rows).

    OUT=. python swiglu_interleaved.py          # on a GPU: swiglu_interleaved.json
    TRITON_INTERPRET=1 python swiglu_interleaved.py --check   # the bits only, small shapes, on a CPU
"""
import json
import os
import sys

import torch

from flashpd.bench.gemm_shapes import graph_us
from flashpd.engine import skinny_gemm as sg
from flashpd.engine.triton_env import INTERPRET, tl, triton


@triton.jit
def _partials(ss_ptr, rm, m_ok, P, P_PAD: tl.constexpr):
    """Each row's P partial sums of squares, loaded before the K loop and summed after it, as the engine does."""
    pp = tl.arange(0, P_PAD)
    return tl.load(ss_ptr + rm[:, None] * P + pp[None, :], mask=m_ok[:, None] & (pp < P)[None, :], other=0.0)


@triton.jit
def _swiglu_store(acc, ss_in, K, eps, y_ptr, rm, rn, m_ok, sym, BM: tl.constexpr, BN: tl.constexpr):
    """acc [BM, 2*BN] = [gate | up] scaled by each row's 1/rms; silu(gate) * up stored, rounded as the engine's form
    rounds it."""
    acc = acc * (1.0 / tl.sqrt(tl.sum(ss_in, 1) / K + eps))[:, None]
    gate, up = tl.split(tl.permute(tl.reshape(acc, [BM, 2, BN]), [0, 2, 1]))
    gate = gate.to(y_ptr.dtype.element_ty).to(tl.float32)
    up = up.to(y_ptr.dtype.element_ty).to(tl.float32)
    y = (gate * tl.sigmoid(gate) * up).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rm[:, None] * sym + rn[None, :], y, mask=m_ok[:, None])


@triton.jit
def _swiglu_interleaved(x_ptr, w_ptr, y_ptr, ss_ptr, M, N, K, P, eps, sxm, swn, sym, BM: tl.constexpr,
                        BN: tl.constexpr, BK: tl.constexpr, P_PAD: tl.constexpr, ROWWISE: tl.constexpr):
    """y[:M, n0:n0+BN] = silu(gate) * up of the rows scaled by 1/rms; w's rows 2*BN*pid .. +2*BN are gate then up."""
    pid = tl.program_id(0)
    rm = tl.arange(0, BM)
    rw = pid * 2 * BN + tl.arange(0, 2 * BN)
    rn = pid * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_ok = rm < M
    ss_in = _partials(ss_ptr, rm, m_ok, P, P_PAD)
    x_base = x_ptr + rm[:, None] * sxm + rk[None, :]
    w_base = w_ptr + rw[:, None] * swn + rk[None, :]
    acc = tl.zeros([BM, 2 * BN], tl.float32)
    for k in range(0, K, BK):
        a = tl.load(x_base + k, mask=m_ok[:, None], other=0.0)
        w = tl.load(w_base + k)
        if ROWWISE:
            acc += tl.sum(a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], 2)
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    _swiglu_store(acc, ss_in, K, eps, y_ptr, rm, rn, m_ok, sym, BM, BN)


@triton.jit
def _swiglu_joined(x_ptr, w_ptr, y_ptr, ss_ptr, M, N, K, P, eps, sxm, swn, sym, BM: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, P_PAD: tl.constexpr, ROWWISE: tl.constexpr):
    """The same on the engine's [gate; up] layout: the gate and up tiles loaded apart, joined into one [2*BN, BK]
    operand for a single dot (whether the compiler keeps that in its pipeline is what the timing shows)."""
    pid = tl.program_id(0)
    rm = tl.arange(0, BM)
    rn = pid * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_ok = rm < M
    ss_in = _partials(ss_ptr, rm, m_ok, P, P_PAD)
    x_base = x_ptr + rm[:, None] * sxm + rk[None, :]
    w_base = w_ptr + rn[:, None] * swn + rk[None, :]
    u_base = w_base + N * swn
    acc = tl.zeros([BM, 2 * BN], tl.float32)
    for k in range(0, K, BK):
        a = tl.load(x_base + k, mask=m_ok[:, None], other=0.0)
        wu = tl.reshape(tl.permute(tl.join(tl.load(w_base + k), tl.load(u_base + k)), [2, 0, 1]), [2 * BN, BK])
        if ROWWISE:
            acc += tl.sum(a.to(tl.float32)[:, None, :] * wu.to(tl.float32)[None, :, :], 2)
        else:
            acc = tl.dot(a, tl.trans(wu), acc)
    _swiglu_store(acc, ss_in, K, eps, y_ptr, rm, rn, m_ok, sym, BM, BN)


def interleave(w: torch.Tensor, bn: int) -> torch.Tensor:
    """[gate; up] (2I rows) -> [gate block 0; up block 0; gate block 1; ...] in blocks of bn rows."""
    i, k = w.shape[0] // 2, w.shape[1]
    return torch.stack([w[:i].view(i // bn, bn, k), w[i:].view(i // bn, bn, k)], dim=1).reshape(2 * i, k)


def launch(xg: torch.Tensor, w_int: torch.Tensor, ss: torch.Tensor, eps: float, bn: int, kernel=None
           ) -> torch.Tensor:
    """The interleaved kernel on w_int, or `kernel` (_swiglu_joined) on the engine's layout."""
    m, k = xg.shape
    n = w_int.shape[0] // 2
    bk, warps, stages = sg.fused_tile(w_int, True)[1:]
    y = xg.new_empty((m, n))
    p = ss.shape[1]
    (kernel or _swiglu_interleaved)[(n // bn,)](xg, w_int, y, ss, m, n, k, p, eps, xg.stride(0), w_int.stride(0),
                                                 y.stride(0), BM=16, BN=bn, BK=bk,
                                                 P_PAD=max(16, triton.next_power_of_2(p)), ROWWISE=INTERPRET,
                                                 num_warps=warps, num_stages=stages)
    return y


def main() -> None:
    check_only = "--check" in sys.argv
    dev = "cpu" if check_only else "cuda"
    dt = torch.float32 if check_only else torch.bfloat16
    h_dim, inter = (256, 64) if check_only else (4096, 12288)
    res = {}
    for m in (1, 16):
        g = torch.Generator().manual_seed(m)
        h = torch.randn(m, h_dim, generator=g).to(dev, dt)
        gw = (torch.rand(h_dim, generator=g) + 0.5).to(dev, dt)
        xg, ss = sg.norm_input(h, gw)
        ws = [(torch.randn(2 * inter, h_dim, generator=g) * 0.02).to(dev, dt) for _ in range(1 if check_only else 24)]
        bn = sg.fused_tile(ws[0], True)[0]
        w_ints = [interleave(w, bn) for w in ws]
        want = sg.fused_linear(xg, ws[0], ss, 1e-6, swiglu=True)
        got = launch(xg, w_ints[0], ss, 1e-6, bn)
        joined = launch(xg, ws[0], ss, 1e-6, bn, _swiglu_joined)
        res[f"m{m}_bits_equal"] = bool(torch.equal(got, want))
        res[f"m{m}_joined_bits_equal"] = bool(torch.equal(joined, want))
        print(m, "bits equal: interleaved", res[f"m{m}_bits_equal"], "joined", res[f"m{m}_joined_bits_equal"],
              flush=True)
        if check_only:
            continue
        res[f"m{m}_engine_us"] = graph_us([lambda w=w: sg.fused_linear(xg, w, ss, 1e-6, swiglu=True) for w in ws],
                                          reps=50)
        res[f"m{m}_interleaved_us"] = graph_us([lambda w=w: launch(xg, w, ss, 1e-6, bn) for w in w_ints], reps=50)
        res[f"m{m}_joined_us"] = graph_us([lambda w=w: launch(xg, w, ss, 1e-6, bn, _swiglu_joined) for w in ws],
                                          reps=50)
        res[f"m{m}_plain_us"] = graph_us([lambda w=w: sg.launch(xg, w, *sg.tile(*w.shape)) for w in ws], reps=50)
        print(m, {k: v for k, v in res.items() if k.startswith(f"m{m}")}, flush=True)
    if not check_only:
        json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "swiglu_interleaved.json"), "w"), indent=1)
    assert all(v for k, v in res.items() if k.endswith("bits_equal"))


if __name__ == "__main__":
    main()
