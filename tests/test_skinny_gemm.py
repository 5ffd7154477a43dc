"""The few-row projection kernel (engine/skinny_gemm.py) against F.linear, its row invariance (a row's bits alone
and among 16), the compiled op, and where the engine takes it; its fused forms (rows scaled by 1/rms after the
matmul, the SwiGLU product, a residual added with the next norm's input) against the unfused steps, and the
engine's fused decode layers.

Without a GPU the kernel runs under triton's interpreter in one child process started with TRITON_INTERPRET=1
(tests/_interpreted.py says why); on a GPU the cases run here on CUDA tensors, where the invariance is the
MMA's."""
from __future__ import annotations

import contextlib
import sys
from types import ModuleType
from typing import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from _interpreted import check as check_case

import flashpd.engine.skinny_gemm as engine_sg

CASES: dict[str, Callable[[ModuleType, str], None]] = {}
KERNELS = engine_sg  # the module the cases take (tests/_interpreted.py)
# (rows, N, K): N not a multiple of either tile's columns, K a multiple of BLOCK_K or not; N > WIDE_N takes
# the wide tile
SHAPES = ((1, 40, 256), (5, 72, 300), (16, 24, 128), (3, 8200, 64))
INTERPRETED_WIDE_N = 256  # `shapes` under the interpreter


@contextlib.contextmanager
def shapes(sg: ModuleType) -> Iterator[tuple[tuple[int, int, int], ...]]:
    """SHAPES. Under the interpreter the wide tile starts at INTERPRETED_WIDE_N (sg.WIDE_N lowered while the case
    runs) and the wide shape is as far past it: 264 columns, 9 of the wide tile's programs where 8200 takes 257, each
    run in Python (most of the module's time). The tile choice reads WIDE_N when called; a program's code is the
    tile's whatever the threshold."""
    if not sg.INTERPRET:
        yield SHAPES
        return
    saved, sg.WIDE_N = sg.WIDE_N, INTERPRETED_WIDE_N
    try:
        cases = tuple((m, n - saved + INTERPRETED_WIDE_N if n > saved else n, k) for m, n, k in SHAPES)
        assert [sg.tile(n, k) for _, n, k in cases] == [
            sg.TILE_WIDE if n > saved else sg.TILE_NARROW for _, n, k in SHAPES]  # each shape keeps its tile
        yield cases
    finally:
        sg.WIDE_N = saved


def operands(dev: str, dtype: torch.dtype, m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g).to(dev, dtype), (torch.randn(n, k, generator=g) / k ** 0.5).to(dev, dtype))


def matches_f_linear(sg: ModuleType, dev: str, dtype: torch.dtype) -> None:
    """The kernel at the engine's tile for each shape, on leading dims [1, m] as a decode passes them, equals
    F.linear in fp32 to rounding, and in bf16 within bf16's rounding of an fp32-accumulated result."""
    with shapes(sg) as cases:
        for i, (m, n, k) in enumerate(cases):
            x, w = operands(dev, dtype, m, n, k, seed=i)
            out = sg.skinny_linear(x.view(1, m, k), w)
            ref = F.linear(x.float(), w.float()).view(1, m, n)
            assert out.dtype == dtype and out.shape == (1, m, n)
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


def rows_do_not_depend_on_the_row_count(sg: ModuleType, dev: str, dtype: torch.dtype) -> None:
    """Each row of a 16-row call is bitwise the row computed alone and inside a call of 7 rows (a decode at
    batch 1, a verify's block, and a batch between)."""
    with shapes(sg) as cases:
        for i, (_, n, k) in enumerate(cases):
            x, w = operands(dev, dtype, 16, n, k, seed=10 + i)
            full = sg.skinny_linear(x, w)
            for r in (0, 15):
                assert torch.equal(sg.skinny_linear(x[r:r + 1], w), full[r:r + 1]), (n, k, r)
            assert torch.equal(sg.skinny_linear(x[3:10], w), full[3:10]), (n, k)


