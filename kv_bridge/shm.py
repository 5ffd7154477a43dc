"""Same-host transfer through shared memory: one file under /dev/shm per chunk, passed by name.

Plain files on the tmpfs rather than multiprocessing.shared_memory: on Python 3.11 the latter
registers every segment (even one merely attached) with a resource tracker that unlinks it or
warns at exit, which fights the hand-off (the writer creates, the reader unlinks). The writer
creates a segment with O_EXCL; the reader reads it out and unlinks it.
"""
from __future__ import annotations

import os
import re
import stat
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

SHM_DIR = Path("/dev/shm")
PREFIX = "fpkv-"
_NAME_RE = re.compile(r"^fpkv-[A-Za-z0-9_-]{1,120}$")


class ShmError(OSError):
    """A handle that is malformed, missing or not the announced length."""


def available() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def write_all(fd: int, data: bytes | memoryview) -> None:
    """os.write until every byte is down (a single write may be short)."""
    with memoryview(data) as view:
        written = 0
        while written < len(view):
            written += os.write(fd, view[written:])


def write_segment(data: bytes | list[bytes | memoryview]) -> str:
    """Create a new segment holding data (or its parts, in order); returns its name (the caller or its
    peer unlinks it)."""
    name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
    path = SHM_DIR / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for part in (data if isinstance(data, list) else [data]):
            write_all(fd, part)
    except BaseException:
        os.close(fd)
        unlink_segment(name)
        raise
    os.close(fd)
    return name


def take_segment(name: str, length: int, writable: bool = False) -> bytes | bytearray:
    """Read the segment's bytes and unlink it (also when it is the wrong size). writable: into a bytearray
    the caller owns (an importer's, see KVChunk.from_bytes(own=True)), else immutable bytes.

    The name is a peer's: only a regular file is read (a FIFO would block the open forever, a link could
    point anywhere), and it is read with read(2), not mapped, so a peer that shrinks the file meanwhile
    gives a short read (ShmError) rather than a SIGBUS that kills this process."""
    if not _NAME_RE.match(name):
        raise ShmError(f"shm.name {name!r} is not a bridge segment name")
    path = SHM_DIR / name
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError as e:
        raise ShmError(f"shm segment {name} does not exist") from e
    except OSError as e:  # ELOOP: a symbolic link
        unlink_segment(name)
        raise ShmError(f"shm segment {name} cannot be opened: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ShmError(f"shm segment {name} is not a regular file")
        if st.st_size != length or length == 0:
            raise ShmError(f"shm segment {name} holds {st.st_size} bytes, handle says {length}")
        return _read_exactly(fd, name, length, writable)
    finally:
        os.close(fd)
        unlink_segment(name)


def _read_exactly(fd: int, name: str, length: int, writable: bool) -> bytes | bytearray:
    if writable:
        buf = bytearray(length)
        view, got = memoryview(buf), 0
        while got < length:
            n = os.readv(fd, [view[got:]])
            if n == 0:
                raise ShmError(f"shm segment {name} shrank to {got} of {length} bytes while read")
            got += n
        return buf
    data = os.read(fd, length)  # one copy, into the bytes object itself
    if len(data) == length:
        return data
    parts = [data]
    got = len(data)
    while got < length:
        more = os.read(fd, length - got)
        if not more:
            raise ShmError(f"shm segment {name} shrank to {got} of {length} bytes while read")
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def unlink_segment(name: str) -> None:
    """Remove a segment if it is there and ours to remove (another user's file in /dev/shm is not: left alone)."""
    if _NAME_RE.match(name):
        try:
            os.unlink(SHM_DIR / name)
        except OSError:  # gone already, or not this process's to unlink
            pass


def list_segments(pid: int | None = None) -> list[str]:
    """Bridge segments present now (of one process when pid is given): for leak checks."""
    if not SHM_DIR.is_dir():
        return []
    prefix = PREFIX if pid is None else f"{PREFIX}{pid}-"
    return sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith(prefix))


def sweep_segments(max_age_s: float, pid: int | None = None) -> int:
    """Unlink bridge segments (of one process when pid is given) older than max_age_s: their
    reader died or walked away before taking them."""
    now = time.time()
    n = 0
    for name in list_segments(pid):
        try:
            if now - (SHM_DIR / name).stat().st_mtime > max_age_s:
                unlink_segment(name)
                n += 1
        except FileNotFoundError:
            pass
    return n


class SegmentLedger:
    """The segments a server handed out that their readers have not taken yet, bounded in bytes.

    A reader takes (unlinks) a segment as soon as its handle arrives; one that does not (a client that
    never reads, or asks for the same bytes over and over) would otherwise fill the host's memory with
    files only a later TTL sweep removes. `reserve` admits a new segment while the untaken ones and the
    new one fit in max_bytes (one segment alone always fits), waiting up to wait_s for readers to take
    theirs."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._out: dict[str, int] = {}  # segment name, or a reservation's "?" ticket -> bytes

    def _prune(self) -> None:
        for name in [n for n in self._out if not n.startswith("?")]:
            if not (SHM_DIR / name).exists():
                del self._out[name]

    def outstanding(self) -> int:
        with self._lock:
            self._prune()
            return sum(self._out.values())

    def reserve(self, n: int, wait_s: float, active: Callable[[], bool]) -> str | None:
        """A ticket for n bytes, or None when no room came within wait_s (or active() turned False)."""
        deadline = time.monotonic() + wait_s
        while True:
            with self._lock:
                self._prune()
                if not self._out or sum(self._out.values()) + n <= self.max_bytes:
                    ticket = f"?{uuid.uuid4().hex}"
                    self._out[ticket] = n
                    return ticket
            if time.monotonic() > deadline or not active():
                return None
            time.sleep(0.002)

    def bind(self, ticket: str, name: str | None) -> None:
        """The ticket's segment was written as `name` (None: it was not)."""
        with self._lock:
            n = self._out.pop(ticket, 0)
            if name is not None:
                self._out[name] = n
