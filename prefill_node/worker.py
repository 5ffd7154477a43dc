"""PrefillWorker: compute a prompt's target KV and drafter state, publish both, return the first token.

The prefill side of disaggregation. A prompt is prefilled with the drafter's taps (so the
drafter's context K/V exists for every prompt position), its full chunks are published to the
bridge as two-half entries, and the first token (from the prefill's last logits) is returned at
once for TTFT. A decode worker with a prefix cache on the same bridge then imports those chunks
and recomputes only the partial tail, so its output and acceptance equal a colocated run.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from flashpd.engine.drafter import DFlashDrafter
from flashpd.engine.generate import NativeGenerator
from flashpd.engine.runner import ModelRunner
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.spec_decode import DFlashGenerator
from flashpd.kv_bridge.prefix_cache import PrefixCache


@dataclass
class PrefillResult:
    first_token: int
    finish_reason: str | None  # set when the first token already ends the request
    published_chunks: int
    cached_tokens: int  # prompt positions that were already in the bridge (not recomputed)
    prefill_ms: float


class PrefillWorker:
    def __init__(self, runner: ModelRunner, drafter: DFlashDrafter | None, cache: PrefixCache,
                 stop_ids: tuple[int, ...] = ()) -> None:
        self.gen = DFlashGenerator(runner, drafter, stop_ids) if drafter is not None else \
            NativeGenerator(runner, stop_ids)
        self.cache = cache

    def prefill(self, prompt: list[int], params: SamplingParams) -> PrefillResult:
        t0 = time.perf_counter()
        gen = self.gen
        seq = gen.new_sequences([prompt], [params])[0]
        gen.reserve([seq])
        before = self.cache.stats.hit_tokens
        try:  # whatever fails (restore, prefill, publish), the blocks go back
            gen.restore_prefixes([seq], self.cache)
            gen.prefill_request([seq])  # DFlash: the drafter's context too, in the same forwards
            published = self.cache.publish(gen, seq)
        finally:
            gen.runner.allocator.free(seq.table)
        return PrefillResult(seq.output[0], seq.finish_reason, published, self.cache.stats.hit_tokens - before,
                             (time.perf_counter() - t0) * 1e3)