def compiled_op_is_the_eager_op(sg: ModuleType, dev: str) -> None:
    """Under torch.compile the op is one opaque call that gives the eager bits, at two row counts."""
    fn = torch.compile(lambda a, b: sg.skinny_linear(a, b) * 2.0, fullgraph=True,
                       backend="inductor" if dev == "cuda" else "aot_eager")
    for m in (1, 16):
        x, w = operands(dev, torch.bfloat16, m, 72, 256, seed=m)
        assert torch.equal(fn(x, w), sg.skinny_linear(x, w) * 2.0)


def the_engine_takes_it_for_few_low_precision_rows_on_cuda(sg: ModuleType, dev: str) -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    head = 151936 * 4096
    assert sg.applies(cuda, torch.bfloat16, 1, head) and sg.applies(cuda, torch.float16, sg.MAX_ROWS, head)
    assert not sg.applies(cuda, torch.bfloat16, sg.MAX_ROWS + 1, head)  # batches: cuBLAS
    assert not sg.applies(cuda, torch.float32, 1, head)  # fp32 keeps cuBLAS's exact fp32
    assert not sg.applies(cpu, torch.bfloat16, 1, head)
    assert not sg.applies(cuda, torch.bfloat16, 1, 2 ** 31)  # past int32 offsets: cuBLAS
    assert sg.tile(151936, 4096) == sg.TILE_WIDE and sg.tile(4096, 12288) == sg.TILE_NARROW
    assert sg.tile(151936, 4096, fp8=True) == sg.tile(4096, 12288, fp8=True) == sg.TILE_FP8
    w8 = torch.zeros(64, 32, dtype=torch.float8_e4m3fn)
    assert sg.fused_tile(w8, False) == sg.TILE_FP8 and sg.fused_tile(w8, True)[:3] == (
        sg.TILE_FP8[0] // 2, sg.TILE_FP8[1], sg.TILE_FP8[2])


def fused_operands(dev: str, dtype: torch.dtype, m: int, n: int, k: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = {"h": torch.randn(m, k, generator=g), "g": torch.rand(k, generator=g) + 0.5,
         "w": torch.randn(n, k, generator=g) / k ** 0.5, "w2": torch.randn(2 * n, k, generator=g) / k ** 0.5,
         "r": torch.randn(m, n, generator=g), "g_next": torch.rand(n, generator=g) + 0.5}
    return {key: v.to(dev, dtype) for key, v in t.items()}


def fused_forms_match_the_steps(sg: ModuleType, dev: str, dtype: torch.dtype) -> None:
    """Each fused form against the steps it replaces, at every shape: norm_input then the RMS form equals F.linear
    of rms_norm(h) (fp32 to rounding; bf16 within bf16's rounding of the normed input), the SwiGLU form
    silu(gate) * up of the normed rows; the residual form is bitwise the residual plus the plain kernel's product
    (in bf16 under the interpreter, within a unit of its last place: the interpreter casts fp32 to bf16 by
    truncation where torch and a GPU round to nearest), its next-norm input that times g_next, and its partial
    sums add up to the rows' sums of squares."""
    from flashpd.engine.layers import rms_norm

    tol = 1e-5 if dtype == torch.float32 else 3e-2
    with shapes(sg) as cases:
        for i, (m, n, k) in enumerate(cases):
            o = fused_operands(dev, dtype, m, n, k, seed=30 + i)
            xg, ss = sg.norm_input(o["h"].view(1, m, k), o["g"])
            assert xg.shape == (1, m, k) and ss.shape == (m, 1) and ss.dtype == torch.float32
            normed = rms_norm(o["h"].float(), o["g"].float(), 1e-6)
            out = sg.fused_linear(xg, o["w"], ss, 1e-6)
            assert out.shape == (1, m, n) and out.dtype == dtype
            torch.testing.assert_close(out[0].float(), F.linear(normed, o["w"].float()), rtol=tol, atol=tol)
            gate, up = F.linear(normed, o["w2"].float()).chunk(2, dim=-1)
            act = sg.fused_linear(xg[0], o["w2"], ss, 1e-6, swiglu=True)
            assert act.shape == (m, n)
            torch.testing.assert_close(act.float(), F.silu(gate) * up, rtol=2 * tol, atol=2 * tol)
            h, xg2, ss2 = sg.fused_residual(o["h"], o["w"], o["r"], o["g_next"])
            want = o["r"] + sg.skinny_linear(o["h"], o["w"])
            for got, ref in ((h, want), (xg2, (h.float() * o["g_next"].float()).to(dtype))):
                if sg.INTERPRET and dtype != torch.float32:
                    torch.testing.assert_close(got.float(), ref.float(), rtol=2 ** -7, atol=0)
                else:
                    assert torch.equal(got, ref)
            torch.testing.assert_close(ss2.sum(1), (h.float() ** 2).sum(-1), rtol=1e-5, atol=1e-5)
            assert ss2.shape == (m, -(-n // sg.fused_tile(o["w"], False)[0]))


def fused_rows_do_not_depend_on_the_row_count(sg: ModuleType, dev: str, dtype: torch.dtype) -> None:
    """Every fused form keeps the kernel's invariance: each row of a 16-row call is bitwise the row alone (the
    partial sums included)."""
    with shapes(sg) as cases:
        for i, (_, n, k) in enumerate(cases):
            o = fused_operands(dev, dtype, 16, n, k, seed=40 + i)
            xg, ss = sg.norm_input(o["h"], o["g"])
            full = (sg.fused_linear(xg, o["w"], ss, 1e-6), sg.fused_linear(xg, o["w2"], ss, 1e-6, swiglu=True),
                    *sg.fused_residual(o["h"], o["w"], o["r"], o["g_next"]))
            for r in (0, 6, 15):
                xr, sr = sg.norm_input(o["h"][r:r + 1], o["g"])
                assert torch.equal(xr, xg[r:r + 1]) and torch.equal(sr, ss[r:r + 1])
                alone = (sg.fused_linear(xr, o["w"], sr, 1e-6), sg.fused_linear(xr, o["w2"], sr, 1e-6, swiglu=True),
                         *sg.fused_residual(o["h"][r:r + 1], o["w"], o["r"][r:r + 1], o["g_next"]))
                for j, (a, f) in enumerate(zip(alone, full)):
                    assert torch.equal(a, f[r:r + 1]), (n, k, r, j)


def fused_compiled_ops_are_the_eager_ops(sg: ModuleType, dev: str) -> None:
    """Compiled, each fused op is one opaque call with the eager bits."""
    o = fused_operands(dev, torch.bfloat16, 4, 72, 256, seed=5)

    def layer(h, g, w, w2, r, gn):
        xg, ss = sg.norm_input(h, g)
        act = sg.fused_linear(xg, w2, ss, 1e-6, swiglu=True)
        y, xg2, ss2 = sg.fused_residual(act, w.T.contiguous()[:72, :72], r, gn)
        return sg.fused_linear(xg, w, ss, 1e-6) * 2.0, y, xg2, ss2

    args = (o["h"], o["g"], o["w"], o["w2"], o["r"], o["g_next"])
    fn = torch.compile(layer, fullgraph=True, backend="inductor" if dev == "cuda" else "aot_eager")
    for got, want in zip(fn(*args), layer(*args)):
        assert torch.equal(got, want)


def the_engine_fuses_its_decode_layers(sg: ModuleType, dev: str) -> None:
    """qwen3.fused_layers: a decode, verify or draft pass of at most 16 rows on the paged path runs each layer as
    `fused_layer` (a spy records its RMS forms: the target's and the drafter's layers both take it), and a whole
    engine's tokens and acceptance lengths equal the gathered path's (the plain steps), for DFlash at width 8 on
    one prompt (verifies and draft passes of 8 rows) and native decode of three (3 rows); 17 rows and the
    gathered form keep the unfused steps. Random tiny models, in fp32 under the interpreter. On a GPU the fused
    layers run in bf16 only, where they round apart from the plain steps: there the case checks that they run
    and the requests finish."""
    from flashpd.engine import qwen3
    from flashpd.engine.generate import NativeGenerator
    from flashpd.engine.runner import ModelRunner
    from flashpd.engine.runner_config import RunnerConfig
    from flashpd.engine.sampling import SamplingParams
    from flashpd.engine.scheduler import generate
    from flashpd.engine.spec_decode import DFlashGenerator
    from test_paged_attention import tiny_pair

    exact = sg.INTERPRET  # fp32 (CPU, interpreter): tokens compared; bf16 (GPU): the path taken
    target, drafter = tiny_pair(dev, 16, 1e6, seed=6, dtype=torch.float32 if exact else torch.bfloat16)
    calls, weights, real = [], set(), qwen3.fused_linear

    def spy(xg, w, *args, **kw):
        calls.append(xg.shape[:-1].numel())
        weights.add(w.data_ptr())
        return real(xg, w, *args, **kw)

    def run(impl: str, prompts: list, width: int | None) -> list:
        runner = ModelRunner(target, 64, 8, taps=(0, 1), config=RunnerConfig(cuda_graphs=False, compile=False,
                                                                             attention_impl=impl))
        gen = DFlashGenerator(runner, drafter, (), 8) if width else NativeGenerator(runner)
        params = [SamplingParams(max_tokens=10, ignore_eos=True)] * len(prompts)
        return generate(gen, prompts, params, [width] * len(prompts) if width else None)

    qwen3.fused_linear = spy
    try:
        for prompts, width in (([[3, 9, 27, 17]], 8), ([[3, 9, 27, 17], list(range(5, 30)), [11] * 12], None)):
            calls.clear()
            weights.clear()
            fused = run("paged", prompts, width)
            assert calls and max(calls) <= sg.MAX_ROWS and len(calls) % 2 == 0  # 2 RMS forms a layer
            assert {l.mlp.gate_up_proj.weight.data_ptr() for l in target.layers} <= weights
            if width:  # the draft pass's layers too
                assert {l.gate_up_proj.data_ptr() for l in drafter.layers} <= weights
            assert all(len(s.output) == 10 for s in fused)
            if not exact:
                continue
            calls.clear()
            plain = run("matmul", prompts, width)
            assert not calls
            for a, b in zip(fused, plain):
                assert a.output == b.output and a.stats.acceptance_lengths == b.stats.acceptance_lengths
    finally:
        qwen3.fused_linear = real

    h = torch.zeros(1, 17, 32, device=dev, dtype=target.embed_tokens.weight.dtype)
    cfg = target.cfg
    heads = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    assert not qwen3.fused_layers(h, 17, "paged", *heads)  # 17 rows
    assert not qwen3.fused_layers(h[:, :9].expand(2, 9, 32), 9, "paged", *heads)  # 18 rows
    assert qwen3.fused_layers(h[:, :16], 16, "paged", *heads)
    assert not qwen3.fused_layers(h[:, :16], 16, "matmul", *heads)  # the gathered form


def fused_dispatch(sg: ModuleType, dev: str) -> None:
    """fused_applies: at most MAX_ROWS rows; on CUDA bf16/fp16 only (fp32 keeps cuBLAS), any float dtype under the
    interpreter (these tests); and its switch turns it off."""
    x = torch.zeros(1, 8, device=dev, dtype=torch.bfloat16)
    assert sg.fused_applies(x, sg.MAX_ROWS) and not sg.fused_applies(x, sg.MAX_ROWS + 1)
    assert sg.fused_applies(x.float(), 1) == bool(sg.INTERPRET)
    sg.FUSED_ENABLED = False
    try:
        assert not sg.fused_applies(x, 1)
    finally:
        sg.FUSED_ENABLED = True
    # a SwiGLU program takes half the columns of each of its two tiles: as many programs stream the weight
    w = torch.zeros(24576, 64, device=dev, dtype=torch.bfloat16)
    assert sg.fused_tile(w, True)[0] * 2 == sg.tile(24576, 64)[0]


def fp8_weights_match_their_values(sg: ModuleType, dev: str, dtype: torch.dtype) -> None:
    """An Fp8Weight (e4m3, a scale per row) in every form equals the same form computed from the values it stands
    for: the plain product x @ (data * scale).T in fp64, and each fused form against the same form with the
    weight widened (`dequantize`) to the dtype (fp32: to rounding; bf16: within the widened weight's rounding).
    Each row of a 16-row call is bitwise the row alone, as with bf16 weights. The rows' scales follow the SwiGLU
    form's gate and up rows. quantize_fp8 keeps every row within e4m3's range and relative step (1/16 at most)."""
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    with shapes(sg) as cases:
        for i, (m, n, k) in enumerate(cases):
            o = fused_operands(dev, dtype, m, n, k, seed=60 + i)
            w8, w28 = sg.quantize_fp8(o["w"]), sg.quantize_fp8(o["w2"])
            if n > sg.WIDE_N:  # the wide tile: the plain product only (the fused forms share its loads and epilogue)
                exact = (o["h"].double() @ (w8.data.double() * w8.scale.double()[:, None]).T)
                torch.testing.assert_close(sg.skinny_linear(o["h"], w8).double(), exact, rtol=tol, atol=tol)
                continue
            assert w8.data.dtype == torch.float8_e4m3fn and w8.scale.shape == (n,) and w8.shape == (n, k)
            assert float(w8.data.float().abs().max()) <= sg.FP8_MAX
            torch.testing.assert_close(w8.dequantize(torch.float32), o["w"].float(),
                                       rtol=1 / 16, atol=float(w8.scale.max()) * 2 ** -9)
            exact = (o["h"].double() @ (w8.data.double() * w8.scale.double()[:, None]).T)
            torch.testing.assert_close(sg.skinny_linear(o["h"], w8).double(), exact, rtol=tol, atol=tol)
            # `linear` dispatches: the kernel where `applies` (CUDA, bf16/fp16), else F.linear on the widened weight
            kernel = sg.applies(o["h"].device, dtype, m, w8.data.numel())
            expect = sg.skinny_linear(o["h"], w8) if kernel else F.linear(o["h"], w8.dequantize(dtype))
            assert torch.equal(sg.linear(o["h"], w8), expect)
            xg, ss = sg.norm_input(o["h"], o["g"])
            wide, wide2 = w8.dequantize(dtype), w28.dequantize(dtype)
            torch.testing.assert_close(sg.fused_linear(xg, w8, ss, 1e-6).float(),
                                       sg.fused_linear(xg, wide, ss, 1e-6).float(), rtol=tol, atol=tol)
            torch.testing.assert_close(sg.fused_linear(xg, w28, ss, 1e-6, swiglu=True).float(),
                                       sg.fused_linear(xg, wide2, ss, 1e-6, swiglu=True).float(), rtol=4 * tol,
                                       atol=4 * tol)
            # (y, y * g_next, partial sums of y's squares): the fp8 tile has its own program count, so the partial
            # sums compare as each row's total
            got, ref = sg.fused_residual(o["h"], w8, o["r"], o["g_next"]), sg.fused_residual(o["h"], wide, o["r"],
                                                                                              o["g_next"])
            for a, b in zip((got[0], got[1], got[2].sum(-1)), (ref[0], ref[1], ref[2].sum(-1))):
                torch.testing.assert_close(a.float(), b.float(), rtol=4 * tol, atol=4 * tol * (1 + k / 64))
    o = fused_operands(dev, dtype, 16, 72, 300, seed=70)
    w8, w28 = sg.quantize_fp8(o["w"]), sg.quantize_fp8(o["w2"])
    xg, ss = sg.norm_input(o["h"], o["g"])
    full = (sg.skinny_linear(o["h"], w8), sg.fused_linear(xg, w28, ss, 1e-6, swiglu=True),
            *sg.fused_residual(o["h"], w8, o["r"], o["g_next"]))
    for r in (0, 9):
        alone = (sg.skinny_linear(o["h"][r:r + 1], w8), sg.fused_linear(xg[r:r + 1], w28, ss[r:r + 1], 1e-6,
                                                                           swiglu=True),
                 *sg.fused_residual(o["h"][r:r + 1], w8, o["r"][r:r + 1], o["g_next"]))
        for j, (a, f) in enumerate(zip(alone, full)):
            assert torch.equal(a, f[r:r + 1]), (r, j)


def fp8_compiled_ops_are_the_eager_ops(sg: ModuleType, dev: str) -> None:
    """Compiled with Fp8Weight arguments (a NamedTuple, as the draft runner's compiled functions get them), the
    plain and fused ops are the eager calls, bitwise."""
    o = fused_operands(dev, torch.bfloat16, 4, 72, 256, seed=6)
    w8, w28 = sg.quantize_fp8(o["w"]), sg.quantize_fp8(o["w2"])
    wo8 = sg.quantize_fp8(o["w"].T.contiguous()[:72, :72])

    def layer(h, g, w, w2, wo, r, gn):
        xg, ss = sg.norm_input(h, g)
        act = sg.fused_linear(xg, w2, ss, 1e-6, swiglu=True)
        y, xg2, ss2 = sg.fused_residual(act, wo, r, gn)
        return sg.skinny_linear(h, w) * 2.0, sg.fused_linear(xg, w, ss, 1e-6), y, xg2, ss2

    args = (o["h"], o["g"], w8, w28, wo8, o["r"], o["g_next"])
    fn = torch.compile(layer, fullgraph=True, backend="inductor" if dev == "cuda" else "aot_eager")
    for got, want in zip(fn(*args), layer(*args)):
        assert torch.equal(got, want)


def fp8_row_scales_follow_the_rows(sg: ModuleType, dev: str) -> None:
    """Rows of very different sizes each keep their own scale: a weight whose rows span 1e-4 .. 1e3 comes back
    within e4m3's relative step in every row, and a zero row stays zero (scale 1)."""
    w = torch.randn(48, 64) * torch.logspace(-4, 3, 48)[:, None]
    w[5] = 0
    q = sg.quantize_fp8(w.to(dev))
    back = q.dequantize(torch.float32).cpu()
    assert torch.equal(back[5], torch.zeros(64)) and float(q.scale[5]) == 1.0
    rel = ((back - w).abs() / w.abs().amax(1, keepdim=True).clamp_min(1e-30))
    assert float(rel.max()) <= 1 / 16
    saved = sg.QUANTIZE_ROWS
    try:  # in row chunks (5 rows at a time here) the same bits as at once
        sg.QUANTIZE_ROWS = 5
        chunked = sg.quantize_fp8(w.to(dev))
    finally:
        sg.QUANTIZE_ROWS = saved
    assert torch.equal(chunked.data.view(torch.uint8), q.data.view(torch.uint8)) and torch.equal(chunked.scale, q.scale)


def fp8_every_code_widens_to_its_value(sg: ModuleType, dev: str) -> None:
    """Each of e4m3's 254 finite codes, through the kernel with a unit scale and one-hot rows of x (y[i, n] =
    w[n, i]), comes out as its own value: on a GPU the bf16 form widens by E4M3_TO_BF16_ASM, here by triton's
    conversion. (-0 comes out as +0: the fp32 sum starts at +0.)"""
    codes = torch.arange(256, dtype=torch.int32)
    codes[(codes & 0x7F) == 0x7F] = 0  # the two NaN codes
    data = codes.to(torch.uint8).view(torch.float8_e4m3fn).reshape(16, 16).to(dev)
    w8 = sg.Fp8Weight(data, torch.ones(16, dtype=torch.float32, device=dev))
    y = sg.skinny_linear(torch.eye(16, dtype=torch.bfloat16, device=dev), w8)
    assert torch.equal(y.T.float(), data.float())


for _dt in (torch.float32, torch.bfloat16):
    CASES[f"f-linear-{str(_dt)[6:]}"] = lambda sg, dev, dt=_dt: matches_f_linear(sg, dev, dt)
    CASES[f"invariance-{str(_dt)[6:]}"] = lambda sg, dev, dt=_dt: rows_do_not_depend_on_the_row_count(sg, dev, dt)
    CASES[f"fused-forms-{str(_dt)[6:]}"] = lambda sg, dev, dt=_dt: fused_forms_match_the_steps(sg, dev, dt)
    CASES[f"fused-invariance-{str(_dt)[6:]}"] = (
        lambda sg, dev, dt=_dt: fused_rows_do_not_depend_on_the_row_count(sg, dev, dt))
    CASES[f"fp8-{str(_dt)[6:]}"] = lambda sg, dev, dt=_dt: fp8_weights_match_their_values(sg, dev, dt)
CASES["compiled"] = compiled_op_is_the_eager_op
CASES["dispatch"] = the_engine_takes_it_for_few_low_precision_rows_on_cuda
CASES["fused-compiled"] = fused_compiled_ops_are_the_eager_ops
CASES["fused-dispatch"] = fused_dispatch
CASES["fused-engine"] = the_engine_fuses_its_decode_layers
CASES["fp8-scales"] = fp8_row_scales_follow_the_rows
CASES["fp8-compiled"] = fp8_compiled_ops_are_the_eager_ops
CASES["fp8-codes"] = fp8_every_code_widens_to_its_value


@pytest.mark.parametrize("name", list(CASES))
def test_kernel(name: str) -> None:
    check_case(sys.modules[__name__], name)


def test_the_cpu_keeps_f_linear_bitwise():
    """Off a GPU `linear` is F.linear itself: the fp32 oracles' comparisons see no other kernel."""
    x, w = torch.randn(1, 16, 64, dtype=torch.bfloat16), torch.randn(48, 64, dtype=torch.bfloat16)
    assert torch.equal(engine_sg.linear(x, w), F.linear(x, w))
    assert torch.equal(engine_sg.linear(x.float(), w.float()), F.linear(x.float(), w.float()))


def _emulate_ptx(text: str, regs: dict[str, int]) -> dict[str, int]:
    """Runs the instructions of an inline-asm block (mov, prmt, and, shr, lop3 on .b32; fma.rn.bf16x2) on 32-bit
    integers, registers by name ($0 .. or declared); every bf16x2 result must be exact (it is asserted)."""
    def val(tok: str) -> int:
        tok = tok.strip()
        return regs[tok] if tok in regs or not tok[0].isdigit() else int(tok, 0)

    def bf16(bits: int) -> float:
        return float(torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).double())

    for line in text.strip().strip("{}").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        d, *src = [a.strip() for a in args.split(",")]
        a = [val(x) for x in src]
        if op == "mov.b32":
            r = a[0]
        elif op == "and.b32":
            r = a[0] & a[1]
        elif op == "shr.b32":
            r = a[0] >> a[1]
        elif op == "lop3.b32":
            r = sum(((a[3] >> (((a[0] >> i) & 1) << 2 | ((a[1] >> i) & 1) << 1 | ((a[2] >> i) & 1))) & 1) << i
                    for i in range(32))
        elif op == "prmt.b32":
            pool = a[0] | a[1] << 32
            r = 0
            for i in range(4):
                sel = (a[2] >> (4 * i)) & 0xF
                byte = (pool >> (8 * (sel & 7))) & 0xFF
                r |= ((0xFF if byte & 0x80 else 0) if sel & 8 else byte) << (8 * i)
        elif op == "fma.rn.bf16x2":
            r = 0
            for lane in (0, 16):
                x, y, z = (bf16((v >> lane) & 0xFFFF) for v in a)
                exact = torch.tensor(x * y + z, dtype=torch.float64)
                out = exact.to(torch.float32).to(torch.bfloat16)
                assert float(out.double()) == float(exact) or (x * y + z != x * y + z), (x, y, z)
                if float(exact) == 0.0 and str(float(exact)).startswith("-"):
                    out = torch.tensor(-0.0, dtype=torch.bfloat16)
                r |= (int(out.view(torch.int16)) & 0xFFFF) << lane
        else:
            raise AssertionError(f"no emulation for {op}")
        regs[d] = r & 0xFFFFFFFF
    return regs


def test_the_e4m3_to_bf16_text_widens_every_finite_code_exactly() -> None:
    """engine_sg.E4M3_TO_BF16_ASM, the text the GPU runs (pack 4: $2 four bytes, the first lowest; $0, $1 two bf16
    each), emulated instruction by instruction over all 256 bytes: every finite code gives the bits of torch's
    widening, -0 and the subnormals included; the two NaN codes give +-480 (`quantize_fp8` writes neither)."""
    want = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.bfloat16)
    want = want.view(torch.int16).to(torch.int32) & 0xFFFF
    got = []
    for w in range(64):
        regs = _emulate_ptx(engine_sg.E4M3_TO_BF16_ASM, {"$2": int.from_bytes(bytes(range(4 * w, 4 * w + 4)),
                                                                             "little")})
        got += [regs["$0"] & 0xFFFF, regs["$0"] >> 16, regs["$1"] & 0xFFFF, regs["$1"] >> 16]
    nan = [0x7F, 0xFF]
    assert [g for c, g in enumerate(got) if c not in nan] == [int(v) for c, v in enumerate(want) if c not in nan]
    assert [got[c] for c in nan] == [0x43F0, 0xC3F0]  # +-480
    assert got[0x80] == 0x8000 and got[0x01] == 0x3B00  # -0; the smallest subnormal, 2^-9


FP8_LAUNCHES = r'''
from flashpd.engine import skinny_gemm as sg
w8 = sg.quantize_fp8(torch.randn(512, 4096))
for dt in (torch.bfloat16, torch.float16):
    sg.launch(torch.empty(1, 4096, dtype=dt), w8.data, *sg.tile(512, 4096, fp8=True), w_scale=w8.scale)
'''


def test_the_fp8_launch_widens_bf16_calls_by_bits_and_fp16_calls_by_conversion() -> None:
    """skinny_gemm.launch with an Fp8Weight, on CPU tensors as far as the sm_90 compile (tests/_launch_path.py):
    a bf16 call builds WQ 2, whose PTX holds E4M3_TO_BF16_ASM's bf16x2 multiplies and no fp16 -> bf16 conversion;
    an fp16 call builds WQ 1 (e4m3 -> fp16 is one native conversion for two values)."""
    pytest.importorskip("triton")
    from _launch_path import compile_launches
    bf16, fp16 = compile_launches(FP8_LAUNCHES)
    assert bf16["constexprs"]["WQ"] == "2" and fp16["constexprs"]["WQ"] == "1"
    bn, bk, warps, _ = engine_sg.TILE_FP8  # the fp8 tile compiles for sm_90 within an H100/H200's 227 KB of shared memory
    assert (bf16["constexprs"]["BN"], bf16["constexprs"]["BK"], bf16["num_warps"]) == (str(bn), str(bk), warps)
    assert 0 < bf16["shared"] <= 227 * 1024
    assert bf16["ptx"].count("fma.rn.bf16x2") >= 2 and "cvt.bf16.f16" not in bf16["ptx"]
    assert "cvt.rn.f16x2.e4m3x2" in fp16["ptx"] and "fma.rn.bf16x2" not in fp16["ptx"]
