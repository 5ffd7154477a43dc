"""Warm-up at worker start: run throwaway requests so that CUDA graphs and compiles happen before serving.

Graphs are captured lazily, one per shape (batch bucket, block-table bucket, padded prefill width,
verify width). Without a warm-up the first requests of each shape pay for the capture and the
compile inside their measured latency (a service sweep's TTFT outliers came from this: docs/results.md,
"Figures behind design choices"). The prompt lengths below cover
the padded prefill widths (64 to 1,024 tokens) and the block-table buckets of contexts up to about
2,000 tokens, at batch 1 and as one batch. Then every power-of-two batch bucket (engine/cuda_graph.py
`bucket`) up to the scheduler's max_running runs a few tokens of short prompts per method, greedy, sampled,
and sampled with top-p: the device step's three graphs a shape (engine/device_loop.py), which a stable batch
replays in a session and a changing one step by step (a closed-loop load moves its batch through every
bucket under its concurrency: a 3.7 s stall at concurrency 32 was such a shape first met inside a measured
level); a width policy's batch rule (narrower widths, no speculation past a size) applies there as it will
when serving. Then, per method, the fresh prefills of 2 or more prompts at once that replay a graph (each batch
bucket and padded width within the prefill graph's tokens: a closed loop admits its replacements a few at a
time), and each batch bucket once more, in the three modes, with tables in the 16-block bucket (contexts of
129-256 tokens, where chat-length requests run; an HTTP request samples unless it asks otherwise). Each prompt
alone runs in the three modes too. Where the worker serves with a prefix cache, prompts of 1 and 2 rows hit a
private one (`warm_hits`, one geometry): the first prefill over a cached prefix with 2 rows compiles. Other shapes
(other block-table buckets at large batches, other hit tails, prefixes and batches) are still captured when first
seen; a decode worker logs and counts each (engine/jit_watch.py).

Warm-up requests never touch the serving prefix cache or a bridge (the hit pass publishes to and imports from its
private cache only), and leave every KV block free. Random token ids: only the shapes matter.
"""
from __future__ import annotations

import logging
import time

import torch

from flashpd.engine.kv_cache import blocks_needed
from flashpd.engine.runner_config import RunnerConfig
from flashpd.engine.sampling import SamplingParams

log = logging.getLogger(__name__)

# one prompt per padded prefill width (64 .. 1,024 tokens) and block-table bucket, plus a long one; and short ones:
# a prompt of 2-32 tokens pads to 16 or 32 (runner._graph_width) and one of 33-64 to 64, each width a graph of its
# own, captured inside the first such request's TTFT unless warmed here (12 for width 16, 20 for 32, 40 for 64;
# docs/results.md, forty-third and forty-fourth sessions). 13 pads as 12 does, but makes the all-at-once group 9
# prompts, whose device steps then meet batch bucket 16 (with 8 prompts, bucket 8 only: keys a mixed-length load meets)
SHORT_LENGTHS = (12, 13, 20, 40)
DEFAULT_LENGTHS = (*SHORT_LENGTHS, 100, 200, 400, 900, 2000)
BUCKET_PROMPT = 16  # tokens of each prompt of the batch-bucket pass (one prefill width, one block-table bucket)
BUCKET_TOKENS = 4  # tokens each request of that pass generates: its prefill's token, then a few steps
# A second pass (greedy, sampled, filtered) over the same batch buckets with tables of WIDE_TABLE_BLOCKS blocks
# (the 16-block bucket: contexts of 129-256 tokens at blocks of 16), where chat-length requests run at every batch
# (a 128-token prompt and 64 new tokens end at 192). The 16-token pass's tables take the 4-block bucket only, so
# a closed loop at large batches met each batch bucket's device step at 16 blocks for the first time while serving
# (counted on the CPU with the GPU's padded paths: docs/results.md; tests/test_warmup.py checks a closed loop of 8
# in each mode).
WIDE_TABLE_BLOCKS = 12
HIT_TAIL = 24  # the prefix-hit pass: its prompts are a chunk + this, then + twice this (a 48-token tail, 64 wide)
PROGRESS_S = 30.0  # a warm-up's progress line at most this often (it takes minutes on a GPU: serve waits on it)


def lengths_for(max_positions: int, new_tokens: int, lengths: tuple[int, ...] = DEFAULT_LENGTHS) -> list[int]:
    """The warm-up prompt lengths that fit the model's positions with `new_tokens` to generate."""
    return [n for n in lengths if n + new_tokens <= max_positions]


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def batch_sizes(max_batch: int) -> list[int]:
    """One batch per power-of-two bucket from 2 up to the bucket of max_batch (the last one max_batch itself:
    it pads to that bucket)."""
    out, b = [], 2
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + ([max_batch] if max_batch >= 2 else [])


