"""The DFlash block-diffusion drafter: z-lab checkpoint loading, context K/V, one-pass block drafts.

A drafter layer's state for a prefix is its context K/V: K_l[t] = RoPE(k_norm(k_proj_l(ctx[t])), t)
and V_l[t] = v_proj_l(ctx[t]) with ctx[t] = hidden_norm(fc(concat of the target's tapped hidden
states at t)). It depends on position t's target states alone, so it lives in a paged cache
indexed by the SAME block tables as the target's KV (one table per sequence drives both) and
is appended only for committed positions. A draft pass embeds [last token, MASK x (B-1)] with
the target's embedding, lets every block query see all context K/V plus all B block keys
(non-causal), and reads B-1 guesses through the target's lm_head.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from torch import nn
import torch.nn.functional as F

from flashpd.engine.attention import gather_kv, group_mask, group_queries, grouped_attention, out_proj, \
    paged_applies
from flashpd.engine.config import CheckpointError, HeadGeometry, architectures_of, positive_ints, positive_numbers, \
    check_math, read_json_object, require_file, rope_theta_of
from flashpd.engine.layers import Rotary, apply_rotary, rms_norm, rope_tables
from flashpd.engine.loader import check_checkpoint, fill_from_checkpoint, meta_build, safetensors_files
from flashpd.engine.qwen3 import Qwen3ForCausalLM, attn_inputs, attn_mlp, fused_attn_inputs, fused_layer, \
    fused_layers, mlp_residual
from flashpd.engine import skinny_gemm
from flashpd.engine.skinny_gemm import Fp8Weight, Weight, linear, quantize_fp8


class DrafterMismatch(CheckpointError):
    """The drafter does not fit this target (the message names the field)."""


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass(frozen=True)
class DFlashConfig(HeadGeometry):
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int  # config.json's spelling (z-lab format): the drafter's default draft width
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    vocab_size: int | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    @classmethod
    def from_dict(cls, d: dict, source: str = "drafter config") -> "DFlashConfig":
        archs = architectures_of(d, source)
        if archs and "DFlashDraftModel" not in archs:
            raise CheckpointError(f"{source}: architectures {archs} is not a DFlash drafter (DFlashDraftModel)")
        dc = d.get("dflash_config") or {}
        if not isinstance(dc, dict):
            raise CheckpointError(f"{source}: dflash_config must be a JSON object, got {dc!r}")

        def pick(name: str, default=None):  # dflash_config wins, its null too (softcap null: none), as dflash's
            return dc.get(name, d.get(name, default))

        def pick_int(name: str, default=None):  # the integer fields: a null anywhere is unset (int(None) raised)
            v = dc.get(name)
            v = d.get(name) if v is None else v
            return default if v is None else v

        for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if k not in d:
                raise CheckpointError(f"{source}: missing field {k}")
        positive_ints(d, ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                          "num_key_value_heads", "head_dim", "vocab_size"), source)
        for k in ("num_target_layers", "block_size", "mask_token_id"):  # (their ranges: check_fits, against the target)
            v = pick_int(k)
            if v is not None and not (isinstance(v, int) and not isinstance(v, bool)):
                raise CheckpointError(f"{source}: {k} must be an integer, got {v!r}")
        ids = pick("target_layer_ids")
        if ids is not None and not (isinstance(ids, list) and ids and all(isinstance(i, int) and
                                                                         not isinstance(i, bool) for i in ids)):
            raise CheckpointError(f"{source}: target_layer_ids must be a non-empty list of integers, got {ids!r}")
        positive_numbers(d, ("rms_norm_eps",), source)
        check_math(d, source)
        scales = {k: pick(k) for k in ("input_embedding_scale", "output_multiplier")}
        scales["final_logit_softcapping"] = pick("final_logit_softcapping") or None  # 0: no softcap
        positive_numbers(scales, tuple(scales), source)  # a string: a bare float() error; a sign: garbage drafts
        heads = d["num_attention_heads"]
        n_layers = d["num_hidden_layers"]
        if pick_int("num_target_layers") is None:
            raise CheckpointError(f"{source}: missing field num_target_layers")
        n_target = int(pick_int("num_target_layers"))
        mask = pick_int("mask_token_id")
        if mask is None:
            raise CheckpointError(f"{source}: missing field dflash_config.mask_token_id")
        if ids is None:
            ids = default_target_layer_ids(n_target, n_layers)
        softcap = pick("final_logit_softcapping")
        return cls(hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
                   num_hidden_layers=n_layers, num_attention_heads=heads,
                   num_key_value_heads=d.get("num_key_value_heads") or heads,
                   head_dim=d.get("head_dim") or d["hidden_size"] // heads,
                   rms_norm_eps=float(d.get("rms_norm_eps") or 1e-6), rope_theta=rope_theta_of(d, source),
                   block_size=int(pick_int("block_size", 16)), num_target_layers=n_target,
                   target_layer_ids=tuple(int(i) for i in ids), mask_token_id=int(mask),
                   vocab_size=d.get("vocab_size"),
                   input_embedding_scale=float(pick("input_embedding_scale") or 1.0),
                   output_multiplier=float(pick("output_multiplier") or 1.0),
                   final_logit_softcapping=float(softcap) if softcap else None)

    def check_fits(self, target: Qwen3ForCausalLM) -> None:
        """Refuse a drafter that cannot condition on / draft for this target, naming the field."""
        t = target.cfg
        if self.hidden_size != t.hidden_size:
            raise DrafterMismatch(f"drafter hidden_size {self.hidden_size} != target hidden_size {t.hidden_size}")
        if self.num_target_layers != t.num_hidden_layers:
            raise DrafterMismatch(f"drafter num_target_layers {self.num_target_layers} != target "
                                  f"num_hidden_layers {t.num_hidden_layers}")
        if self.vocab_size is not None and self.vocab_size != t.vocab_size:
            raise DrafterMismatch(f"drafter vocab_size {self.vocab_size} != target vocab_size {t.vocab_size}")
        bad = [j for j in self.target_layer_ids if not 0 <= j < t.num_hidden_layers]
        if bad or len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            raise DrafterMismatch(f"drafter target_layer_ids {list(self.target_layer_ids)} must be distinct "
                                  f"layers in [0, {t.num_hidden_layers})")
        if not 0 <= self.mask_token_id < t.vocab_size:
            raise DrafterMismatch(f"drafter mask_token_id {self.mask_token_id} is outside the target "
                                  f"vocabulary [0, {t.vocab_size})")
        if not 2 <= self.block_size <= 16:
            raise DrafterMismatch(f"drafter block_size {self.block_size} must be in [2, 16] (flashpd's draft widths)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise DrafterMismatch(f"drafter num_attention_heads {self.num_attention_heads} is not a multiple "
                                  f"of num_key_value_heads {self.num_key_value_heads}")


class DraftLayer(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.Parameter(torch.ones(c.hidden_size))
        # q, k, v in one matrix: one matmul a layer in a draft pass (two were two kernels a step); the k/v
        # rows of every layer also feed the context write, through `_kv_all` (attach)
        self.qkv_proj = nn.Parameter(torch.empty(c.q_size + 2 * c.kv_size, c.hidden_size))
        self.o_proj = nn.Parameter(torch.empty(c.hidden_size, c.q_size))
        self.q_norm = nn.Parameter(torch.ones(c.head_dim))
        self.k_norm = nn.Parameter(torch.ones(c.head_dim))
        self.post_attention_layernorm = nn.Parameter(torch.ones(c.hidden_size))
        self.gate_up_proj = nn.Parameter(torch.empty(2 * c.intermediate_size, c.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(c.hidden_size, c.intermediate_size))


class DFlashDrafter(nn.Module):
    """Drafter weights plus borrowed target embedding / lm_head (not owned: never saved here)."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.cfg = cfg
        n_taps = len(cfg.target_layer_ids)
        self.fc = nn.Parameter(torch.empty(cfg.hidden_size, n_taps * cfg.hidden_size))
        self.hidden_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.rotary: Rotary | None = None
        self._target: tuple[Qwen3ForCausalLM] | None = None  # a tuple keeps it out of this module's params
        # a reduced draft vocabulary (engine/token_map.py): the hot ids, sorted, and their head rows (a copy)
        self.hot_ids: torch.Tensor | None = None
        self._hot_head: torch.Tensor | None = None
        # the few-row draft passes' weights in fp8 (`quantize`): each layer's four projections, fc, and the head
        self.quantization: str | None = None
        self._fp8_layers: list[dict[str, Fp8Weight]] | None = None
        self._fp8_fc: Fp8Weight | None = None
        self._fc_wide: torch.Tensor | None = None  # the fp8 fc widened back, for context writes past MAX_ROWS
        self._fp8_head: tuple[torch.Tensor, Fp8Weight] | None = None  # (the bf16 head it was made from, it)

    def attach(self, target: Qwen3ForCausalLM) -> None:
        """Borrow the target's embedding / head / RoPE; stack per-layer weights (views share storage): the
        context write reads every layer's k/v rows as one [layers, 2*kv, H] view of the stacked q/k/v."""
        self.cfg.check_fits(target)
        with torch.no_grad():
            qkv_all = torch.stack([l.qkv_proj for l in self.layers])
            self._kn_all = torch.stack([l.k_norm for l in self.layers])
            for i, l in enumerate(self.layers):
                l.qkv_proj.data = qkv_all[i]
                l.k_norm.data = self._kn_all[i]
            self._kv_all = qkv_all[:, self.cfg.q_size:]
        self._target = (target,)
        self.rotary = target.rotary if target.cfg.head_dim == self.cfg.head_dim and \
            target.cfg.rope_theta == self.cfg.rope_theta else \
            Rotary(self.cfg.head_dim, self.cfg.rope_theta, target.rotary.max_positions, target.rotary.cos.device)

    @property
    def target(self) -> Qwen3ForCausalLM:
        assert self._target is not None, "attach() the drafter to its target first"
        return self._target[0]

    # ---- draft vocabulary --------------------------------------------------------------
    def set_token_map(self, hot_ids: torch.Tensor | None) -> None:
        """Draft over the head rows of `hot_ids` only (sorted int64, engine/token_map.parse_token_ids), or over the
        whole vocabulary (None). The rows are copied once into one contiguous weight: the draft pass then reads
        |hot| rows of the head a step instead of all of them."""
        if hot_ids is None:
            self.hot_ids = self._hot_head = None
            self._quantize_head()
            return
        w = self.target.head_weight
        ids = hot_ids.to(device=w.device, dtype=torch.int64)
        assert ids.dim() == 1 and ids.numel() and bool((ids[1:] > ids[:-1]).all()), "hot ids: sorted, distinct"
        assert int(ids[-1]) < w.shape[0], "hot id outside the head"
        self.hot_ids, self._hot_head = ids, w.index_select(0, ids).contiguous()
        self._quantize_head()

    @property
    def head_weight(self) -> torch.Tensor:
        """The draft pass's head: the target's, or its hot rows (the draft's logits then index hot_ids)."""
        return self.target.head_weight if self._hot_head is None else self._hot_head

    def draft_head(self, rows: int) -> Weight:
        """`head_weight` as a draft pass of `rows` rows reads it: in fp8 under `quantize` where the few-row kernel
        takes the pass (made by `quantize` and `set_token_map`, never here: a pass may be a CUDA graph's capture)."""
        head = self.head_weight
        if not self._fp8_for(rows):
            return head
        assert self._fp8_head is not None and self._fp8_head[0] is head, "the fp8 head is not the current head's"
        return self._fp8_head[1]

    # ---- weight format -----------------------------------------------------------------
    QUANTIZATIONS = (None, "fp8")

    def quantize(self, quantization: str | None) -> None:
        """The draft passes' projection weights in `quantization`: None (the checkpoint's dtype) or "fp8" (float8
        e4m3 with a scale per output row, skinny_gemm.Fp8Weight): each layer's q/k/v, o_proj, gate/up and down,
        fc, and a copy of the head (or of the hot rows), at half the bytes a draft pass reads. The few-row kernel
        widens each tile back before its multiply, so drafts change only by the weights' rounding; the target
        verifies every draft, so greedy output does not change at all and sampled output keeps its distribution
        (a seeded sampled request's tokens follow its drafts: sampling.py). The bf16 weights stay for the batched
        passes; fc's context writes take the fp8 values at every size (fc_weight says why; its widened copy is
        fc's size again). vLLM's speculative_config "quantization"."""
        if quantization not in self.QUANTIZATIONS:
            raise ValueError(f"draft quantization must be one of {list(self.QUANTIZATIONS)}, got {quantization!r}")
        self.quantization = quantization
        self._quantize_head()
        if quantization is None:
            self._fp8_layers = self._fp8_fc = self._fc_wide = None
            return
        names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
        self._fp8_layers = [{n: quantize_fp8(getattr(l, n)) for n in names} for l in self.layers]
        self._fp8_fc = quantize_fp8(self.fc)
        self._fc_wide = self._fp8_fc.dequantize(self.fc.dtype)

    def _quantize_head(self) -> None:
        """The fp8 copy of the head the draft reads now (`head_weight`), under `quantize`; none otherwise."""
        self._fp8_head = None if self.quantization is None else (self.head_weight, quantize_fp8(self.head_weight))

    def _fp8_for(self, rows: int) -> bool:
        """Whether a projection of `rows` rows reads the fp8 weights: under `quantize`, at most the few-row
        kernel's rows (skinny_gemm.MAX_ROWS). Past them a pass multiplies, not streams, its weights: the bf16 ones."""
        return self.quantization is not None and rows <= skinny_gemm.MAX_ROWS

    def proj(self, i: int, name: str, rows: int) -> Weight:
        """Layer i's projection `name` (qkv_proj, o_proj, gate_up_proj, down_proj) as a pass of `rows` rows reads
        it."""
        return self._fp8_layers[i][name] if self._fp8_for(rows) else getattr(self.layers[i], name)

    def fc_weight(self, rows: int) -> Weight:
        """The context projection as a context write of `rows` positions reads it. Under `quantize`, every write
        takes the fp8 values, past the few-row kernel's rows widened back (`_fc_wide`): a position's context K/V
        must not depend on how many positions its write took, or a prefix hit's tail (a few rows) would be
        written with other weights than a cold prefill's (many) and draft otherwise."""
        if self.quantization is None:
            return self.fc
        return self._fp8_fc if self._fp8_for(rows) else self._fc_wide

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's vocabulary: a reduced draft's [..., |hot|] scattered into -inf
        elsewhere (what sampled rows draw from: q is zero off the hot set); the whole head's unchanged."""
        if self.hot_ids is None:
            return logits
        out = logits.new_full((*logits.shape[:-1], self.target.head_weight.shape[0]), float("-inf"))
        return out.index_copy_(-1, self.hot_ids, logits)

    def target_ids(self, tokens: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary indices (an argmax of the draft's logits) -> target token ids."""
        return tokens if self.hot_ids is None else self.hot_ids[tokens]

    # ---- context state -----------------------------------------------------------------
    def context_feature(self, taps: torch.Tensor) -> torch.Tensor:
        """[..., n_taps*H] concatenated target taps -> ctx [..., H]."""
        return rms_norm(linear(taps, self.fc_weight(taps.numel() // taps.shape[-1])), self.hidden_norm,
                        self.cfg.rms_norm_eps)

    def write_context(self, cache: torch.Tensor, taps: torch.Tensor, positions: torch.Tensor,
                      slots: torch.Tensor, kv_fn: Callable | None = None) -> None:
        """Append committed positions' context K/V for every draft layer in one scatter.

        cache [draft_layers, 2, blocks, bs, kv, d]; taps [N, n_taps*H]; positions, slots [N].
        """
        c = self.cfg
        n_l, _, nb, bs, h, d = cache.shape
        (kv_fn or write_context_kv)(cache.view(n_l * 2, nb * bs, h, d), taps, positions, slots, self.rotary.cos,
                                    self.rotary.sin, self.fc_weight(taps.shape[0]), self.hidden_norm, self._kv_all,
                                    self._kn_all,
                                    c.rms_norm_eps, c.num_key_value_heads, c.head_dim)

    # ---- drafting ----------------------------------------------------------------------
    def layer_weights(self, i: int, rows: int | None = None) -> tuple[torch.Tensor, ...]:
        """Layer i's weights in `draft_layer`'s order; for a pass of `rows` rows under `quantize`, its four
        projections are the fp8 weights widened back (the values the few-row kernel multiplies)."""
        l = self.layers[i]
        w = [l.input_layernorm, l.qkv_proj, l.o_proj, l.q_norm, l.k_norm, l.post_attention_layernorm,
             l.gate_up_proj, l.down_proj]
        if rows is not None and self._fp8_for(rows):
            q = self._fp8_layers[i]
            w[1], w[2], w[6], w[7] = (q[n].dequantize(l.qkv_proj.dtype)
                                      for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
        return tuple(w)

    def draft_logits(self, block_ids: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor,
                     block_tables: torch.Tensor, ctx_lens: torch.Tensor, block_lens: torch.Tensor,
                     layer_fn: Callable = None, attention_impl: str | None = None,
                     block_slots: torch.Tensor | None = None, paged_fns: "PagedDraftFns | None" = None
                     ) -> torch.Tensor:
        """One draft pass. block_ids/positions [B, T]; ctx_lens [B] valid context positions;
        block_lens [B] real draft width per row (shorter rows mask their tail keys). attention_impl: the
        forced attention form (RunnerConfig.attention_impl, via DraftRunner), None: automatic.
        Returns logits [B, T-1, V] for block positions 1..T-1 (position i predicts token start+i); V is |hot_ids|
        under a token map (`target_ids` maps an argmax back, `full_logits` widens them).

        With block_slots [B*T] (the cache slots of the block's positions, the scratch block past a row's width:
        the verify's own slots), where the paged kernel applies (a GPU; attention_impl "paged" forces it) the
        pass runs `paged_block_hidden` (paged_fns: its functions, compiled by the caller) instead of gathering
        the context: the runners' invariant that a row's context ends where its block starts (ctx_lens ==
        positions[:, 0]) is then required, and rows narrower than T must repeat their last position in
        `positions` (DraftRunner.inputs, device_loop.spec_in), whose last column bounds every query's keys.
        """
        c = self.cfg
        b, t = block_ids.shape
        tgt = self.target
        if attention_impl == "paged" and not paged_applies(block_ids.device, t, attention_impl):
            raise RuntimeError(f"attention_impl 'paged' needs triton (a GPU, or TRITON_INTERPRET=1) and a block "
                               f"of at most attention.PAGED_MAX_T tokens, got {t}")
        if block_slots is not None and paged_applies(block_ids.device, t, attention_impl):
            fns = paged_fns or PAGED_EAGER
            x = self.paged_block_hidden(block_ids, positions, cache, block_tables, block_slots, fns, attention_impl)
            return fns.head(x, self.draft_head(b * (t - 1)), c.output_multiplier, c.final_logit_softcapping)
        if attention_impl == "paged":
            raise ValueError("attention_impl 'paged' needs block_slots")
        h = tgt.embed(block_ids)
        if c.input_embedding_scale != 1.0:
            h = h * c.input_embedding_scale
        cos, sin = self.rotary.tables(positions, h.dtype)
        n_ctx = block_tables.shape[1] * cache.shape[3]
        ctx_ok = torch.arange(n_ctx, device=h.device)[None, :] < ctx_lens[:, None]
        blk_ok = torch.arange(t, device=h.device)[None, :] < block_lens[:, None]
        mask = torch.cat([ctx_ok, blk_ok], dim=1)[:, None, None, :].expand(b, 1, t, n_ctx + t)
        mask = group_mask(mask, c.num_attention_heads // c.num_key_value_heads)
        fn = layer_fn or draft_layer
        for i in range(c.num_hidden_layers):
            h = fn(h, cos, sin, gather_kv(cache[i, 0], block_tables), gather_kv(cache[i, 1], block_tables), mask,
                   *self.layer_weights(i, b * t),
                   c.rms_norm_eps, c.num_attention_heads, c.num_key_value_heads, c.head_dim, impl=attention_impl)
        return block_head(rms_norm(h, self.norm, c.rms_norm_eps), self.draft_head(b * (t - 1)), c.output_multiplier,
                          c.final_logit_softcapping)

    def paged_block_hidden(self, block_ids: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor,
                           block_tables: torch.Tensor, block_slots: torch.Tensor, fns: "PagedDraftFns",
                           impl: str | None = None) -> torch.Tensor:
        """The draft pass over the paged draft cache in place, the block's final-normed hidden states [B, T, H].

        Each layer writes its block's own K/V into the cache at `block_slots` (the positions the row's context
        reaches next: later context writes overwrite them with the accepted positions' context K/V), then its
        queries attend with the paged kernel to keys 0 .. the row's last block position: the whole context and
        every key of the row's block, bidirectional within it, the visibility `draft_layer`'s mask gives. The
        target's own layer functions do both halves: no copy of the row's whole padded context, no mask and no
        concatenation (the gathered pass's reads grow with the block table, which a session reserves to its end)."""
        c = self.cfg
        n_kv, d, eps = c.num_key_value_heads, c.head_dim, c.rms_norm_eps
        layers = self.layers
        h, x, cos, sin, key_pos = fns.inputs(block_ids, positions, self.target.embed_tokens.weight, self.rotary.cos,
                                             self.rotary.sin, layers[0].input_layernorm, c.input_embedding_scale,
                                             eps)
        n_q = c.num_attention_heads
        fused = fused_layers(h, positions.shape[1], impl, n_q, n_kv, d)  # qwen3.fused_layer, as the target's
        if fused:
            xg, ss = skinny_gemm.norm_input(h, layers[0].input_layernorm)
        for i, l in enumerate(layers):
            w_next = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.norm
            k_cache, v_cache = cache[i, 0], cache[i, 1]
            if fused:
                rows = h.shape[0] * h.shape[1]
                h, xg, ss = fused_layer(h, xg, ss, cos, sin, self.proj(i, "qkv_proj", rows), l.q_norm, l.k_norm,
                                        self.proj(i, "o_proj", rows), l.post_attention_layernorm,
                                        self.proj(i, "gate_up_proj", rows), self.proj(i, "down_proj", rows), w_next,
                                        eps, n_q, n_kv, d, k_cache, v_cache, block_slots, block_tables, key_pos,
                                        positions)
                continue
            args = (x, cos, sin, l.qkv_proj, l.q_norm, l.k_norm, eps, c.num_attention_heads, n_kv, d,
                    k_cache.view(-1, n_kv, d), v_cache.view(-1, n_kv, d), block_slots)
            q = fused_attn_inputs(*args)  # one kernel after the matmul where it applies, eagerly (qwen3's layer)
            if q is None:
                q = fns.qkv(*args)
            h, x = fns.attn_mlp(h, q, k_cache, v_cache, block_tables, key_pos, l.o_proj, l.post_attention_layernorm,
                                l.gate_up_proj, l.down_proj, w_next, eps, d ** -0.5, impl)
        return fns.norm(h, self.norm, eps) if fused else x


def block_head(x: torch.Tensor, w_head: Weight, multiplier: float, softcap: float | None) -> torch.Tensor:
    """Draft logits [B, T-1, V] of the final-normed block x [B, T, H] at positions 1..T-1, through the
    target's head (and the drafter's output multiplier and soft cap, where its config has them)."""
    b, t, h = x.shape
    # one [B*(T-1), H] matrix, not a strided [B, T-1, H] view: F.linear takes a view it cannot flatten as a
    # batched matmul that reads the whole head once per row (docs/results.md, 2026-12-04)
    return scale_logits(linear(x[:, 1:].reshape(b * (t - 1), h), w_head).view(b, t - 1, -1), multiplier, softcap)


def scale_logits(logits: torch.Tensor, multiplier: float, softcap: float | None) -> torch.Tensor:
    """The drafter config's output multiplier, then its soft cap, on head logits (the draft pass and training)."""
    if multiplier != 1.0:
        logits = logits * multiplier
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def paged_block_inputs(block_ids: torch.Tensor, positions: torch.Tensor, w_embed: torch.Tensor, cos_t: torch.Tensor,
                       sin_t: torch.Tensor, w_in: torch.Tensor, scale: float, eps: float
                       ) -> tuple[torch.Tensor, ...]:
    """The paged pass's prologue: the block's embeddings h [B, T, H] (scaled), h under the first layer's
    input norm, the RoPE tables, and each query's last visible key: its row's last block position."""
    h = F.embedding(block_ids, w_embed)
    if scale != 1.0:
        h = h * scale
    cos, sin = rope_tables(cos_t, sin_t, positions, h.dtype)
    return h, rms_norm(h, w_in, eps), cos, sin, positions[:, -1:].expand_as(positions).contiguous()


def paged_qkv(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w_qkv: torch.Tensor, w_qn: torch.Tensor,
              w_kn: torch.Tensor, eps: float, n_q: int, n_kv: int, d: int, k_slots: torch.Tensor,
              v_slots: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """A draft layer's grouped queries, its block's K/V written at `slots`: qwen3.attn_inputs. A function of
    the drafter's own, so that compiled its code is the drafter's: dynamo caches code per function, and a call
    at the drafter's shapes must not add code that the target's calls could then take (ModelRunner.compiled)."""
    return attn_inputs(x, cos, sin, w_qkv, w_qn, w_kn, eps, n_q, n_kv, d, k_slots, v_slots, slots)[0]


def paged_attn_mlp(h: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   block_tables: torch.Tensor, key_pos: torch.Tensor, w_o: torch.Tensor, w_post: torch.Tensor,
                   w_gate_up: torch.Tensor, w_down: torch.Tensor, w_next: torch.Tensor, eps: float, scale: float,
                   impl: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft layer's paged attention, output projection and MLP: qwen3.attn_mlp (its own function for the
    reason `paged_qkv` gives). In a function apart from the cache write, as the target's are: one compiled
    function that wrote a view of the cache and read the cache would take two aliasing inputs."""
    return attn_mlp(h, q, k_cache, v_cache, block_tables, key_pos, None, w_o, w_post, w_gate_up, w_down, w_next,
                    eps, scale, impl)


class PagedDraftFns(NamedTuple):
    """The functions of `DFlashDrafter.paged_block_hidden` and its head (DraftRunner compiles each)."""

    inputs: Callable
    qkv: Callable
    attn_mlp: Callable
    head: Callable
    norm: Callable


def paged_norm(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The pass's final norm after fused layers (qwen3.fused_layer), a function of the drafter's own: paged_qkv's
    docstring says why."""
    return rms_norm(h, w, eps)


PAGED_EAGER = PagedDraftFns(paged_block_inputs, paged_qkv, paged_attn_mlp, block_head, paged_norm)


def context_kv_all(taps: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w_fc: Weight,
                   w_hidden_norm: torch.Tensor, w_kv_all: torch.Tensor, w_kn_all: torch.Tensor, eps: float,
                   n_kv: int, d: int) -> torch.Tensor:
    """Context K/V of every draft layer at once: taps [N, n_taps*H] -> [layers, 2, N, n_kv, d]."""
    n = taps.shape[0]
    n_l = w_kv_all.shape[0]
    ctx = rms_norm(linear(taps, w_fc), w_hidden_norm, eps)
    kv = torch.matmul(ctx.unsqueeze(0), w_kv_all.transpose(1, 2))  # [layers, N, 2*n_kv*d]
    k, v = kv.split([n_kv * d, n_kv * d], dim=-1)
    k = apply_rotary(rms_norm(k.view(n_l, n, n_kv, d), w_kn_all.view(n_l, 1, 1, d), eps), cos, sin)
    return torch.stack([k, v.view(n_l, n, n_kv, d)], dim=1)


def write_context_kv(cache: torch.Tensor, taps: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                     cos_t: torch.Tensor, sin_t: torch.Tensor, w_fc: Weight, w_hidden_norm: torch.Tensor,
                     w_kv_all: torch.Tensor, w_kn_all: torch.Tensor, eps: float, n_kv: int, d: int) -> None:
    """`context_kv_all` of taps [N, n_taps*H] at `positions`, scattered into the draft cache viewed as
    [layers*2, slots, n_kv, d] at `slots` [N]. The scatter mutates the argument itself, so compiled (the
    runner's kv_fn) the RoPE lookup, K/V and their store are fused kernels, not eager gathers and casts
    and an index_copy (see attention.write_kv)."""
    cos, sin = rope_tables(cos_t, sin_t, positions, taps.dtype)
    kv = context_kv_all(taps, cos, sin, w_fc, w_hidden_norm, w_kv_all, w_kn_all, eps, n_kv, d)
    rows = torch.arange(cache.shape[0], device=cache.device)[:, None]
    cache.index_put_((rows, slots[None, :]), kv.view(cache.shape[0], -1, n_kv, d).to(cache.dtype))


def draft_qkv(h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
              w_in: torch.Tensor, w_qkv: torch.Tensor, w_qn: torch.Tensor, w_kn: torch.Tensor,
              eps: float, n_q: int, n_kv: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A draft layer's attention inputs: queries [B, T, n_q, d] of the block, and keys and values
    [kv, B, L + T, d] (kv-major, as attention.gather_kv gives the context [kv, B, L, d]), the context's
    then the block's own (normed and roped as the target's are)."""
    b, t, _ = h.shape
    x = rms_norm(h, w_in, eps)
    q, k, v = linear(x, w_qkv).split([n_q * d, n_kv * d, n_kv * d], dim=-1)
    q = apply_rotary(rms_norm(q.view(b, t, n_q, d), w_qn, eps), cos, sin)
    k = apply_rotary(rms_norm(k.view(b, t, n_kv, d), w_kn, eps), cos, sin)
    keys = torch.cat([ctx_k, k.permute(2, 0, 1, 3)], dim=2)
    vals = torch.cat([ctx_v, v.view(b, t, n_kv, d).permute(2, 0, 1, 3)], dim=2)
    return q, keys, vals


def draft_layer(h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, mask: torch.Tensor, w_in: torch.Tensor,
                w_qkv: torch.Tensor, w_o: torch.Tensor, w_qn: torch.Tensor, w_kn: torch.Tensor,
                w_post: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, eps: float, n_q: int,
                n_kv: int, d: int, impl: str | None = None) -> torch.Tensor:
    """One draft layer over a block: queries see the context K/V [kv, B, L, d] and every block key; mask
    [1, B, T*groups, L + T] (attention.group_mask); impl: attention.use_matmul's forced form, None: automatic.

    The same function serves inference (context gathered from the paged cache) and training
    (context computed for a whole sequence, many blocks masked apart)."""
    q, keys, vals = draft_qkv(h, cos, sin, ctx_k, ctx_v, w_in, w_qkv, w_qn, w_kn, eps, n_q, n_kv, d)
    attn = grouped_attention(group_queries(q, n_kv), keys, vals, mask, d ** -0.5, impl)
    return mlp_residual(h + out_proj(attn, w_o), w_post, w_gate_up, w_down, eps)


def draft_slices(m: DFlashDrafter) -> dict[str, tuple[torch.Tensor, int, int]]:
    c = m.cfg
    out: dict[str, tuple[torch.Tensor, int, int]] = {}

    def whole(name: str, p: torch.Tensor) -> None:
        out[name] = (p, 0, p.shape[0])

    whole("fc.weight", m.fc)
    whole("hidden_norm.weight", m.hidden_norm)
    whole("norm.weight", m.norm)
    for i, layer in enumerate(m.layers):
        pre = f"layers.{i}."
        out[pre + "self_attn.q_proj.weight"] = (layer.qkv_proj, 0, c.q_size)
        out[pre + "self_attn.k_proj.weight"] = (layer.qkv_proj, c.q_size, c.kv_size)
        out[pre + "self_attn.v_proj.weight"] = (layer.qkv_proj, c.q_size + c.kv_size, c.kv_size)
        whole(pre + "self_attn.o_proj.weight", layer.o_proj)
        whole(pre + "self_attn.q_norm.weight", layer.q_norm)
        whole(pre + "self_attn.k_norm.weight", layer.k_norm)
        out[pre + "mlp.gate_proj.weight"] = (layer.gate_up_proj, 0, c.intermediate_size)
        out[pre + "mlp.up_proj.weight"] = (layer.gate_up_proj, c.intermediate_size, c.intermediate_size)
        whole(pre + "mlp.down_proj.weight", layer.down_proj)
        whole(pre + "input_layernorm.weight", layer.input_layernorm)
        whole(pre + "post_attention_layernorm.weight", layer.post_attention_layernorm)
    return out


def load_drafter(draft_dir: str | Path, target: Qwen3ForCausalLM, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None) -> DFlashDrafter:
    """Load a z-lab DFlash directory for `target` (refused at load if it does not fit)."""
    p = Path(draft_dir)
    require_file(p / "config.json", p, "a DFlash drafter directory")
    cfg = DFlashConfig.from_dict(read_json_object(p / "config.json"), source=str(p / "config.json"))
    device = torch.device(device) if device is not None else target.embed_tokens.weight.device
    dtype = dtype or target.embed_tokens.weight.dtype
    try:
        cfg.check_fits(target)
    except DrafterMismatch as e:  # name the file, as every other checkpoint error does
        raise DrafterMismatch(f"{p / 'config.json'}: {e}") from None
    m = meta_build(lambda: DFlashDrafter(cfg).to(dtype), str(p / "config.json"))
    files = safetensors_files(p)
    check_checkpoint(draft_slices(m), files, str(p))  # before any allocation
    m = m.to_empty(device=device)
    dev = "cpu" if device.type == "cpu" else str(device if device.index is not None else f"{device.type}:0")
    fill_from_checkpoint(draft_slices(m), files, dev, str(p))
    m.attach(target)
    return m.eval().requires_grad_(False)


def dummy_drafter(cfg: DFlashConfig, target: Qwen3ForCausalLM, seed: int = 0) -> DFlashDrafter:
    """Random drafter weights of any shape, for timing at real shapes."""
    w = target.embed_tokens.weight
    with torch.device("meta"):
        m = DFlashDrafter(cfg).to(w.dtype)
    m = m.to_empty(device=w.device)
    gen = torch.Generator(device=w.device).manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name or name.endswith("layernorm"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    m.attach(target)
    return m.eval().requires_grad_(False)
