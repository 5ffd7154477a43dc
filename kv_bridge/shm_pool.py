"""Shared-memory files allocated ahead of a client's Put segments.

A chunk written into a fresh tmpfs file has its pages allocated and zeroed on the writer's thread, which is most
of a same-host Put's time on the client (docs/results.md, the publish path). A pool file's pages were allocated
beforehand (posix_fallocate) on a thread of the pool's own, while the writer did other work. That helps a burst
(a prompt's chunks), not a steady stream: a refill costs what a fresh file costs, on another thread.

A pooled file has no name (O_TMPFILE): a writer that dies leaks nothing, the kernel frees the file with its last
descriptor. `write` fills one, cuts it to the chunk's length and links it under a new segment name; from then on
it is an ordinary Put segment (shm.write_segment's), which the bridge takes. The pool never fills the tmpfs past
half (a small /dev/shm, as a container's 64 MiB, gets no pool rather than a Put that no longer fits); a full tmpfs
pauses the refills until the next write. Where the host cannot do this at all (no O_TMPFILE on the tmpfs, no
/proc to name a file by), the pool turns itself off, says so once in the log, and every write goes to a fresh
segment as before.
"""
from __future__ import annotations

import errno
import logging
import os
import threading
import time
import weakref

from flashpd.kv_bridge import shm

log = logging.getLogger(__name__)