def prefill_shapes(config: RunnerConfig, sizes: list[int]) -> list[tuple[int, int]]:
    """(prompts, tokens each) of the fresh prefills that replay a graph with several prompts at once: every batch
    bucket of `sizes` and padded width (64, 128, ...) whose product is within config.prefill_graph_tokens
    (ModelRunner._graph_width). Prompts of the width's full length: their tables take the width's own block
    bucket, as every prompt padded to that width does. None without CUDA graphs."""
    if not config.cuda_graphs:
        return []
    out, t = [], 64
    while 2 * t <= config.prefill_graph_tokens:
        out += [(b, t) for b in sizes if b * t <= config.prefill_graph_tokens and b & (b - 1) == 0]
        t *= 2
    return out


def warm_scheduler(scheduler, lengths: list[int], new_tokens: int, max_batch: int | None = None,
                   bucket_tokens: int = BUCKET_TOKENS, scratch_cache=None) -> dict:
    """Each prompt alone (greedy, sampled and filtered), then all at once, through every method the scheduler has;
    then, per method, a batch of short prompts at every power-of-two bucket up to max_batch (default: the
    scheduler's max_running) for `bucket_tokens` tokens, greedy, sampled and filtered, then the fresh prefills of
    several prompts that replay a graph (`prefill_shapes`), then the three modes again with prompts whose tables
    take the WIDE_TABLE_BLOCKS bucket. Its prefix cache is detached meanwhile and its counters reset after; a group
    whose worst case does not fit the free KV blocks at once is skipped (a small cache), never preempted.
    scratch_cache: a private prefix cache (the serving cache's kind: its fingerprint and chunk size, its own
    empty store), given where the scheduler serves with a prefix cache: prompts of 1 and 2 rows publish a chunk
    into it and come back longer, so that a hit's tail prefill (a prefill over a cached prefix, which a lone
    long prompt's chunks alone ran, at one row) compiles here, not inside the first hits (`warm_hits`). Returns
    what ran (for the log and the tests)."""
    runner = scheduler.runner
    free = runner.allocator.num_free
    methods = ["native"] + (["dflash"] if scheduler.spec is not None else [])
    vocab = scheduler.runner.model.cfg.vocab_size
    prompts = random_prompts(lengths, vocab)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    sizes = batch_sizes(scheduler.max_running if max_batch is None else min(max_batch, scheduler.max_running))
    # greedy, sampled, sampled with a filter: the device step's three graphs (its sampling modes)
    modes = ({}, dict(temperature=1.0, seed=0), dict(temperature=1.0, top_p=0.9, seed=0))
    shorts = [SamplingParams(max_tokens=bucket_tokens, ignore_eos=True, **kw) for kw in modes]
    # each prompt alone in every mode: a request alone (a first HTTP request, which samples by default) grows
    # through the block-table buckets of its length at batch 1
    alone = [SamplingParams(max_tokens=new_tokens, ignore_eos=True, **kw) for kw in modes]
    cache, scheduler.prefix_cache = scheduler.prefix_cache, None
    t0 = time.perf_counter()
    n, batches, skipped, bucket_s = 0, {m: [] for m in methods}, {m: [] for m in methods}, 0.0
    wide_batches: dict[str, list[int]] = {m: [] for m in methods}
    hit_batches: dict[str, list[int]] = {m: [] for m in methods}
    prefills: dict[str, list[tuple[int, int]]] = {m: [] for m in methods}
    first_only = SamplingParams(max_tokens=1, ignore_eos=True)

    width = scheduler.spec.draft_width if scheduler.spec is not None else 1  # a DFlash request's draft width

    def fits(group: list[list[int]], tokens: int) -> bool:
        return sum(blocks_needed(len(p), tokens, width, runner.kv_block_size) + 1 for p in group) <= free

    last_line = t0
    phase = ""

    def run(group: list[list[int]], sp: SamplingParams, method: str) -> None:
        nonlocal n, last_line
        for p in group:
            scheduler.add(p, sp, method)
            n += 1
        scheduler.run_until_idle()
        if time.perf_counter() - last_line >= PROGRESS_S:
            last_line = time.perf_counter()
            log.info("warm-up: %s, %s: %d requests in %.0f s (methods %s, batch buckets up to %d)", method, phase, n,
                     last_line - t0, "/".join(methods), sizes[-1] if sizes else 1)

    try:
        for method in methods:
            phase = "prompts of each length"
            for group in [[p] for p in prompts] + [prompts]:
                if fits(group, new_tokens):  # a small KV cache: skip what cannot run at once rather than preempt
                    for sp in alone if len(group) == 1 else [params]:
                        run(group, sp, method)
            t1 = time.perf_counter()
            for b in sizes:
                phase = f"batch bucket {b}"
                group = random_prompts([BUCKET_PROMPT] * b, vocab, seed=b)
                if not fits(group, bucket_tokens):
                    skipped[method].append(b)
                    continue
                for short in shorts:
                    run(group, short, method)
                batches[method].append(b)
            phase = "prefills of several prompts"
            for b, t in prefill_shapes(runner.config, sizes):  # fresh prefills of several prompts at once
                group = random_prompts([t] * b, vocab, seed=2000 + b * t)
                if fits(group, 1):
                    run(group, first_only, method)
                    prefills[method].append((b, t))
            wide = WIDE_TABLE_BLOCKS * runner.kv_block_size - bucket_tokens  # prompt + new tokens fill the blocks
            phase = "chat-length tables"
            if wide + bucket_tokens <= runner.max_positions:
                for b in sizes:
                    group = random_prompts([wide] * b, vocab, seed=1000 + b)
                    if fits(group, bucket_tokens):
                        for short in shorts:  # an HTTP request samples by default (temperature 1.0, or the
                            run(group, short, method)  # target's generation_config: top-p/top-k for Qwen3)
                        wide_batches[method].append(b)
            if scratch_cache is not None:
                phase = "prefix hits"
                hit_batches[method] = warm_hits(scheduler, scratch_cache, method, run, fits, first_only)
            bucket_s += time.perf_counter() - t1
    finally:
        scheduler.prefix_cache = cache
    scheduler.reset_stats()
    if runner.allocator.num_free != free:
        raise RuntimeError(f"warm-up leaked KV blocks ({free - runner.allocator.num_free})")
    return {"requests": n, "methods": methods, "lengths": lengths, "batches": batches, "skipped_batches": skipped,
            "wide_table_batches": wide_batches, "prefill_batches": prefills, "hit_batches": hit_batches,
            "seconds": time.perf_counter() - t0,
            "batch_seconds": bucket_s}


