"""bench/splitk_gemm.py's split-K kernel (a gemm_shapes variant): its partials and their fixed-order reduction
against F.linear, a row's bits whatever the other rows, and the tiles it refuses: so that its sweep's figures
are of a correct kernel.

Without a GPU the kernel runs under triton's interpreter in one child process (tests/_interpreted.py); on a GPU
the cases run here on CUDA tensors."""
from __future__ import annotations

import sys
from types import ModuleType
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from _interpreted import check as check_case

import flashpd.bench.splitk_gemm as bench_bg

CASES: dict[str, Callable[[ModuleType, str], None]] = {}
KERNELS = bench_bg
# (rows, N, K, tile): rows past one row tile (40 > 32) and inside one, N not a multiple of BLOCK_N, splits that
# divide K's steps unevenly (6 steps in 4 slices) and one slice
SHAPES = ((40, 72, 384, "32-32-64-4-4-2"), (17, 24, 256, "32-16-32-3-4-2"), (20, 40, 128, "16-32-64-1-4-2"))


def operands(dev: str, dtype: torch.dtype, m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g).to(dev, dtype), (torch.randn(n, k, generator=g) / k ** 0.5).to(dev, dtype))


def matches_f_linear(bg: ModuleType, dev: str, dtype: torch.dtype) -> None:
    """Each tile's result equals F.linear in fp32 to rounding, and in bf16 within bf16's rounding of an
    fp32-accumulated result; the reduction adds every slice (a slice left out would be off by a third or more)."""
    for i, (m, n, k, t) in enumerate(SHAPES):
        x, w = operands(dev, dtype, m, n, k, seed=i)
        out = bg.launch(x, w, bg.Tile.parse(t))
        ref = F.linear(x.float(), w.float())
        assert out.dtype == dtype and out.shape == (m, n)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


def rows_do_not_depend_on_the_other_rows(bg: ModuleType, dev: str, dtype: torch.dtype) -> None:
    """A row's bits are the same alone, among the first rows, and in the full call (in another row tile)."""
    for i, (m, n, k, t) in enumerate(SHAPES):
        tile = bg.Tile.parse(t)
        x, w = operands(dev, dtype, m, n, k, seed=10 + i)
        full = bg.launch(x, w, tile)
        for r in (0, m - 1):
            assert torch.equal(bg.launch(x[r:r + 1].contiguous(), w, tile), full[r:r + 1]), (t, r)
        assert torch.equal(bg.launch(x[:17].contiguous(), w, tile), full[:17]), t


def bad_tiles_are_refused(bg: ModuleType, dev: str) -> None:
    x, w = operands(dev, torch.float32, 20, 24, 96, seed=0)
    with pytest.raises(ValueError, match="does not split"):
        bg.launch(x, w, bg.Tile.parse("32-16-64-1-4-2"))  # 96 is no multiple of 64
    with pytest.raises(ValueError, match="does not split"):
        bg.launch(x, w, bg.Tile.parse("32-16-32-4-4-2"))  # 3 steps in 4 slices
    with pytest.raises(ValueError, match="six numbers"):
        bg.Tile.parse("32-16-32")


for _dt in (torch.float32, torch.bfloat16):
    CASES[f"f-linear-{str(_dt)[6:]}"] = lambda bg, dev, dt=_dt: matches_f_linear(bg, dev, dt)
    CASES[f"invariance-{str(_dt)[6:]}"] = lambda bg, dev, dt=_dt: rows_do_not_depend_on_the_other_rows(bg, dev, dt)
CASES["bad-tiles"] = bad_tiles_are_refused


@pytest.mark.parametrize("name", list(CASES))
def test_kernel(name: str) -> None:
    check_case(sys.modules[__name__], name)
