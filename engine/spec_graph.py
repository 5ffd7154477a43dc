"""A greedy DFlash step as ONE captured function: draft, argmax, verify, argmax.

A greedy step needs nothing from the host between its draft and its verify: the verify's ids are
the last token followed by the draft's argmax, and its positions, slots and block tables are known
before the draft runs. Fusing both passes gives one input copy, one graph launch and one result
copy per step. On a small model the host, not the GPU, sets a step's pace (with two graphs a DFlash
step's wall time was several times its GPU work: docs/results.md), so every launch and copy saved
shortens the step. On the CPU the same function runs eagerly, so the tests exercise exactly what a GPU replays.
"""
from __future__ import annotations

import torch

from flashpd.engine.cuda_graph import GraphedFn, pack_host
from flashpd.engine.draft_runner import DraftRunner
from flashpd.engine.runner import ModelRunner
from flashpd.engine.sequence import Sequence


class FusedGreedyStep:
    def __init__(self, runner: ModelRunner, drafts: DraftRunner) -> None:
        self.runner = runner
        self.drafts = drafts
        self._graph = GraphedFn(self._fn) if runner.config.cuda_graphs else None
        self.calls = 0  # steps run fused (tests check the path is taken)

    def _fn(self, new_taps: torch.Tensor, packed: torch.Tensor, b: int, t: int, rows: int, nblk: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> ([B, 2t-1] = t-1 guesses then the target's t argmaxes, [B, t, F] verify taps)."""
        n_draft = 2 * b * rows + 2 * b * t + b * nblk + 2 * b
        d_in, v_in = packed.split([n_draft, 3 * b * t + b * nblk])
        guess = self.drafts._step(new_taps, d_in, b=b, t=t, rows=rows, nblk=nblk).argmax(-1)
        ids, pos, slots, bt = v_in.split([b * t, b * t, b * t, b * nblk])
        ids = torch.cat([ids.view(b, t)[:, :1], guess], dim=1)
        _, tapped, logits = self.runner.model_step(ids, pos.view(b, t), slots, bt.view(b, nblk))
        feats = torch.cat(tapped, dim=-1) if len(tapped) > 1 else tapped[0]
        return torch.cat([guess, logits.argmax(-1)], dim=1), feats

    def __call__(self, seqs: list[Sequence], widths: list[int], t: int) -> tuple[list[list[int]], torch.Tensor]:
        """Draft and verify every row at width t >= max(widths) (KV reserved for t positions per row).
        Returns per row the t-1 guesses followed by the target's t choices, and the verify's taps
        [B, t, F] (a copy: they outlive the graph's next replay as the rows' pending draft context)."""
        runner = self.runner
        tables = [s.table for s in seqs]
        runner.check_room(tables, [t] * len(seqs))
        new_taps, d_arrays, shape = self.drafts.inputs(seqs, widths, t)
        assert shape["t"] == t
        b_pad, nblk = shape["b"], shape["nblk"]
        if self._graph is None:  # eager: the draft's unpadded block table width is the verify's too
            assert b_pad == len(seqs)
        v_arrays = runner.batch_arrays(tables, [[s.last_token] + [0] * (t - 1) for s in seqs], b_pad, t, nblk)
        packed, _ = pack_host(d_arrays + v_arrays, runner.device)
        if self._graph is not None:
            out, feats = self._graph([new_taps, packed], **shape)
        else:
            out, feats = self._fn(new_taps, packed, **shape)
        b = len(seqs)
        feats = feats[:b].clone()
        rows = out[:b].tolist()  # the step's one sync
        for table in tables:
            table.num_tokens += t
        self.calls += 1
        return rows, feats

