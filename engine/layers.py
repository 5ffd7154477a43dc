"""Building blocks shared by the target and the drafter: RMSNorm, rotary tables, SwiGLU MLP.

Numerics follow Hugging Face's Qwen3 exactly (norms in float32, RoPE tables in float32
cast to the activation dtype), so float32 runs match the transformers oracle to rounding.
"""
from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Qwen3RMSNorm: normalise in float32, cast back, then scale."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Rotary:
    """cos/sin tables for absolute positions [0, max_positions), float32 like HF."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, device: torch.device | str) -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
        pos = torch.arange(max_positions, device=device).float()
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()
        self.max_positions = max_positions

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape positions.shape + [head_dim], in `dtype`."""
        return rope_tables(self.cos, self.sin, positions, dtype)


def rope_tables(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `positions` of the float32 tables, in `dtype` (a pure function: compiled step functions look
    their tables up themselves, fused, instead of taking four eager gather and cast kernels a step)."""
    return cos[positions].to(dtype), sin[positions].to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., T, heads, head_dim]; cos/sin: [..., T, head_dim]."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return x * cos + _rotate_half(x) * sin


class SwiGLU(nn.Module):
    """Weights of a Qwen3 MLP, gate and up fused into one matrix (loaders fill both halves);
    the computation is `qwen3.mlp_residual`, shared with the drafter."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
