"""Whole-request decoding with the step's bookkeeping on the device, one step ahead of the host.

At batch 1 on a small model the host, not the GPU, sets a step's pace: building the step's inputs,
launching its graph and waiting for its result take longer than the GPU work
(docs/results.md). Here each row's state (committed length, draft context
length, last token, pending draft rows, tokens emitted, its seed and filters) lives on the device. One
captured step drafts, verifies, accepts and advances that state in place, so step k+1 can be launched before
step k's result reaches the host. The host reads each step's tokens one step late, while the GPU
already runs the next one, and commits them through `Sequence.commit` as the stepwise loop does
(stop tokens, max_tokens, acceptance stats). Steps launched after every row is done are wasted work,
never output: a row that reaches its max_tokens freezes (its state stops moving and its writes go
to the scratch block), and the host stops launching once every row is done.

Sampled rows step here too: their draws are counter-based (engine/sampling.py), so the captured step draws
the guesses from the draft's distributions, accepts by rejection sampling and draws the next token with no
host round trip, and gives exactly the two-pass host step's tokens (spec_decode.py). A session whose rows are all greedy replays
the greedy step, which computes no distribution; one with sampled rows replays the sampled step (with a
sort only when some row asks for top-p or top-k): three graphs a shape at most.

The same step functions run eagerly on the CPU, so the tests check exactly what a GPU replays
against the two-pass host step (spec_decode.py) and the reference DFlash implementation. `run` drives whole
requests; `begin` / `launch` / `read` / `end` let the serving scheduler step a stable batch here in a session
and end it when the batch changes: `end` reads what is still in flight and restores each row's host state
(cache length, draft context, pending draft rows). A changing batch runs the same step as sessions of one
(`step`), each reserving KV for its one step only.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from flashpd.engine.cuda_graph import bucket, capture
from flashpd.engine.kv_cache import SCRATCH_BLOCK, slots_of
from flashpd.engine.sampling import (DRAFT, GREEDY_BELOW, accepted_greedy, draw, filtered_probs, greedy_tokens,
                                     sample_tokens, speculative_accept, step_width)
from flashpd.engine.sequence import FLOAT32_MAX, Sequence, any_filtered

# state columns (int64 [B, 9]): committed target length P, draft context length D, last token x,
# pending draft rows n, tokens emitted O, the row's max_tokens M, its seed S, top_k K and draft width W (its
# own width under the policy's cap: a session's rows may differ); a sampled session also has a float32 [B, 2]
# buffer of each row's temperature and top_p
P, D, X, N, O, M, S, K, W = range(9)
NCOL = 9
# a session's sampling mode (a graph each): every row greedy; some row sampled; some row sampled with top-p/top-k
GREEDY, SAMPLED, FILTERED = 0, 1, 2


class InPlaceGraph:
    """One CUDA graph per buffer set, replayed with no input copy: the captured function reads and
    updates its buffers in place. On the CPU the function just runs."""

    def __init__(self, fn: Callable[..., torch.Tensor], enabled: bool = True) -> None:
        self.fn = fn
        self.enabled = enabled  # False: run the function directly on any device (RunnerConfig(cuda_graphs=False))
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None

    def __call__(self, key: tuple, bufs: tuple[torch.Tensor, ...], reset: Callable[[], None]) -> torch.Tensor:
        """Run fn(*bufs). On a new key the function is warmed up and captured; `reset` must then put the
        buffers in a harmless state first (warm-up runs mutate them) and is called again after."""
        if bufs[0].device.type != "cuda" or not self.enabled:
            return self.fn(*bufs)
        entry = self._graphs.get(key)
        if entry is None:
            reset()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile / autotune / allocate outside the capture
                    self.fn(*bufs)
            torch.cuda.current_stream().wait_stream(stream)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with capture(graph, self._pool):  # cuda_graph.capture: why
                out = self.fn(*bufs)
            entry = self._graphs[key] = (graph, out)
            reset()
            return None  # the caller fills the real state, then replays
        entry[0].replay()
        return entry[1]


# ---- the step's bookkeeping: a few fused kernels when the runner compiles, else eager -----------------
def native_in(st: torch.Tensor, bt: torch.Tensor, bs: int) -> tuple[torch.Tensor, ...]:
    """(live rows, positions [B, 1], flat slots): a frozen row (O >= M) writes scratch. The positions are a
    buffer of their own, not a column view of the state: the paged kernel reads a row's positions as
    consecutive elements, and a strided view would be copied again in every layer (36 copies a step)."""
    live = st[:, O] < st[:, M]
    pos = st[:, P:P + 1].contiguous()
    slots = torch.where(live[:, None], slots_of(bt, pos, bs), SCRATCH_BLOCK * bs).view(-1)
    return live, pos, slots


def native_out(st: torch.Tensor, logits: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """Greedy token of each row; live rows advance (P, O, X) in place. -> [B, 1]."""
    tok = greedy_tokens(logits[:, 0])
    step = live.to(st.dtype)
    st[:, P] += step
    st[:, O] += step
    st[:, X] = torch.where(live, tok, st[:, X])
    return tok[:, None].clone()


def native_out_sampled(st: torch.Tensor, sp: torch.Tensor, logits: torch.Tensor, live: torch.Tensor,
                       filtered: bool) -> torch.Tensor:
    """native_out for a session with sampled rows: each row's token from sampling.sample_tokens (greedy rows
    their argmax), drawn at its next token index P + 1, as the host's sample_rows draws it."""
    tok = sample_tokens(logits[:, 0], sp[:, 0], sp[:, 1], st[:, K], st[:, S], st[:, P] + 1, filtered)
    step = live.to(st.dtype)
    st[:, P] += step
    st[:, O] += step
    st[:, X] = torch.where(live, tok, st[:, X])
    return tok[:, None].clone()


