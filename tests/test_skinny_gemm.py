"""The few-row projection kernel (engine/skinny_gemm.py) against F.linear, its row invariance (a row's bits alone
and among 16), the compiled op, and where the engine takes it.

Without a GPU the kernel runs under triton's interpreter in one child process started with TRITON_INTERPRET=1
(tests/_interpreted.py says why); on a GPU the cases run here on CUDA tensors, where the invariance is the
MMA's."""
from __future__ import annotations

import sys
from types import ModuleType
from typing import Callable

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


def operands(dev: str, dtype: torch.dtype, m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g).to(dev, dtype), (torch.randn(n, k, generator=g) / k ** 0.5).to(dev, dtype))


def matches_f_linear(sg: ModuleType, dev: str, dtype: torch.dtype) -> None:
    """The kernel at the engine's tile for each shape, on leading dims [1, m] as a decode passes them, equals
    F.linear in fp32 to rounding, and in bf16 within bf16's rounding of an fp32-accumulated result."""
    for i, (m, n, k) in enumerate(SHAPES):
        x, w = operands(dev, dtype, m, n, k, seed=i)
        out = sg.skinny_linear(x.view(1, m, k), w)
        ref = F.linear(x.float(), w.float()).view(1, m, n)
        assert out.dtype == dtype and out.shape == (1, m, n)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


def rows_do_not_depend_on_the_row_count(sg: ModuleType, dev: str, dtype: torch.dtype) -> None:
    """Each row of a 16-row call is bitwise the row computed alone and inside a call of 7 rows (a decode at
    batch 1, a verify's block, and a batch between)."""
    for i, (_, n, k) in enumerate(SHAPES):
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


for _dt in (torch.float32, torch.bfloat16):
    CASES[f"f-linear-{str(_dt)[6:]}"] = lambda sg, dev, dt=_dt: matches_f_linear(sg, dev, dt)
    CASES[f"invariance-{str(_dt)[6:]}"] = lambda sg, dev, dt=_dt: rows_do_not_depend_on_the_row_count(sg, dev, dt)
CASES["compiled"] = compiled_op_is_the_eager_op
CASES["dispatch"] = the_engine_takes_it_for_few_low_precision_rows_on_cuda


@pytest.mark.parametrize("name", list(CASES))
def test_kernel(name: str) -> None:
    check_case(sys.modules[__name__], name)


def test_the_cpu_keeps_f_linear_bitwise():
    """Off a GPU `linear` is F.linear itself: the fp32 oracles' comparisons see no other kernel."""
    x, w = torch.randn(1, 16, 64, dtype=torch.bfloat16), torch.randn(48, 64, dtype=torch.bfloat16)
    assert torch.equal(engine_sg.linear(x, w), F.linear(x, w))
    assert torch.equal(engine_sg.linear(x.float(), w.float()), F.linear(x.float(), w.float()))
