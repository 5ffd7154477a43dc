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

# Programmatic dependent launch (PDL, sm_90 and up). With it, the engine's Triton kernels launch so that a kernel's
# programs may start before the kernel ahead of it in the stream has finished. Each program waits
# (griddepcontrol.wait: the kernel ahead finished, its writes visible) before it touches anything another kernel
# writes, so no bit changes; what overlaps is a launch's latency and a kernel's tail. When a kernel lets the next
# one launch (griddepcontrol.launch_dependents) decides what overlaps:
#   - the few-row GEMM (skinny_gemm) lets it after its K loop, so the next kernel starts in the GEMM's tail;
#   - the latency-bound kernels (q/k norm and RoPE, attention, its combine, a norm's prep) let it as
#     PDL_LATENCY_RELEASE says: 0 never (the kernel after one launches as without PDL; the default); 1 right
#     after they wait; 2 before (every launch down to the next GEMM goes ahead at once).
# On an H200 at the Qwen3-8B shape (docs/results.md, issue 23's PDL entries), 0 made batches 1-16 and the DFlash
# step faster and left 32-256 within noise (no few-row GEMM there to release); 1 lost at batch 16, 2 everywhere.
# The interpreter has no griddepcontrol.
PDL_ENABLED = True
PDL_LATENCY_RELEASE = 0
# A latency-bound kernel of a one-token call of at most PDL_RELEASE_MAX_ROWS rows whose successor is latency-bound
# too (q/k norm and RoPE before the attention, a split attention before its combine): the successor's programs are
# few, so letting it launch early holds few SMs. Its release, as PDL_LATENCY_RELEASE's values: 0 never, 1 after the
# wait, 2 before. On an H200 at the 8B shape (docs/results.md), 1 and 2 each took 1% off a batch-1 decode step; for
# 16-token calls (verify, draft) both lost 0.3-0.6%, and at batch 32 0.2%. Batches 2-16 were not measured with it
# (releasing every latency kernel once lost 2.6% at 16), so one row only.
PDL_RELEASE_TO_LATENCY = 1
PDL_RELEASE_MAX_ROWS = 1
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


def pdl_args(device: torch.device, next_latency: bool = False, tokens: int = 0, rows: int = 0) -> dict:
    """A launch's PDL arguments: the kernel's PDL constexpr (0 off; else on, and for a latency-bound kernel's
    `pdl_enter`: 1 let the next kernel launch after waiting, 2 before, 3 never) and triton's launch option.
    next_latency: the kernel after this one is latency-bound too, in a call of `tokens` tokens a row over `rows`
    rows (PDL_RELEASE_TO_LATENCY applies to one-token calls of at most PDL_RELEASE_MAX_ROWS rows)."""
    if not pdl(device):
        return {"PDL": 0}
    early = next_latency and tokens == 1 and rows <= PDL_RELEASE_MAX_ROWS
    name, release = ("PDL_RELEASE_TO_LATENCY", PDL_RELEASE_TO_LATENCY) if early else \
        ("PDL_LATENCY_RELEASE", PDL_LATENCY_RELEASE)
    if release not in (0, 1, 2):
        raise ValueError(f"triton_env.{name} is {release!r}: 0, 1 or 2")
    return {"PDL": {1: 1, 2: 2, 0: 3}[release], "launch_pdl": True}


if triton is not None:
    @triton.jit
    def pdl_enter(PDL: tl.constexpr):
        """A latency-bound kernel's first step: with PDL, wait for the kernel ahead, and let the next one launch
        after the wait (PDL 1), before it (2) or not at all (3). Called before any load or store."""
        if PDL == 2:
            tl.extra.cuda.gdc_launch_dependents()
        if PDL >= 1:
            tl.extra.cuda.gdc_wait()
        if PDL == 1:
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """With PDL: wait for the kernel ahead (its writes visible). Called before any load or store."""
        if PDL >= 1:
            tl.extra.cuda.gdc_wait()

    @triton.jit
    def pdl_release(PDL: tl.constexpr):
        """With PDL: let the next kernel in the stream launch (its programs wait for this kernel's end)."""
        if PDL >= 1:
            tl.extra.cuda.gdc_launch_dependents()
