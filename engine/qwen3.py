"""The Qwen3 target in plain PyTorch, reading and writing a paged KV cache.

Q/K/V and gate/up are fused into single matmuls (the loader fills the slices). A decoder layer
is two functions: `attn_inputs` (QKV of the normed input, q/k norms, RoPE, the cache write) and `attn_mlp`
(paged attention, output projection, MLP, and the next layer's input norm). The same functions run eagerly on the
CPU (where exactness is tested) and, on a GPU, through torch.compile inside a CUDA graph.
`forward` returns the final normed hidden states plus the outputs of the tapped decoder
layers, which the DFlash drafter conditions on.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import nn
import torch.nn.functional as F

from dataclasses import replace

from flashpd.engine.attention import Q_GROUPED, Q_HEADS, Q_TOKENS, AttnBatch, causal_position_mask, causal_sdpa, \
    continued_sdpa, gather_kv, group_mask, group_queries, grouped_attention, out_proj, paged_applies, use_continued, \
    use_paged, write_kv
from flashpd.engine import qkv_rope
from flashpd.engine.paged_attention import paged_attention, paged_attention_rope
from flashpd.engine import skinny_gemm
from flashpd.engine.skinny_gemm import fused_linear, fused_residual, linear
from flashpd.engine.config import Qwen3Config
from flashpd.engine.layers import RMSNorm, Rotary, SwiGLU, apply_rotary, rms_norm, rope_tables


def attn_inputs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w_qkv: torch.Tensor, w_qn: torch.Tensor,
                w_kn: torch.Tensor, eps: float, n_q: int, n_kv: int, d: int, k_slots: torch.Tensor | None = None,
                v_slots: torch.Tensor | None = None, slots: torch.Tensor | None = None, layout: str = Q_GROUPED
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [B, T, H], the layer's input already normed (the previous layer's `attn_mlp`, or the forward's
    first norm) -> queries, k and v [B*T, n_kv, d] (k roped and normed). Queries come in the layout
    their attention reads (`layout`): Q_GROUPED [n_kv, B, T*groups, d] (attention.group_queries) over the
    cache, Q_HEADS [B, n_q, T, d] for a fresh prefill's causal kernel, Q_TOKENS [B*T, n_q, d] for
    `continued_sdpa`. Given a layer's cache as [slots, n_kv, d] views, k and
    v are written at `slots` here, so that compiled they are stored by the kernel that makes them (separate
    index_copy kernels, two a layer, were a sizeable share of a small model's step: docs/results.md)."""
    b, t, _ = x.shape
    q, k, v = linear(x, w_qkv).split([n_q * d, n_kv * d, n_kv * d], dim=-1)
    q = apply_rotary(rms_norm(q.view(b, t, n_q, d), w_qn, eps), cos, sin)
    if layout == Q_HEADS:
        q = q.transpose(1, 2).contiguous()
    elif layout == Q_TOKENS:
        q = q.reshape(b * t, n_q, d)
    else:
        q = group_queries(q, n_kv)
    k = apply_rotary(rms_norm(k.view(b, t, n_kv, d), w_kn, eps), cos, sin).reshape(b * t, n_kv, d)
    v = v.reshape(b * t, n_kv, d)
    if k_slots is not None:
        write_kv(k_slots, v_slots, slots, k, v)
    return q, k, v


def fused_attn_inputs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w_qkv: torch.Tensor,
                      w_qn: torch.Tensor, w_kn: torch.Tensor, eps: float, n_q: int, n_kv: int, d: int,
                      k_slots: torch.Tensor, v_slots: torch.Tensor, slots: torch.Tensor) -> torch.Tensor | None:
    """`attn_inputs` of a decode or verify over the cache (the paged kernel's queries; K/V written at `slots`) as
    two launches, the QKV matmul and engine/qkv_rope.py's kernel for the rest (inductor makes two kernels of the
    rest); None where that kernel does not apply. Called eagerly (the layer's forward is not compiled), not inside
    the compiled `attn_inputs`: there the op, which writes two views of one cache, goes through functionalization,
    and the first step that ran it so on an H200 faulted (an illegal address; docs/results.md): inductor clones
    the two views' base from V's own pointer, past the cache's end (pytorch/pytorch#139628). Eagerly it writes the
    cache in place and adds no other kernel."""
    if not qkv_rope.applies(x, n_q, n_kv, d):
        return None
    return qkv_rope.qkv_rope_write(linear(x, w_qkv), cos, sin, w_qn, w_kn, eps, n_q, n_kv, k_slots, v_slots, slots)


