"""bench/chain_bound.py's persistent kernel: four projections a layer over several layers, with a grid-wide
barrier between them, equal to the chain computed in float64 (under triton's interpreter on the CPU with one
program, tests/_interpreted.py; on a GPU with several programs, which must all be resident, and bitwise equal to
the engine's launches in bf16)."""
from __future__ import annotations

import sys
from types import ModuleType

import pytest
import torch

from _interpreted import check as check_case
from flashpd.bench import chain_bound

KERNELS = chain_bound  # the module the cases take (tests/_interpreted.py)


def equals_the_chain(cb: ModuleType, dev: str) -> None:
    programs = 1 if dev == "cpu" else 8  # the interpreter runs programs one after another: a barrier needs one
    for rows in (1, 3):
        chain = cb.Chain(2, 128, 256, 256, rows, dev, seed=rows, dtype=torch.float32)
        got = chain.run_persistent(programs).double()
        assert chain.err.item() == 0
        assert chain.bar[0].item() == 8 * programs  # every program arrived at each of the 2 x 4 barriers
        torch.testing.assert_close(got, chain.reference(), rtol=1e-5, atol=1e-5)  # fp32 MMAs in IEEE fp32 on a GPU
    if dev == "cuda":  # bf16: the same tiles and K loop as the engine's launches, so the same bits
        chain = cb.Chain(2, 128, 256, 256, 1, dev)
        want = chain.run_launches()
        assert torch.equal(chain.run_persistent(programs), want)


def preloaded_equals_the_chain(cb: ModuleType, dev: str) -> None:
    """The next projection's first columns loaded before each barrier (`_preload`), and the flag barriers, give
    the same result as the plain chain (fp32: within rounding; bf16 on a GPU: bitwise, as the engine's launches)."""
    programs = 1 if dev == "cpu" else 8
    chain = cb.Chain(2, 512, 768, 512, 2, dev, seed=5, dtype=torch.float32)
    got = chain.run_persistent(programs, preload_cols=256).double()
    assert chain.err.item() == 0 and chain.bar[0].item() == 8 * programs
    torch.testing.assert_close(got, chain.reference(), rtol=1e-5, atol=1e-5)
    for barrier in ("flag", "flag_sleep"):  # the last arrival raises a flag the others poll: the same result
        got = chain.run_persistent(programs, barrier=barrier).double()
        assert chain.err.item() == 0 and chain.bar[0].item() == 8 * programs and chain.bar[32].item() == 8 * programs
        torch.testing.assert_close(got, chain.reference(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="barrier"):
        chain.run_persistent(programs, barrier="none")
    with pytest.raises(ValueError, match="preload_cols"):
        chain.run_persistent(programs, preload_cols=128)  # less than two K steps: not a form the kernel has
    if dev == "cuda":
        chain = cb.Chain(2, 512, 768, 512, 1, dev)
        want = chain.run_launches()
        assert torch.equal(chain.run_persistent(programs, preload_cols=256), want)
        for barrier in ("flag", "flag_sleep"):
            assert torch.equal(chain.run_persistent(programs, barrier=barrier), want)


CASES = {"equals_the_chain": equals_the_chain, "preloaded_equals_the_chain": preloaded_equals_the_chain}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel(name: str) -> None:
    check_case(sys.modules[__name__], name)