def warm_hits(scheduler, scratch_cache, method: str, run, fits, params: SamplingParams) -> list[int]:
    """Prefix hits of 1 and 2 rows through `scratch_cache` (attached for this only): prompts of one chunk and
    HIT_TAIL tokens publish their chunk, then come back HIT_TAIL tokens longer, each restoring that chunk and
    prefilling the 2 * HIT_TAIL tokens past it. Two rows at once is the first prefill over a cached prefix with
    more than one row, which compiles (sizes 0 and 1 specialize: engine/runner.py `compiled`). One geometry: other
    tails, prefixes and batches still capture their graphs when first met. Returns the batches whose every row hit
    (a batch that did not, a store refusing the chunks or a failed restore, is logged, not counted)."""
    runner = scheduler.runner
    chunk, vocab, done = scratch_cache.chunk_tokens, runner.model.cfg.vocab_size, []
    # restores inside admission: with fetches on the load threads, two requests' hits may finish apart and
    # prefill one row each (as they may while serving; the pass needs the two rows together once)
    saved = scheduler.prefix_cache, scheduler.async_load
    scheduler.prefix_cache, scheduler.async_load = scratch_cache, False
    try:
        for b in (1, 2):
            base = random_prompts([chunk + HIT_TAIL] * b, vocab, seed=3000 + b)
            longer = [p + q for p, q in zip(base, random_prompts([HIT_TAIL] * b, vocab, seed=3100 + b))]
            if b > scheduler.max_running or len(longer[0]) + 1 > runner.max_positions or not fits(longer, 1):
                continue
            failed = scheduler.stats.failed_requests
            run(base, params, method)
            run(longer, params, method)
            hits = scratch_cache.stats.per_request_hits[-b:]
            if hits == [chunk] * b and scheduler.stats.failed_requests == failed:
                done.append(b)
            else:
                log.warning("warm-up: %s prefix hits of %d rows did not all hit (%s of %d tokens, %d failed): "
                            "their first prefill over a cached prefix may compile while serving", method, b, hits,
                            chunk, scheduler.stats.failed_requests - failed)
    finally:
        scheduler.prefix_cache, scheduler.async_load = saved
    return done


def warm_prefill(gen, lengths: list[int]) -> dict:
    """Prefill each prompt (with the drafter's context write where there is a drafter), publish nothing."""
    free = gen.runner.allocator.num_free
    t0 = time.perf_counter()
    for p in random_prompts(lengths, gen.runner.model.cfg.vocab_size):
        seq = gen.new_sequences([p], [SamplingParams(max_tokens=1)])[0]
        gen.reserve([seq])
        try:
            gen.prefill_request([seq])
        finally:  # a prefill that raised (out of memory) gives its blocks back too
            gen.runner.allocator.free(seq.table)
    if gen.runner.allocator.num_free != free:
        raise RuntimeError(f"warm-up leaked KV blocks ({free - gen.runner.allocator.num_free})")
    return {"requests": len(lengths), "lengths": lengths, "seconds": time.perf_counter() - t0}
