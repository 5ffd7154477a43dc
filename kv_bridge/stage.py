"""A restore's chunks copied to the GPU while the next one is still being read and verified.

Why: a bridge hit's chunks arrive as host bytes (the arena's mapping, a segment, a gRPC frame), each checked
against its keyed BLAKE3 MAC before it is used. Restored as before, the fetch verified every chunk, and then the
engine's apply copied them host -> device one by one, blocking: a restore cost the MACs plus the copies in series,
and the copies ran on the engine's thread (docs/results.md). Here the fetch starts each verified chunk's copy to its
cache's device on a side stream and goes on to read the next, so the DMA runs under the next chunk's MAC; `finish`
waits for the run's copies once, then checks that each source read in place (an arena lease) was still the chunk's
after its copy was done. apply then writes device tensors into the paged caches: a device-to-device copy.

Bounds: staged bytes are device memory held from the fetch until the restore is applied (or dropped). A Stager's
budget bounds them across every fetch in flight (a worker's load threads share one); a chunk past it stays on the
host and apply copies it as before, as it does when the device has no memory to give (an out-of-memory error,
logged once). The side stream's blocks stay in torch's caching allocator for that stream after first use: up to
the budget of device memory is kept for staging.
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass

import torch

from flashpd.kv_bridge.chunk import KVChunk

log = logging.getLogger(__name__)

DEFAULT_STAGE_BYTES = 1 << 30  # a 6,000-token prefix of the Qwen3-8B pair (both halves), or several shorter ones
# After an out-of-memory error no chunk is staged for this long: each failed allocation makes torch's allocator free
# its cached blocks (a device-wide synchronisation), which must not recur a chunk while memory is short
OOM_PAUSE_S = 1.0


@dataclass
class StagedChunk(KVChunk):
    """A chunk whose tensors were copied to their cache's device on a Stager's side stream (the copy is complete
    once its run finished). `handed_to_current_stream` must be called before another stream reads them."""

    def handed_to_current_stream(self) -> None:
        """Tell the caching allocator that the current stream uses the tensors: their blocks, allocated on the side
        stream, are not reused by a later staging copy before what the current stream queued has read them."""
        for t in (self.target_kv, self.draft_kv):
            if t is not None and t.is_cuda:
                t.record_stream(torch.cuda.current_stream(t.device))


class Stager:
    """The side streams and the device-byte budget that the fetches of one prefix cache share. Thread-safe."""

    def __init__(self, budget_bytes: int = DEFAULT_STAGE_BYTES) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.staged_bytes = 0  # held now by staged chunks not yet dropped
        self.stats = {"staged_chunks": 0, "over_budget": 0, "out_of_memory": 0, "stale": 0}
        # re-entrant: a staged chunk's finalizer gives its bytes back under it, and the collector may run one while
        # this thread holds it (a staged chunk in a reference cycle, an exception's traceback)
        self._lock = threading.RLock()
        self._streams: dict[torch.device, object] = {}
        self._oom_logged = False
        self._paused_until = 0.0  # time.monotonic(): no staging before it (OOM_PAUSE_S)

    def run(self) -> "StageRun":
        """One fetch's copies."""
        return StageRun(self)

    def _stream(self, device: torch.device):
        with self._lock:
            s = self._streams.get(device)
            if s is None:  # torch's streams do not synchronise with the legacy default stream the engine may use
                s = self._streams[device] = torch.cuda.Stream(device)
            return s

    def _take(self, n: int) -> bool:
        with self._lock:
            if self.staged_bytes + n > self.budget_bytes:
                self.stats["over_budget"] += 1
                return False
            self.staged_bytes += n
            return True

    def _give(self, n: int) -> None:
        with self._lock:
            self.staged_bytes -= n

    def _count(self, what: str) -> None:
        with self._lock:
            self.stats[what] += 1

    def _paused(self) -> bool:
        return time.monotonic() < self._paused_until

    def _out_of_memory(self, n: int) -> None:
        with self._lock:
            self.stats["out_of_memory"] += 1
            self._paused_until = time.monotonic() + OOM_PAUSE_S
            first, self._oom_logged = not self._oom_logged, True
        if first:
            log.warning("prefix restore: no device memory to stage %d bytes; chunks are copied from the host by the "
                        "engine meanwhile (logged once)", n)


def _moves(t: torch.Tensor | None, device: torch.device | None) -> bool:
    return t is not None and device is not None and device.type == "cuda" and t.device != device


class StageRun:
    """The copies one fetch started: `add` each chunk as it is read, in order; `finish` once, whatever happened."""

    def __init__(self, stager: Stager) -> None:
        self._stager = stager
        self._sources: list[KVChunk | None] = []  # what each added chunk was copied from (None: not staged)
        self._held: list[KVChunk] = []  # every chunk a copy may still read, until finish (failed copies' too)
        self._streams: list[object] = []  # the side streams this run's copies went to

    def add(self, chunk: KVChunk, target_device: torch.device | None, draft_device: torch.device | None
            ) -> KVChunk:
        """The chunk with its copy to the devices started (a StagedChunk), or the chunk itself where nothing moves
        to a CUDA device (already there, a CPU cache), the budget is spent, or the device is out of memory (then
        nothing is staged for OOM_PAUSE_S). draft_device None: the draft half is not staged (the control restores
        none). Any other error is raised, with the budget given back and the chunk held until finish."""
        move_t, move_d = _moves(chunk.target_kv, target_device), _moves(chunk.draft_kv, draft_device)
        if not (move_t or move_d) or self._stager._paused():
            self._sources.append(None)
            return chunk
        n = (chunk.target_kv.nbytes if move_t else 0) + (chunk.draft_kv.nbytes if move_d else 0)
        if not self._stager._take(n):
            self._sources.append(None)
            return chunk
        self._held.append(chunk)  # before any copy starts: its bytes are read until finish has waited
        try:
            t = self._copy(chunk.target_kv, target_device) if move_t else chunk.target_kv
            d = self._copy(chunk.draft_kv, draft_device) if move_d else chunk.draft_kv
        except torch.cuda.OutOfMemoryError:
            self._stager._give(n)
            self._stager._out_of_memory(n)
            self._sources.append(None)
            return chunk
        except BaseException:
            self._stager._give(n)
            raise
        staged = StagedChunk(chunk.key, chunk.parent, chunk.fingerprint, chunk.token_ids, t, d)
        weakref.finalize(staged, self._stager._give, n)
        self._sources.append(chunk)
        self._stager._count("staged_chunks")
        return staged

    def _copy(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """t's copy to device, started on the device's side stream (which finish then waits for)."""
        stream = self._stager._stream(device)
        if stream not in self._streams:  # before the copy is issued: finish must wait for it whatever follows
            self._streams.append(stream)
        with torch.cuda.stream(stream):
            return t.to(device, non_blocking=True)

    def finish(self) -> int | None:
        """Wait for every copy this run started; the index of the first staged chunk whose source was no longer its
        own once its copy was done (an arena slot reused: that chunk and the rest must not be used), else None.
        Call it on every path, errors included: a source must outlive the copy reading it. The wait is for each
        side stream as it is now, so it may include other fetches' copies queued in between."""
        for stream in self._streams:
            ev = torch.cuda.Event()
            ev.record(stream)
            ev.synchronize()
        self._streams.clear()
        self._held.clear()
        sources, self._sources = self._sources, []
        for i, src in enumerate(sources):
            if src is not None and not src.fresh():
                self._stager._count("stale")
                return i
        return None