def attn_mlp(h: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             block_tables: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, w_o: torch.Tensor,
             w_post: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, w_next: torch.Tensor, eps: float,
             scale: float, impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of grouped queries (attn_inputs) over the cache, then the residual MLP -> (the layer's
    output h, h normed by w_next: the next layer's input norm, or the model's final norm after the last).
    Decode and verify on a GPU read the cache in place by position (attention.use_paged); elsewhere it is
    gathered and masked (`mask`: step_inputs builds it exactly when this branch runs). impl: AttnBatch.impl
    (None: chosen per shape and device)."""
    if use_paged(q, positions.shape[1], impl):
        # o_proj as one matmul over the kernel's [B, T, Hq*d] output (the kv-major per-head matmuls and their
        # sum cost several times the weight's read at large batches)
        o = linear(paged_attention(q, k_cache, v_cache, block_tables, positions, scale, heads_last=True), w_o)
    else:
        if mask is None:
            raise ValueError("the gathered attention needs the position mask (qwen3.step_inputs)")
        o = out_proj(grouped_attention(q, gather_kv(k_cache, block_tables), gather_kv(v_cache, block_tables),
                                       mask, scale, impl), w_o)
    return residual_and_norm(mlp_residual(h + o, w_post, w_gate_up, w_down, eps), w_next, eps)


def attn_mlp_continued(h: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_tables: torch.Tensor, positions: torch.Tensor, w_o: torch.Tensor, w_post: torch.Tensor,
                       w_gate_up: torch.Tensor, w_down: torch.Tensor, w_next: torch.Tensor, eps: float, scale: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """`attn_mlp` for one row continuing a cached prefix (AttnBatch.continued): attention.continued_sdpa."""
    o = linear(continued_sdpa(q, k_cache, v_cache, block_tables, positions, scale), w_o)
    return residual_and_norm(mlp_residual(h + o, w_post, w_gate_up, w_down, eps), w_next, eps)


def attn_mlp_fresh(h: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w_o: torch.Tensor,
                   w_post: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, w_next: torch.Tensor,
                   eps: float, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`attn_mlp` for a fresh prefill (AttnBatch.fresh): causal attention over this forward's own K/V."""
    h = mlp_residual(h + linear(causal_sdpa(q, k, v, scale), w_o), w_post, w_gate_up, w_down, eps)
    return residual_and_norm(h, w_next, eps)


def fused_layers(h: torch.Tensor, t: int, impl: str | None, n_q: int, n_kv: int, d: int) -> bool:
    """Whether a forward of h [B, T, H] (not a fresh prefill: the caller checks) takes `fused_layer`: a decode,
    verify or draft pass on the paged path (T tokens a row, attention form `impl`) of at most 16 rows in all,
    where the few-row projection kernel's fused forms and qkv_rope's kernel both run (a GPU in bf16/fp16, or
    triton's interpreter in tests)."""
    return (paged_applies(h.device, t, impl) and skinny_gemm.fused_applies(h, h.shape[0] * t)
            and qkv_rope.applies(h, n_q, n_kv, d))


def fused_layer(h: torch.Tensor, xg: torch.Tensor, ss: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                w_qkv: torch.Tensor, w_qn: torch.Tensor, w_kn: torch.Tensor, w_o: torch.Tensor, w_post: torch.Tensor,
                w_gate_up: torch.Tensor, w_down: torch.Tensor, w_next: torch.Tensor, eps: float, n_q: int, n_kv: int,
                d: int, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                block_tables: torch.Tensor, positions: torch.Tensor, write_positions: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decoder layer (`fused_layers`) in 7 launches (6 with qkv_rope.IN_ATTENTION), plus the paged kernel's
    combine where it splits the keys: the residual stream h, with xg = h times the input norm's weight and ss the
    partial sums of h's squares (skinny_gemm.norm_input, or the previous fused layer) -> the same three for the
    layer's output, xg by w_next (the next layer's input norm, or the final norm's weight). QKV scales its rows by
    1/rms; qkv_rope's kernel (or, IN_ATTENTION, the paged kernel) makes the queries and writes K/V at `slots`;
    the paged kernel attends up to `positions`; o_proj adds the residual and writes the post-attention norm's
    input, gate/up forms silu(gate) * up of the normed rows, down adds the residual and writes the next norm's
    input. write_positions: each token's key index (default: positions; the drafter's block queries see to its
    last position, its tokens' keys sit at their own). Eager launches (opaque ops: nothing is left between them
    for a compiler to fuse)."""
    qkv = fused_linear(xg, w_qkv, ss, eps)
    if qkv_rope.IN_ATTENTION:
        o = paged_attention_rope(qkv, k_cache, v_cache, block_tables, positions, d ** -0.5, cos, sin, w_qn, w_kn,
                                 eps, n_q, slots, write_positions, heads_last=True)
    else:
        q = qkv_rope.qkv_rope_write(qkv, cos, sin, w_qn, w_kn, eps, n_q, n_kv, k_cache.view(-1, n_kv, d),
                                    v_cache.view(-1, n_kv, d), slots)
        o = paged_attention(q, k_cache, v_cache, block_tables, positions, d ** -0.5, heads_last=True)
    h, xg, ss = fused_residual(o, w_o, h, w_post)
    act = fused_linear(xg, w_gate_up, ss, eps, swiglu=True)
    return fused_residual(act, w_down, h, w_next)


def residual_and_norm(h: torch.Tensor, w_next: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, rms_norm(h)): the next layer's input norm taken in the layer that makes h. Compiled, the MLP's
    residual add and this norm are one kernel; with the norm at the start of the next layer's function (a
    graph of its own) they were two, each a launch and a pass over h, 36 a step at Qwen3-8B."""
    return h, rms_norm(h, w_next, eps)


def mlp_residual(h: torch.Tensor, w_post: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """h + SwiGLU(post_attention_layernorm(h)), gate and up fused."""
    gate, up = linear(rms_norm(h, w_post, eps), w_gate_up).chunk(2, dim=-1)
    return h + linear(F.silu(gate) * up, w_down)


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=False)
        self.self_attn.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.self_attn.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.self_attn.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: AttnBatch,
                k_cache: torch.Tensor, v_cache: torch.Tensor, w_next: torch.Tensor, fns: "StepFns"
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """h: the residual stream [B, T, H]; x: h under this layer's input norm. -> (the layer's output,
        it normed by w_next)."""
        c, a = self.cfg, self.self_attn
        pre, post, fresh = fns.attn_inputs, fns.attn_mlp, fns.attn_mlp_fresh
        n_kv, d = c.num_key_value_heads, c.head_dim
        args = (x, cos, sin, a.qkv_proj.weight, a.q_norm.weight, a.k_norm.weight, c.rms_norm_eps,
                c.num_attention_heads, n_kv, d, k_cache.view(-1, n_kv, d), v_cache.view(-1, n_kv, d), batch.slots)
        q = k = v = None
        if not batch.fresh and paged_applies(x.device, x.shape[1], batch.impl):  # the paged kernel's queries
            q = fused_attn_inputs(*args)
        if q is None:
            q, k, v = pre(*args, Q_HEADS if batch.fresh else Q_TOKENS if batch.continued else Q_GROUPED)
        if batch.continued:
            return fns.attn_mlp_continued(h, q, k_cache, v_cache, batch.block_tables, batch.positions,
                                          a.o_proj.weight, self.post_attention_layernorm.weight,
                                          self.mlp.gate_up_proj.weight, self.mlp.down_proj.weight, w_next,
                                          c.rms_norm_eps, c.head_dim ** -0.5)
        if batch.fresh:
            return fresh(h, q, k, v, a.o_proj.weight, self.post_attention_layernorm.weight,
                         self.mlp.gate_up_proj.weight, self.mlp.down_proj.weight, w_next, c.rms_norm_eps,
                         c.head_dim ** -0.5)
        return post(h, q, k_cache, v_cache, batch.block_tables, batch.positions, batch.mask, a.o_proj.weight,
                    self.post_attention_layernorm.weight, self.mlp.gate_up_proj.weight, self.mlp.down_proj.weight,
                    w_next, c.rms_norm_eps, c.head_dim ** -0.5, batch.impl)


def step_inputs(ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor, w_embed: torch.Tensor,
                cos_t: torch.Tensor, sin_t: torch.Tensor, kv_block_size: int, groups: int, mask: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A forward's prologue: embeddings [B, T, H], RoPE tables, and (with `mask`: the layers gather the
    cache) the grouped position mask over the block tables' keys (key j visible to the query at position p
    iff j <= p). Eagerly this is about ten small kernels a step, each a launch a small model's step waits for;
    compiled, one or two. Fresh prefills and the paged kernel's decode and verify read no mask."""
    h = F.embedding(ids, w_embed)
    cos, sin = rope_tables(cos_t, sin_t, positions, h.dtype)
    if not mask:
        return h, cos, sin, None
    return h, cos, sin, group_mask(causal_position_mask(positions, block_tables.shape[1] * kv_block_size), groups)


