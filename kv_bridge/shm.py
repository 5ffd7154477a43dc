"""Same-host transfer through shared memory: one file under /dev/shm per chunk, passed by name.

Plain files on the tmpfs rather than multiprocessing.shared_memory: on Python 3.11 the latter
registers every segment (even one merely attached) with a resource tracker that unlinks it or
warns at exit, which fights the hand-off (the writer creates, the reader unlinks). The writer
creates a segment with O_EXCL; the reader maps it, copies it out and unlinks it.
"""
from __future__ import annotations

import mmap
import os
import re
import time
import uuid
from pathlib import Path

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
    """Map the segment, copy its bytes out and unlink it (also when it is the wrong size). writable: into
    a bytearray the caller owns (an importer's, see KVChunk.from_bytes(own=True)), else immutable bytes."""
    if not _NAME_RE.match(name):
        raise ShmError(f"shm.name {name!r} is not a bridge segment name")
    path = SHM_DIR / name
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError as e:
        raise ShmError(f"shm segment {name} does not exist") from e
    try:
        size = os.fstat(fd).st_size
        if size != length or length == 0:
            raise ShmError(f"shm segment {name} holds {size} bytes, handle says {length}")
        with mmap.mmap(fd, length, prot=mmap.PROT_READ) as mm:
            return bytearray(mm) if writable else mm[:]
    finally:
        os.close(fd)
        unlink_segment(name)


def unlink_segment(name: str) -> None:
    if _NAME_RE.match(name):
        try:
            os.unlink(SHM_DIR / name)
        except FileNotFoundError:
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
