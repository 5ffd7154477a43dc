"""Shared-memory files allocated ahead of a client's Put segments.

A chunk written into a fresh tmpfs file has its pages allocated and zeroed on the writer's thread, which is most
of a same-host Put's time on the client (docs/results.md, the publish path). A pool file's pages were allocated
beforehand (posix_fallocate) on a thread of the pool's own, while the writer did other work.

A pooled file has no name (O_TMPFILE): a writer that dies leaks nothing, the kernel frees the file with its last
descriptor. `write` fills one, cuts it to the chunk's length and links it under a new segment name; from then on
it is an ordinary Put segment (shm.write_segment's), which the bridge takes and unlinks. Where the host cannot do
this (no O_TMPFILE on the tmpfs, no /proc, the tmpfs full), the pool turns itself off, says so once in the log,
and every write goes to a fresh segment as before.
"""
from __future__ import annotations

import logging
import os
import threading
import time

from flashpd.kv_bridge import shm

log = logging.getLogger(__name__)

DEFAULT_POOL_BYTES = 256 << 20  # about six 43 MB chunks of the Qwen3-8B shape held ready (tmpfs memory)
MAX_FILES = 4  # at most this many files held (small chunks would otherwise fill max_bytes with hundreds)
ROUND = 2 << 20  # a pool file's size: the largest segment seen lately, rounded up to this
IDLE_S = 30.0  # a pool with no write for this long frees its files and ends its thread (the next write restarts it)


class SegmentPool:
    """Up to max_bytes (and MAX_FILES) of pre-allocated, unnamed tmpfs files, refilled in the background after each
    use. Thread-safe. A write starts the refill thread if it is not running; after IDLE_S without a write, or at
    close(), the thread ends and the files held are freed (a client never closed holds none for long)."""

    def __init__(self, max_bytes: int = DEFAULT_POOL_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"a segment pool's bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._cond = threading.Condition()
        self._ready: list[tuple[int, int]] = []  # (fd, allocated bytes)
        self._want = 0  # the size of the files to make (0: none asked for yet)
        self._thread: threading.Thread | None = None
        self._last_take = 0.0
        self._dir: int | None = None  # SHM_DIR, open while the pool may make or name files
        self._closed = False
        self.disabled: str | None = None if max_bytes > 0 and shm.available() else "off"
        self.stats = {"pooled_writes": 0, "fresh_writes": 0, "files_made": 0}

    def write(self, parts: list, tag: str) -> str:
        """A new Put segment holding the parts in order (shm.write_segment's contract): in a pool file if one is
        ready, else in a fresh one."""
        size = sum(len(memoryview(p).cast("B")) for p in parts)
        fd = self._take(size)
        if fd is None:
            with self._cond:
                self.stats["fresh_writes"] += 1
            return shm.write_segment(parts, tag)
        name = shm.segment_name(tag)
        try:
            for p in parts:
                shm.write_all(fd, p)
            os.ftruncate(fd, size)  # a larger file gives its tail back; the segment is exactly the chunk
            # named through the directory's descriptor the file was made in: one host here stacks two tmpfs
            # mounts on /dev/shm, and a link by path then crossed devices (EXDEV). Fails if the name exists.
            os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=self._dir_fd())
        except OSError as e:  # no /proc, a full tmpfs: this chunk and every later one go to fresh files
            self._disable(f"a pool file cannot be filled and named ({e.strerror})")
            with self._cond:
                self.stats["fresh_writes"] += 1
            return shm.write_segment(parts, tag)
        finally:
            os.close(fd)
        with self._cond:
            self.stats["pooled_writes"] += 1
        return name

    def stats_now(self) -> dict:
        with self._cond:
            return {**self.stats, "held_bytes": sum(n for _, n in self._ready), "disabled": self.disabled}

    def held_bytes(self) -> int:
        with self._cond:
            return sum(n for _, n in self._ready)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            ready, self._ready = self._ready, []
            thread = self._thread
            self._cond.notify_all()
        for fd, _ in ready:
            os.close(fd)
        if thread is not None:
            thread.join()
        with self._cond:
            d, self._dir = self._dir, None
        if d is not None:
            os.close(d)

    # -- internals ------------------------------------------------------------------------------------------
    def _take(self, size: int) -> int | None:
        with self._cond:
            if self.disabled is not None or self._closed:
                return None
            want = -(-size // ROUND) * ROUND
            if want > self.max_bytes:
                return None  # larger than the whole pool: never pooled
            if want > self._want:
                self._want = want
            self._last_take = time.monotonic()
            if self._thread is None:
                self._thread = threading.Thread(target=self._refill, name="shm-pool", daemon=True)
                self._thread.start()
            fd = self._ready.pop(0)[0] if self._ready else None
            self._cond.notify_all()
            return fd

    def _refill(self) -> None:
        while True:
            with self._cond:
                while not self._closed and self._full():
                    idle = time.monotonic() - self._last_take
                    if idle >= IDLE_S:  # nobody writes: free the files, end; the next write starts a thread again
                        ready, self._ready, self._thread = self._ready, [], None
                        for fd, _ in ready:
                            os.close(fd)
                        return
                    self._cond.wait(IDLE_S - idle)
                if self._closed:
                    return
                want = self._want
            try:
                fd = os.open(".", os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600, dir_fd=self._dir_fd())
            except OSError as e:
                self._disable(f"an unnamed tmpfs file cannot be made ({e.strerror})")
                return
            try:
                os.posix_fallocate(fd, 0, want)  # the pages allocated and zeroed here, not on the writer's thread
            except OSError as e:
                os.close(fd)
                self._disable(f"{want} bytes cannot be allocated on the tmpfs ({e.strerror})")
                return
            with self._cond:
                if self._closed or self.disabled is not None:
                    os.close(fd)
                    return
                self._ready.append((fd, want))
                self.stats["files_made"] += 1

    def _dir_fd(self) -> int:
        with self._cond:
            if self._closed:  # a write that took a file just before close(): it goes to a fresh segment
                raise OSError(9, "the segment pool is closed")
            if self._dir is None:
                self._dir = os.open(shm.SHM_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            return self._dir

    def _full(self) -> bool:
        """Whether no file is to be made now (lock held): none asked for yet, or MAX_FILES or max_bytes held."""
        return (self._want == 0 or len(self._ready) >= MAX_FILES
                or sum(n for _, n in self._ready) + self._want > self.max_bytes)

    def _disable(self, why: str) -> None:
        with self._cond:
            self.disabled = why
            ready, self._ready = self._ready, []
        for fd, _ in ready:
            os.close(fd)
        log.warning("shared-memory segment pool off: %s; Put segments are written into fresh files", why)
