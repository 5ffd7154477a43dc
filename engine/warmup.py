"""Warm-up at worker start: run throwaway requests so that CUDA graphs and compiles happen before serving.

Graphs are captured lazily, one per shape (batch bucket, block-table bucket, padded prefill width,
verify width). Without a warm-up the first requests of each shape pay for the capture and the
compile inside their measured latency (a service sweep's TTFT outliers came from this: docs/results.md,
"Figures behind design choices"). The prompt lengths below cover
the padded prefill widths (64 to 1,024 tokens) and the block-table buckets of contexts up to about
2,000 tokens, at batch 1 and as one batch; other shapes are still captured when first seen.

Warm-up requests never touch a prefix cache or a bridge (nothing is published or imported), and
leave every KV block free. Random token ids: only the shapes matter.
"""
from __future__ import annotations

import logging
import time

import torch

from flashpd.engine.sampling import SamplingParams

log = logging.getLogger(__name__)

# one prompt per padded prefill width (64 .. 1,024 tokens) and block-table bucket, plus a long one
DEFAULT_LENGTHS = (16, 100, 200, 400, 900, 2000)


def lengths_for(max_positions: int, new_tokens: int, lengths: tuple[int, ...] = DEFAULT_LENGTHS) -> list[int]:
    """The warm-up prompt lengths that fit the model's positions with `new_tokens` to generate."""
    return [n for n in lengths if n + new_tokens <= max_positions]


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def warm_scheduler(scheduler, lengths: list[int], new_tokens: int) -> dict:
    """Each prompt alone, then all at once, through every method the scheduler has; its prefix cache is
    detached meanwhile and its counters reset after. Returns what ran (for the log and the tests)."""
    runner = scheduler.runner
    free = runner.allocator.num_free
    methods = ["native"] + (["dflash"] if scheduler.spec is not None else [])
    prompts = random_prompts(lengths, scheduler.runner.model.cfg.vocab_size)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    cache, scheduler.prefix_cache = scheduler.prefix_cache, None
    t0 = time.perf_counter()
    n = 0
    try:
        for method in methods:
            for group in [[p] for p in prompts] + [prompts]:
                if sum(-(-(len(p) + new_tokens + 16) // runner.block_size) + 1 for p in group) > free:
                    continue  # a small KV cache: skip what cannot run at once rather than preempt
                for p in group:
                    scheduler.add(p, params, method)
                    n += 1
                scheduler.run_until_idle()
    finally:
        scheduler.prefix_cache = cache
    scheduler.reset_stats()
    if runner.allocator.num_free != free:
        raise RuntimeError(f"warm-up leaked KV blocks ({free - runner.allocator.num_free})")
    return {"requests": n, "methods": methods, "lengths": lengths, "seconds": time.perf_counter() - t0}


def warm_prefill(gen, lengths: list[int]) -> dict:
    """Prefill each prompt (with the drafter's context write where there is a drafter), publish nothing."""
    free = gen.runner.allocator.num_free
    t0 = time.perf_counter()
    for p in random_prompts(lengths, gen.runner.model.cfg.vocab_size):
        seq = gen.new_sequences([p], [SamplingParams(max_tokens=1)])[0]
        gen.reserve([seq])
        gen.prefill_request([seq])
        gen.runner.allocator.free(seq.table)
    if gen.runner.allocator.num_free != free:
        raise RuntimeError(f"warm-up leaked KV blocks ({free - gen.runner.allocator.num_free})")
    return {"requests": len(lengths), "lengths": lengths, "seconds": time.perf_counter() - t0}
