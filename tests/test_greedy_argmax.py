"""The one-pass greedy argmax (engine/greedy_argmax.py) against torch's argmax: ties, -inf rows, NaN, chunk
boundaries, row counts that chunk a row differently, the compiled op, and sampling.greedy_tokens taking it.

Without a GPU the kernels run under triton's interpreter in one child process started with TRITON_INTERPRET=1
(tests/_interpreted.py says why); on a GPU the cases run here on CUDA tensors."""
from __future__ import annotations

import sys
from types import ModuleType
from typing import Callable

import pytest
import torch
from _interpreted import check as check_case

import flashpd.engine.greedy_argmax as engine_ga

CASES: dict[str, Callable[[ModuleType, str], None]] = {}
KERNELS = engine_ga  # the module the cases take (tests/_interpreted.py)


def rows(v: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """n rows of v logits: random, then rows of many ties (values rounded to a few levels, the maximum at many
    indices), a row whose maximum sits at a chunk's first and last entries, an all -inf row, a row with +inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=g)
    x[1] = torch.round(x[1] * 2) / 2  # many ties at the top
    x[2] = 0.0
    x[2, [min(engine_ga.BLOCK, v // 2), v - 1]] = 1.0  # two equal maxima, the first at a block's first entry
    x[3] = float("-inf")
    x[4, v // 3] = float("inf")
    return x.to(dtype)


def matches_torch_argmax(ga: ModuleType, dev: str, dtype: torch.dtype) -> None:
    """Row counts 5 and 40 and vocabularies of 700 (one short chunk), 10,007 (several chunks, the last short) and
    Qwen3's 151,936: the kernel's token is torch.argmax's (its first maximum) on every row."""
    for v in (700, 10007, 151936):
        for n in (5, 40) if v < 100000 else (5,):
            x = rows(v, n, dtype, seed=v + n).to(dev)
            assert ga.applies(x)
            out = ga.greedy_argmax(x)
            assert out.dtype == torch.int64 and out.shape == (n,)
            assert torch.equal(out, x.float().argmax(-1)), (v, n, out, x.float().argmax(-1))


for _dt in (torch.float32, torch.bfloat16):
    CASES[f"argmax-{str(_dt)[6:]}"] = lambda ga, dev, dt=_dt: matches_torch_argmax(ga, dev, dt)


def nan_is_the_maximum(ga: ModuleType, dev: str) -> None:
    """A row holding NaN gives its first NaN's index, as torch.argmax does, wherever the NaNs and the row's largest
    value lie (in one chunk, across chunks, before or after the maximum); leading dims are kept."""
    x = rows(10007, 6, torch.float32, seed=1)
    x[0, [9000, 50]] = float("nan")
    x[1, 7000] = float("nan")
    x[5, :] = float("nan")
    x = x.to(dev)
    assert torch.equal(ga.greedy_argmax(x), x.argmax(-1))
    assert torch.equal(ga.greedy_argmax(x.view(2, 3, -1)), x.view(2, 3, -1).argmax(-1))


CASES["nan"] = nan_is_the_maximum


def compiled_op_is_the_eager_op(ga: ModuleType, dev: str) -> None:
    """torch.compile of a caller (inductor on a GPU, aot_eager on the CPU): the same tokens, on a strided view."""
    x = rows(3001, 6, torch.bfloat16, seed=2).to(dev)

    def f(x):
        return ga.greedy_argmax(x[:, 1:]) + 1

    torch._dynamo.reset()
    backend = "inductor" if dev == "cuda" else "aot_eager"
    assert torch.equal(torch.compile(f, fullgraph=True, backend=backend)(x), x[:, 1:].float().argmax(-1) + 1)


CASES["compiled"] = compiled_op_is_the_eager_op


def greedy_tokens_takes_it(ga: ModuleType, dev: str) -> None:
    """sampling.greedy_tokens gives the kernel's tokens where it applies, torch's argmax's."""
    from flashpd.engine.sampling import greedy_tokens

    x = rows(5000, 7, torch.bfloat16, seed=3).to(dev)
    assert ga.applies(x) and torch.equal(greedy_tokens(x), ga.greedy_argmax(x))
    assert torch.equal(greedy_tokens(x), x.float().argmax(-1))


CASES["greedy-tokens"] = greedy_tokens_takes_it


@pytest.mark.parametrize("name", list(CASES))
def test_kernel(name: str) -> None:
    check_case(sys.modules[__name__], name)


def test_the_cpu_keeps_the_plain_reductions():
    """Without the interpreter (this process) the CPU never takes the kernels."""
    assert not engine_ga.applies(torch.zeros(2, 10))
    if torch.cuda.is_available():  # pragma: no cover (GPU machines)
        assert engine_ga.applies(torch.zeros(2, 10, device="cuda", dtype=torch.bfloat16))