class StepFns(NamedTuple):
    """The functions a forward is made of: the runner compiles each (eagerly the final norm is 8 kernels)."""

    attn_inputs: Callable
    attn_mlp: Callable
    attn_mlp_fresh: Callable
    norm: Callable
    step_inputs: Callable
    attn_mlp_continued: Callable


EAGER = StepFns(attn_inputs, attn_mlp, attn_mlp_fresh, rms_norm, step_inputs, attn_mlp_continued)


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

    def forward(self, input_ids: torch.Tensor, batch: AttnBatch, kv: torch.Tensor, taps: tuple[int, ...] = (),
                fns: StepFns = EAGER) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """input_ids [B, T]; kv: the cache tensor [layers, 2, blocks, bs, kv_heads, d]. The attention mask
        comes from the positions and block tables (step_inputs); batch.mask is not read.

        Returns the normed final hidden states [B, T, H] and the raw outputs of the
        decoder layers listed in `taps`, in that order (tap j = output of layer j =
        HF hidden_states[j+1]; for the last layer that is, as in HF, after the final norm).
        """
        assert self.rotary is not None, "call init_rotary() after loading weights"
        if len(set(taps)) != len(taps) or any(not 0 <= j < len(self.layers) for j in taps):
            raise ValueError(f"tap ids {taps} must be distinct layer indices below {len(self.layers)}")
        b, t = input_ids.shape
        continued = not batch.fresh and use_continued(input_ids.device, b, t, kv.dtype, self.cfg.head_dim, batch.impl)
        gathers = not batch.fresh and not continued and not paged_applies(input_ids.device, t, batch.impl)
        h, cos, sin, mask = fns.step_inputs(input_ids, batch.positions, batch.block_tables, self.embed_tokens.weight,
                                            self.rotary.cos, self.rotary.sin, kv.shape[3],
                                            self.cfg.num_attention_heads // self.cfg.num_key_value_heads, gathers)
        batch = replace(batch, mask=mask, continued=continued)
        eps, layers, c = self.cfg.rms_norm_eps, self.layers, self.cfg
        n_q, n_kv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        fused = not batch.fresh and fused_layers(h, t, batch.impl, n_q, n_kv, d)
        if fused:
            xg, ss = skinny_gemm.norm_input(h, layers[0].input_layernorm.weight)
        else:
            x = fns.norm(h, layers[0].input_layernorm.weight, eps)
        tapped: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(layers):
            w_next = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else self.norm.weight
            if fused:
                a, mlp = layer.self_attn, layer.mlp
                h, xg, ss = fused_layer(h, xg, ss, cos, sin, a.qkv_proj.weight, a.q_norm.weight, a.k_norm.weight,
                                        a.o_proj.weight, layer.post_attention_layernorm.weight,
                                        mlp.gate_up_proj.weight, mlp.down_proj.weight, w_next, eps, n_q, n_kv, d,
                                        kv[i, 0], kv[i, 1], batch.slots, batch.block_tables, batch.positions)
            else:
                h, x = layer(h, x, cos, sin, batch, kv[i, 0], kv[i, 1], w_next, fns)
            if i in taps:
                tapped[i] = h
        # the last layer's output under the final norm (after fused layers its own kernel: the last xg is unused)
        out = fns.norm(h, self.norm.weight, eps) if fused else x
        if len(layers) - 1 in tapped:  # HF's last hidden state comes after the final norm
            tapped[len(layers) - 1] = out
        return out, [tapped[j] for j in taps]

    def causal_forward(self, input_ids: torch.Tensor, taps: tuple[int, ...] = ()
                       ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Cache-free causal forward of whole sequences [B, T] (training, feature extraction)."""
        c = self.cfg
        b, t = input_ids.shape
        h = self.embed(input_ids)
        cos, sin = self.rotary.tables(torch.arange(t, device=h.device), h.dtype)
        tapped: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            q, k, v = attn_inputs(rms_norm(h, layer.input_layernorm.weight, c.rms_norm_eps), cos, sin,
                                  a.qkv_proj.weight, a.q_norm.weight, a.k_norm.weight, c.rms_norm_eps,
                                  c.num_attention_heads, c.num_key_value_heads, c.head_dim, layout=Q_HEADS)
            h = h + linear(causal_sdpa(q, k, v, c.head_dim ** -0.5), a.o_proj.weight)
            h = mlp_residual(h, layer.post_attention_layernorm.weight, layer.mlp.gate_up_proj.weight,
                             layer.mlp.down_proj.weight, c.rms_norm_eps)
            if i in taps:
                tapped[i] = h
        out = rms_norm(h, self.norm.weight, c.rms_norm_eps)
        if len(self.layers) - 1 in tapped:
            tapped[len(self.layers) - 1] = out
        return out, [tapped[j] for j in taps]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.head_weight)
