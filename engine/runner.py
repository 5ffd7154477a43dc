"""ModelRunner: turns a list of (sequence, new tokens) into one batched forward over the paged cache.

It owns the cache tensor and the block allocator, builds the padded [B, T] batch and its
attention metadata, and replays CUDA graphs for small fixed shapes (decode T=1, verify
T=block) so that the per-step cost on a GPU is the weights' read, not Python and launches.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flashpd.engine.cuda_graph import GraphedFn, bucket, pack_host
from flashpd.engine.attention import AttnBatch, causal_position_mask
from flashpd.engine.kv_cache import SCRATCH_BLOCK, BlockAllocator, BlockTable, PagedKVCache
from flashpd.engine.qwen3 import EAGER, Qwen3ForCausalLM


@dataclass
class StepOutput:
    """hidden: [B, T, H] normed final states; taps: per tap id [B, T, H]; logits: [B, T, V] or None."""

    hidden: torch.Tensor
    taps: list[torch.Tensor]
    logits: torch.Tensor | None


class ModelRunner:
    def __init__(self, model: Qwen3ForCausalLM, num_blocks: int, block_size: int = 16,
                 taps: tuple[int, ...] = (), cuda_graphs: bool | None = None, compile: bool | None = None) -> None:
        cfg = model.cfg
        self.model = model
        self.device = model.embed_tokens.weight.device
        self.dtype = model.embed_tokens.weight.dtype
        self.block_size = block_size
        self.taps = tuple(taps)
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.cache = PagedKVCache(cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads,
                                  cfg.head_dim, self.dtype, self.device)
        self.max_positions = model.rotary.max_positions if model.rotary else cfg.max_position_embeddings
        self.cuda_graphs = (self.device.type == "cuda") if cuda_graphs is None else cuda_graphs
        # torch.compile fuses each layer's small ops (norms, RoPE, SwiGLU) inside captured graphs;
        # the same two layer functions run eagerly everywhere else.
        self.compile = self.cuda_graphs if compile is None else compile
        self.graph_fns = EAGER
        if self.compile:
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            self.graph_fns = tuple(torch.compile(f, fullgraph=True) for f in EAGER)
        self._graph = GraphedFn(self._graphed)

    # ---- batch construction -------------------------------------------------------------
    def _batch(self, tables: list[BlockTable], tokens: list[list[int]], b_pad: int, t_pad: int,
               nblk: int, behind_work: bool = False) -> tuple[torch.Tensor, AttnBatch, torch.Tensor]:
        """Device [B, T] inputs, positions, cache slots and block tables, built in numpy (no per-token
        torch ops) and moved in one host-to-device copy."""
        bs = self.block_size
        ids = np.zeros((b_pad, t_pad), dtype=np.int64)
        pos = np.zeros((b_pad, t_pad), dtype=np.int64)
        slots = np.full((b_pad, t_pad), SCRATCH_BLOCK * bs, dtype=np.int64)
        bt = np.full((b_pad, nblk), SCRATCH_BLOCK, dtype=np.int64)
        for i, (table, toks) in enumerate(zip(tables, tokens)):
            n = len(toks)
            ids[i, :n] = toks
            p = np.arange(table.num_tokens, table.num_tokens + n)
            pos[i, :n] = p
            blocks = np.asarray(table.blocks, dtype=np.int64)
            bt[i, :len(blocks)] = blocks
            slots[i, :n] = blocks[p // bs] * bs + p % bs
        flat, (d_ids, d_pos, d_slots, d_bt) = pack_host([ids, pos, slots.reshape(-1), bt], self.device, behind_work)
        return d_ids, AttnBatch(d_pos, d_slots, d_bt, torch.empty(0)), flat

    def forward(self, tables: list[BlockTable], tokens: list[list[int]], want_logits: str = "last",
                taps: bool = False, tail: torch.Tensor | None = None) -> StepOutput:
        """Run `tokens[i]` appended to sequence `tables[i]`; advances each table's num_tokens.

        want_logits: "last" (logits of each row's last real token, [B, 1, V]), "all" ([B, T, V]),
        or "none". Blocks must already be reserved (allocator.ensure) for the new length.
        tail: device ids [B, T-1] that replace tokens[i][1:] (equal lengths): a verify pass takes the
        draft's argmax straight from the device, with no host round trip between draft and verify.
        """
        assert len(tables) == len(tokens) and tables
        if want_logits not in ("last", "all", "none"):
            raise ValueError(f"want_logits must be 'last', 'all' or 'none', got {want_logits!r}")
        lengths = [len(t) for t in tokens]
        if min(lengths) < 1:
            raise ValueError("every sequence in a forward needs at least one new token")
        for table, n in zip(tables, lengths):
            end = table.num_tokens + n
            if end > self.max_positions:
                raise ValueError(f"position {end} exceeds the model's {self.max_positions} positions")
            if len(table.blocks) * self.block_size < end:
                raise RuntimeError("KV blocks not reserved for this forward (call allocator.ensure first)")
        t = max(lengths)
        uniform = all(n == t for n in lengths)
        if tail is not None and (not uniform or tuple(tail.shape) != (len(tables), t - 1)):
            raise ValueError(f"tail of shape {tuple(tail.shape)} does not fit {len(tables)} rows of {lengths} tokens")
        nblk_real = max(len(tb.blocks) for tb in tables)
        use_graph = self.cuda_graphs and uniform and t <= 32 and len(tables) <= 256
        if use_graph:
            out = self._graph_forward(tables, tokens, t, nblk_real, want_logits != "none", taps, tail)
        else:
            ids, batch, _ = self._batch(tables, tokens, len(tables), t, nblk_real, tail is not None)
            if tail is not None:
                ids[:, 1:] = tail
            batch.mask = causal_position_mask(batch.positions, nblk_real * self.block_size)
            hidden, tapped = self.model(ids, batch, self.cache.data, self.taps if taps else ())
            out = StepOutput(hidden, tapped, None)
            if want_logits == "all":
                out.logits = self.model.logits(hidden)
            elif want_logits == "last":
                idx = torch.tensor([n - 1 for n in lengths], device=self.device)
                last = hidden[torch.arange(len(tables), device=self.device), idx]
                out.logits = self.model.logits(last)[:, None]
        if want_logits == "last" and use_graph:
            out.logits = out.logits[:, -1:]
        for table, n in zip(tables, lengths):
            table.num_tokens += n
        return out

    # ---- CUDA graphs ---------------------------------------------------------------------
    def _graphed(self, packed: torch.Tensor, b: int, t: int, nblk: int
                 ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """The captured forward: a pure function of one packed int64 input (ids, pos, slots, tables)."""
        ids, pos, slots, bt = packed.split([b * t, b * t, b * t, b * nblk])
        ids, pos, bt = ids.view(b, t), pos.view(b, t), bt.view(b, nblk)
        batch = AttnBatch(pos, slots, bt, causal_position_mask(pos, bt.shape[1] * self.block_size))
        hidden, tapped = self.model(ids, batch, self.cache.data, self.taps, self.graph_fns)
        return hidden, tapped, self.model.logits(hidden)

    def _graph_forward(self, tables: list[BlockTable], tokens: list[list[int]], t: int, nblk: int,
                       logits: bool, taps: bool, tail: torch.Tensor | None = None) -> StepOutput:
        b = len(tables)
        bp, nb = bucket(b), bucket(nblk, 4)
        # with a tail, the draft that made it is still running: don't let the input copy wait for it
        ids, _, packed = self._batch(tables, tokens, bp, t, nb, tail is not None)
        if tail is not None:
            ids[:b, 1:] = tail  # ids is a view of packed
        hidden, tapped, lg = self._graph([packed], b=bp, t=t, nblk=nb)
        return StepOutput(hidden[:b], [x[:b] for x in tapped] if taps else [], lg[:b] if logits else None)
