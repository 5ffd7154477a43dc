"""y = x @ w.T for up to 16 rows of x (a decode at batch 1, a DFlash verify's or draft's block): one Triton kernel.

At these row counts a projection is a pass over its weight. cuBLAS reads the smaller weights of a layer well
below the copy rate at one row, adds a split-K reduction kernel to some, and picks another kernel for each row
count, so a row's bits depend on how many rows share the call (bench/gemm_shapes.py; docs/results.md).

Each program holds every row of x (up to BLOCK_M = 16, the smallest tile tl.dot takes) and BLOCK_N rows of w, and
walks K in BLOCK_K steps with tl.dot, accumulating in fp32. The tile depends on w's shape only (`tile`), never on
the row count, and an MMA computes each output row from that row alone, in the same order wherever it sits in the
tile: a row's bits are the same alone and among 16 (tests/test_skinny_gemm.py, on a GPU).

`linear` is the engine's projection: this kernel where it applies (`applies`: CUDA, bf16 or fp16, at most 16 rows,
a weight within int32 offsets), F.linear elsewhere (the CPU, fp32, batches, prefill).

The fused forms (qwen3.fused_layer: a decode, verify or draft pass of at most 16 rows) take the work between a
layer's projections into their epilogues, so the K loop stays the plain one. (Forms that worked on x inside the
K loop, the norm or the SwiGLU product, cost 1.3-5x the plain kernel on an H200: every program repeated them on
the whole x tile; bench/results/2026-12-03_fused_layers_f8fd192.) o_proj and down add the residual and write
the next norm's input, the stream times that norm's weight, with each program's sums of the stream's squares;
QKV and gate/up multiply that input and scale each row by 1/rms at the end; gate/up also forms silu(gate) * up.
A layer is then 7 launches, not 10: the two norms and the SwiGLU product have no kernel of their own.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from flashpd.engine import triton_env
from flashpd.engine.triton_env import INTERPRET, tl, triton  # triton None: F.linear only
if triton is not None:
    from flashpd.engine.triton_env import pdl_enter, pdl_release, pdl_wait

BLOCK_M = 16  # the most rows a call takes
MAX_ROWS = BLOCK_M
MAX_WEIGHT_ELEMENTS = 2 ** 31 - 1  # the kernel indexes the weight in int32
# (BLOCK_N, BLOCK_K, warps, stages) by w's rows: picked by bench/gemm_shapes.py's sweep at the Qwen3-8B shape
# (docs/results.md): 16 output columns a program for q/k/v, o_proj and down (N <= 8192, 256-384 programs);
# 32 for gate/up and the LM head
TILE_NARROW = (16, 128, 2, 6)
TILE_WIDE = (32, 128, 2, 6)
WIDE_N = 8192
# an fp8 weight's tile, any shape: at 16 rows (a draft pass) an H200 streamed e4m3 weights fastest, or near it, 32
# columns by 256 with 4 warps and 4 stages on five of the drafter's six shapes (bench/gemm_shapes.py --weights fp8,
# docs/results.md); at the bf16 tiles, q/k/v, o_proj, down and the fc were slower in fp8 than in bf16
TILE_FP8 = (32, 256, 4, 4)
SWIGLU_STAGES = 4  # `fused_tile`'s pipeline depth for the SwiGLU form


def available() -> bool:
    return triton is not None


def tile(n: int, k: int, fp8: bool = False) -> tuple[int, int, int, int]:
    """The tile for a weight of n rows and k columns (fp8: float8 e4m3, `Fp8Weight`): a function of the weight
    alone, so of no row count."""
    if fp8:
        return TILE_FP8
    return TILE_WIDE if n > WIDE_N else TILE_NARROW


def _is_fp8(w: torch.Tensor) -> bool:
    return w.dtype == torch.float8_e4m3fn


# e4m3 -> bf16 by bit operations, four values a call (`tl.inline_asm_elementwise`, pack 4: $2 holds four bytes,
# the first lowest; $0 and $1 two bf16 each). A byte goes to the high byte of a 16-bit lane (prmt); its exponent
# and mantissa bits move down 4 to bf16's places and its sign stays (and, shr, lop3: a | (b & c)): the bf16 bits of
# the value times 2^-120, exact for every finite e4m3 value, subnormals included (the exponent fields' biases are 7
# and 127); then times 2^120 in bf16 (fma with -0.0: exact, a power of two, no subnormal result). Triton's own
# conversion goes through fp16, one conversion-unit instruction (F2F) a value in the sm_90 SASS, a unit that issues
# fewer instructions a clock than the integer and bf16x2 pipes (NVIDIA's throughput tables); these are 10 of those
# for four values; on an H200 the fp8 draft pass is faster this way than by triton's conversion (`speed_8b
# --fp8-widen`, docs/results.md). tests/test_skinny_gemm.py emulates this text over all 256 bytes.
# e4m3's NaN codes (0x7f, 0xff) would come out as +-480: `quantize_fp8` never writes them.
E4M3_TO_BF16_ASM = """{
.reg .b32 h, t, zr, sgn, two120;
mov.b32 zr, 0;
mov.b32 sgn, 0x80008000;
mov.b32 two120, 0x7B807B80;
prmt.b32 h, $2, zr, 0x1404;
and.b32 t, h, 0x7F007F00;
shr.b32 t, t, 4;
lop3.b32 t, t, h, sgn, 0xF8;
fma.rn.bf16x2 $0, t, two120, sgn;
prmt.b32 h, $2, zr, 0x3424;
and.b32 t, h, 0x7F007F00;
shr.b32 t, t, 4;
lop3.b32 t, t, h, sgn, 0xF8;
fma.rn.bf16x2 $1, t, two120, sgn;
}"""
FP8_BITS = True  # bf16 calls widen their fp8 tiles by E4M3_TO_BF16_ASM (False: triton's conversion)

if triton is not None:
    _E4M3_TO_BF16 = tl.constexpr(E4M3_TO_BF16_ASM)

    @triton.jit
    def _e4m3_to_bf16(w):
        """An e4m3 tile, widened to bf16 by E4M3_TO_BF16_ASM (the same values as w.to(tl.bfloat16))."""
        return tl.inline_asm_elementwise(_E4M3_TO_BF16, "=r,=r,r", [w.to(tl.uint8, bitcast=True)],
                                         dtype=tl.bfloat16, is_pure=True, pack=4)

    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, y_ptr, M, N, K, sxm, swn, sym, ss_ptr, P, eps, r_ptr, srm, g_ptr, xg_ptr,
                       sso_ptr, s_ptr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                       F32: tl.constexpr, ROWWISE: tl.constexpr, RMS: tl.constexpr, SWIGLU: tl.constexpr,
                       RESID: tl.constexpr, NEXT: tl.constexpr, P_PAD: tl.constexpr, WQ: tl.constexpr,
                       PDL: tl.constexpr):
        """One program: y[:M, n0:n0+BN] over all of K. F32: fp32 inputs, multiplied in fp32 (no tf32). ROWWISE
        (the interpreter only): a broadcast product summed along K, as paged_attention._dot explains.
        The fused layer's forms (`fused_linear`), all in the epilogue, so the K loop stays the plain one:
        RMS, x is a residual stream already multiplied by its norm's weight and ss_ptr holds [M, P] partial sums of
        the stream's squares: each row is scaled by 1/rms after the loop. SWIGLU: w is [gate; up] (2N rows) and
        y = silu(gate) * up; a program's BN gate rows and the BN up rows at the same offset load as one [2*BN, BK]
        tile, one dot a K step, as the plain kernel's loop (two tiles and two dots were slower on an H200:
        docs/results.md). RESID: y = round(x @ w.T) + r. NEXT (with RESID): also the next norm's input y * g (xg_ptr)
        and this program's sum of each row's squares of y (sso_ptr, [M, programs]). WQ: w is float8 (e4m3) with a
        scale per row (s_ptr, fp32): each tile is widened to x's dtype before its dot (exact: every e4m3 value is a
        bf16 and fp16 value), and the fp32 sums are multiplied by their rows' scales after the loop, before any
        other epilogue step (`Fp8Weight`); WQ 2 (bf16 on a GPU, FP8_BITS): widened by bits (`_e4m3_to_bf16`).
        PDL (triton_env's comment): wait at the top, let the next kernel launch
        after the K loop, so it starts in this kernel's tail."""
        pid = tl.program_id(0)
        rm = tl.arange(0, BM)
        rn = pid * BN + tl.arange(0, BN)
        pdl_wait(PDL)
        rk = tl.arange(0, BK)
        m_ok = rm < M
        n_ok = rn < N
        if RMS:  # loaded before the loop, summed after it (on an H200 faster in the step than after the loop)
            pp = tl.arange(0, P_PAD)
            ss_in = tl.load(ss_ptr + rm[:, None] * P + pp[None, :], mask=m_ok[:, None] & (pp < P)[None, :],
                            other=0.0)
        out_ok = m_ok[:, None] & n_ok[None, :]
        # the epilogue's operands loaded before the loop (a load after the output's store would wait for it: they
        # may alias as far as the compiler knows), their latency behind the weight's stream
        if RESID:
            r = tl.load(r_ptr + rm[:, None] * srm + rn[None, :], mask=out_ok, other=0.0)
        if NEXT:
            gw = tl.load(g_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        x_base = x_ptr + rm[:, None] * sxm + rk[None, :]
        if SWIGLU:  # BN gate rows then the BN up rows at the same offset: one [2*BN, BK] tile, one dot a K step
            WN: tl.constexpr = 2 * BN
            j = tl.arange(0, WN)
            w_ok = (pid * BN + j % BN) < N
            w_base = w_ptr + (pid * BN + j % BN + (j // BN) * N)[:, None] * swn + rk[None, :]
        else:
            WN: tl.constexpr = BN
            w_ok = n_ok
            w_base = w_ptr + rn[:, None] * swn + rk[None, :]
        if WQ:  # the rows' scales, in the order of the tile's rows (w_base's)
            if SWIGLU:
                w_scale = tl.load(s_ptr + pid * BN + j % BN + (j // BN) * N, mask=w_ok, other=0.0)
            else:
                w_scale = tl.load(s_ptr + rn, mask=w_ok, other=0.0)
        acc = tl.zeros([BM, WN], tl.float32)
        for k in range(0, K, BK):
            if EVEN_K:
                a = tl.load(x_base + k, mask=m_ok[:, None], other=0.0)
                w = tl.load(w_base + k, mask=w_ok[:, None], other=0.0)
            else:
                k_ok = (k + rk) < K
                a = tl.load(x_base + k, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_base + k, mask=w_ok[:, None] & k_ok[None, :], other=0.0)
            if WQ == 2:
                w = _e4m3_to_bf16(w)
            elif WQ:
                w = w.to(a.dtype)
            if ROWWISE:
                acc += tl.sum(a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], 2)
            elif F32:
                acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(w), acc)
        pdl_release(PDL)
        if WQ:
            acc = acc * w_scale[None, :]
        if RMS:
            acc = acc * (1.0 / tl.sqrt(tl.sum(ss_in, 1) / K + eps))[:, None]
        if SWIGLU:  # gate and up rounded as the unfused matmul's output would be, the product in fp32
            gate, up = tl.split(tl.permute(tl.reshape(acc, [BM, 2, BN]), [0, 2, 1]))
            gate = gate.to(y_ptr.dtype.element_ty).to(tl.float32)
            up = up.to(y_ptr.dtype.element_ty).to(tl.float32)
            y = (gate * tl.sigmoid(gate) * up).to(y_ptr.dtype.element_ty)
        else:
            y = acc.to(y_ptr.dtype.element_ty)
        if RESID:  # bitwise the unfused residual + round(x @ w.T)
            y = (y.to(tl.float32) + r.to(tl.float32)).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rm[:, None] * sym + rn[None, :], y, mask=out_ok)
        if NEXT:
            yf = tl.where(out_ok, y.to(tl.float32), 0.0)
            tl.store(xg_ptr + rm[:, None] * sym + rn[None, :], (yf * gw[None, :]).to(y_ptr.dtype.element_ty),
                     mask=out_ok)
            tl.store(sso_ptr + rm * tl.num_programs(0) + pid, tl.sum(yf * yf, 1), mask=m_ok)

    @triton.jit
    def _prep_kernel(x_ptr, g_ptr, xg_ptr, ss_ptr, K, sxm, BK: tl.constexpr, PDL: tl.constexpr):
        """One row: x * g (a norm's input for an RMS form) and the sum of x's squares (one partial, [M, 1])."""
        pdl_enter(PDL)
        row = tl.program_id(0)
        acc = tl.zeros([BK], tl.float32)
        for k in range(0, K, BK):
            kk = k + tl.arange(0, BK)
            ok = kk < K
            x = tl.load(x_ptr + row * sxm + kk, mask=ok, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + kk, mask=ok, other=0.0).to(tl.float32)
            tl.store(xg_ptr + row * K + kk, (x * g).to(xg_ptr.dtype.element_ty), mask=ok)
            acc += x * x
        tl.store(ss_ptr + row, tl.sum(acc, 0))


class Fp8Weight(NamedTuple):
    """A projection's weight in float8 (e4m3) with a scale per output row: w ~ data * scale[:, None]. Half the bytes
    of bf16 for a pass that reads its weights once (a few-row draft pass); only the kernel's forms take it
    (`linear` widens it for F.linear elsewhere). Built by `quantize_fp8`."""

    data: torch.Tensor  # [N, K] torch.float8_e4m3fn, rows contiguous
    scale: torch.Tensor  # [N] float32

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight it stands for, in `dtype` (each row's fp8 values times its scale, rounded once)."""
        return (self.data.float() * self.scale[:, None]).to(dtype)


FP8_MAX = 448.0  # the largest finite e4m3 value


QUANTIZE_ROWS = 8192  # rows `quantize_fp8` widens to fp32 at a time (a whole 8B head would be 2.5 GB more)


def quantize_fp8(w: torch.Tensor) -> Fp8Weight:
    """w [N, K] -> its Fp8Weight: each row scaled so that its largest magnitude maps to FP8_MAX (a zero row keeps
    scale 1), rounded to e4m3 to nearest. Rows are independent, so it works QUANTIZE_ROWS rows at a time."""
    data = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    for i in range(0, w.shape[0], QUANTIZE_ROWS):
        wf = w[i:i + QUANTIZE_ROWS].detach().float()
        amax = wf.abs().amax(dim=1)
        s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        data[i:i + QUANTIZE_ROWS] = (wf / s[:, None]).to(torch.float8_e4m3fn)
        scale[i:i + QUANTIZE_ROWS] = s
    return Fp8Weight(data, scale)


def launch(x: torch.Tensor, w: torch.Tensor, block_n: int, block_k: int, num_warps: int, num_stages: int,
           w_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M <= 16, K] (rows contiguous), w [N, K] (rows contiguous) -> x @ w.T [M, N] in x's dtype; w_scale:
    w is fp8 with these row scales (`Fp8Weight`)."""
    return launch_fused(x, w, block_n, block_k, num_warps, num_stages, w_scale=w_scale)[0]


def launch_fused(x: torch.Tensor, w: torch.Tensor, block_n: int, block_k: int, num_warps: int, num_stages: int,
                 ss: torch.Tensor | None = None, eps: float = 0.0, swiglu: bool = False,
                 residual: torch.Tensor | None = None, g_next: torch.Tensor | None = None,
                 w_scale: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`launch` -> (y, None, None), or a fused form (`fused_linear` says what each computes): ss [M, P] fp32
    partial sums of squares (x then holds the stream times its norm's weight); swiglu, w is [gate; up] and the
    output has half its rows; residual [M, N] (rows contiguous); g_next [N] (with residual): -> (y, y * g_next,
    [M, programs] partial sums of y's squares). w_scale [rows of w] fp32: w is float8 e4m3 (`Fp8Weight`)."""
    m, k = x.shape
    n = w.shape[0] // 2 if swiglu else w.shape[0]
    assert m <= BLOCK_M and w.shape[1] == k and x.stride(1) == 1 and w.stride(1) == 1
    assert (w_scale is None) == (w.dtype != torch.float8_e4m3fn), "an fp8 weight needs its row scales, and only it"
    assert w_scale is None or (w_scale.dtype == torch.float32 and w_scale.shape == (w.shape[0],)
                               and w_scale.is_contiguous())
    assert not swiglu or w.shape[0] == 2 * n
    assert ss is None or (ss.dtype == torch.float32 and ss.dim() == 2 and ss.shape[0] == m and ss.is_contiguous())
    assert residual is None or (residual.shape == (m, n) and residual.stride(1) == 1)
    assert g_next is None or (residual is not None and g_next.shape == (n,) and g_next.is_contiguous())
    if w.numel() > MAX_WEIGHT_ELEMENTS:
        raise ValueError(f"a weight of {w.numel()} elements is past the kernel's int32 indexing")
    y = x.new_empty((m, n))
    programs = triton.cdiv(n, block_n)
    xg = torch.empty_like(y) if g_next is not None else None
    sso = torch.empty((m, programs), dtype=torch.float32, device=x.device) if g_next is not None else None
    p = ss.shape[1] if ss is not None else 1
    _skinny_kernel[(programs,)](
        x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0), y if ss is None else ss, p, float(eps),
        y if residual is None else residual, 0 if residual is None else residual.stride(0),
        y if g_next is None else g_next, y if xg is None else xg, y if sso is None else sso,
        y if w_scale is None else w_scale,
        BM=BLOCK_M, BN=block_n, BK=block_k, EVEN_K=k % block_k == 0, F32=x.dtype == torch.float32,
        ROWWISE=INTERPRET, RMS=ss is not None, SWIGLU=swiglu, RESID=residual is not None, NEXT=g_next is not None,
        P_PAD=max(16, triton.next_power_of_2(p)), WQ=_fp8_mode(x, w_scale), num_warps=num_warps,
        num_stages=num_stages,
        **triton_env.pdl_args(x.device))
    return y, xg, sso


def _fp8_mode(x: torch.Tensor, w_scale: torch.Tensor | None) -> int:
    """The kernel's WQ: 0 a bf16/fp16/fp32 weight; 2 an fp8 one widened by bits (bf16 on a GPU, FP8_BITS); 1 an fp8
    one widened by triton's conversion (the interpreter, whose numpy cannot run PTX; fp16 and fp32 calls)."""
    if w_scale is None:
        return 0
    return 2 if FP8_BITS and x.dtype == torch.bfloat16 and not INTERPRET else 1


def fused_tile(w: torch.Tensor, swiglu: bool) -> tuple[int, int, int, int]:
    """The tile of a fused form: the weight's (`tile`); a SwiGLU program streams a gate and an up tile, so it
    takes half the columns of each (as many programs stream the weight as its plain matmul has; 32 columns of
    each were no faster) and SWIGLU_STAGES stages: at the plain tile's 6 its [2*BN, BK] tile was slower on an
    H200 (docs/results.md). Stages change no bit."""
    block_n, block_k, warps, stages = tile(w.shape[0], w.shape[1], _is_fp8(w))
    if swiglu:
        return max(16, block_n // 2), block_k, warps, SWIGLU_STAGES
    return block_n, block_k, warps, stages


if triton is not None:
    # an opaque custom op, as paged_attention's: compiled, inductor calls it as one extern kernel
    @torch.library.custom_op("flashpd::skinny_linear", mutates_args=())
    def _skinny_linear_op(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None = None) -> torch.Tensor:
        return launch(x, w, *tile(w.shape[0], w.shape[1], _is_fp8(w)), w_scale=w_scale)

    @_skinny_linear_op.register_fake
    def _(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None = None) -> torch.Tensor:
        return x.new_empty((x.shape[0], w.shape[0]))

    @torch.library.custom_op("flashpd::skinny_rms", mutates_args=())
    def _skinny_rms_op(xg: torch.Tensor, w: torch.Tensor, ss: torch.Tensor, eps: float, swiglu: bool,
                       w_scale: torch.Tensor | None = None) -> torch.Tensor:
        return launch_fused(xg, w, *fused_tile(w, swiglu), ss=ss, eps=eps, swiglu=swiglu, w_scale=w_scale)[0]

    @_skinny_rms_op.register_fake
    def _(xg: torch.Tensor, w: torch.Tensor, ss: torch.Tensor, eps: float, swiglu: bool,
          w_scale: torch.Tensor | None = None) -> torch.Tensor:
        return xg.new_empty((xg.shape[0], w.shape[0] // 2 if swiglu else w.shape[0]))

    @torch.library.custom_op("flashpd::skinny_residual", mutates_args=())
    def _skinny_residual_op(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, g_next: torch.Tensor,
                            w_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return launch_fused(x, w, *fused_tile(w, False), residual=residual, g_next=g_next, w_scale=w_scale)

    @_skinny_residual_op.register_fake
    def _(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, g_next: torch.Tensor,
          w_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = w.shape[0]
        programs = triton.cdiv(n, fused_tile(w, False)[0])
        return (x.new_empty((x.shape[0], n)), x.new_empty((x.shape[0], n)),
                x.new_empty((x.shape[0], programs), dtype=torch.float32))

    @torch.library.custom_op("flashpd::skinny_prep", mutates_args=())
    def _skinny_prep_op(x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m, k = x.shape
        xg = torch.empty_like(x)
        ss = torch.empty((m, 1), dtype=torch.float32, device=x.device)
        _prep_kernel[(m,)](x, g, xg, ss, k, x.stride(0), BK=min(1024, triton.next_power_of_2(k)),
                           **triton_env.pdl_args(x.device))
        return xg, ss

    @_skinny_prep_op.register_fake
    def _(x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty_like(x), x.new_empty((x.shape[0], 1), dtype=torch.float32)


def applies(device: torch.device, dtype: torch.dtype, rows: int, weight_numel: int) -> bool:
    """Whether `linear` takes the kernel: on CUDA with triton, in bf16 or fp16 (fp32 keeps cuBLAS's exact
    fp32; the oracles compare there), at most MAX_ROWS rows, and a weight whose offsets fit the kernel's 32-bit
    index arithmetic (MAX_WEIGHT_ELEMENTS)."""
    return (triton is not None and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and rows <= MAX_ROWS and weight_numel <= MAX_WEIGHT_ELEMENTS)


Weight = torch.Tensor | Fp8Weight  # what `linear` and the fused forms take


def _parts(w: Weight) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the weight's tensor, its fp8 row scales or None)."""
    return (w.data, w.scale) if isinstance(w, Fp8Weight) else (w.contiguous(), None)


def skinny_linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """The kernel on x [..., K] of any leading shape (at most 16 rows in all) -> [..., N]; on any device triton
    runs on (the interpreter in tests), fp32 included."""
    if triton is None:
        raise RuntimeError("skinny_linear needs triton")
    k = x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    data, scale = _parts(w)
    return torch.ops.flashpd.skinny_linear(x2, data, scale).view(*x.shape[:-1], data.shape[0])


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """F.linear(x, w) without bias: the kernel where `applies`, else F.linear (an Fp8Weight widened to x's dtype
    first: the same values the kernel multiplies, summed by another kernel)."""
    if isinstance(w, Fp8Weight):
        if applies(x.device, x.dtype, x.numel() // x.shape[-1], w.data.numel()):
            return skinny_linear(x, w)
        return F.linear(x, w.dequantize(x.dtype))
    if applies(x.device, x.dtype, x.numel() // x.shape[-1], w.numel()) and w.dtype == x.dtype:
        return skinny_linear(x, w)
    return F.linear(x, w)


FUSED_ENABLED = True  # `fused_applies`' switch (the engine's fused decode layers; off: the unfused steps)


def fused_applies(x: torch.Tensor, rows: int) -> bool:
    """Whether the fused forms run for `rows` rows like x: FUSED_ENABLED, triton on CUDA in bf16 or fp16 (as
    `applies`), or under the interpreter in any float dtype (the engine's fused layers in CPU tests), at most
    MAX_ROWS rows."""
    if not FUSED_ENABLED or triton is None or rows > MAX_ROWS:
        return False
    if INTERPRET:
        return x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


def norm_input(x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The input of an RMS form from a stream no fused projection made (the embeddings): x [..., K] ->
    (x * g rounded, [rows, 1] sums of x's squares in fp32). One launch."""
    k = x.shape[-1]
    xg, ss = torch.ops.flashpd.skinny_prep(x.reshape(-1, k).contiguous(), g.contiguous())
    return xg.view(x.shape), ss


def fused_linear(xg: torch.Tensor, w: Weight, ss: torch.Tensor, eps: float, swiglu: bool = False
                 ) -> torch.Tensor:
    """rms_norm(x, g, eps) @ w.T as (x * g) @ w.T with each row scaled by 1/rms after the matmul: xg [..., K] is
    x * g (`norm_input`, or the producing projection's `fused_residual`) and ss [rows, P] the partial sums of x's
    squares. The rows are not normed and rounded before the matmul, so the result rounds differently from the
    unfused steps; like every form of the kernel, a row's bits do not depend on the rows beside it.
    swiglu: w is [gate; up] (2N rows) -> silu(gate) * up [..., N], gate and up rounded first as the unfused
    matmul's output is, the product in fp32."""
    k = xg.shape[-1]
    data, scale = _parts(w)
    y = torch.ops.flashpd.skinny_rms(xg.reshape(-1, k).contiguous(), data, ss, float(eps), swiglu, scale)
    return y.view(*xg.shape[:-1], y.shape[-1])


def fused_residual(x: torch.Tensor, w: Weight, residual: torch.Tensor, g_next: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h = residual + round(x @ w.T), rounded (bitwise the unfused add), with what the next RMS form reads:
    -> (h, h * g_next rounded, [rows, programs] partial sums of h's squares in fp32)."""
    k = x.shape[-1]
    n = w.shape[0]
    data, scale = _parts(w)
    h, xg, ss = torch.ops.flashpd.skinny_residual(x.reshape(-1, k).contiguous(), data,
                                                  residual.reshape(-1, n).contiguous(), g_next.contiguous(), scale)
    return h.view(*x.shape[:-1], n), xg.view(*x.shape[:-1], n), ss

