"""The native executor on one ModelRunner: batched prefill, native decode steps, the device loop.

It runs steps; it does not decide which requests run. The one driver is engine/scheduler.py (its
`generate` for a whole batch, its Scheduler for serving). Every forward goes through the paged cache.
"""
from __future__ import annotations

import time
from typing import Iterable

import torch

from flashpd.engine.device_loop import DeviceLoop
from flashpd.engine.kv_cache import OutOfBlocks, blocks_needed
from flashpd.engine.runner import ModelRunner, TapSink
from flashpd.engine.sampling import SamplingParams, greedy_tokens, request_seed, sample_tokens
from flashpd.engine.sequence import Sequence, any_filtered, host_values, next_index, row_params


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sample_on_device(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """One token per row of logits [B, V] (greedy rows their argmax), on the device, with no host sync."""
    if all(s.params.greedy for s in seqs):
        return greedy_tokens(logits)
    index = host_values([next_index(s) for s in seqs], torch.int64, logits.device)
    return sample_tokens(logits, *row_params(seqs, logits.device), index,
                         filtered=any_filtered(seqs, logits.shape[-1]))


def sample_rows(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """One token per row of logits [B, V] (greedy rows their argmax), with one host sync."""
    return sample_on_device(logits, seqs).tolist()


class NativeGenerator:
    """Plain (non-speculative) decoding of a batch of requests."""

    speculative = False  # DFlashGenerator: True (its requests draft and verify)

    def __init__(self, runner: ModelRunner, stop_ids: Iterable[int] = (), prefill_token_budget: int = 8192,
                 step_width: int = 1) -> None:
        if step_width < 1:
            raise ValueError(f"step_width must be at least 1, got {step_width}")
        self.runner = runner
        # > 1: the device loop forwards each token with step_width - 1 padding columns and computes every
        # column's logits, the kernel shapes of a DFlash verify of that width. In bf16 a matmul's rounding
        # depends on its M, so a one-token step and a verify can part on a near-tie; at the verify's shapes a
        # position's logits are the verify's bit for bit (bench/speed_8b.py reports the match and the cost).
        self.step_width = step_width
        self.stop_ids = frozenset(stop_ids)
        self.prefill_token_budget = prefill_token_budget
        # a stable batch steps in device-loop sessions of many steps, the host one step behind
        # (device_loop.py); False: every step is a session of one, read before the next (what a changing
        # serving batch runs)
        self.device_loop = True
        self._loop = None

    def loop(self) -> DeviceLoop:
        """This generator's device loop (made on first use: its graphs and buffers are per generator)."""
        if self._loop is None:
            self._loop = DeviceLoop(self)
        return self._loop

    def run_on_device(self, seqs: list[Sequence]) -> bool:
        """Drive these prefilled sequences to their ends in the device loop, when it applies."""
        live = [s for s in seqs if not s.done]
        if not self.device_loop or not live or not self.loop().usable(live):
            return False
        self.loop().run(live)
        return True

    def overlaps_start(self, seqs: list[Sequence]) -> bool:
        """Whether these fresh requests may start in the device loop straight from their prefill
        (engine/scheduler.py, Scheduler._may_start): rows the loop takes, with no first token forced by a prefill
        worker, each wanting more than the prefill's token (a step queued for a one-token batch would only be
        waited for)."""
        return self.device_loop and bool(seqs) and self.loop().usable(seqs) and all(
            s.forced_first is None and not s.output and s.params.max_tokens > 1 for s in seqs)

    def prefill_request(self, seqs: list[Sequence], defer: list[torch.Tensor] | None = None) -> None:
        """The prefill a request needs: the target's (DFlashGenerator writes the drafter's context in the same
        forwards). `defer`: as `prefill`'s."""
        self.prefill(seqs, defer=defer)

    def new_sequences(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Sequence]:
        seqs = []
        limit = self.runner.max_positions
        for p, sp in zip(prompts, params):
            sp.validate()
            if not p:
                raise ValueError("prompt is empty")
            if len(p) + sp.max_tokens > limit:
                raise ValueError(f"prompt of {len(p)} tokens + max_tokens {sp.max_tokens} exceeds the "
                                 f"model's {limit} positions")
            seqs.append(Sequence(list(p), sp, self.stop_ids, seed=request_seed(sp.seed)))
        return seqs

    def prefill(self, seqs: list[Sequence], taps: bool = False, sink: TapSink | None = None,
                defer: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Prefill prompts in padded groups under a token budget; sample each first token.

        Returns, when `taps` is set, the tapped hidden states of every prompt position not already
        cached, one [len(prompt) - cached, n_taps * H] tensor per sequence (what the drafter
        conditions on). `sink` consumes them inside each forward instead (ModelRunner.forward).
        `defer`: each group's first tokens (greedy or drawn) are appended there as a device tensor,
        with no host sync and nothing committed; the device loop starts from them and commits them
        (DeviceLoop.run's `first`).
        """
        alloc = self.runner.allocator
        features: list[torch.Tensor] = []
        i = 0
        while i < len(seqs):
            group = seqs[i:i + self._group_size(seqs[i:])]
            i += len(group)
            cached = [s.table.num_tokens for s in group]
            for s in group:
                alloc.ensure(s.table, len(s.prompt))
            # a prefix-cache hit already holds positions [0, num_tokens): compute only the rest
            out = self.runner.forward([s.table for s in group], [s.prompt[s.table.num_tokens:] for s in group],
                                      "last", taps, sink)
            if defer is not None:  # read before the next replay reuses the buffer; no host sync either way
                defer.append(sample_on_device(out.logits[:, -1], group))
                continue
            firsts = sample_rows(out.logits[:, -1], group)
            _sync(self.runner.device)
            now = time.perf_counter()
            for j, (s, tok) in enumerate(zip(group, firsts)):
                s.stats.ttft_ms = (now - s.t_start) * 1e3
                # the token a prefill worker already streamed wins (bf16 recompute may round otherwise)
                s.commit([tok if s.forced_first is None else s.forced_first])
                if taps:
                    n = len(s.prompt) - cached[j]
                    features.append(torch.cat([x[j, :n] for x in out.taps], dim=-1))
        return features

    def _group_size(self, seqs: list[Sequence]) -> int:
        """How many of these prompts (in order) the next prefill forward takes. With CUDA graphs, when the first
        one's new tokens replay a graph: the most, by powers of two (no padding rows), whose padded forward still
        replays one (ModelRunner.replays_graph), so that a closed loop's few-at-a-time admissions and a large
        batch's prefill are graph replays rather than eager forwards (whose launch and Python cost set a DFlash
        batch's step time at 128 rows on a small model: docs/results.md). Otherwise
        padded groups under prefill_token_budget; a prompt past prefill_chunk prefills alone, in chunks."""
        runner, chunk = self.runner, self.runner.config.prefill_chunk
        new = [len(s.prompt) - s.table.num_tokens for s in seqs]
        if runner.replays_graph(new[:1]) and not (chunk and new[0] > chunk):
            n = 1
            while 2 * n <= len(seqs) and runner.replays_graph(new[:2 * n]) and not (chunk and max(new[:2 * n]) > chunk) \
                    and 2 * n * max(len(s.prompt) for s in seqs[:2 * n]) <= self.prefill_token_budget:
                n *= 2
            return n
        n = 1
        while n < len(seqs):
            longest = max(len(s.prompt) for s in seqs[:n + 1])
            if longest * (n + 1) > self.prefill_token_budget or (chunk and longest > chunk):
                break
            n += 1
        return n

    def decode_step(self, seqs: list[Sequence]) -> None:
        """One token for every running sequence: the device step (engine/device_loop.py), a session of one."""
        self.loop().step(seqs)

    def finish(self, s: Sequence, prefix_cache=None) -> None:
        """Publish the prompt to the prefix cache (if any) and free the blocks, whatever publish does."""
        try:
            if prefix_cache is not None:
                prefix_cache.publish(self, s)
        finally:
            self.runner.allocator.free(s.table)
        _sync(self.runner.device)
        s.stats.latency_ms = (time.perf_counter() - s.t_start) * 1e3

    def reserve(self, seqs: list[Sequence]) -> None:
        """Refuse a batch the cache cannot hold to the end (this loop has no preemption)."""
        bs = self.runner.kv_block_size
        need = sum(blocks_needed(len(s.prompt), s.params.max_tokens, s.draft_width, bs) for s in seqs)
        if need > self.runner.allocator.num_free:
            raise OutOfBlocks(f"{len(seqs)} requests need up to {need} KV blocks; "
                              f"{self.runner.allocator.num_free} are free")

    def restore_prefixes(self, seqs: list[Sequence], prefix_cache) -> None:
        """Reserve each prompt's blocks and import its cached prefix (both halves) where there is one."""
        if prefix_cache is None:
            return
        for s in seqs:
            self.runner.allocator.ensure(s.table, len(s.prompt))
            prefix_cache.restore(self, s)
