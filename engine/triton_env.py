"""Triton for the engine's kernels (paged attention, few-row projections, the q/k norm and RoPE kernel, the greedy
argmax): imported on a CUDA build of torch, or on the CPU under triton's interpreter (tests: TRITON_INTERPRET=1,
set before triton is first imported); otherwise None, and each kernel's caller keeps its plain-PyTorch form. A CPU
build of torch skips the import (a third of a second a process)."""
from __future__ import annotations

import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

triton = None
tl = None
if torch.backends.cuda.is_built() or INTERPRET:
    try:
        import triton
        import triton.language as tl
    except ImportError:  # no triton: the plain-PyTorch forms only
        triton = tl = None

# Programmatic dependent launch (sm_90 and up): the engine's Triton kernels launch with it, so a kernel's programs
# start while the kernel before it in the stream finishes; each waits (griddepcontrol.wait) before it reads or
# writes anything another kernel touches, so the overlap is launch and scheduling only. Off: plain launches.
# The interpreter has no griddepcontrol.
PDL_ENABLED = True
_pdl_devices: dict[int, bool] = {}


def pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch with programmatic dependent launch: PDL_ENABLED, a CUDA device of
    compute capability 9 or more, and not the interpreter."""
    if not PDL_ENABLED or INTERPRET or triton is None or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _pdl_devices:
        _pdl_devices[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _pdl_devices[index]


def pdl_args(device: torch.device) -> dict:
    """A launch's PDL arguments: the kernel's PDL constexpr (which calls `pdl_wait`) and triton's launch option."""
    return {"PDL": True, "launch_pdl": True} if pdl(device) else {"PDL": False}


if triton is not None:
    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """With PDL: wait for the kernel before this one to finish (its writes visible), then let the next one
        launch. Called first in a kernel, before any load or store."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
