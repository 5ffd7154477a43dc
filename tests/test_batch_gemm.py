"""The decode-batch projection kernel (engine/batch_gemm.py): split-K partials and their fixed-order reduction
against F.linear, a row's bits whatever the other rows, the compiled op, and where the engine takes it.

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

import flashpd.engine.batch_gemm as engine_bg
from flashpd.engine.projection import linear

CASES: dict[str, Callable[[ModuleType, str], None]] = {}
KERNELS = engine_bg
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


def compiled_op_is_the_eager_op(bg: ModuleType, dev: str) -> None:
    """Under torch.compile the op is one opaque call at the weight's tile in TILES, with the eager bits."""
    saved = dict(bg.TILES)
    bg.TILES[(72, 384)] = bg.Tile.parse(SHAPES[0][3])
    try:
        fn = torch.compile(lambda a, b: bg.splitk_linear(a, b) * 2.0, fullgraph=True,
                           backend="inductor" if dev == "cuda" else "aot_eager")
        x, w = operands(dev, torch.bfloat16, 40, 72, 384, seed=3)
        assert torch.equal(fn(x.view(2, 20, 384), w), (bg.splitk_linear(x, w) * 2.0).view(2, 20, 72))
    finally:
        bg.TILES.clear()
        bg.TILES.update(saved)


def bad_tiles_are_refused(bg: ModuleType, dev: str) -> None:
    x, w = operands(dev, torch.float32, 20, 24, 96, seed=0)
    with pytest.raises(ValueError, match="does not split"):
        bg.launch(x, w, bg.Tile.parse("32-16-64-1-4-2"))  # 96 is no multiple of 64
    with pytest.raises(ValueError, match="does not split"):
        bg.launch(x, w, bg.Tile.parse("32-16-32-4-4-2"))  # 3 steps in 4 slices
    with pytest.raises(ValueError, match="six numbers"):
        bg.Tile.parse("32-16-32")


def the_engine_takes_it_for_batches_of_tiled_shapes_on_cuda(bg: ModuleType, dev: str) -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    saved = dict(bg.TILES)
    bg.TILES.clear()
    bg.TILES[(4096, 4096)] = bg.Tile.parse("128-128-64-4-8-4")
    try:
        assert bg.applies(cuda, torch.bfloat16, 128, 4096, 4096) and bg.applies(cuda, torch.float16, 17, 4096, 4096)
        assert bg.applies(cuda, torch.bfloat16, bg.MAX_ROWS, 4096, 4096)
        assert not bg.applies(cuda, torch.bfloat16, 16, 4096, 4096)  # the skinny kernel's rows
        assert not bg.applies(cuda, torch.bfloat16, bg.MAX_ROWS + 1, 4096, 4096)  # prefill: cuBLAS
        assert not bg.applies(cuda, torch.bfloat16, 128, 6144, 4096)  # an untiled shape: cuBLAS
        assert not bg.applies(cuda, torch.float32, 128, 4096, 4096)  # fp32 keeps cuBLAS's exact fp32
        assert not bg.applies(cpu, torch.bfloat16, 128, 4096, 4096)
    finally:
        bg.TILES.clear()
        bg.TILES.update(saved)


for _dt in (torch.float32, torch.bfloat16):
    CASES[f"f-linear-{str(_dt)[6:]}"] = lambda bg, dev, dt=_dt: matches_f_linear(bg, dev, dt)
    CASES[f"invariance-{str(_dt)[6:]}"] = lambda bg, dev, dt=_dt: rows_do_not_depend_on_the_other_rows(bg, dev, dt)
CASES["compiled"] = compiled_op_is_the_eager_op
CASES["bad-tiles"] = bad_tiles_are_refused
CASES["dispatch"] = the_engine_takes_it_for_batches_of_tiled_shapes_on_cuda


@pytest.mark.parametrize("name", list(CASES))
def test_kernel(name: str) -> None:
    check_case(sys.modules[__name__], name)


def test_the_engine_tiles_are_valid_for_their_shapes():
    """Every tile in the engine's table splits its weight's K (a bad entry would fail at the first batch)."""
    for (n, k), t in engine_bg.TILES.items():
        assert k % t.block_k == 0 and 1 <= t.splits <= k // t.block_k, ((n, k), t)


def test_the_cpu_keeps_f_linear_bitwise():
    """Off a GPU the engine's projection is F.linear itself at batch row counts too."""
    x, w = torch.randn(4, 32, 64, dtype=torch.bfloat16), torch.randn(48, 64, dtype=torch.bfloat16)
    assert torch.equal(linear(x, w), F.linear(x, w))
