"""ModelRunner: turns a list of (sequence, new tokens) into one batched forward over the paged cache.

It owns the cache tensor and the block allocator, builds the padded [B, T] batch and its
attention metadata, and replays CUDA graphs for small fixed shapes (decode T=1, verify
T=block) so that the per-step cost on a GPU is the weights' read, not Python and launches.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
import torch

from flashpd.engine.cuda_graph import GraphedFn, bucket, pack_host
from flashpd.engine.attention import AttnBatch
from flashpd.engine.kv_cache import SCRATCH_BLOCK, BlockAllocator, BlockTable, PagedKVCache, slots_of
from flashpd.engine.qwen3 import EAGER, Qwen3ForCausalLM, StepFns
from flashpd.engine.runner_config import PREFILL_KNOBS, RunnerConfig

__all__ = ["ModelRunner", "RunnerConfig", "StepOutput", "TapSink"]


@dataclass
class StepOutput:
    """hidden: [B, T, H] normed final states; taps: per tap id [B, T, H]; logits: [B, T, V] or None."""

    hidden: torch.Tensor
    taps: list[torch.Tensor]
    logits: torch.Tensor | None


# A forward's tap consumer: (taps [B, T, H] per tap id, positions [B, T], flat slots [B*T]) -> None.
TapSink = Callable[[list[torch.Tensor], torch.Tensor, torch.Tensor], None]


def inductor_options(config: RunnerConfig) -> dict[str, object]:
    """torch.compile's inductor options for `config` (RunnerConfig.compile_deterministic, compile_eager_rounding
    and inductor_extra). combo_kernels: inductor launches independent small kernels as one;
    measured faster at batch 1, 32 and 128 and in the DFlash step, exactness unchanged (docs/results.md).
    inductor_extra may turn it off."""
    return {"deterministic": config.compile_deterministic, "emulate_precision_casts": config.compile_eager_rounding,
            "combo_kernels": True, **dict(config.inductor_extra)}


class ModelRunner:
    """config: the runner's knobs (engine/runner_config.py; default RunnerConfig()); `self.config` holds
    them resolved for the model's device."""

    def __init__(self, model: Qwen3ForCausalLM, num_blocks: int, kv_block_size: int = 16,
                 taps: tuple[int, ...] = (), config: RunnerConfig | None = None) -> None:
        cfg = model.cfg
        self.model = model
        self.device = model.embed_tokens.weight.device
        self.dtype = model.embed_tokens.weight.dtype
        self.kv_block_size = kv_block_size
        self.taps = tuple(taps)
        self.allocator = BlockAllocator(num_blocks, kv_block_size)
        self.cache = PagedKVCache(cfg.num_hidden_layers, num_blocks, kv_block_size, cfg.num_key_value_heads,
                                  cfg.head_dim, self.dtype, self.device)
        self.max_positions = model.rotary.max_positions if model.rotary else cfg.max_position_embeddings
        self.config: RunnerConfig = (config or RunnerConfig()).resolved(self.device)  # automatic values decided
        if self.device.type == "cuda" and self.config.blas is not None:
            torch.backends.cuda.preferred_blas_library(self.config.blas)  # per process (RunnerConfig.blas)
        # torch.compile fuses each layer's small ops (norms, RoPE, SwiGLU) inside captured graphs;
        # the same layer functions run eagerly everywhere else.
        if self.config.compile:
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        self.graph_fns = StepFns(*(self.compiled(f) for f in EAGER))
        self._graph = GraphedFn(self._graphed)

    def reconfigure(self, **changes) -> RunnerConfig:
        """Change the prefill knobs (prefill_graph_tokens, prefill_chunk, fresh_prefill) of this loaded
        runner, for benches that compare them on one model; returns the previous config (pass its values
        back to restore). Graphs and compilation are fixed at construction: build another runner for those."""
        bad = set(changes) - PREFILL_KNOBS
        if bad:
            raise ValueError(f"reconfigure changes only {sorted(PREFILL_KNOBS)}, not {sorted(bad)}")
        old = self.config
        self.config = replace(old, **changes).resolved(self.device)
        return old

    def compiled(self, fn: Callable) -> Callable:
        """fn through torch.compile (whole graph, config.compile_backend) when this runner compiles, else fn
        itself: the layer functions here, and the drafter's and the device loop's step functions beside them.

        dynamic=True: sizes are symbolic from a function's first compile. Under dynamo's default a first
        shape compiles static and the next recompiles symbolic, and a later call of the first shape then runs
        the symbolic code; a CUDA graph captured before that keeps the static code, one captured after gets
        the other, and the two can round a position differently. DFlash and native capture their graphs at
        different times, so in bf16 on an H200 a native decode at the verify's shapes parted from DFlash
        on a long prompt by this alone (docs/results.md). A shape's code now depends on its guards only
        (sizes 0 and 1 still specialize), not on what ran before it. Every compiled function takes it, not the
        target's layers alone: with the drafter's and the loop's under dynamo's default, DFlash parted from
        native on one prompt of 16 in both full speed_8b runs on an H200 (docs/results.md). Inductor's options:
        `inductor_options`."""
        if not self.config.compile:
            return fn
        backend = self.config.compile_backend
        options = inductor_options(self.config) if backend == "inductor" else None
        return torch.compile(fn, fullgraph=True, dynamic=True, backend=backend, options=options)

    # ---- batch construction -------------------------------------------------------------
    def batch_arrays(self, tables: list[BlockTable], tokens: list[list[int]], b_pad: int, t_pad: int,
                     nblk: int) -> list[np.ndarray]:
        """Host [B, T] ids, positions, flat cache slots and [B, nblk] block tables, built in numpy (no
        per-token torch ops) so that they move to the device in one copy."""
        bs = self.kv_block_size
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
            slots[i, :n] = slots_of(blocks, p, bs)
        return [ids, pos, slots.reshape(-1), bt]

    def _batch(self, tables: list[BlockTable], tokens: list[list[int]], b_pad: int, t_pad: int,
               nblk: int) -> tuple[torch.Tensor, AttnBatch, torch.Tensor]:
        """Device inputs of `batch_arrays`: ids, the attention metadata, and the packed flat tensor."""
        flat, (d_ids, d_pos, d_slots, d_bt) = pack_host(self.batch_arrays(tables, tokens, b_pad, t_pad, nblk),
                                                        self.device)
        return d_ids, AttnBatch(d_pos, d_slots, d_bt, impl=self.config.attention_impl), flat

    def check_room(self, tables: list[BlockTable], lengths: list[int]) -> None:
        """Every row's new positions exist in the model and have reserved KV blocks."""
        for table, n in zip(tables, lengths):
            end = table.num_tokens + n
            if end > self.max_positions:
                raise ValueError(f"position {end} exceeds the model's {self.max_positions} positions")
            if len(table.blocks) * self.kv_block_size < end:
                raise RuntimeError("KV blocks not reserved for this forward (call allocator.ensure first)")

    def forward(self, tables: list[BlockTable], tokens: list[list[int]], want_logits: str = "last",
                taps: bool = False, sink: TapSink | None = None) -> StepOutput:
        """Run `tokens[i]` appended to sequence `tables[i]`; advances each table's num_tokens.

        want_logits: "last" (logits of each row's last real token, [B, 1, V]), "all" ([B, T, V]),
        or "none". Blocks must already be reserved (allocator.ensure) for the new length.
        sink: called with the taps [B, T, H] each, positions [B, T] and slots [B*T] of this forward
        inside it (in its CUDA graph when it replays one): the drafter's prompt context is written there
        (DraftRunner.write_forward_context), with no host work between prefill and context write.
        Padding columns carry position 0 and the scratch slot.
        """
        assert len(tables) == len(tokens) and tables
        if want_logits not in ("last", "all", "none"):
            raise ValueError(f"want_logits must be 'last', 'all' or 'none', got {want_logits!r}")
        lengths = [len(t) for t in tokens]
        if min(lengths) < 1:
            raise ValueError("every sequence in a forward needs at least one new token")
        self.check_room(tables, lengths)
        t = max(lengths)
        chunk = self.config.prefill_chunk
        if chunk and len(tables) == 1 and t > chunk and want_logits != "all":
            return self._chunked(tables[0], tokens[0], want_logits, taps, sink)
        uniform = all(n == t for n in lengths)
        nblk_real = max(len(tb.blocks) for tb in tables)
        fresh = self.config.fresh_prefill and all(tb.num_tokens == 0 for tb in tables)  # no cached prefix
        t_graph = self._graph_width(len(tables), t, uniform, want_logits)
        if t_graph:
            out = self._graph_forward(tables, tokens, t_graph, nblk_real, want_logits, taps, fresh, sink)
        else:
            ids, batch, _ = self._batch(tables, tokens, len(tables), t, nblk_real)
            batch.fresh = fresh
            hidden, tapped = self.model(ids, batch, self.cache.data, self.taps if taps or sink else ())
            if sink is not None:
                sink(tapped, batch.positions, batch.slots)
            out = StepOutput(hidden, tapped if taps else [], None)
            if want_logits == "all":
                out.logits = self.model.logits(hidden)
            elif want_logits == "last":
                idx = torch.tensor([n - 1 for n in lengths], device=self.device)
                last = hidden[torch.arange(len(tables), device=self.device), idx]
                out.logits = self.model.logits(last)[:, None]
        for table, n in zip(tables, lengths):
            table.num_tokens += n
        return out

    def _chunked(self, table: BlockTable, tokens: list[int], want_logits: str, taps: bool,
                 sink: TapSink | None = None) -> StepOutput:
        """One sequence's long forward as chunks of prefill_chunk tokens; the same outputs as one forward
        (each chunk's hidden states and taps copied out before the next replay reuses the graph's buffers)."""
        c = self.config.prefill_chunk
        hidden, tapped, logits = [], [], None
        for i in range(0, len(tokens), c):
            last = i + c >= len(tokens)
            out = self.forward([table], [tokens[i:i + c]], want_logits if last else "none", taps, sink)
            n = min(c, len(tokens) - i)
            hidden.append(out.hidden[:, :n].clone())
            tapped.append([x[:, :n].clone() for x in out.taps])
            logits = out.logits if last else None
        return StepOutput(torch.cat(hidden, dim=1), [torch.cat(x, dim=1) for x in zip(*tapped)], logits)

    # ---- CUDA graphs ---------------------------------------------------------------------
    def replays_graph(self, new_tokens: list[int]) -> bool:
        """Whether a forward of rows with these new-token counts (a prefill wanting the last logits) replays a
        CUDA graph rather than running eagerly (NativeGenerator groups fresh prompts by it)."""
        t = max(new_tokens)
        return bool(self._graph_width(len(new_tokens), t, all(n == t for n in new_tokens), "last"))

    def _graph_width(self, b: int, t: int, uniform: bool, want_logits: str) -> int:
        """The padded width T of the graph that runs this forward, or 0 for the eager path. Decode and
        verify (equal rows, T <= 32) replay a graph of their own width; a prefill of equal rows of at most 32
        tokens (a short prompt, a prefix hit's tail, a chunked prompt's last piece: more than one token, no
        logits or the last ones) pads to 16 or 32, so that prompts of 2-32 tokens meet two graphs a batch
        bucket, not 31 (each captured inside the first such request's TTFT unless warmed: docs/results.md). Other short prefills pad to a multiple of 64 up to config.prefill_graph_tokens,
        so that their Python and launch overhead (tens of ms on Qwen3-8B, eagerly) is one graph launch."""
        if not self.config.cuda_graphs or b > 256:
            return 0
        if uniform and t <= 32:
            return bucket(t, 16) if want_logits != "all" and t > 1 else t
        if want_logits != "all" and bucket(b) * bucket(t, 64) <= self.config.prefill_graph_tokens:
            return bucket(t, 64)
        return 0

    def _graphed(self, packed: torch.Tensor, b: int, t: int, nblk: int, last: bool, fresh: bool = False,
                 sink: TapSink | None = None) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """The captured forward: a pure function of one packed int64 input (ids, pos, slots, tables and,
        with `last`, each row's last real column, whose logits alone are computed), and the sink's
        writes (a graph per sink: it is part of the shape key)."""
        ids, pos, slots, bt, idx = packed.split([b * t, b * t, b * t, b * nblk, b if last else 0])
        hidden, tapped, logits = self.model_step(ids.view(b, t), pos.view(b, t), slots, bt.view(b, nblk),
                                                 idx if last else None, fresh)
        if sink is not None:
            sink(tapped, pos.view(b, t), slots)
        return hidden, tapped, logits

    def model_step(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, bt: torch.Tensor,
                   last: torch.Tensor | None = None, fresh: bool = False
                   ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """The target forward of device inputs (graph-safe): normed hidden, taps, and logits of every
        column or, given `last` [B], of those columns only ([B, 1, V]). `fresh`: every row starts at 0
        (AttnBatch.fresh)."""
        batch = AttnBatch(pos, slots, bt, fresh=fresh, impl=self.config.attention_impl)  # mask: qwen3.step_inputs
        hidden, tapped = self.model(ids, batch, self.cache.data, self.taps, self.graph_fns)
        if last is not None:
            return hidden, tapped, self.model.logits(hidden[torch.arange(ids.shape[0], device=ids.device), last][:, None])
        return hidden, tapped, self.model.logits(hidden)

    def _graph_forward(self, tables: list[BlockTable], tokens: list[list[int]], t: int, nblk: int,
                       want_logits: str, taps: bool, fresh: bool = False, sink: TapSink | None = None
                       ) -> StepOutput:
        b = len(tables)
        bp, nb = bucket(b), bucket(nblk, 4)
        arrays = self.batch_arrays(tables, tokens, bp, t, nb)
        last = want_logits != "all"  # "none" too: one row of logits per sequence, not T_pad rows
        if last:
            idx = np.zeros(bp, dtype=np.int64)
            idx[:b] = [len(x) - 1 for x in tokens]
            arrays.append(idx)
        packed, _ = pack_host(arrays, self.device)
        hidden, tapped, lg = self._graph([packed], b=bp, t=t, nblk=nb, last=last, fresh=fresh, sink=sink)
        return StepOutput(hidden[:b], [x[:b] for x in tapped] if taps else [],
                          lg[:b] if want_logits != "none" else None)
