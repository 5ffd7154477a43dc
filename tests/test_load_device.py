"""load_engine's device argument (engine/factory.resolve_device): a name torch does not know, a device flashpd does
not run on, or cuda on a machine without one is a ValueError naming it (it was torch's RuntimeError, or an
AssertionError deep in the loader)."""
from __future__ import annotations

import pytest
import torch

from flashpd.engine.factory import resolve_device


@pytest.mark.parametrize("name, why", [("tpu", "not a device name"), ("meta", "runs on 'cpu' or 'cuda'")])
def test_a_device_flashpd_cannot_use_is_refused_by_name(name, why):
    with pytest.raises(ValueError, match=f"device {name!r}: .*{why}"):
        resolve_device(name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_without_a_cuda_device_is_refused_by_name():
    for name in ("cuda", "cuda:0"):
        with pytest.raises(ValueError, match="has no CUDA device"):
            resolve_device(name)
    assert resolve_device(None) == torch.device("cpu") and resolve_device("cpu") == torch.device("cpu")
