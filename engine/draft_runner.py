"""DraftRunner: the drafter's paged context cache and its per-step forward (graphed on a GPU).

A step first appends the context K/V of the positions the previous verify accepted (pending
rows, padded to a fixed count per sequence; padding writes the scratch block), then drafts
the block. Folding both into one function gives one CUDA graph per step shape.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from flashpd.engine.attention import paged_applies
from flashpd.engine.cuda_graph import GraphedFn, bucket, pack_host
from flashpd.engine.drafter import PAGED_EAGER, DFlashDrafter, PagedDraftFns, draft_layer, write_context_kv
from flashpd.engine.kv_cache import SCRATCH_BLOCK, PagedKVCache, slots_of
from flashpd.engine.runner import ModelRunner
from flashpd.engine.sampling import greedy_tokens
from flashpd.engine.sequence import Sequence


def first_and_guesses(ids: torch.Tensor, logits: torch.Tensor, hot_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The block to verify [B, T]: each row's first id (ids [B, T]), then the draft's greedy tokens of logits
    [B, T - 1, V] (under a token map, V indexes hot_ids: the argmax is mapped to target ids)."""
    g = greedy_tokens(logits)
    return torch.cat([ids[:, :1], g if hot_ids is None else hot_ids[g]], dim=1)


class DraftRunner:
    def __init__(self, drafter: DFlashDrafter, runner: ModelRunner) -> None:
        c = drafter.cfg
        self.drafter = drafter
        self.runner = runner
        self.device = runner.device
        self.kv_block_size = runner.kv_block_size
        # Same block geometry as the target cache: the sequence's block table indexes both.
        self.cache = PagedKVCache(c.num_hidden_layers, runner.cache.num_blocks, runner.kv_block_size,
                                  c.num_key_value_heads, c.head_dim, runner.dtype, runner.device)
        compiled = runner.compiled
        self.layer_fn, self.kv_fn = compiled(draft_layer), compiled(write_context_kv)
        self.impl = runner.config.attention_impl
        # on a GPU the pass reads its context in place (DFlashDrafter.paged_block_hidden): each layer is two
        # compiled functions around the cache write, as the target's are, so the pass is not one compiled function
        self.paged = paged_applies(self.device, c.block_size, self.impl)
        self.paged_fns = PagedDraftFns(*(compiled(f) for f in PAGED_EAGER))
        # otherwise the greedy draft (whole pass + argmax) is one compiled function: its glue (rotary tables,
        # masks, cache gathers, final norm, argmax: about 25 eager kernels a step) fuses with the layers
        self.guess_fn = self.guess if self.paged else compiled(self.guess)
        self._pick = compiled(first_and_guesses) if self.paged else first_and_guesses  # fused, not ~10 eager kernels
        # the same pass for a device step that samples its guesses
        self.logits_fn = self.block_logits if self.paged else compiled(self.block_logits)
        self._graph = GraphedFn(self._step) if runner.config.cuda_graphs else None

    def _step(self, new_taps: torch.Tensor, packed: torch.Tensor, b: int, t: int, rows: int, nblk: int) -> torch.Tensor:
        """Pure function of (pending context rows, one packed int64 tensor) -> draft logits."""
        n = b * rows
        new_pos, new_slots, ids, pos, bt, ctx_lens, blens, bslots = packed.split(
            [n, n, b * t, b * t, b * nblk, b, b, b * t])
        if n:
            self.drafter.write_context(self.cache.data, new_taps, new_pos, new_slots, self.kv_fn)
        return self.drafter.draft_logits(ids.view(b, t), pos.view(b, t), self.cache.data, bt.view(b, nblk),
                                         ctx_lens, blens, self.layer_fn, self.impl, bslots, self.paged_fns)

    def guess(self, ids: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor, bt: torch.Tensor,
              ctx_lens: torch.Tensor, block_lens: torch.Tensor, block_slots: torch.Tensor) -> torch.Tensor:
        """The block to verify [B, T]: each row's first id, then its greedy draft tokens (see
        DFlashDrafter.draft_logits) for blocks ids/pos [B, T]; block_slots [B*T]: the verify's slots."""
        return self._pick(ids, self.block_logits(ids, pos, cache, bt, ctx_lens, block_lens, block_slots),
                          self.drafter.hot_ids)

    def block_logits(self, ids: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor, bt: torch.Tensor,
                     ctx_lens: torch.Tensor, block_lens: torch.Tensor, block_slots: torch.Tensor) -> torch.Tensor:
        """The draft's logits [B, T - 1, V] for blocks ids/pos [B, T] (guess's pass, before its argmax; V: the
        draft vocabulary, DFlashDrafter.draft_logits). Compiled
        whole (the gathered pass), its layers are inlined; the paged pass calls its compiled functions."""
        return self.drafter.draft_logits(ids, pos, cache, bt, ctx_lens, block_lens, draft_layer, self.impl,
                                         block_slots, self.paged_fns)

    def _slots(self, s: Sequence, start: int, n: int) -> np.ndarray:
        p = np.arange(start, start + n)
        blocks = np.asarray(s.table.blocks, dtype=np.int64)
        return slots_of(blocks, p, self.kv_block_size)

    def write_prompt(self, seqs: list[Sequence], feats: list[torch.Tensor]) -> None:
        """Append long context (a prompt's taps) for each sequence, outside any graph (prompt lengths vary)
        but through the compiled context K/V function, a few fused kernels instead of about fifteen."""
        slots = [self._slots(s, s.draft_len, f.shape[0]) for s, f in zip(seqs, feats)]
        pos = [np.arange(s.draft_len, s.draft_len + f.shape[0]) for s, f in zip(seqs, feats)]
        for s, f in zip(seqs, feats):
            s.draft_len += f.shape[0]
        _, (d_pos, d_slots) = pack_host([np.concatenate(pos), np.concatenate(slots)], self.device)
        self.drafter.write_context(self.cache.data, torch.cat(feats), d_pos, d_slots, self.kv_fn)

    def write_pending(self, seqs: list[Sequence]) -> None:
        """Write each sequence's pending draft rows (the taps of the positions its last verify accepted) into the
        draft cache now, eagerly (no compile or capture for these few rows), outside any step."""
        pend = [s for s in seqs if s.pending is not None and s.pending_rows]
        if pend:
            feats = torch.cat([s.pending[:s.pending_rows] for s in pend])
            pos = np.concatenate([np.arange(s.draft_len, s.draft_len + s.pending_rows) for s in pend])
            slots = np.concatenate([self._slots(s, s.draft_len, s.pending_rows) for s in pend])
            self.drafter.write_context(self.cache.data, feats, torch.from_numpy(pos).to(self.device),
                                       torch.from_numpy(np.asarray(slots, dtype=np.int64)).to(self.device))
        for s in seqs:
            if s.pending is not None:
                s.draft_len += s.pending_rows
                s.pending, s.pending_rows = None, 0

    def write_forward_context(self, taps: list[torch.Tensor], positions: torch.Tensor, slots: torch.Tensor) -> None:
        """A target forward's sink (ModelRunner.forward): its taps become draft context at the forward's own
        positions and slots, inside the forward's graph. Valid where a sequence's draft context is as long
        as its target cache (a prompt's prefill, with or without a restored prefix: both halves)."""
        feats = torch.cat(taps, dim=-1) if len(taps) > 1 else taps[0]
        self.drafter.write_context(self.cache.data, feats.reshape(-1, feats.shape[-1]), positions.reshape(-1),
                                   slots.reshape(-1), self.kv_fn)

    def inputs(self, seqs: list[Sequence], widths: list[int], t: int | None = None
               ) -> tuple[torch.Tensor, list[np.ndarray], dict]:
        """A draft step's inputs at draft width t (default: the widest row): the pending context rows
        [B_pad * rows, F] (device), the host arrays (packed into one copy by the caller) and the step's
        shape. Consumes each sequence's pending rows."""
        b, t = len(seqs), (t or max(widths))
        graphed = self._graph is not None
        b_pad = bucket(b) if graphed else b
        nblk = max(len(s.table.blocks) for s in seqs)
        nblk = bucket(nblk, 4) if graphed else nblk
        rows = max((s.pending.shape[0] for s in seqs if s.pending is not None), default=0)
        # a graph per pending-row count would mean up to 16 captures per batch shape (one per acceptance
        # length): round up to a power of two; padding rows write the scratch block
        rows = bucket(rows) if graphed and rows else rows
        bs = self.kv_block_size
        ids = np.full((b_pad, t), self.drafter.cfg.mask_token_id, dtype=np.int64)
        pos = np.zeros((b_pad, t), dtype=np.int64)
        bt = np.full((b_pad, nblk), SCRATCH_BLOCK, dtype=np.int64)
        ctx_lens = np.ones(b_pad, dtype=np.int64)
        blens = np.ones(b_pad, dtype=np.int64)
        npos = np.zeros((b_pad, rows), dtype=np.int64)
        nslots = np.full((b_pad, rows), SCRATCH_BLOCK * bs, dtype=np.int64)
        bslots = np.full((b_pad, t), SCRATCH_BLOCK * bs, dtype=np.int64)  # the block's own K/V (paged pass)
        taps = []
        width = len(self.drafter.cfg.target_layer_ids) * self.drafter.cfg.hidden_size
        for i, (s, w) in enumerate(zip(seqs, widths)):
            n = s.pending_rows if s.pending is not None else 0
            if n:
                npos[i, :n] = np.arange(s.draft_len, s.draft_len + n)
                nslots[i, :n] = self._slots(s, s.draft_len, n)
                p = s.pending
                taps.append(F.pad(p, (0, 0, 0, rows - p.shape[0])) if p.shape[0] < rows else p)
            elif rows:
                taps.append(torch.zeros(rows, width, dtype=self.runner.dtype, device=self.device))
            s.draft_len += n
            s.pending, s.pending_rows = None, 0
            ids[i, 0] = s.last_token
            # a row narrower than the batch repeats its last position (those keys are masked) so that
            # padding never indexes RoPE past the model's positions
            pos[i] = np.minimum(np.arange(s.table.num_tokens, s.table.num_tokens + t), s.table.num_tokens + w - 1)
            bt[i, :len(s.table.blocks)] = s.table.blocks
            ctx_lens[i], blens[i] = s.draft_len, w
            bslots[i, :w] = self._slots(s, s.table.num_tokens, w)
        if rows and b_pad > b:
            taps.extend([torch.zeros(rows, width, dtype=self.runner.dtype, device=self.device)] * (b_pad - b))
        if not rows:
            new_taps = torch.zeros(0, width, dtype=self.runner.dtype, device=self.device)
        else:
            new_taps = torch.cat(taps) if len(taps) > 1 else taps[0]
        return new_taps, [npos, nslots, ids, pos, bt, ctx_lens, blens, bslots], dict(b=b_pad, t=t, rows=rows,
                                                                                      nblk=nblk)

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's greedy guesses of logits [B, T-1, V] (from `draft`) as target token ids."""
        return self.drafter.target_ids(greedy_tokens(logits))

    def draft(self, seqs: list[Sequence], widths: list[int]) -> torch.Tensor:
        """Write each sequence's pending context rows, then draft; returns logits [B, T-1, V] (V: the draft
        vocabulary: `greedy` reads target ids from them, `drafter.full_logits` widens them)."""
        new_taps, arrays, shape = self.inputs(seqs, widths)
        packed, _ = pack_host(arrays, self.device)
        logits = self._graph([new_taps, packed], **shape) if self._graph is not None else self._step(new_taps, packed, **shape)
        return logits[:len(seqs)]
