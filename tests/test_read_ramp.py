"""bench/read_ramp.py's read kernel: every element summed once, by the program whose span holds it (under triton's
interpreter on the CPU, tests/_interpreted.py; on a GPU the same cases run on CUDA tensors)."""
from __future__ import annotations

import sys
from types import ModuleType

import pytest
import torch

from _interpreted import check as check_case
from flashpd.bench import read_ramp

KERNELS = read_ramp  # the module the cases take (tests/_interpreted.py)


def sums_each_span(rr: ModuleType, dev: str) -> None:
    for n, programs, block in ((10_000, 8, 256), (3 * 4096 + 5, 5, 512), (100, 16, 64)):
        src = torch.randn(n, dtype=torch.bfloat16, device=dev)
        out = torch.full((programs,), float("nan"), dtype=torch.float32, device=dev)
        rr.read_sum(src, out, block, 4, 2)
        span = rr.spans(n, programs, block)
        assert span % block == 0 and span * programs >= n
        want = torch.stack([src[p * span:(p + 1) * span].float().sum() for p in range(programs)])
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)


CASES = {"sums_each_span": sums_each_span}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel(name: str) -> None:
    check_case(sys.modules[__name__], name)
