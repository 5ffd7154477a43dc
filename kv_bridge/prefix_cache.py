"""Decode-side, method-aware prefix cache: a hit restores BOTH the target KV and the drafter state.

restore(): the longest run of leading prompt chunks present in the store is imported into the
sequence's blocks (target K/V and draft context K/V, one unit), so prefill computes only the
rest. At least one prompt token is always recomputed: its logits give the first token.
publish(): a prompt's full chunks, both halves, go to the store when the request finishes (a
native request's, target K/V only, go to a separate target-only chain; see _readable).
restore_draft=False is the "target-only" CONTROL that reproduces what generic connectors do
(draft state not restored; its slots are zeroed, i.e. state absent): outputs stay exact, and
whatever acceptance the drafter drew from that context is lost. Never use it to serve.

What comes from the store is checked against the layout of the caches it is written into (shape,
dtype, token count, fingerprint, byte length), by byte stores before they build tensors and here
again before writing; a chunk that does not fit, or whose write fails in any way, ends the hit
there and is counted in `refused_chunks`: the rest of the prompt is recomputed, never an exception.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Protocol

import torch

from flashpd.engine.kv_transfer import position_slots, read_positions, write_positions
from flashpd.engine.sequence import Sequence
from flashpd.kv_bridge.chunk import CorruptChunk, KVChunk, LayoutMismatch
from flashpd.kv_bridge.keys import chunk_keys
from flashpd.kv_bridge.layout import ChunkLayout
from flashpd.kv_bridge.stage import DEFAULT_STAGE_BYTES, StagedChunk, Stager
from flashpd.kv_bridge.store import put_all


class Store(Protocol):
    """get(key, layout) returns None for a miss and raises LayoutMismatch for an entry not of `layout`.
    An optional get_many(keys, layout) returns the leading chunks that are present and fit; an optional
    iter_many(keys, layout) yields them one by one as they are read (a restore then copies each to the GPU while
    the next is read: kv_bridge/stage.py). An optional get_shared(key, layout) is get whose tensors may be views of
    the store's own bytes (a restore only reads them)."""

    def put(self, chunk: KVChunk) -> bool: ...
    def get(self, key: str, layout: ChunkLayout | None = None) -> KVChunk | None: ...
    def lookup(self, keys: list[str]) -> int: ...


_END = object()  # a read run's end
PER_REQUEST_HITS_KEPT = 4096  # restores whose hit `per_request_hits` keeps (the most recent; up to twice that)


@dataclass
class PrefixCacheStats:
    requests: int = 0
    hit_tokens: int = 0
    prompt_tokens: int = 0
    published_chunks: int = 0
    refused_chunks: int = 0  # present but unusable (tokens, layout, fingerprint, a failed write): recomputed
    per_request_hits: list[int] = field(default_factory=list)  # the latest restores' hits, oldest first (bounded)


@dataclass
class Fetched:
    """A restore's data, read but not yet written: the leading usable chunks of one prompt (StagedChunks where
    their copy to the caches' device was made ahead: kv_bridge/stage.py)."""

    prompt_len: int
    chunks: list[KVChunk] = field(default_factory=list)
    refused: bool = False  # a present chunk that could not be used ended the run (counted when applied)


@dataclass
class Pending:
    """A save read out of the caches but not yet stored: the prompt and its full chunks' K/V."""

    prompt: list[int]
    with_draft: bool
    target: list[torch.Tensor] = field(default_factory=list)
    draft: list[torch.Tensor] = field(default_factory=list)


