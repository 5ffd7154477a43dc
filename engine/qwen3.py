"""The Qwen3 target in plain PyTorch, reading and writing a paged KV cache.

Q/K/V and gate/up are fused into single matmuls (the loader fills the slices). `forward`
returns the final hidden states (before the output norm is applied to logits) plus the
outputs of the tapped decoder layers, which the DFlash drafter conditions on.
"""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from flashpd.engine.attention import AttnBatch, gather_kv, grouped_sdpa, write_kv
from flashpd.engine.config import Qwen3Config
from flashpd.engine.layers import RMSNorm, Rotary, SwiGLU, apply_rotary


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=False)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: AttnBatch,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        c = self.cfg
        q, k, v = self.qkv_proj(x).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = apply_rotary(self.q_norm(q.view(b, t, c.num_attention_heads, c.head_dim)), cos, sin)
        k = apply_rotary(self.k_norm(k.view(b, t, c.num_key_value_heads, c.head_dim)), cos, sin)
        v = v.view(b, t, c.num_key_value_heads, c.head_dim)
        write_kv(k_cache, v_cache, batch.slots, k.reshape(b * t, *k.shape[2:]), v.reshape(b * t, *v.shape[2:]))
        keys = gather_kv(k_cache, batch.block_tables)
        values = gather_kv(v_cache, batch.block_tables)
        return self.o_proj(grouped_sdpa(q, keys, values, batch.mask, self.scale))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Qwen3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: AttnBatch,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, batch, k_cache, v_cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary: Rotary | None = None

    def init_rotary(self, device: torch.device | str, max_positions: int | None = None) -> None:
        """Build RoPE tables on `device` (after weights are in place; meta-built modules need it)."""
        n = max_positions or self.cfg.max_position_embeddings
        self.rotary = Rotary(self.cfg.head_dim, self.cfg.rope_theta, n, device)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, batch: AttnBatch, kv: torch.Tensor,
                taps: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """input_ids [B, T]; kv: the cache tensor [layers, 2, blocks, bs, kv_heads, d].

        Returns the normed final hidden states [B, T, H] and the raw outputs of the
        decoder layers listed in `taps` (tap j = output of layer j = HF hidden_states[j+1]).
        """
        assert self.rotary is not None, "call init_rotary() after loading weights"
        h = self.embed(input_ids)
        cos, sin = self.rotary.tables(batch.positions, h.dtype)
        tapped: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, batch, kv[i, 0], kv[i, 1])
            if i in taps:
                tapped.append(h)
        if len(tapped) != len(taps):
            raise ValueError(f"tap ids {taps} must be distinct layer indices below {len(self.layers)}")
        order = sorted(range(len(taps)), key=lambda j: taps[j])
        tapped = [tapped[order.index(j)] for j in range(len(taps))]
        return self.norm(h), tapped

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.head_weight)
