"""DFlash exact speculative decoding: draft a block in one drafter pass, verify it in one target pass.

Per step and sequence (committed length P, last token x not yet in the caches):
  draft   block [x, MASK x (w-1)] at positions P..P+w-1 -> w-1 guesses, one drafter forward;
  verify  target forward of [x, guesses] with taps -> w logits, one target forward;
  accept  greedy: the longest prefix of guesses equal to the target's argmax, plus the bonus
          token (the target's own choice after it); sampling: speculative rejection sampling;
  commit  tokens clipped exactly at a stop token or max_tokens; the target cache rolls back to
          P+a+1 and only those accepted positions' context K/V join the draft cache.
Every committed token is the target's own choice, so greedy output equals native greedy decoding.
Near max_tokens the block shrinks to what can still be committed (as the reference loop does).
A width policy (engine/width_policy.py, a constructor argument) may verify fewer positions than the
block: a width cap by batch size, which every path runs, and a cut by the draft's confidence, which runs
as two passes (`_cut_step`: its widths need the draft on the host before the verify launches).

Every other step, greedy or sampled, of a stable batch or a changing one, is the device step
(engine/device_loop.py): `spec_step` runs it as a session of one step. The two-pass step here is left for
an injected `Seam`: a test's oracle drafter or a bench's recorded acceptance.
"""
from __future__ import annotations

import operator
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from flashpd.engine.drafter import DFlashDrafter
from flashpd.engine.generate import NativeGenerator
from flashpd.engine.draft_runner import DraftRunner
from flashpd.engine.runner import ModelRunner
from flashpd.engine.sampling import (DRAFT, accepted_greedy, draw, filtered_probs, greedy_tokens, speculative_accept,
                                     step_width)
from flashpd.engine.sequence import Sequence, any_filtered, next_index, row_params
from flashpd.engine.width_policy import FixedWidth, WidthPolicy, WidthStats


@dataclass(frozen=True)
class Seam:
    """What a test or a bench injects in place of the model's own draft or acceptance (DFlashGenerator(seam=...)):
    `guesses(seq, width)`: the width - 1 tokens to verify instead of the drafter's (greedy rows only; the drafter
    still runs, so its context stays in step), e.g. an oracle drafter; `accepted(seq, width)`: how many guesses to
    accept instead of the acceptance rule's, the token after them being the target's own choice there, e.g. a
    recorded run replayed at real shapes (its tokens are then not the target's). A generator with a seam steps as
    two passes with the host between; the device step never reads one. `Seam()`, with neither: the two passes
    with the model's own draft and acceptance (a path to compare the device step with)."""

    guesses: Callable[[Sequence, int], list[int]] | None = None
    accepted: Callable[[Sequence, int], int] | None = None