def spec_in(st: torch.Tensor, bt: torch.Tensor, t: int, bs: int, mask_id: int) -> tuple[torch.Tensor, ...]:
    """A DFlash step's inputs from the state: the pending context rows' positions and slots, the draft
    context length, the block's positions, draft ids [x, MASK...], width w, verify slots, live rows."""
    ar = torch.arange(t, device=st.device)[None, :]
    p_, d_, x_, n_ = st[:, P:P + 1], st[:, D:D + 1], st[:, X:X + 1], st[:, N:N + 1]
    live = st[:, O] < st[:, M]
    # each row's own width, shrunk near max_tokens as the stepwise loop shrinks it (t: the session's widest)
    w = step_width(t, st[:, M:M + 1], st[:, O:O + 1]).minimum(st[:, W:W + 1].clamp_min(1))  # padding rows: W 0
    ok = ar < n_
    cpos = torch.where(ok, d_ + ar, 0).reshape(-1)
    cslots = torch.where(ok, slots_of(bt, d_ + ar, bs), SCRATCH_BLOCK * bs).reshape(-1)
    pos = torch.minimum(p_ + ar, p_ + w - 1)
    ids = torch.cat([x_, torch.full_like(x_, mask_id).expand(-1, t - 1)], dim=1)
    vslots = torch.where((ar < w) & live[:, None], slots_of(bt, pos, bs), SCRATCH_BLOCK * bs).reshape(-1)
    return cpos, cslots, d_ + n_, pos, ids, w, vslots, live


def _advance(st: torch.Tensor, a: torch.Tensor, bonus: torch.Tensor, live: torch.Tensor, ctx: torch.Tensor) -> None:
    """A DFlash step's state update: live rows commit a accepted guesses and the token after them."""
    p_, d_, x_ = st[:, P:P + 1], st[:, D:D + 1], st[:, X:X + 1]
    keep = live[:, None]
    o_ = st[:, O:O + 1]
    new = torch.cat([torch.where(keep, p_ + a + 1, p_), torch.where(keep, ctx, d_), torch.where(keep, bonus, x_),
                     torch.where(keep, a + 1, 0), torch.where(keep, o_ + a + 1, o_)], dim=1)
    st[:, P:O + 1] = new


def spec_out(st: torch.Tensor, logits: torch.Tensor, guess: torch.Tensor, w: torch.Tensor, live: torch.Tensor,
             ctx: torch.Tensor) -> torch.Tensor:
    """Accept the longest agreeing prefix (at most w - 1 guesses) plus the target's next choice; live rows
    advance in place. -> [B, t + 1] (the target's t choices, accepted count)."""
    t = logits.shape[1]
    truth = greedy_tokens(logits)
    a = accepted_greedy(guess, truth[:, :t - 1], w)
    _advance(st, a, truth.gather(1, a), live, ctx)
    return torch.cat([truth, a], dim=1)


