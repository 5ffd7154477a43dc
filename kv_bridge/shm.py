"""Same-host transfer through shared memory: one file under /dev/shm per chunk, passed by name.

Plain files on the tmpfs rather than multiprocessing.shared_memory: on Python 3.11 the latter
registers every segment (even one merely attached) with a resource tracker that unlinks it or
warns at exit, which fights the hand-off (the writer creates, the reader unlinks). The writer
creates a segment with O_EXCL; the reader reads it out and unlinks it. A Put segment the server does not
take stays its writer's, until the writer is gone (PutLeftovers).

A Put segment is its writer's alone to hand over (SegmentOwner): its name carries the writer's owner id, a
hash of a secret key the writer presents with its Put (SHM_OWNER_HEADER) and nobody else knows. Every Put
client holds the cluster's token and /dev/shm lists every name, so neither a name nor the token tells the
server who wrote a segment; a name's owner id that does not match the key of the Put naming it is refused
before the file is opened, so no client can make the server take (read and unlink) another client's segment.
"""
from __future__ import annotations

import atexit
import hmac
import os
import re
import secrets
import stat
import threading
import time
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import blake3
import numpy as np

SHM_DIR = Path("/dev/shm")
PREFIX = "fpkv-"
GET_TAG = "get-"  # in the names of the segments a server hands to its SHM Gets (never a Put's to take)
PUT_TAG = "put-"  # in the names of the segments a client writes for its SHM Puts (fpkv-<pid>-put-<owner>-<hex>)
SHM_OWNER_HEADER = "x-flashpd-shm-owner"  # a Put's metadata: the hex key of the SegmentOwner that wrote its segments
OWNER_KEY_BYTES = 32
OWNER_ID_HEX = 32  # the owner id in a Put segment's name: 128 bits of a keyed hash of the owner's key
_OWNER_CONTEXT = "flashpd 2025 kv-bridge shm Put segment owner id v1"
_NAME_RE = re.compile(r"fpkv-[A-Za-z0-9_-]{1,120}")
_HANDED_OUT_RE = re.compile(rf"fpkv-[0-9]+-{GET_TAG}.*", re.DOTALL)
# pids stay below 2**22 on Linux; group 2 is the writer's owner id (SegmentOwner)
_PUT_RE = re.compile(rf"fpkv-([1-9][0-9]{{0,6}})-{PUT_TAG}([0-9a-f]{{{OWNER_ID_HEX}}})-[0-9a-f]{{32}}")
PUT_LEFTOVER_GRACE_S = 30.0  # a Put segment the server did not take, of a writer that is gone, goes after this
MAX_PUT_LEFTOVERS = 4096  # such segments a server keeps track of (past it, the oldest are left to the start sweep)
DEFAULT_PEER_SHARE = 4  # a peer may hold 1/4 of a ledger's bytes untaken
OVER_SHARE_TTL_S = 2.0  # a finished call's untaken segments expire after this while a Get waits for room
MAX_ROOM_WAITERS = 8  # Gets that may wait for room at once (SegmentLedger.reserve); more are refused at once
_SWEEP_EVERY_S = 0.1  # how often a Get waiting for room sweeps expired segments
PRUNE_EVERY_S = 0.05  # how often a ledger stats its untaken segments to forget those taken (SegmentLedger._prune)


class ShmError(OSError):
    """A handle that is malformed, missing or not the announced length."""


class NotOwned(ShmError):
    """A Put handle naming a segment whose name does not carry the caller's owner id: never opened nor unlinked."""