class DFlashGenerator(NativeGenerator):
    """Batch generation with DFlash steps; sequences in one step may accept different lengths."""

    speculative = True

    def __init__(self, runner: ModelRunner, drafter: DFlashDrafter, stop_ids: Iterable[int] = (),
                 draft_width: int | None = None, width_policy: WidthPolicy | None = None,
                 seam: Seam | None = None) -> None:
        super().__init__(runner, stop_ids)
        self.seam = seam
        self.width_policy = width_policy or FixedWidth()
        self.width_stats = WidthStats()
        c = drafter.cfg
        if tuple(runner.taps) != tuple(c.target_layer_ids):
            raise ValueError(f"runner taps {runner.taps} != drafter target_layer_ids {c.target_layer_ids}")
        self.drafter = drafter
        self.draft_width = self._check_width(c.block_size if draft_width is None else draft_width)
        self.drafts = DraftRunner(drafter, runner)

    def model_steps(self) -> bool:
        """Whether every step's guesses and verdicts are this generator's own (no `Seam`): the device step (and the
        confidence cut) then computes them inside its graph; with a seam, steps run as two passes."""
        return self.seam is None

    @staticmethod
    def _check_width(w: int) -> int:
        try:
            if isinstance(w, bool):
                raise TypeError
            w = operator.index(w)
        except TypeError:
            raise ValueError(f"draft width (block_size) must be an integer in [2, 16], got {w!r}") from None
        if not 2 <= w <= 16:
            raise ValueError(f"draft width (block_size) must be in [2, 16], got {w}")
        return w

    def _fits(self, seqs: list[Sequence], t: int) -> bool:
        """Every row may write t verify positions: within its draft width (its KV reservation) and the model."""
        return all(t <= s.draft_width and s.table.num_tokens + t <= self.runner.max_positions for s in seqs)

    def limits(self, seqs: list[Sequence]) -> list[int]:
        """Each row's widest verify this step: its draft width, the policy's cap for this batch size, and what
        max_tokens still admits."""
        cap = self.width_policy.cap(len(seqs))
        return [step_width(min(s.draft_width, cap), s.params.max_tokens, len(s.output)) for s in seqs]

    def loop_widths(self, seqs: list[Sequence]) -> list[int] | None:
        """Each row's draft width in the device step (its own under the policy's cap for this batch size), or
        None where the step cannot run there: a policy that cuts by confidence at this batch size (the cut
        needs the host between draft and verify)."""
        pol = self.width_policy
        if pol.cuts(len(seqs)):
            return None
        cap = pol.cap(len(seqs))
        return [min(s.draft_width, cap) for s in seqs]

    # ---- one speculative step ------------------------------------------------------------
    def _draft(self, seqs: list[Sequence], widths: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Guesses per sequence (width-1 tokens) and, for sampled rows, the draft distribution q."""
        logits = self.drafts.draft(seqs, widths)
        return self._guesses(seqs, widths, logits, self.drafts.greedy(logits).tolist())

    def _guesses(self, seqs: list[Sequence], widths: list[int], logits: torch.Tensor, greedy: list[list[int]]
                 ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Each row's first width-1 guesses from the draft's logits [B, n, V]: greedy rows its argmax, sampled
        rows a draw from the draft distribution q (returned beside them for the rejection sampler), keyed by the
        indices the guesses would take (sampling.draw, stream DRAFT), as the device loop draws them."""
        if self.seam is not None and self.seam.guesses is not None:
            if not all(s.params.greedy for s in seqs):
                raise ValueError("a seam's guesses take greedy rows only (sampled rows draw from a distribution)")
            return [list(self.seam.guesses(s, w))[:w - 1] for s, w in zip(seqs, widths)], [None] * len(seqs)
        sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
        qs_all = drawn = None
        if sampled:
            sub = [seqs[i] for i in sampled]
            temp, top_p, top_k, seed = row_params(sub, logits.device)
            full = self.drafts.drafter.full_logits(logits[sampled])  # q over the target's vocabulary
            qs_all = filtered_probs(full, temp, top_p, top_k, any_filtered(sub, full.shape[-1]))
            index = torch.tensor([next_index(s) for s in sub], device=logits.device)[:, None] + \
                torch.arange(logits.shape[1], device=logits.device)
            drawn = draw(qs_all, seed, index, DRAFT).tolist()
        guesses, qs = [], []
        for i, (s, w) in enumerate(zip(seqs, widths)):
            if s.params.greedy:
                guesses.append(greedy[i][:w - 1])
                qs.append(None)
            else:
                j = sampled.index(i)
                guesses.append(drawn[j][:w - 1])
                qs.append(qs_all[j, :w - 1])
        return guesses, qs

    @staticmethod
    def _pending_features(out) -> torch.Tensor:
        """The verify pass's taps [B, w, F], copied out of the graph's static buffers for the next draft."""
        return torch.cat(out.taps, dim=-1) if len(out.taps) > 1 else out.taps[0].clone()

    def _cut_step(self, seqs: list[Sequence], limits: list[int]) -> None:
        """A step whose widths the policy chooses from the draft's confidence: draft at each row's limit,
        read the guesses and the confidences, choose, then verify every row padded to the batch's width T
        (one graph shape on a GPU; a padded position's verdict is never read) and accept each row within
        its own width. Sampled rows draw their guesses only after the widths are fixed (module doc of
        width_policy: why that keeps them exact)."""
        alloc, ws = self.runner.allocator, self.width_stats
        for s, lim in zip(seqs, limits):
            assert s.draft_len + s.pending_rows == s.table.num_tokens, "draft context out of step with the target"
            alloc.ensure(s.table, s.table.num_tokens + lim)  # a paged draft writes its block's K/V there
        logits = self.drafts.draft(seqs, limits)  # [B, max(limits) - 1, V]
        greedy = self.drafts.greedy(logits).tolist()  # the draft is on the host: the policy's time starts here
        t0 = time.perf_counter()
        lf = logits.float()
        conf = torch.exp(lf.amax(-1) - torch.logsumexp(lf, -1)).tolist()  # p of the drafter's own greedy token
        widths = self.width_policy.choose([s.stats.acceptance_lengths for s in seqs], limits, conf)
        ws.policy_ms += (time.perf_counter() - t0) * 1e3
        for w, lim in zip(widths, limits):
            assert 1 <= w <= lim, f"width policy chose {w} for a row limited to {lim}"
        guesses, qs = self._guesses(seqs, widths, logits, greedy)  # cut steps run only without a seam
        t = self.width_policy.batch_width(widths, limits)
        pad = self._fits(seqs, t)  # one width for every row: a captured verify graph on a GPU
        tokens = [[s.last_token] + (g + greedy[i][len(g):t - 1] if pad else g) for i, (s, g) in enumerate(zip(seqs, guesses))]
        t = max(len(x) for x in tokens)
        for s, toks in zip(seqs, tokens):
            alloc.ensure(s.table, s.table.num_tokens + len(toks))
        starts = [s.table.num_tokens for s in seqs]
        out = self.runner.forward([s.table for s in seqs], tokens, "all", taps=True)
        feats = self._pending_features(out)
        truth = greedy_tokens(out.logits).tolist()
        ws.steps += 1
        ws.cut_steps += 1
        ws.rows += len(seqs)
        ws.verified += len(seqs) * t  # a ragged verify pads to its widest row too
        ws.widths[t] = ws.widths.get(t, 0) + 1
        self._accept(seqs, guesses, qs, widths, truth, out, feats, starts)

    def spec_step(self, seqs: list[Sequence]) -> None:
        """One DFlash step of every row: the device step (engine/device_loop.py), the one every session
        replays; a confidence cut at this batch size runs `_cut_step`, and a subclass with its own guesses or
        verdicts (a `Seam`) the two-pass step below."""
        widths = self.limits(seqs)
        if self.model_steps() and self.width_policy.cuts(len(seqs)):
            return self._cut_step(seqs, widths)  # counts its own step
        self.width_stats.steps += 1
        if self.model_steps():
            return self.loop().step(seqs)
        alloc = self.runner.allocator
        for s, w in zip(seqs, widths):
            assert s.draft_len + s.pending_rows == s.table.num_tokens, "draft context out of step with the target"
            alloc.ensure(s.table, s.table.num_tokens + w)
        starts = [s.table.num_tokens for s in seqs]
        guesses, qs = self._draft(seqs, widths)
        out = self.runner.forward([s.table for s in seqs], [[s.last_token] + g for s, g in zip(seqs, guesses)],
                                  "all", taps=True)
        feats = self._pending_features(out)
        truth = greedy_tokens(out.logits).tolist()
        self._accept(seqs, guesses, qs, widths, truth, out, feats, starts)

    def _accept(self, seqs: list[Sequence], guesses: list[list[int]], qs: list[torch.Tensor | None],
                widths: list[int], truth: list[list[int]], out, feats: torch.Tensor, starts: list[int]) -> None:
        """Accept within each row's width (greedy: longest agreeing prefix; sampled: rejection sampling),
        commit, roll the target cache back to the accepted positions and keep their taps as pending."""
        alloc = self.runner.allocator
        for i, (s, g, q, w) in enumerate(zip(seqs, guesses, qs, widths)):
            a, bonus = self._verdict(s, g, q, w, truth[i], None if out is None else out.logits[i])
            s.stats.record_step(len(s.commit(g[:a] + [bonus])), w, a)
            alloc.truncate(s.table, starts[i] + a + 1)
            s.pending, s.pending_rows = feats[i], a + 1  # joins the draft cache in the next draft pass

    def _verdict(self, s: Sequence, g: list[int], q: torch.Tensor | None, w: int, truth: list[int],
                 logits: torch.Tensor | None) -> tuple[int, int]:
        """(accepted guesses, the token after them) of one row within its width w: greedy rows the longest
        prefix agreeing with the target's argmax `truth`, sampled rows rejection sampling against the
        target's `logits` [w, V] (q: the draft distribution they drew from); a seam's `accepted` instead."""
        if self.seam is not None and self.seam.accepted is not None:
            a = min(self.seam.accepted(s, w), w - 1)
            return a, truth[a]
        if q is None:
            a = int(accepted_greedy(torch.tensor([g[:w - 1]], dtype=torch.int64),
                                    torch.tensor([truth[:w - 1]], dtype=torch.int64), w))
            return a, truth[a]
        dev = logits.device
        temp, top_p, top_k, seed = row_params([s], dev)
        p = filtered_probs(logits[None, :w], temp, top_p, top_k, any_filtered([s], logits.shape[-1]))
        a, tok = speculative_accept(torch.tensor([g], dtype=torch.int64, device=dev), q[None], p,
                                    torch.tensor([[w]], device=dev), seed, torch.tensor([[next_index(s)]], device=dev))
        return int(a), int(tok)

    def prefill_request(self, seqs: list[Sequence], defer: list[torch.Tensor] | None = None) -> None:
        """Prefill, and write each prompt's draft context (its taps' K/V) inside the same forwards: in the
        prefill's CUDA graph on a GPU, where a separate write (host-side slots, a copy, a dynamic-shape
        compiled call) cost each request a fixed time (docs/results.md).
        Every sequence's draft context must be as long as its target cache (a restored prefix restores
        both halves), so the forward's own positions and slots are the draft context's."""
        for s in seqs:
            if s.draft_len != s.table.num_tokens or s.pending is not None:
                raise RuntimeError(f"draft context ({s.draft_len} positions) out of step with the target cache "
                                   f"({s.table.num_tokens}) before prefill")
        self.prefill(seqs, sink=self.drafts.write_forward_context, defer=defer)
        for s in seqs:
            s.draft_len = len(s.prompt)
