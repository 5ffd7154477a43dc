"""PrefillWorker: compute a prompt's target KV and drafter state, publish both, return the first token.

The prefill side of disaggregation. A prompt is prefilled with the drafter's taps (so the
drafter's context K/V exists for every prompt position), its full chunks are published to the
bridge as two-half entries, and the first token (from the prefill's last logits) is returned at
once for TTFT. A decode worker with a prefix cache on the same bridge then imports those chunks
and recomputes only the partial tail, so its output and acceptance equal a colocated run.

With an exporter (the same-host device path, kv_bridge/handoff.py) nothing is published: the
prompt's blocks stay allocated under a lease that the result carries, the decode worker copies them
device to device, and `release` (or the lease's deadline, `expire`) frees them. While it computes, the
exporter's busy word is set, so a decode worker on the same GPU holds its steps (kv_bridge/handoff.py).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Sequence

from flashpd.engine.drafter import DFlashDrafter
from flashpd.engine.kv_cache import OutOfBlocks
from flashpd.engine.generate import NativeGenerator
from flashpd.engine.runner import ModelRunner
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.spec_decode import DFlashGenerator
from flashpd.kv_bridge.handoff import prompt_digest
from flashpd.kv_bridge.handoff import CacheExporter, Handoff
from flashpd.kv_bridge.prefix_cache import PrefixCache


@dataclass
class PrefillResult:
    first_token: int
    finish_reason: str | None  # set when the first token already ends the request
    published_chunks: int
    cached_tokens: int  # prompt positions that were already in the bridge (not recomputed)
    prefill_ms: float
    handoff: Handoff | None = None  # the device path's lease on the prompt's blocks


class PrefillWorker:
    def __init__(self, runner: ModelRunner, drafter: DFlashDrafter | None, cache: PrefixCache | None,
                 stop_ids: tuple[int, ...] = (), exporter: CacheExporter | None = None) -> None:
        self.gen = DFlashGenerator(runner, drafter, stop_ids) if drafter is not None else \
            NativeGenerator(runner, stop_ids)
        self.cache = cache
        self.exporter = exporter

    def prefill(self, prompt: list[int], params: SamplingParams) -> PrefillResult:
        """Not thread-safe (one runner): the caller serialises prefill, release and expire."""
        t0 = time.perf_counter()
        gen = self.gen
        if self.exporter is not None:
            self.exporter.expire()  # leases nobody came for give their blocks back first
        seq = gen.new_sequences([prompt], [params])[0]
        # the prompt's blocks only: a prefill computes (and a lease holds) nothing past the prompt, so a request's
        # max_tokens must not refuse it here (its decode worker checks the whole request's room)
        need, free = -(-len(prompt) // gen.runner.kv_block_size), gen.runner.allocator.num_free
        if need > free:
            raise OutOfBlocks(f"a {len(prompt)}-token prompt needs {need} KV blocks; {free} are free")
        before = self.cache.stats.hit_tokens if self.cache is not None else 0
        handoff, published = None, 0
        try:  # whatever fails (restore, prefill, publish, lease), the blocks go back
            with self.exporter.computing() if self.exporter is not None else contextlib.nullcontext():
                gen.restore_prefixes([seq], self.cache)
                gen.prefill_request([seq])  # DFlash: the drafter's context too, in the same forwards
            if self.exporter is not None:
                table, alloc = seq.table, gen.runner.allocator
                handoff = self.exporter.lease(list(table.blocks), len(prompt), lambda: alloc.free(table),
                                              prompt_digest(prompt))
            elif self.cache is not None:
                published = self.cache.publish(gen, seq)
        finally:
            if handoff is None:
                gen.runner.allocator.free(seq.table)
        cached = (self.cache.stats.hit_tokens - before) if self.cache is not None else 0
        return PrefillResult(seq.output[0], seq.finish_reason, published, cached, (time.perf_counter() - t0) * 1e3,
                             handoff)

    def release(self, lease_id: int, blocks: Sequence[int], epochs: Sequence[int]) -> bool:
        """The decode worker is done with a lease: free its blocks (False: unknown or expired already, or refused:
        not exactly the lease's blocks and epochs, as its handoff named them)."""
        return self.exporter.release(lease_id, blocks, epochs) if self.exporter is not None else False