class SegmentOwner:
    """A Put writer's secret key, and the owner id (a keyed hash of it) that the names of its segments carry.

    Why: every client holds the cluster's token and can list /dev/shm, so a segment's name alone would let one
    client make the bridge take (read and unlink) another's segment, refusing the victim's Put. The key travels
    only in the writer's own Put calls (SHM_OWNER_HEADER) and the id does not reveal it, so only its writer can
    name a segment that `owns` accepts. One per BridgeClient: its retries may name its earlier segments."""

    __slots__ = ("_key", "_id")

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, (bytes, bytearray)) or len(key) != OWNER_KEY_BYTES:
            raise ValueError(f"a segment owner key is {OWNER_KEY_BYTES} bytes")
        self._key = bytes(key)
        self._id = blake3.blake3(self._key, derive_key_context=_OWNER_CONTEXT).hexdigest(OWNER_ID_HEX // 2)

    @classmethod
    def generate(cls) -> "SegmentOwner":
        return cls(secrets.token_bytes(OWNER_KEY_BYTES))

    @classmethod
    def from_metadata(cls, metadata: Sequence[tuple[str, str | bytes]] | None) -> "SegmentOwner | None":
        """The owner a call's metadata presents (SHM_OWNER_HEADER: 64 hex digits); None when absent or malformed."""
        for k, v in metadata or ():
            if k == SHM_OWNER_HEADER:
                try:
                    return cls(bytes.fromhex(v.decode("ascii") if isinstance(v, bytes) else v))
                except (ValueError, UnicodeDecodeError):
                    return None
        return None

    def metadata(self) -> tuple[str, str]:
        """The metadata entry a Put naming this owner's segments carries (never log a call's metadata)."""
        return SHM_OWNER_HEADER, self._key.hex()

    @property
    def put_tag(self) -> str:
        """The write_segment tag of this owner's Put segments: fpkv-<pid>-put-<owner id>-<hex>."""
        return f"{PUT_TAG}{self._id}-"

    def owns(self, name: str) -> bool:
        """Whether `name` is a Put segment's name carrying this owner's id (a check of the string alone)."""
        m = _PUT_RE.fullmatch(name)
        return m is not None and hmac.compare_digest(m.group(2), self._id)

    def __repr__(self) -> str:
        return f"SegmentOwner(id={self._id})"

    __str__ = __repr__


class NoRoom(Exception):
    """A segment the ledger refuses at once: the requesting peer already holds its share untaken."""


class TooManyWaiting(NoRoom):
    """MAX_ROOM_WAITERS Gets wait for room already: this one is refused at once, not queued on a server thread."""


def available() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def write_all(fd: int, data: bytes | memoryview) -> None:
    """os.write until every byte is down (a single write may be short)."""
    with memoryview(data) as view:
        written = 0
        while written < len(view):
            written += os.write(fd, view[written:])


def valid_name(name: str) -> bool:
    return _NAME_RE.fullmatch(name) is not None


def handed_out(name: str) -> bool:
    """Whether name is a segment some server wrote for an SHM Get (its reader's to take, nobody else's)."""
    return _HANDED_OUT_RE.fullmatch(name) is not None


def put_writer(name: str) -> int | None:
    """The pid of the process that wrote a Put segment, as its name says (None: not a Put segment's name)."""
    m = _PUT_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def process_exists(pid: int) -> bool:
    """Whether a process `pid` exists on this host (of any user: EPERM means it does)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: no pid is that large
        return False
    except PermissionError:
        return True
    return True


def segment_name(tag: str = "") -> str:
    """A new segment's name: this process's pid, the tag, 128 random bits."""
    return f"{PREFIX}{os.getpid()}-{tag}{uuid.uuid4().hex}"


def write_segment(data: bytes | list[bytes | memoryview], tag: str = "") -> str:
    """Create a new segment holding data (or its parts, in order); returns its name (the caller or its
    peer unlinks it). tag: GET_TAG for a server's Get segments, SegmentOwner.put_tag for a client's Put
    segments (a bridge takes a Put's segment only from the owner its name carries)."""
    name = segment_name(tag)
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


def take_segment(name: str, length: int, writable: bool = False, into: np.ndarray | None = None) -> bytes | memoryview:
    """Read the segment's bytes and unlink it. writable: into a buffer the caller owns (an importer's, see
    KVChunk.from_bytes(own=True)), a view of numpy's memory (huge pages where the kernel offers them: a fresh
    bytearray's 4 KiB page faults made the read 3x slower), else immutable bytes. into: a buffer of `length`
    bytes to read into (a store's reserved slot), returned as a view.

    The name is a peer's, who may name a file that is not its own to hand over: only a regular file of
    this process's user is read (a FIFO would block the open forever, a link could point anywhere), and a
    segment that fails any check (or a read) is left where it is, for its owner or a TTL sweep to remove,
    never unlinked on a peer's word. It is read with read(2), not mapped, so a peer that shrinks the file
    meanwhile gives a short read (ShmError) rather than a SIGBUS that kills this process."""
    if not valid_name(name):
        raise ShmError(f"shm.name {name!r} is not a bridge segment name")
    path = SHM_DIR / name
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError as e:
        raise ShmError(f"shm segment {name} does not exist") from e
    except OSError as e:  # ELOOP: a symbolic link
        raise ShmError(f"shm segment {name} cannot be opened: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ShmError(f"shm segment {name} is not a regular file")
        if st.st_uid != os.geteuid():
            raise ShmError(f"shm segment {name} belongs to another user")
        if st.st_size != length or length == 0:
            raise ShmError(f"shm segment {name} holds {st.st_size} bytes, handle says {length}")
        data = _read_exactly(fd, name, length, writable, into)
    finally:
        os.close(fd)
    retire(name, length)
    return data


def _read_exactly(fd: int, name: str, length: int, writable: bool, into: np.ndarray | None = None) -> bytes | memoryview:
    if into is not None and len(into) != length:
        raise ValueError(f"a buffer of {len(into)} bytes for a segment of {length}")
    if writable or into is not None:  # not zeroed: every byte is read into it before it is returned
        view, got = memoryview(into if into is not None else np.empty(length, dtype=np.uint8)), 0
        while got < length:
            n = os.readv(fd, [view[got:]])
            if n == 0:
                raise ShmError(f"shm segment {name} shrank to {got} of {length} bytes while read")
            got += n
        return view
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


def unlink_segment(name: str) -> bool:
    """Remove a segment if it is there and ours to remove (another user's file in /dev/shm is not: left alone).
    True when this call removed it."""
    if valid_name(name):
        try:
            os.unlink(SHM_DIR / name)
            return True
        except OSError:  # gone already, or not this process's to unlink
            pass
    return False


GONE_PREFIX = ".fpkv-gone-"  # a taken segment, renamed for the reaper: fpkv-<pid>-... names never match it
_GONE_RE = re.compile(rf"{re.escape(GONE_PREFIX)}[0-9]{{1,7}}-[0-9a-f]{{32}}")
# retired files queued at most, and their bytes; past either a take unlinks its own (the tmpfs stays bounded)
MAX_REAP_BACKLOG = 64
MAX_REAP_BACKLOG_BYTES = 1 << 30
_reap_lock = threading.Lock()
_reap_wake = threading.Condition(_reap_lock)
_reap_queue: list[tuple[str, int]] = []
_reaping = 0  # queued or being unlinked now
_reaping_bytes = 0
_reaper: threading.Thread | None = None


def retire(name: str, nbytes: int = 0) -> None:
    """Remove a taken segment (of nbytes) from under its name now, and free its pages later, on a thread of its own.
    Unlinking a 43 MB tmpfs file frees its pages (6 ms on the CPU machine, a third of a bridge's work a Put chunk:
    py-spy), on the path of the call that took it; a rename frees none (0.05 ms). The renamed file (GONE_PREFIX) is
    garbage: this process's reaper unlinks it, or a bridge's sweep (`sweep_retired`) first, whichever comes."""
    global _reaper, _reaping, _reaping_bytes
    if not valid_name(name):
        return
    gone = f"{GONE_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
    with _reap_lock:
        backlog = _reaping >= MAX_REAP_BACKLOG or _reaping_bytes + nbytes > MAX_REAP_BACKLOG_BYTES
    if backlog:  # the reaper is behind: this one is unlinked here, as before
        unlink_segment(name)
        return
    try:
        os.rename(SHM_DIR / name, SHM_DIR / gone)
    except OSError:  # gone already (its writer's cleanup), or not this process's to move: unlink as before
        unlink_segment(name)
        return
    with _reap_lock:
        _reap_queue.append((gone, nbytes))
        _reaping += 1
        _reaping_bytes += nbytes
        try:
            if _reaper is None or not _reaper.is_alive():
                _reaper = threading.Thread(target=_reap, name="shm-reaper", daemon=True)
                _reaper.start()
        except RuntimeError:  # no thread to be had (a thread limit, the interpreter exiting): unlinked here
            _reaper = None
            _reap_queue.remove((gone, nbytes))
            _reaping -= 1
            _reaping_bytes -= nbytes
            unlink_now = True
        else:
            unlink_now = False
            _reap_wake.notify()
    if unlink_now:
        try:
            os.unlink(SHM_DIR / gone)
        except OSError:
            pass


def _reap() -> None:
    global _reaping, _reaping_bytes
    while True:
        with _reap_lock:
            while not _reap_queue:
                _reap_wake.wait()
            gone, nbytes = _reap_queue.pop(0)
        try:
            os.unlink(SHM_DIR / gone)
        except OSError:
            pass
        with _reap_lock:
            _reaping -= 1
            _reaping_bytes -= nbytes


def reap_pending() -> int:
    """Retired segments this process has not unlinked yet (queued, or being unlinked)."""
    with _reap_lock:
        return _reaping


def drain_reaper(timeout_s: float = 5.0) -> bool:
    """Wait until this process's reaper has unlinked every segment it retired (at exit; tests); False on timeout."""
    deadline = time.monotonic() + timeout_s
    while reap_pending():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def sweep_retired() -> int:
    """Unlink every retired segment of this user (GONE_PREFIX names) that is a regular file; how many. A retired
    file is garbage by construction: whoever renamed it had taken its bytes. One whose process is alive is in its
    reaper's queue, whose own unlink then finds it gone. Run at a bridge's start and with its periodic sweeps, so
    a reader or client that died before its reaper leaks nothing for long."""
    n = 0
    if not SHM_DIR.is_dir():
        return 0
    for p in SHM_DIR.iterdir():
        if _GONE_RE.fullmatch(p.name) is None:
            continue
        try:
            st = p.lstat()
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                p.unlink()
                n += 1
        except OSError:
            pass
    return n


def _after_fork_in_child() -> None:
    """A forked child has no reaper thread: it starts with an empty queue and locks of its own."""
    global _reap_lock, _reap_wake, _reap_queue, _reaping, _reaping_bytes, _reaper
    _reap_lock = threading.Lock()
    _reap_wake = threading.Condition(_reap_lock)
    _reap_queue, _reaping, _reaping_bytes, _reaper = [], 0, 0, None


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(drain_reaper, 2.0)


def list_segments(pid: int | None = None, tag: str = "") -> list[str]:
    """Bridge segments present now (of one process when pid is given, of its `tag` ones when that is
    given too): for leak checks."""
    if not SHM_DIR.is_dir():
        return []
    prefix = PREFIX if pid is None else f"{PREFIX}{pid}-{tag}"
    return sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith(prefix))


_WRITER_RE = re.compile(rf"{PREFIX}([1-9][0-9]{{0,9}})-")


def sweep_dead_writers(grace_s: float = PUT_LEFTOVER_GRACE_S) -> int:
    """Unlink this user's segments whose writer (the pid in the name: a Get's bridge, a Put's or a pool's client) is
    gone and which were last written grace_s ago or more; how many. Nobody can take them any more: a bridge that
    died left its Get segments (a restart's age sweep spared those under SHM_SWEEP_AGE_S), a client killed mid-Put
    the segments it wrote ahead of the frames the bridge read. One PID namespace is assumed, as same-host transfer
    through /dev/shm has (see PutLeftovers); a pid reused meanwhile keeps its segments for the age sweep."""
    now = time.time()
    n = 0
    for name in list_segments():
        m = _WRITER_RE.match(name)
        if m is None or int(m.group(1)) == os.getpid() or process_exists(int(m.group(1))):
            continue
        st = _own_file(name)
        if st is not None and now - st.st_mtime >= grace_s:
            n += unlink_segment(name)  # counted only if this call removed it (another sweep may have first)
    return n


def sweep_segments(max_age_s: float, pid: int | None = None, tag: str = "") -> int:
    """Unlink bridge segments (of one process when pid is given, of its `tag` ones when that is given
    too) older than max_age_s: their reader died or walked away before taking them."""
    now = time.time()
    n = 0
    for name in list_segments(pid, tag):
        try:
            if now - (SHM_DIR / name).stat().st_mtime > max_age_s:
                n += unlink_segment(name)  # a waiting Get's ledger may have expired it meanwhile (counted there)
        except FileNotFoundError:
            pass
    return n


class _Out(NamedTuple):
    """One untaken segment (or reservation): its bytes, whose Get made it, and when it was bound."""
    n: int
    peer: str
    call: str
    since: float
    done: bool = False  # its call has finished: its reader has had every handle


class SegmentLedger:
    """The segments a server handed out that their readers have not taken yet, bounded in bytes.

    A reader takes (unlinks) a segment as soon as its handle arrives; one that does not (a client that
    never reads, or asks for the same bytes over and over) would otherwise fill the host's memory with
    files only a later TTL sweep removes. `reserve` admits a new segment while the untaken ones and the
    new one fit in max_bytes (one segment alone always fits), waiting up to wait_s for readers to take
    theirs.

    One peer must not starve the others, so each may hold peer_max_bytes untaken (one segment alone
    always fits): a Get whose peer is past that with segments of its finished calls is refused at once
    (NoRoom: waiting would not help), one whose own stream's reader lags waits for it. While a Get waits
    for room, segments of finished calls untaken for OVER_SHARE_TTL_S expire, oldest first: those beyond their
    peer's share, then any while the total has no room. A peer is a connection, and a client may open several
    (BridgeClient opens 4): each at its share filled the total for good, and every other client's Gets waited
    out SHM_ROOM_WAIT_S and failed. A reader takes its segments milliseconds after their handles arrive. At most
    MAX_ROOM_WAITERS Gets wait at once (each holds a server thread); another is refused at once (NoRoom)."""

    def __init__(self, max_bytes: int, peer_max_bytes: int | None = None) -> None:
        self.max_bytes = max_bytes
        self.peer_max_bytes = max(1, max_bytes // DEFAULT_PEER_SHARE) if peer_max_bytes is None else peer_max_bytes
        self._lock = threading.Lock()
        self._out: dict[str, _Out] = {}  # segment name, or a reservation's "?" ticket
        # running sums of _out's bytes (all; by peer; by peer, of finished calls): a reservation costs O(1), not a
        # sum over every untaken segment (a client that left 3,000 small ones made its own Get O(n^2): 17 s of CPU)
        self._total = 0
        self._held: dict[str, int] = {}
        self._stale: dict[str, int] = {}
        self._pruned = 0.0  # when _prune last looked at the files (monotonic)
        self._expired = 0.0  # when _expire_for last sorted the untaken segments (monotonic)
        self._waiting = 0  # Gets in reserve's wait
        self.expired = 0  # segments _expire_for unlinked (a stat: the server adds them to its TTL sweep's count)

    def _add(self, name: str, o: _Out) -> None:
        self._out[name] = o
        self._total += o.n
        self._held[o.peer] = self._held.get(o.peer, 0) + o.n
        if o.done:
            self._stale[o.peer] = self._stale.get(o.peer, 0) + o.n

    def _drop(self, name: str) -> _Out | None:
        o = self._out.pop(name, None)
        if o is not None:
            self._total -= o.n
            _less(self._held, o.peer, o.n)
            if o.done:
                _less(self._stale, o.peer, o.n)
        return o

    def _prune(self, force: bool = False) -> None:
        """Forget segments their readers took (the file is gone): a stat of each, so at most every PRUNE_EVERY_S
        unless forced."""
        now = time.monotonic()
        if not force and now - self._pruned < PRUNE_EVERY_S:
            return
        self._pruned = now
        for name in [n for n in self._out if not n.startswith("?")]:
            if not (SHM_DIR / name).exists():
                self._drop(name)

    def outstanding(self) -> int:
        with self._lock:
            self._prune(force=True)
            return self._total

    def reserve(self, n: int, wait_s: float, active: Callable[[], bool], peer: str = "", call: str = "",
                sweep: Callable[[], object] | None = None) -> str | None:
        """A ticket for n bytes, or None when no room came within wait_s (or active() turned False).
        Raises NoRoom at once when the peer's finished calls hold its share. sweep: called now and then
        while waiting (a TTL sweep that may make room)."""
        deadline = time.monotonic() + wait_s
        next_sweep = time.monotonic() + _SWEEP_EVERY_S
        waiting = False
        try:
            while True:
                with self._lock:
                    self._prune()
                    if self._fits_now(n, peer):
                        ticket = f"?{uuid.uuid4().hex}"
                        self._add(ticket, _Out(n, peer, call, time.monotonic()))
                        return ticket
                    self._expire_for(peer, n)
                    if not waiting:
                        if self._waiting >= MAX_ROOM_WAITERS:
                            raise TooManyWaiting(f"{self._waiting} Gets are waiting for shared-memory room already; "
                                         f"try again or use INLINE")
                        self._waiting += 1
                        waiting = True
                now = time.monotonic()
                if now > deadline or not active():
                    return None
                if sweep is not None and now >= next_sweep:
                    sweep()
                    next_sweep = now + _SWEEP_EVERY_S
                time.sleep(0.002)
        finally:
            if waiting:
                with self._lock:
                    self._waiting -= 1

    def _fits_now(self, n: int, peer: str) -> bool:
        """_fits, the files looked at again before a no (or a NoRoom): segments taken since the last _prune must
        not count against their reader."""
        try:
            if self._fits(n, peer):
                return True
        except NoRoom:
            pass
        self._prune(force=True)
        return self._fits(n, peer)

    def _fits(self, n: int, peer: str) -> bool:
        held, stale = self._held.get(peer, 0), self._stale.get(peer, 0)
        if stale and stale + n > self.peer_max_bytes:
            raise NoRoom(f"this client holds {stale} bytes of shared-memory segments it never took "
                         f"(its share is {self.peer_max_bytes}); take them or use INLINE")
        if held and held + n > self.peer_max_bytes:
            return False
        return not self._out or self._total + n <= self.max_bytes

    def _expire_for(self, waiting: str, n: int) -> None:
        """Unlink other peers' segments of finished calls untaken for OVER_SHARE_TTL_S, oldest first: those of a
        peer past its share, then, while the total has no room for n, any (a sort of every untaken segment: at most
        every PRUNE_EVERY_S)."""
        now = time.monotonic()
        if now - self._expired < PRUNE_EVERY_S:
            return
        self._expired = now
        old = [(name, o) for name, o in sorted(self._out.items(), key=lambda kv: kv[1].since)
               if o.peer != waiting and o.done and now - o.since > OVER_SHARE_TTL_S and not name.startswith("?")]
        for name, o in old:
            if self._held.get(o.peer, 0) > self.peer_max_bytes:
                self._expire(name)
        for name, o in old:
            if self._total + n <= self.max_bytes:
                break
            if name in self._out:
                self._expire(name)

    def _expire(self, name: str) -> None:
        self.expired += unlink_segment(name)  # False: its reader (or the TTL sweep) took it first
        self._drop(name)

    def bind(self, ticket: str, name: str | None) -> None:
        """The ticket's segment was written as `name` (None: it was not)."""
        with self._lock:
            o = self._drop(ticket)
            if o is not None and name is not None:
                self._add(name, o._replace(since=time.monotonic()))

    def finish(self, call: str) -> None:
        """The Get `call` has ended: its untaken segments are its peer's to take, no longer in flight."""
        with self._lock:
            for name in [k for k, o in self._out.items() if o.call == call and not o.done]:
                o = self._drop(name)
                self._add(name, o._replace(done=True))


def _less(sums: dict[str, int], peer: str, n: int) -> None:
    """sums[peer] -= n, the peer gone from sums at 0 (a zero-byte entry may outlive its peer's sum: no KeyError)."""
    left = sums.get(peer, 0) - n
    if left:
        sums[peer] = left
    else:
        sums.pop(peer, None)


class _Seen(NamedTuple):
    """A Put segment a server did not take: the file it was (device, inode) and when it was last seen so."""
    dev: int
    ino: int
    since: float


class PutLeftovers:
    """The Put segments a server was handed and did not take (a handle it refused: wrong length, a stream that
    ended at it), which it unlinks itself once no one can use them, so that a client that dies leaks none.

    Until then such a segment is its writer's: BridgeClient unlinks its own after every Put, and a client may send
    it again. The rule: a segment is unlinked when its name is a Put segment's (fpkv-<pid>-put-<owner>-<hex>,
    SegmentOwner.put_tag), the process <pid> that wrote it no longer exists, PUT_LEFTOVER_GRACE_S have passed since
    a Put last named it, and the file is still the one seen then (a regular file of this user, same device and
    inode). Whoever names a segment, only its writer's death frees it: a client cannot make the server unlink a live
    client's segment (one in use for a retry), a Get's (get- names never match), another user's file, or a file that
    replaced the one seen. The pid must name the same process to the writer and the server (one PID namespace, as
    same-host transfer through /dev/shm has here); a pid reused by then keeps the segment, for the start sweep. At
    most MAX_PUT_LEFTOVERS are kept, the least recently seen forgotten first (left in place). A server notes only
    segments whose owner id matched the Put naming them (SegmentOwner)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: OrderedDict[str, _Seen] = OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._seen)

    def note(self, name: str) -> bool:
        """A Put named `name` and the server did not take it: kept (True) when it is a Put segment's name and a
        regular file of this user is there now."""
        if put_writer(name) is None:
            return False
        st = _own_file(name)
        if st is None:
            return False
        with self._lock:
            self._seen.pop(name, None)
            self._seen[name] = _Seen(st.st_dev, st.st_ino, time.monotonic())
            while len(self._seen) > MAX_PUT_LEFTOVERS:
                self._seen.popitem(last=False)
        return True

    def reclaim(self) -> int:
        """Unlink the kept segments the rule frees (see the class doc), forget those gone or replaced; returns
        how many were unlinked."""
        now = time.monotonic()
        n = 0
        with self._lock:
            for name, seen in list(self._seen.items()):
                st = _own_file(name)
                if st is None or (st.st_dev, st.st_ino) != (seen.dev, seen.ino):
                    del self._seen[name]  # taken, unlinked by its writer, or another file now: not what was seen
                elif now - seen.since >= PUT_LEFTOVER_GRACE_S and not process_exists(put_writer(name)):
                    n += unlink_segment(name)
                    del self._seen[name]
        return n


def _own_file(name: str) -> os.stat_result | None:
    """The segment's stat when it is a regular file of this process's user (not followed if a link), else None."""
    try:
        st = os.lstat(SHM_DIR / name)
    except OSError:
        return None
    return st if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() else None