DEFAULT_POOL_BYTES = 256 << 20  # about six 43 MB chunks of the Qwen3-8B shape held ready (tmpfs memory)
MAX_FILES = 4  # at most this many files held (small chunks would otherwise fill max_bytes with hundreds)
ROUND = 2 << 20  # a pool file's size: the latest segment's, rounded up to this
IDLE_S = 30.0  # a pool with no write for this long frees its files and ends its thread (the next write restarts it)
MAX_TMPFS_FILL = 0.5  # the pool allocates a file only while the tmpfs stays at most this full with it
# errors that say "not now" (no room, no descriptor, no memory): a pause or a fresh write, never the pool off for good
_TRANSIENT = frozenset({errno.ENOSPC, errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN})


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
        self._paused = False  # the tmpfs was full: no refill until the next write
        self._closed = False
        self.disabled: str | None = None if max_bytes > 0 and shm.available() else "off"
        self.stats = {"pooled_writes": 0, "fresh_writes": 0, "files_made": 0}
        _POOLS.add(self)

    def write(self, parts: list, tag: str) -> str:
        """A new Put segment holding the parts in order (shm.write_segment's contract): in a pool file if one is
        ready, else in a fresh one."""
        size = sum(len(memoryview(p).cast("B")) for p in parts)
        fd = self._take(size)
        if fd is None:
            return self._fresh(parts, tag)
        name = shm.segment_name(tag)
        try:
            for p in parts:
                shm.write_all(fd, p)
            os.ftruncate(fd, size)  # a larger file gives its tail back; the segment is exactly the chunk
            _link(fd, name)
        except OSError as e:
            if e.errno not in _TRANSIENT:  # no /proc, or a tmpfs that cannot link: every later write goes fresh
                self._disable(f"a pool file cannot be filled and named ({e.strerror})")
            return self._fresh(parts, tag)
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
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    # -- internals ------------------------------------------------------------------------------------------
    def _fresh(self, parts: list, tag: str) -> str:
        with self._cond:
            self.stats["fresh_writes"] += 1
        return shm.write_segment(parts, tag)

    def _take(self, size: int) -> int | None:
        with self._cond:
            if self.disabled is not None or self._closed:
                return None
            want = -(-size // ROUND) * ROUND
            if want > self.max_bytes:
                return None  # larger than the whole pool: never pooled
            self._want = want  # the latest size: a client's chunks are of one layout
            self._last_take = time.monotonic()
            self._paused = False
            if self._thread is None:
                thread = threading.Thread(target=self._refill_guarded, name="shm-pool", daemon=True)
                try:
                    thread.start()
                except RuntimeError:  # no thread to be had now (a thread limit, the interpreter exiting)
                    return None
                self._thread = thread
            fd = self._ready.pop(0)[0] if self._ready else None
            self._cond.notify_all()
            return fd

    def _refill_guarded(self) -> None:
        try:
            self._refill()
        except Exception as e:  # noqa: BLE001  a bug here must not leave a pool that silently never refills
            self._disable(f"its refill thread failed ({e!r})")
            with self._cond:
                if self._thread is threading.current_thread():
                    self._thread = None

    def _refill(self) -> None:
        while True:
            with self._cond:
                while not self._closed and self.disabled is None and (self._paused or self._full()):
                    idle = time.monotonic() - self._last_take
                    if idle >= IDLE_S:  # nobody writes: free the files, end; the next write starts a thread again
                        ready, self._ready, self._thread = self._ready, [], None
                        for fd, _ in ready:
                            os.close(fd)
                        return
                    self._cond.wait(IDLE_S - idle)
                if self._closed or self.disabled is not None:
                    self._thread = None if self._thread is threading.current_thread() else self._thread
                    return
                want = self._want
            fd, why = _allocate(want)
            with self._cond:
                if fd is None:
                    if why is None:  # no room on the tmpfs (or no descriptor) now: wait for the next write
                        self._paused = True
                        continue
                elif not self._closed and self.disabled is None:
                    self._ready.append((fd, want))
                    self.stats["files_made"] += 1
                    continue
            if fd is not None:
                os.close(fd)  # closed or turned off meanwhile
                continue
            self._disable(why)

    def _full(self) -> bool:
        """Whether no file is to be made now (lock held): none asked for yet, or MAX_FILES or max_bytes held."""
        return (self._want == 0 or len(self._ready) >= MAX_FILES
                or sum(n for _, n in self._ready) + self._want > self.max_bytes)

    def _disable(self, why: str) -> None:
        with self._cond:
            if self.disabled is not None:
                return
            self.disabled = why
            ready, self._ready = self._ready, []
            self._cond.notify_all()
        for fd, _ in ready:
            os.close(fd)
        log.warning("shared-memory segment pool off: %s; Put segments are written into fresh files", why)

    def _after_fork_in_child(self) -> None:
        """A forked child shares the parent's pool files: it drops them (never writes into the parent's) and starts
        with no thread and a lock of its own."""
        for fd, _ in self._ready:
            try:
                os.close(fd)
            except OSError:
                pass
        self._cond = threading.Condition()
        self._ready, self._thread, self._paused = [], None, False


def _allocate(size: int) -> tuple[int | None, str | None]:
    """A new unnamed tmpfs file of `size` allocated bytes: (fd, None); (None, None) when not now (no room for it
    within MAX_TMPFS_FILL, or a transient error); (None, why) when such files cannot be made here."""
    try:
        st = os.statvfs(shm.SHM_DIR)
        # f_blocks 0: a tmpfs mounted without a size limit
        if st.f_blocks and (st.f_bavail * st.f_frsize - size) < (1 - MAX_TMPFS_FILL) * st.f_blocks * st.f_frsize:
            return None, None
        d = os.open(shm.SHM_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        return None, None if e.errno in _TRANSIENT else f"{shm.SHM_DIR} cannot be opened ({e.strerror})"
    try:
        fd = os.open(".", os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600, dir_fd=d)
    except OSError as e:
        return None, None if e.errno in _TRANSIENT else f"an unnamed tmpfs file cannot be made ({e.strerror})"
    finally:
        os.close(d)
    try:
        os.posix_fallocate(fd, 0, size)  # the pages allocated and zeroed here, not on the writer's thread
    except OSError as e:
        os.close(fd)
        return None, None if e.errno in _TRANSIENT else f"{size} bytes cannot be allocated ({e.strerror})"
    return fd, None


def _link(fd: int, name: str) -> None:
    """Name an unnamed file `name` in SHM_DIR (fails if the name exists, as O_EXCL does). Through a descriptor of the
    directory, opened for this link alone: one host here stacks two tmpfs mounts on /dev/shm, and a link by path
    then crossed devices (EXDEV)."""
    d = os.open(shm.SHM_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=d)
    finally:
        os.close(d)


_POOLS: "weakref.WeakSet[SegmentPool]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for pool in list(_POOLS):
        pool._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