def spec_draw(st: torch.Tensor, sp: torch.Tensor, draft_logits: torch.Tensor, filtered: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """A sampled session's guesses [B, t - 1] (greedy rows the draft's argmax, sampled rows a draw from q at
    the indices the guesses would take, stream DRAFT) and the draft distributions q [B, t - 1, V]."""
    q = filtered_probs(draft_logits, sp[:, 0], sp[:, 1], st[:, K], filtered)
    index = st[:, P:P + 1] + 1 + torch.arange(draft_logits.shape[1], device=st.device)
    drawn = draw(q, st[:, S], index, DRAFT)
    return torch.where(sp[:, 0:1] < GREEDY_BELOW, greedy_tokens(draft_logits), drawn), q


def spec_out_sampled(st: torch.Tensor, sp: torch.Tensor, logits: torch.Tensor, guess: torch.Tensor,
                     q: torch.Tensor, w: torch.Tensor, live: torch.Tensor, ctx: torch.Tensor, filtered: bool
                     ) -> torch.Tensor:
    """spec_out for a session with sampled rows: greedy rows accept as spec_out does, sampled rows by
    sampling.speculative_accept (the two-pass host step's rule and draws). -> [B, t + 1]: each row's committed
    tokens (its a accepted guesses, then the token after them; zeros past it), then a."""
    t = logits.shape[1]
    truth = greedy_tokens(logits)
    a_g = accepted_greedy(guess, truth[:, :t - 1], w)
    p = filtered_probs(logits, sp[:, 0], sp[:, 1], st[:, K], filtered)
    a_s, tok_s = speculative_accept(guess, q, p, w, st[:, S], st[:, P:P + 1] + 1)
    greedy = sp[:, 0:1] < GREEDY_BELOW
    a = torch.where(greedy, a_g, a_s)
    bonus = torch.where(greedy, truth.gather(1, a_g), tok_s)
    ks = torch.arange(t, device=st.device)
    guessed = torch.cat([guess, torch.zeros_like(guess[:, :1])], dim=1)
    tokens = torch.where(ks < a, guessed, torch.where(ks == a, bonus, 0))
    _advance(st, a, bonus, live, ctx)
    return torch.cat([tokens, a], dim=1)


@dataclass
class HostBuffers:
    """Pinned host memory a shape's sessions reuse: the state and block tables uploaded by `begin`, the two
    result buffers steps are copied into, and the first tokens `run` reads. A pinned allocation per request
    cost tens of microseconds of the host's time between a prefill and its first step."""

    st: torch.Tensor
    bt: torch.Tensor
    ring: list[tuple[torch.Tensor, "torch.cuda.Event | None"]]
    first: torch.Tensor
    sp: torch.Tensor  # each row's temperature and top_p (sampled sessions)


@dataclass
class Session:
    """A batch of sequences stepping on the device (DeviceLoop.begin .. end)."""

    seqs: list[Sequence]
    key: tuple
    bufs: tuple[torch.Tensor, ...]
    reset: Callable[[], None]
    cuda: bool
    ring: list[tuple[torch.Tensor, "torch.cuda.Event"]]  # two pinned result buffers and their events
    draft_len: list[int]  # per row, the device's D and n as of the last step read (DFlash)
    pending: list[int]
    queued: list[tuple[torch.Tensor, "torch.cuda.Event | None"]] = field(default_factory=list)
    launched: int = 0
    emits: list[int] = field(default_factory=list)  # DFlash: emits[k] = row-steps that emitted k tokens
    width: int = 1  # DFlash: the widest draft width a step of this session verifies (its graph's)
    widths: list[int] = field(default_factory=list)  # DFlash: each row's own draft width (at most `width`)
    mode: int = GREEDY  # GREEDY, SAMPLED or FILTERED: which step function (and graph) it replays


class DeviceLoop:
    """Runs whole requests to the end with a step function over device state (see module doc)."""

    def __init__(self, gen) -> None:
        self.gen = gen  # NativeGenerator or DFlashGenerator
        self.runner = gen.runner
        self.spec = gen.speculative
        # one step function (and CUDA graph) per sampling mode: an all-greedy session replays the greedy step,
        # which computes no distribution at all
        on = self.runner.config.cuda_graphs
        if self.spec:
            self.graphs = {GREEDY: InPlaceGraph(self._spec_fn, on),
                           SAMPLED: InPlaceGraph(lambda *b: self._spec_sampled_fn(*b, filtered=False), on),
                           FILTERED: InPlaceGraph(lambda *b: self._spec_sampled_fn(*b, filtered=True), on)}
        else:
            self.graphs = {GREEDY: InPlaceGraph(self._native_fn, on),
                           SAMPLED: InPlaceGraph(lambda *b: self._native_fn(*b, filtered=False), on),
                           FILTERED: InPlaceGraph(lambda *b: self._native_fn(*b, filtered=True), on)}
        # the bookkeeping's ~40 tiny ops, compiled (as the runner compiles its layers), are a few fused
        # kernels in the captured graph instead of ~40 launches a step (docs/results.md)
        fuse = self.runner.compiled
        self._native_in, self._native_out = fuse(native_in), fuse(native_out)
        self._spec_in, self._spec_out = fuse(spec_in), fuse(spec_out)
        self._native_out_sampled = fuse(native_out_sampled)
        self._spec_draw, self._spec_out_sampled = fuse(spec_draw), fuse(spec_out_sampled)
        self._bufs: dict[tuple, tuple[torch.Tensor, ...]] = {}
        self._host: dict[tuple, "HostBuffers"] = {}
        self._uploaded: "torch.cuda.Event | None" = None  # the last begin's uploads from the host buffers
        self.sessions = 0  # sessions of many steps begun here (tests check the path is taken)
        self.single_steps = 0  # sessions of one step (`step`: the stepwise calls)
        self.wasted_steps = 0  # steps launched after every row had finished (run's tail)

    # ---- the device step functions (graph-safe: fixed shapes, no host sync) ----------------------
    def _native_fn(self, st: torch.Tensor, bt: torch.Tensor, sp: torch.Tensor | None = None,
                   filtered: bool = False) -> torch.Tensor:
        """One token per row: forward x at P; a frozen row (O >= M) writes scratch and stays put. At the
        generator's step_width w > 1 the token is column 0 of a w-column forward whose other columns repeat
        it at P, write scratch and are never read (a verify's shapes: NativeGenerator). `sp` (a sampled
        session): the rows' temperature and top_p; the token is then native_out_sampled's."""
        bs, w = self.runner.kv_block_size, self.gen.step_width
        live, pos, slots = self._native_in(st, bt, bs)
        ids = st[:, X:X + 1]
        if w > 1:
            b = st.shape[0]
            ids, pos = ids.expand(b, w), pos.expand(b, w).contiguous()  # once here, not in every layer
            slots = torch.cat([slots.view(b, 1), torch.full((b, w - 1), SCRATCH_BLOCK * bs, dtype=slots.dtype,
                                                               device=slots.device)], dim=1).view(-1)
        _, _, logits = self.runner.model_step(ids, pos, slots, bt)
        if sp is not None:
            return self._native_out_sampled(st, sp, logits, live, filtered)
        return self._native_out(st, logits, live)

    def _spec_fn(self, st: torch.Tensor, bt: torch.Tensor, pend: torch.Tensor) -> torch.Tensor:
        """One DFlash step per row at draft width t (pend [B, t, F]): append the pending context rows to
        the draft cache, draft, verify, accept; -> [B, t + 1] (the target's t choices, accepted count)."""
        runner, drafts = self.runner, self.gen.drafts
        ctx, pos, ids, w, vslots, live = self._spec_begin(st, bt, pend)
        # 2) draft [x, MASK...] -> [x, guesses]; columns past the row's width repeat its last position and
        # are masked (a paged pass writes the block's draft K/V at the verify's slots: scratch past the width)
        block = drafts.guess_fn(ids, pos, drafts.cache.data, bt, ctx[:, 0], w[:, 0], vslots)
        # 3) verify it; columns past the width, and frozen rows, write scratch and are never read
        _, tapped, logits = runner.model_step(block, pos, vslots, bt)
        # 4) accept the longest agreeing prefix (at most w - 1 guesses) plus the target's next choice
        out = self._spec_out(st, logits, block[:, 1:], w, live, ctx)
        self._keep_taps(tapped, pend)
        return out

    def _spec_sampled_fn(self, st: torch.Tensor, bt: torch.Tensor, pend: torch.Tensor, sp: torch.Tensor,
                         filtered: bool) -> torch.Tensor:
        """_spec_fn for a session with sampled rows: the guesses are drawn from the draft's distributions and
        accepted by rejection sampling (spec_draw, spec_out_sampled); -> [B, t + 1] (committed tokens, a)."""
        runner, drafts = self.runner, self.gen.drafts
        ctx, pos, ids, w, vslots, live = self._spec_begin(st, bt, pend)
        draft_logits = drafts.logits_fn(ids, pos, drafts.cache.data, bt, ctx[:, 0], w[:, 0], vslots)
        draft_logits = drafts.drafter.full_logits(draft_logits)  # a token map's q: zero off its hot ids
        guess, q = self._spec_draw(st, sp, draft_logits, filtered)
        _, tapped, logits = runner.model_step(torch.cat([ids[:, :1], guess], dim=1), pos, vslots, bt)
        out = self._spec_out_sampled(st, sp, logits, guess, q, w, live, ctx, filtered)
        self._keep_taps(tapped, pend)
        return out

    def _spec_begin(self, st: torch.Tensor, bt: torch.Tensor, pend: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A DFlash step's inputs from the state (spec_in; the draft width t is pend's), after 1) the accepted
        positions' context K/V join the draft cache (padding rows write scratch). -> (draft context lengths,
        block positions, draft ids, widths, verify slots, live rows)."""
        drafts = self.gen.drafts
        b, t, f = pend.shape
        cpos, cslots, *rest = self._spec_in(st, bt, t, self.runner.kv_block_size, drafts.drafter.cfg.mask_token_id)
        drafts.drafter.write_context(drafts.cache.data, pend.reshape(b * t, f), cpos, cslots, drafts.kv_fn)
        return tuple(rest)

    @staticmethod
    def _keep_taps(tapped: list[torch.Tensor], pend: torch.Tensor) -> None:
        """The verify's taps become the next step's pending context rows."""
        if len(tapped) > 1:
            torch.cat(tapped, dim=-1, out=pend)  # one kernel (a cat, then a copy, were two)
        else:
            pend.copy_(tapped[0])

    # ---- host side ------------------------------------------------------------------------------
    def usable(self, seqs: list[Sequence]) -> bool:
        """Rows, greedy or sampled, each at its own draft width under the width policy's cap for this batch size,
        whose guesses and verdicts are the generator's own (DFlashGenerator.model_steps), and no confidence cut
        at this batch size (DFlashGenerator.loop_widths: the cut needs the host between draft and verify, so
        those steps run as two passes). A session of many steps reserves each row's KV to its end, so the caller
        must have checked the room."""
        if not seqs:
            return False
        if self.spec and (self.gen.loop_widths(seqs) is None or not self.gen.model_steps()):
            return False
        # a DFlash row's last step may commit one token past max_tokens (host-trimmed), leaving its state at its
        # end position, which a step already queued behind it still embeds: that position must exist
        if self.spec and any(len(s.prompt) + s.params.max_tokens >= self.runner.max_positions for s in seqs):
            return False
        return True

    def _host_buffers(self, key: tuple, b: int, t: int, nblk: int, cuda: bool) -> HostBuffers:
        if key not in self._host:
            width = t + 1 if self.spec else 1
            self._host[key] = HostBuffers(
                torch.zeros(b, NCOL, dtype=torch.int64, pin_memory=cuda),
                torch.full((b, nblk), SCRATCH_BLOCK, dtype=torch.int64, pin_memory=cuda),
                [(torch.empty((b, width), dtype=torch.int64, pin_memory=True), torch.cuda.Event())
                 for _ in range(2)] if cuda else [],
                torch.zeros(b, dtype=torch.int64, pin_memory=cuda),
                torch.zeros(b, 2, dtype=torch.float32, pin_memory=cuda))
        return self._host[key]

    def _buffers(self, b: int, t: int, nblk: int, feat: int) -> tuple[torch.Tensor, ...]:
        key = (b, t, nblk)
        if key not in self._bufs:
            dev = self.runner.device
            st = torch.zeros(b, NCOL, dtype=torch.int64, device=dev)
            bt = torch.full((b, nblk), SCRATCH_BLOCK, dtype=torch.int64, device=dev)
            bufs = (st, bt) if not self.spec else (st, bt, torch.zeros(b, t, feat, dtype=self.runner.dtype,
                                                                        device=dev))
            self._bufs[key] = bufs + (torch.zeros(b, 2, dtype=torch.float32, device=dev),)  # sp last
        return self._bufs[key]

    # A step launched after the one in flight finished every row is wasted: a whole step the request waits
    # for. Reading the step in flight first costs the GPU
    # only the host's turnaround (sync, commit, launch: tens of microseconds). So read first once the step
    # in flight finishes every running row with at least this probability (from the emissions so far).
    READ_FIRST_P = 0.1

    def run(self, seqs: list[Sequence], first: torch.Tensor | None = None) -> None:
        """Drive every sequence (prefilled, not done) to its end. `first` [len(seqs)]: their first tokens, still
        on the device and not committed (NativeGenerator.prefill's `defer`): the first step is queued behind
        them before the host reads and commits them."""
        self.step_to_end(self.begin(seqs, first) if first is None else self.begin_after_prefill(seqs, first))

    def begin_after_prefill(self, seqs: list[Sequence], first: torch.Tensor) -> "Session":
        """`begin` straight from a prefill whose first tokens are still on the device (`first`, not
        committed): the first step is queued behind them, then the host reads and commits them (one step is
        in flight when this returns)."""
        sess = self.begin(seqs, first)
        self._commit_first(sess, first)
        return sess

    def step_to_end(self, sess: "Session") -> None:
        """Launch and read steps until every row of a session is done, then `end` it."""
        while not all(s.done for s in sess.seqs):
            if sess.queued and self.may_finish(sess):
                self.read(sess)
                continue
            self.launch(sess)  # step k is queued before step k-1 is read
            if len(sess.queued) == 2:
                self.read(sess)
        # a step queued after the last row finished is never read (nothing of it would be kept)
        self.wasted_steps += len(sess.queued)
        sess.queued.clear()
        self.end(sess)

    def may_finish(self, sess: "Session") -> bool:
        """Whether the step in flight finishes every running row with probability >= READ_FIRST_P: a row
        with r tokens to go ends if that step emits r or more (native: always one; DFlash: the share of
        this batch's steps so far that emitted at least r). Stop tokens are not foreseen."""
        total = sum(sess.emits)
        for s in sess.seqs:
            if s.done:
                continue
            r = s.params.max_tokens - len(s.output)
            if r <= 1:
                continue
            if not self.spec or r >= len(sess.emits) or not total or \
                    sum(sess.emits[r:]) < self.READ_FIRST_P * total:
                return False
        return True

    def _commit_first(self, sess: "Session", first: torch.Tensor) -> None:
        """Queue the first step, then read the first tokens (their prefill done by then or soon) and commit
        them as the prefill would have (time to first token, stop tokens)."""
        host = self._host[sess.key].first[:first.shape[0]]
        host.copy_(first, non_blocking=sess.cuda)
        ev = torch.cuda.Event() if sess.cuda else None
        if ev is not None:
            ev.record()
        self.launch(sess)
        if ev is not None:
            ev.synchronize()
        now = time.perf_counter()
        for s, tok in zip(sess.seqs, host.tolist()):
            s.stats.ttft_ms = (now - s.t_start) * 1e3
            s.commit([tok])

    def step(self, seqs: list[Sequence]) -> None:
        """One step of these rows: a session of one step (its KV reserved for that step only), read at once.
        The executors' stepwise calls (NativeGenerator.decode_step, DFlashGenerator.spec_step) come here, so a
        step of a changing batch is the captured step of a stable one."""
        sess = self.begin(seqs, steps=1)
        self.single_steps += 1
        self.launch(sess)
        self.end(sess)

    def begin(self, seqs: list[Sequence], first: torch.Tensor | None = None, steps: int | None = None
              ) -> "Session":
        """Put these sequences' state on the device (their KV reserved to their ends, or for `steps` steps: no
        allocation while steps are in flight); capture the step's graph for this shape if it is new. `first`:
        the rows' first tokens on the device, not yet committed (`run`); the state then counts them as
        emitted."""
        runner, alloc = self.runner, self.runner.allocator
        if self.spec:
            widths = self.gen.loop_widths(seqs)
            t = max(widths)  # a session keeps its widths; its graph verifies the widest
            self._flush_wide_pending(seqs, t)
            for s in seqs:
                assert s.draft_len + s.pending_rows == s.table.num_tokens, "draft context out of step with the target"
        else:
            widths, t = [1] * len(seqs), self.gen.step_width
        for s, w in zip(seqs, widths):
            end = len(s.prompt) + s.params.max_tokens
            if end > runner.max_positions:
                raise ValueError(f"position {end} exceeds the model's {runner.max_positions} positions")
            # a step writes w verify positions (native: one; its padding columns write scratch)
            alloc.ensure(s.table, end if steps is None else min(end, s.table.num_tokens + steps * w))
        graphed = runner.config.cuda_graphs
        b = bucket(len(seqs)) if graphed else len(seqs)
        nblk = max(len(s.table.blocks) for s in seqs)
        nblk = bucket(nblk, 4) if graphed else nblk
        feat = (len(self.gen.drafter.cfg.target_layer_ids) * self.gen.drafter.cfg.hidden_size) if self.spec else 0
        mode = GREEDY if all(s.params.greedy for s in seqs) else \
            FILTERED if any_filtered(seqs, runner.model.cfg.vocab_size) else SAMPLED
        allbufs = self._buffers(b, t, nblk, feat)
        bufs = allbufs[:-1] if mode == GREEDY else allbufs  # a greedy step reads no sampling parameters
        st, bt, sp = bufs[0], bufs[1], allbufs[-1]
        cuda = runner.device.type == "cuda"
        key = (b, t, nblk)
        hb = self._host_buffers(key, b, t, nblk, cuda)
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the last session's uploads read these buffers: done long since
        # filled through numpy views, uploaded without waiting: the host goes on to launch while the GPU still
        # runs the prefill
        st_np, bt_np = hb.st.numpy(), hb.bt.numpy()
        st_np.fill(0)
        bt_np.fill(SCRATCH_BLOCK)
        emitted = 0 if first is None else 1
        for i, s in enumerate(seqs):
            # the last token is not in the target cache yet; its pending draft rows are in s.pending
            st_np[i] = (s.table.num_tokens, s.draft_len, s.last_token if first is None else 0, s.pending_rows,
                        len(s.output) + emitted, s.params.max_tokens, s.seed, s.params.top_k, widths[i])
            bt_np[i, :len(s.table.blocks)] = s.table.blocks
        st_np[len(seqs):, D] = 1  # padding rows: frozen (O = M = 0), one harmless context key
        host_st, host_bt, host_sp = hb.st, hb.bt, hb.sp
        if mode != GREEDY:
            sp_np = host_sp.numpy()
            sp_np.fill(0.0)
            for i, s in enumerate(seqs):
                sp_np[i] = (min(s.params.temperature, FLOAT32_MAX), s.params.top_p)

        def reset() -> None:  # a harmless state (every row frozen, scratch tables) for warm-up and capture
            st.zero_()
            st[:, D] = 1
            bt.fill_(SCRATCH_BLOCK)

        def fill() -> None:
            st.copy_(host_st, non_blocking=cuda)
            bt.copy_(host_bt, non_blocking=cuda)
            if mode != GREEDY:
                sp.copy_(host_sp, non_blocking=cuda)
            if first is not None:
                st[:len(seqs), X] = first
            if self.spec:
                self._upload_pending(seqs, bufs[2])
        fill()
        graph = self.graphs[mode]
        if cuda and graph.enabled and key not in graph._graphs:
            graph(key, bufs, reset)
            fill()
        if cuda:
            self._uploaded = torch.cuda.Event()
            self._uploaded.record()
        if steps is None:
            self.sessions += 1
        return Session(seqs, key, bufs, reset, cuda, hb.ring, [s.draft_len for s in seqs],
                       [s.pending_rows for s in seqs], emits=[0] * (t + 1), width=t, widths=widths, mode=mode)

    def _upload_pending(self, seqs: list[Sequence], pend: torch.Tensor) -> None:
        """Each row's pending draft rows into the step's buffer, in one copy. Rows past a row's pending count
        are never read (their context K/V go to the scratch block); the buffer only ever holds zeros or taps,
        so it stays finite without a clear per request."""
        rows = [(i, s) for i, s in enumerate(seqs) if s.pending is not None and s.pending_rows]
        if not rows:
            return
        t = pend.shape[1]
        flat = [i * t + j for i, s in rows for j in range(s.pending_rows)]
        src = torch.cat([s.pending[:s.pending_rows] for _, s in rows]) if len(rows) > 1 else \
            rows[0][1].pending[:rows[0][1].pending_rows]
        pend.view(-1, pend.shape[2]).index_copy_(0, torch.tensor(flat, device=pend.device), src)

    def _flush_wide_pending(self, seqs: list[Sequence], t: int) -> None:
        """A row whose pending draft rows outnumber this session's width (its last step verified wider, before
        the width policy's cap for a larger batch applied) writes them into the draft cache now, eagerly."""
        wide = [s for s in seqs if s.pending is not None and s.pending_rows > t]
        if wide:
            self.gen.drafts.write_pending(wide)

    def launch(self, sess: "Session") -> None:
        """Queue one step; its result is copied to the host without waiting for it."""
        out = self.graphs[sess.mode](sess.key, sess.bufs, sess.reset)
        if sess.cuda:
            host, ev = sess.ring[sess.launched % 2]  # step k-2's buffer and event: already read
            host.copy_(out, non_blocking=True)
            ev.record()
            sess.queued.append((host, ev))
        else:  # eagerly, the same one-step lag: a step past a row's end runs here too
            sess.queued.append((out.clone(), None))
        sess.launched += 1

    def read(self, sess: "Session") -> None:
        """Wait for the oldest queued step and commit its results to the sequences."""
        host, ev = sess.queued.pop(0)
        if ev is not None:
            ev.synchronize()
        rows = host[:len(sess.seqs)].tolist()
        for i, (s, row) in enumerate(zip(sess.seqs, rows)):
            if self.spec and not s.done:  # mirror the device's draft bookkeeping for `end`
                sess.draft_len[i] += sess.pending[i]
                sess.pending[i] = row[-1] + 1
        self._commit(sess.seqs, rows, sess.emits, sess.widths)

    def end(self, sess: "Session") -> None:
        """Read every step still queued, then hand the sequences back to the stepwise loop: their cache
        lengths, draft context and pending draft rows as the device has them, and the KV blocks
        reserved past their next step freed."""
        while sess.queued:
            self.read(sess)
        alloc = self.runner.allocator
        # the rows' pending taps, copied once out of the buffer the next session overwrites
        kept = sess.bufs[2][:len(sess.seqs)].clone() if self.spec else None
        for i, s in enumerate(sess.seqs):
            s.table.num_tokens = len(s.prompt) + len(s.output) - 1
            if self.spec and not s.done:
                n = sess.pending[i]
                s.draft_len, s.pending_rows = sess.draft_len[i], n
                s.pending = kept[i, :n]
            else:
                s.pending, s.pending_rows = None, 0
            if not s.done:  # a finished row's blocks go back with the whole table (finish)
                alloc.truncate(s.table, s.table.num_tokens)

    def _commit(self, seqs: list[Sequence], rows: list[list[int]], emits: list[int], widths: list[int]) -> None:
        """Apply one step's device results to each row still running, exactly as the stepwise loop does.
        A running row's host state here equals its device state when the step began, so its width (its own
        draft width, or what max_tokens still admits) is the one the device used."""
        for s, row, t in zip(seqs, rows, widths):
            if s.done:
                continue
            if not self.spec:
                s.commit([row[0]])
                continue
            w = step_width(t, s.params.max_tokens, len(s.output))
            a = row[-1]
            assert 0 <= a <= w - 1, f"device accepted {a} guesses at width {w}"
            s.stats.record_step(len(s.commit(row[:a + 1])), w, a)
            emits[a + 1] += 1
