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


def recompute(gen: NativeGenerator, seqs: list[Sequence], prefix_cache=None, taps: bool = False) -> int:
    """Rebuild the target KV (and, with taps, the drafter context) of each sequence's prompt + output[:-1]
    into freshly allocated blocks; returns how many positions were computed (not restored)."""
    runner = gen.runner
    computed = 0
    for s in seqs:
        if not s.output or s.table.blocks or s.draft_len or s.pending is not None:
            raise ValueError("recompute takes preempted sequences: output so far, no blocks, no draft state")
        ctx = s.prompt + s.output[:-1]
        runner.allocator.ensure(s.table, len(ctx))
        if prefix_cache is not None:
            prefix_cache.restore(gen, s)  # sets num_tokens (and draft_len) to the restored prefix
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
