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
