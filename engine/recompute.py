"""Recompute of a preempted request: rebuild its caches from its tokens, sampling nothing.

A preempted request keeps its tokens (prompt + output so far) and its sampling state, and loses
its KV blocks. Re-admitted, its context = prompt + output[:-1] goes through the target in one
forward (after whatever prefix the prefix cache restores) and, for DFlash, the tapped states of
those positions become its drafter context, exactly as after the verify steps it had taken. The
last output token stays "not yet in the caches", as after any step. Nothing is sampled, and a sampled
request's draws are keyed by token index (engine/sampling.py), so the continuation equals an uninterrupted run.
"""
from __future__ import annotations

from flashpd.engine.generate import NativeGenerator
from flashpd.engine.sequence import Sequence


def recompute(gen: NativeGenerator, seqs: list[Sequence], prefix_cache=None, taps: bool = False,
              fetched: list | None = None) -> int:
    """Rebuild the target KV (and, with taps, the drafter context) of each sequence's prompt + output[:-1]
    into freshly allocated blocks; returns how many positions were computed (not restored). fetched: per
    sequence, its prompt's prefix as the prefix cache's fetch() read it off the engine thread (applied here),
    or None (restored here)."""
    runner = gen.runner
    computed = 0
    if fetched is not None and len(fetched) != len(seqs):
        raise ValueError(f"{len(fetched)} fetched prefixes for {len(seqs)} sequences")
    for i, s in enumerate(seqs):
        if not s.output or s.table.blocks or s.draft_len or s.pending is not None:
            raise ValueError("recompute takes preempted sequences: output so far, no blocks, no draft state")
        ctx = s.prompt + s.output[:-1]
        runner.allocator.ensure(s.table, len(ctx))
        got = fetched[i] if fetched is not None else None
        if got is not None:
            prefix_cache.apply(gen, s, got)  # sets num_tokens (and draft_len) to the restored prefix
        elif prefix_cache is not None:
            prefix_cache.restore(gen, s)  # the same, its fetch run here
        rest = ctx[s.table.num_tokens:]
        if taps and s.draft_len != s.table.num_tokens:
            raise RuntimeError(f"restored draft context ({s.draft_len}) out of step with the target cache "
                               f"({s.table.num_tokens})")
        # DFlash: the forward's taps become drafter context inside the forward (its sink), as in a prefill
        runner.forward([s.table], [rest], "none", sink=gen.drafts.write_forward_context if taps else None)
        if taps:
            s.draft_len = len(ctx)
        computed += len(rest)
    return computed