class PrefixCache:
    def __init__(self, store: Store, fingerprint: str, chunk_tokens: int = 256, restore_draft: bool = True,
                 stage_bytes: int = DEFAULT_STAGE_BYTES) -> None:
        """stage_bytes: device memory a fetch may fill with chunks copied ahead of apply, across the fetches in
        flight (kv_bridge/stage.py; 0: apply copies every chunk from the host, as before)."""
        if chunk_tokens <= 0:
            raise ValueError("chunk_tokens must be positive")
        self.stager = Stager(stage_bytes)
        self.store = store
        self.fingerprint = fingerprint
        # what a native request computes (target K/V only) lives on a chain of its own: under the full
        # method's keys it would shadow the both-halves entry a DFlash request needs (first writer wins)
        self.target_only = hashlib.sha256((fingerprint + ":target-only").encode()).hexdigest()
        self.chunk_tokens = chunk_tokens
        self.restore_draft = restore_draft
        self.stats = PrefixCacheStats()

    def _keys(self, tokens: list[int], fingerprint: str | None = None) -> list[str]:
        return chunk_keys(tokens, self.chunk_tokens, fingerprint or self.fingerprint)

    def _readable(self, gen) -> list[str]:
        """Chains whose entries this generator can use, best first: DFlash needs both halves; a native
        request uses a full entry's target half, or the target-only chain."""
        return [self.fingerprint] if getattr(gen, "drafts", None) is not None else [self.fingerprint, self.target_only]

    def lookup_tokens(self, gen, prompt: list[int]) -> int:
        """How many prompt positions a restore would take from the store now (the scheduler side of the
        connector: no side effects, no data moved; entries can still be evicted before the fetch)."""
        best = 0
        for chain in self._readable(gen):
            k = self._keys(prompt[:len(prompt) - 1], chain)
            best = max(best, self.store.lookup(k) if k else 0)
        return best * self.chunk_tokens

    def fetch(self, gen, prompt: list[int]) -> Fetched:
        """The I/O half of a restore: find and read the longest usable run of the prompt's leading chunks,
        each checked against the generator's layout and the prompt's tokens. Touches neither the caches nor
        the stats, so it may run on another thread while the engine steps (apply() writes the result)."""
        n, keys, fp = 0, [], self.fingerprint
        for chain in self._readable(gen):
            k = self._keys(prompt[:len(prompt) - 1], chain)
            m = self.store.lookup(k) if k else 0
            if m > n:
                n, keys, fp = m, k, chain
        runner, drafts = gen.runner, getattr(gen, "drafts", None)
        layout = ChunkLayout.of_caches(runner.cache.data, drafts.cache.data if drafts is not None else None,
                                       self.chunk_tokens, fp)
        chunks = self._read(keys[:n], layout) if n else iter(())
        get = getattr(self.store, "get_shared", self.store.get)  # the chunks are only copied into the caches
        out = Fetched(len(prompt))
        run = self.stager.run() if self.stager.budget_bytes else None
        target_dev = runner.cache.data.device
        draft_dev = drafts.cache.data.device if drafts is not None and self.restore_draft else None
        try:
            for i in range(n):
                lo, hi = i * self.chunk_tokens, (i + 1) * self.chunk_tokens
                try:  # past the read run, get() tells a miss (None) from a chunk that does not fit
                    chunk = next(chunks, _END)
                    if chunk is _END:
                        chunk = get(keys[i], layout)
                except (LayoutMismatch, CorruptChunk):
                    out.refused = True
                    break
                if chunk is None:  # evicted between lookup and get: the rest is recomputed
                    break
                if layout.check(chunk) is not None or chunk.token_ids != prompt[lo:hi]:
                    out.refused = True
                    break
                out.chunks.append(run.add(chunk, target_dev, draft_dev) if run is not None else chunk)
            else:  # every chunk read: the read's end (a bridge stream's closing message, checked) rather than a cancel
                next(chunks, None)
        except BaseException:
            out.chunks.clear()  # staged device memory goes now, not with the exception's traceback
            raise
        finally:
            try:  # every started copy done, errors or not, before anything its sources lie in can go
                stale = run.finish() if run is not None else None
            finally:
                close = getattr(chunks, "close", None)
                if close is not None:  # a stream not read to its end is cancelled (or drained) now
                    close()
        if stale is not None:  # an arena slot reused under its copy: that chunk and the rest are recomputed
            del out.chunks[stale:]
            out.refused = True
        return out

    def _read(self, keys: list[str], layout: ChunkLayout):
        """The store's leading present chunks of `keys` that fit `layout`, as an iterator: one by one as they
        are read where the store can (iter_many), else its get_many's list, else nothing (get() reads each)."""
        iter_many = getattr(self.store, "iter_many", None)
        if iter_many is not None:
            return iter_many(keys, layout)
        get_many = getattr(self.store, "get_many", None)  # a remote store fetches the run in one call
        return iter(get_many(keys, layout) if get_many is not None else ())

    def apply(self, gen, seq: Sequence, got: Fetched) -> int:
        """The write half of a restore: the fetched run into the sequence's (already reserved) blocks, both
        halves; returns the positions restored (a chunk that fails to write ends the run)."""
        if got.prompt_len != len(seq.prompt):
            raise ValueError(f"fetched for a {got.prompt_len}-token prompt, applied to {len(seq.prompt)}")
        for i, chunk in enumerate(got.chunks):  # before any write: a fetch of another prompt must never be applied
            lo, hi = i * self.chunk_tokens, (i + 1) * self.chunk_tokens
            if chunk.token_ids != seq.prompt[lo:hi]:
                raise ValueError(f"fetched chunk {i} holds other tokens than the prompt's positions {lo}..{hi - 1}: "
                                 f"a restore fetched for another prompt")
        self.stats.requests += 1
        self.stats.prompt_tokens += len(seq.prompt)
        runner, drafts = gen.runner, getattr(gen, "drafts", None)
        hit, refused = 0, got.refused
        for i, chunk in enumerate(got.chunks):
            lo, hi = i * self.chunk_tokens, (i + 1) * self.chunk_tokens
            if not self._write(runner, drafts, seq, lo, hi, chunk):
                refused = True
                break
            hit = hi
        self.stats.refused_chunks += int(refused)
        seq.table.num_tokens = hit
        seq.draft_len = hit  # with restore_draft=False these positions hold NO valid draft state (the control)
        self.stats.hit_tokens += hit
        hits = self.stats.per_request_hits
        hits.append(hit)
        if len(hits) > 2 * PER_REQUEST_HITS_KEPT:  # one entry a request, for as long as a worker served: bounded
            del hits[:-PER_REQUEST_HITS_KEPT]
        return hit

    def restore(self, gen, seq: Sequence) -> int:
        """Import the cached prefix of seq.prompt into its (already reserved) blocks; returns its length."""
        return self.apply(gen, seq, self.fetch(gen, seq.prompt))

    def _write(self, runner, drafts, seq: Sequence, lo: int, hi: int, chunk: KVChunk) -> bool:
        """Write one chunk into the sequence's slots; False if anything fails (positions from lo on are
        then recomputed, overwriting whatever part was written)."""
        try:
            if isinstance(chunk, StagedChunk):
                chunk.handed_to_current_stream()
            slots = position_slots(seq.table, lo, hi, runner.kv_block_size, runner.device)
            write_positions(runner.cache.data, slots, chunk.target_kv)
            if drafts is not None:
                # the control zeroes the drafter's slots: "not restored" must not silently read
                # stale state that happens to match (freed blocks are reused LIFO)
                write_positions(drafts.cache.data, slots, chunk.draft_kv if self.restore_draft
                                else torch.zeros_like(chunk.draft_kv))
        except Exception:  # noqa: BLE001  whatever a chunk does, it never takes the engine loop down
            return False
        # read in place from a bridge's arena past its hold: what was written may be another chunk's bytes
        return chunk.fresh()

    def publish(self, gen, seq: Sequence) -> int:
        """Store the prompt's full chunks (both halves) not yet in the store; returns how many were put. The
        control (restore_draft=False) puts nothing: the draft halves it restored are zeros, and one evicted
        since the restore would go back into the store as a full entry under the real fingerprint."""
        if not self.restore_draft:
            return 0
        return self.store_pending(self.collect(gen, seq))

    def collect(self, gen, seq: Sequence) -> Pending:
        """The save's read half: copies of the prompt's full chunks out of the caches (before its blocks are
        freed). No I/O, so the engine loop does it and hands store_pending to another thread."""
        runner, drafts = gen.runner, getattr(gen, "drafts", None)
        ct = self.chunk_tokens
        n = min(len(seq.prompt), seq.table.num_tokens, seq.draft_len if drafts is not None else len(seq.prompt)) // ct
        out = Pending(list(seq.prompt), drafts is not None)
        for i in range(n):
            slots = position_slots(seq.table, i * ct, (i + 1) * ct, runner.kv_block_size, runner.device)
            # fresh tensors on the cache's device: a DeviceStore keeps them there, byte stores serialise
            # them (KVChunk.to_bytes moves them to the host)
            out.target.append(read_positions(runner.cache.data, slots))
            if drafts is not None:
                out.draft.append(read_positions(drafts.cache.data, slots))
        return out

    def store_pending(self, p: Pending) -> int:
        """The save's I/O half: the collected chunks the store does not hold yet, in order; returns how many
        were put. A native request's chunks (target K/V only) go to the target-only chain, unless full
        entries already cover its prompt. The control puts nothing (`publish`)."""
        if not self.restore_draft:
            return 0
        fp = self.fingerprint
        keys = self._keys(p.prompt)
        if not p.with_draft and keys:
            if self.store.lookup(keys) == len(keys):
                return 0
            fp = self.target_only
            keys = self._keys(p.prompt, fp)
        have = self.store.lookup(keys) if keys else 0
        parent = keys[have - 1] if have else ""
        ct = self.chunk_tokens
        chunks = []
        for i in range(have, min(len(keys), len(p.target))):
            chunks.append(KVChunk(keys[i], parent, fp, p.prompt[i * ct:(i + 1) * ct], p.target[i],
                                  p.draft[i] if p.with_draft else None))
            parent = keys[i]
        put = put_all(self.store, chunks)
        self.stats.published_chunks += put
        return put
