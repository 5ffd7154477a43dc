"""The engine's weight projection, y = x @ w.T without bias: which kernel takes a call, by its row count.

- up to 16 rows (a decode at batch 1, a DFlash verify's or draft's block): engine/skinny_gemm.py;
- 17 to 256 rows (decode batches) and a weight shape the sweep tiled: engine/batch_gemm.py's split-K kernel;
- anything else (the CPU, fp32, prefill, other shapes): F.linear.
Each kernel's tile is a function of the weight's shape alone, so within a range a row's bits do not depend on
the row count.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flashpd.engine import batch_gemm, skinny_gemm


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) by the kernel this call's rows and w's shape select."""
    if w.dtype == x.dtype:
        rows = x.numel() // x.shape[-1]
        if skinny_gemm.applies(x.device, x.dtype, rows, w.numel()):
            return skinny_gemm.skinny_linear(x, w)
        if batch_gemm.applies(x.device, x.dtype, rows, w.shape[0], w.shape[1]):
            return batch_gemm.splitk_linear(x, w)
    return F.linear(x, w)
