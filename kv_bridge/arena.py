"""Same-host prefix hits without copying the bytes: a bridge's entries in one shared-memory arena its readers map.

Why: through segments (shm.py) a hit copies each chunk twice, the server into a fresh /dev/shm file and the reader
out of it, both into fresh pages; at the Qwen3-8B shape that made a hit slower than computing the prompt again
(docs/results.md). Here the server copies a chunk once, when it is put, into a slot of one memfd; a Get sends
where the entry lies, and the reader reads it in place from a mapping it made once.

Safety:
- The memfd is sealed against shrinking and growing before anyone maps it, and a reader maps it only when those
  seals are on (checked on the file it opened): no access through the mapping can fault past the end (SIGBUS).
- It is sealed against future writes too, once the server has mapped it: only that one mapping, in the bridge's
  process, can change an entry; a write(2) or a writable mapping by any other process is refused by the kernel,
  so a reader's verified bytes cannot be changed by another client between its MAC check and its copy.
- A reader opens the arena as /proc/<server pid>/fd/<fd>, read-only, and maps it only when it is a regular file of
  this user with the inode and size the handle names (a reused descriptor number names another file: refused).
- A live entry is never rewritten (the store's first put wins). An evicted entry's slot is reused only once the
  hold of its last hand-out has passed (`hold_s`, counted from the Get), and its generation word (one 32-bit word a
  page, after the slots) is bumped before it can be. The reader trusts a handle for READER_MARGIN_S less than its
  hold, from when it arrived (no clock is shared), and while the word still reads what the handle said; it checks
  both after it copied the bytes out (KVChunk.fresh(), chunk.Lease): bytes of a reused slot are never used
  silently; those positions are computed instead.
- The reader verifies each chunk's MAC over the mapped bytes, as every other transport does.

Page-locking (a reader whose restores copy to a GPU, `ArenaMaps(pinner=CudaPinner())`): a host -> device copy out
of pageable memory goes through the driver's staging buffers; out of page-locked memory it is one DMA at the link's
rate. The reader registers each arena it maps with CUDA once, read-only, on a thread of its own (a restore never
waits for it: until it is done copies are pageable, as before; a failure is logged once and changes nothing else).
Registering commits every page of the arena (the bridge's memory tier, which it would fill under load anyway).
A mapping dropped is unregistered, then unmapped, once no chunk or word views it any more.
"""
from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
import queue
import stat
import sys
import threading
import time
import weakref
from bisect import insort
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from flashpd.kv_bridge.shm import process_exists

log = logging.getLogger(__name__)

PAGE = 4096
# An evicted slot read is not reused for HOLD_S after its last read: long enough for a reader to copy a chunk out
# (a restore does within milliseconds), short because held slots are room the store cannot use (its slack), and
# every read of an entry that is later evicted holds it: under churn, held bytes ~ eviction rate x HOLD_S. The
# generation word, not the hold, is what keeps a late reader from using a reused slot; the hold spares readers
# needless recomputes.
HOLD_S = 2.0
READER_MARGIN_S = 0.5  # a reader trusts a handle for hold - this, from when it arrived
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)  # Linux 5.1; Python 3.11's fcntl lacks the name
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE if hasattr(fcntl, "F_SEAL_SHRINK") else 0
MAX_MAPPED = 4  # arenas a reader keeps mapped (a bridge that restarts hands out a new one)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14; Python 3.11's mmap lacks the name
POPULATE_STEP = 16 << 20  # bytes a populate call faults in at a time (the arena is not held longer than that)


class ArenaError(OSError):
    """A handle that names no usable arena, or a range outside it."""


def available() -> bool:
    """Whether this host can make and map sealed arenas (Linux: memfd_create and file seals)."""
    return hasattr(os, "memfd_create") and bool(_SEALS) and os.path.isdir("/proc/self/fd")


def _round_up(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


@dataclass(frozen=True, slots=True)
class ArenaRef:
    """Where a reader finds an arena: the server's pid and descriptor, and the file's inode and size."""
    pid: int
    fd: int
    inode: int
    size: int


class Arena:
    """One sealed memfd: `capacity` bytes of page-aligned slots cut by first fit (pages come as they are first
    written), then a generation word for each page; a freed slot is held until its hold time has passed, and the
    word of its first page is bumped as it becomes free for reuse. Thread-safe."""

    def __init__(self, capacity: int) -> None:
        if not available():
            raise ArenaError("a shared-memory arena needs Linux memfd_create and file seals")
        self.data_size = _round_up(max(capacity, PAGE))
        self.size = self.data_size + _round_up(self.data_size // PAGE * 4)
        fd = os.memfd_create("fpkv-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, self.size)
            self._map = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            try:
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS | fcntl.F_SEAL_SEAL)  # this mapping stays the only writer
            except OSError as e:
                raise ArenaError(f"this kernel cannot seal a memfd against shrinking, growing and future writes "
                                 f"(Linux 5.1 or later): {e.strerror}") from e
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.ref = ArenaRef(os.getpid(), fd, os.fstat(fd).st_ino, self.size)
        self._closer = weakref.finalize(self, os.close, fd)  # the descriptor goes with the arena, or at close()
        self._array = np.frombuffer(self._map, dtype=np.uint8, count=self.data_size)
        self._gen = np.frombuffer(self._map, dtype=np.uint32, count=self.data_size // PAGE, offset=self.data_size)
        self.populated = 0  # bytes of the data region faulted in ahead of use (populate)
        self._free: list[tuple[int, int]] = [(0, self.data_size)]  # (offset, length), sorted, coalesced
        self._held: list[tuple[float, int, int]] = []  # (until, offset, length): freed, not reusable yet
        self._lock = threading.Lock()

    def close(self) -> None:
        """Close the descriptor readers open the arena through (mappings made stay valid: the pages live on while
        any view of them does)."""
        self._closer()

    def populate_async(self) -> threading.Thread:
        """Fault the data region's pages in ahead of use, on a thread of its own, without changing a byte
        (MADV_POPULATE_WRITE, a step at a time; the arena is referenced only during a step). A fresh page's
        first write costs a fault, an allocation and zeroing: receiving a chunk into fresh slots ran at a fifth
        of the rate into slots written before (docs/results.md). That cost is paid once, here, rather than by
        the first puts into each slot; it commits the arena's memory (its budget and slack) from the start."""
        t = threading.Thread(target=_populate, args=(weakref.ref(self),), name="arena-populate", daemon=True)
        t.start()
        return t

    def alloc(self, n: int) -> int | None:
        """The offset of a free slot of n bytes (rounded up to pages), or None when none is free now."""
        need = _round_up(n)
        with self._lock:
            self._release_expired()
            for i, (off, length) in enumerate(self._free):
                if length >= need:
                    if length == need:
                        del self._free[i]
                    else:
                        self._free[i] = (off + need, length - need)
                    return off
        return None

    def fits(self, n: int) -> bool:
        """Whether a free slot of n bytes exists now (alloc would find one)."""
        need = _round_up(n)
        with self._lock:
            self._release_expired()
            return any(length >= need for _, length in self._free)

    def free(self, offset: int, n: int, hold_until: float = 0.0) -> None:
        """Give a slot back; it is reused only after `hold_until` (time.monotonic)."""
        with self._lock:
            if hold_until > time.monotonic():
                self._held.append((hold_until, offset, _round_up(n)))
            else:
                self._give(offset, _round_up(n))

    def held_bytes(self) -> int:
        with self._lock:
            self._release_expired()
            return sum(n for _, _, n in self._held)

    def _release_expired(self) -> None:
        now = time.monotonic()
        if any(until <= now for until, _, _ in self._held):
            keep = []
            for until, off, n in self._held:
                if until <= now:
                    self._give(off, n)
                else:
                    keep.append((until, off, n))
            self._held = keep

    def generation(self, offset: int) -> tuple[int, int]:
        """The slot at offset's generation word: where it lies in the arena, and what it reads now."""
        return self.data_size + 4 * (offset // PAGE), int(self._gen[offset // PAGE])

    def word(self, gen_offset: int) -> np.ndarray:
        """A one-element uint32 view of the generation word at gen_offset (as generation() gave it)."""
        return np.frombuffer(self._map, dtype=np.uint32, count=1, offset=gen_offset)

    def _give(self, offset: int, n: int) -> None:
        self._gen[offset // PAGE] += 1  # before any part of the slot can be handed out again
        insort(self._free, (offset, n))
        merged: list[tuple[int, int]] = []
        for off, length in self._free:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((off, length))
        self._free = merged

    def buffer(self, offset: int, n: int) -> np.ndarray:
        """A writable array over the slot at offset (for a receiver to fill before the slot is put)."""
        return np.frombuffer(self._map, dtype=np.uint8, count=n, offset=offset)

    def write(self, offset: int, data: bytes | memoryview) -> memoryview:
        """Copy data into the slot at offset; returns a read-only view of it there."""
        n = len(data)
        self._array[offset:offset + n] = np.frombuffer(data, dtype=np.uint8)
        return memoryview(self._map)[offset:offset + n].toreadonly()


def _populate(ref: "weakref.ref[Arena]") -> None:
    """populate_async's thread. madvise through ctypes, which lets go of the interpreter lock for the call (mmap's
    own madvise holds it: the bridge's request threads would stall for each step)."""
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    off = 0
    while True:
        a = ref()  # held for one step: the mapping stays valid under the call
        if a is None or off >= a.data_size:
            return
        n = min(POPULATE_STEP, a.data_size - off)
        if madvise(a._array.ctypes.data + off, n, MADV_POPULATE_WRITE) != 0:
            # a kernel before 5.14 (EINVAL), or memory short: slots fault as puts first write them
            log.warning("the arena's pages could not be faulted in ahead of use: %s", os.strerror(ctypes.get_errno()))
            return
        a.populated = off = off + n
        del a


class HostPinner(Protocol):
    """Page-locks a range of this process's memory for a device's copies (CudaPinner), and undoes it."""

    def register(self, addr: int, n: int) -> None: ...  # raises OSError (ArenaError) when it cannot

    def unregister(self, addr: int) -> None: ...


class CudaPinner:
    """cudaHostRegister, read-only (the arena is mapped read-only) and portable (every device's context sees it),
    from the engine's device's context (a new thread's current device is 0: registering there would make a context
    on a GPU the worker does not use). Called on ArenaMaps' pinning thread only: a failed CUDA runtime call leaves
    that thread's last-error state set, and no kernel is launched there that would pick it up."""

    FLAGS = 1 | 8  # cudaHostRegisterPortable | cudaHostRegisterReadOnly

    def __init__(self, device: object = None) -> None:
        import torch  # noqa: PLC0415  (a reader that copies to a GPU has torch)

        if not torch.cuda.is_available():
            raise ArenaError("page-locking an arena for a GPU needs CUDA")
        self._torch = torch
        self._rt = torch.cuda.cudart()
        d = torch.device(device) if device is not None else None
        self._index = d.index if d is not None and d.index is not None else torch.cuda.current_device()
        self._thread: int | None = None  # the thread whose current device was set

    def register(self, addr: int, n: int) -> None:
        if self._thread != threading.get_ident():
            self._torch.cuda.set_device(self._index)
            self._thread = threading.get_ident()
        e = self._rt.cudaHostRegister(addr, n, self.FLAGS)
        if int(e) != 0:
            raise ArenaError(f"cudaHostRegister of {n} bytes (read-only) failed: {e}")

    def unregister(self, addr: int) -> None:
        e = self._rt.cudaHostUnregister(addr)
        if int(e) != 0:
            raise ArenaError(f"cudaHostUnregister failed: {e}")


class _Mapped:
    """One mapped arena: the mapping, and whether it is page-locked (set by the pinning thread only)."""

    __slots__ = ("mm", "addr", "pinned", "_refs")

    def __init__(self, mm: mmap.mmap) -> None:
        self.mm = mm
        a = np.frombuffer(mm, dtype=np.uint8)  # only for the address: dropped at once, so it holds no export
        self.addr = int(a.ctypes.data)
        del a
        self.pinned = False
        self._refs = 0

    def _count(self) -> int:
        return sys.getrefcount(self.mm)

    def settle(self) -> None:
        """Take the reference count of the mapping with no view made yet: called once constructed, where the
        caller holds it only through this object (a count taken inside __init__ would include its argument)."""
        self._refs = self._count()

    def viewed(self) -> bool:
        """Whether any view of the mapping is alive: each memoryview or array made from it holds a reference to
        the mapping (one more than `settle` counted). No new view is made once it is dropped."""
        return self._count() > self._refs


# Page-locked mappings, held here from their registration until they are unregistered: no collection can unmap
# one that is still registered (an ArenaMaps dropped or closed while a view was alive, an unregister that failed).
_REGISTERED: set[_Mapped] = set()
_REGISTERED_LOCK = threading.Lock()
TICK_S = 1.0  # how often the pinning thread looks for dropped mappings whose last view has gone


class ArenaMaps:
    """A reader's read-only mappings of the arenas its bridges hand out, made on first use, the MAX_MAPPED most
    recently used kept. A mapping dropped is unmapped (unregistered first, when pinned) once no chunk views it any
    more. pinner: page-lock each mapping (the module's docstring)."""

    def __init__(self, pinner: HostPinner | None = None) -> None:
        self._lock = threading.Lock()
        self._maps: OrderedDict[ArenaRef, _Mapped] = OrderedDict()
        self._dropped: list[_Mapped] = []  # out of _maps, not yet unmapped: some view of it may be alive
        self._pinner = pinner
        self._jobs: queue.SimpleQueue[Callable[[], None]] | None = None
        self._closed = False
        self._pin_failed = 0
        self._warned = False

    def view(self, ref: ArenaRef, offset: int, length: int) -> memoryview:
        """A read-only view of length bytes at offset in the arena ref names; ArenaError when unusable."""
        if not 0 < length <= ref.size or not 0 <= offset <= ref.size - length:
            raise ArenaError(f"arena range {offset}+{length} is outside its {ref.size} bytes")
        return self._made(ref, lambda mm: memoryview(mm)[offset:offset + length].toreadonly())

    def word(self, ref: ArenaRef, offset: int) -> np.ndarray:
        """A one-element uint32 view of the arena's word at offset (a slot's generation word)."""
        if offset % 4 or not 0 <= offset <= ref.size - 4:
            raise ArenaError(f"arena word at {offset} is not an aligned word of its {ref.size} bytes")
        return self._made(ref, lambda mm: np.frombuffer(mm, dtype=np.uint32, count=1, offset=offset))

    def stats(self) -> dict:
        """Arenas mapped here, how many of them are page-locked or could not be, and dropped mappings some view
        still holds."""
        with self._lock:
            return {"mapped": len(self._maps), "pinned": sum(m.pinned for m in self._maps.values()),
                    "pin_failed": self._pin_failed, "dropped_viewed": len(self._dropped)}

    def close(self) -> None:
        """Drop every mapping: each is unmapped (unregistered first) once nothing views it, by the pinning thread,
        which stops once none is left."""
        with self._lock:
            self._closed = True
            self._dropped.extend(self._maps.values())
            self._maps.clear()
            self._reap()

    def _made(self, ref: ArenaRef, make: Callable[[mmap.mmap], object]):
        """make(mapping of ref's arena), under the lock: no reap can unmap it before the view exists."""
        with self._lock:
            m = self._mapping(ref)
            try:
                return make(m.mm)
            except (ValueError, BufferError) as e:
                raise ArenaError(f"arena of process {ref.pid} cannot be read: {e}") from e

    def _mapping(self, ref: ArenaRef) -> _Mapped:
        """Under the lock: the mapping of ref's arena, made on first use; the MAX_MAPPED most recently used kept."""
        if self._dropped:
            self._reap()
        m = self._maps.get(ref)
        if m is None:
            self._drop_dead()  # a new arena: often a restarted bridge's, whose old one nobody serves any more
            m = _Mapped(_map(ref))
            m.settle()
            self._maps[ref] = m
            while len(self._maps) > MAX_MAPPED:
                self._dropped.append(self._maps.popitem(last=False)[1])
            if self._pinner is not None:
                self._submit(lambda m=m: self._pin(m))
        self._maps.move_to_end(ref)
        return m

    def _drop_dead(self) -> None:
        """Under the lock: drop the mappings of arenas whose bridge process is gone. Each is a whole memory tier
        (budget and slack, committed), held in memory by this mapping alone once its bridge died: a client kept up
        to MAX_MAPPED - 1 of them, whatever their bridges' fate, until it closed."""
        for ref in [r for r in self._maps if not process_exists(r.pid)]:
            self._dropped.append(self._maps.pop(ref))
        if self._dropped:
            self._reap()

    def _reap(self) -> None:
        """Under the lock: unmap the dropped mappings nothing views any more (no view of them can be made now)."""
        keep = []
        for m in self._dropped:
            if m.viewed():
                keep.append(m)
            elif self._pinner is None:
                m.mm.close()
            else:  # on the pinning thread, after its registration if that is still queued: unregistered, unmapped
                self._submit(lambda m=m: self._release(m))
        self._dropped = keep

    def _submit(self, job: Callable[[], None]) -> None:
        """Under the lock: queue a job for the pinning thread, started on first use."""
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=ArenaMaps._run, args=(self._jobs, weakref.ref(self)), name="arena-pin",
                             daemon=True).start()
        self._jobs.put(job)

    @staticmethod
    def _run(jobs: "queue.SimpleQueue[Callable[[], None]]", maps_ref: "weakref.ref[ArenaMaps]") -> None:
        """The pinning thread: its jobs in order; every TICK_S without one, a reap. It ends once its ArenaMaps is
        gone, or closed with nothing left to unmap (registered mappings of a collected one stay in _REGISTERED)."""
        while True:
            try:
                job = jobs.get(timeout=TICK_S)
            except queue.Empty:
                maps = maps_ref()
                if maps is None:
                    return
                with maps._lock:
                    maps._drop_dead()
                    maps._reap()
                    if maps._closed and not maps._dropped and jobs.empty():
                        maps._jobs = None  # a later use starts another thread
                        return
                del maps
                continue
            try:
                job()
            except Exception:  # noqa: BLE001  one job's failure must not strand the ones queued after it
                log.exception("an arena page-locking job failed")

    def _pin(self, m: _Mapped) -> None:
        assert self._pinner is not None
        try:
            self._pinner.register(m.addr, len(m.mm))
        except OSError as e:
            with self._lock:
                self._pin_failed += 1
                warn, self._warned = not self._warned, True
            if warn:  # the copies stay pageable: slower, never wrong
                log.warning("an arena could not be page-locked for device copies (restores from it stay pageable): "
                            "%s", e)
            return
        with _REGISTERED_LOCK:
            _REGISTERED.add(m)
        m.pinned = True

    def _release(self, m: _Mapped) -> None:
        assert self._pinner is not None
        if m.pinned:
            try:
                self._pinner.unregister(m.addr)
            except OSError as e:  # left registered and mapped (held in _REGISTERED): unmapping it would be worse
                log.warning("an arena mapping could not be unregistered; it stays mapped: %s", e)
                return
            m.pinned = False
            with _REGISTERED_LOCK:
                _REGISTERED.discard(m)
        try:
            m.mm.close()
        except BufferError as e:  # a view made after the reap found none: cannot happen under the lock
            log.warning("a dropped arena mapping is still viewed; it goes with its last view: %s", e)


def _map(ref: ArenaRef) -> mmap.mmap:
    """Open the server's arena read-only and map it, once every check on the opened file has passed."""
    if ref.pid <= 0 or ref.fd < 0 or ref.size <= 0:
        raise ArenaError(f"arena handle {ref} is malformed")
    try:
        fd = os.open(f"/proc/{ref.pid}/fd/{ref.fd}", os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as e:
        raise ArenaError(f"arena of process {ref.pid} cannot be opened: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_ino != ref.inode or st.st_size != ref.size:
            raise ArenaError(f"process {ref.pid}'s descriptor {ref.fd} is not the arena the handle names")
        if st.st_uid != os.geteuid():
            raise ArenaError(f"arena of process {ref.pid} belongs to another user")
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as e:
            raise ArenaError(f"arena of process {ref.pid} is not a sealable memfd: {e.strerror}") from e
        if seals & _SEALS != _SEALS:
            raise ArenaError(f"arena of process {ref.pid} is not sealed against shrinking, growing and writes")
        try:
            return mmap.mmap(fd, ref.size, mmap.MAP_SHARED, mmap.PROT_READ)
        except OSError as e:  # out of address space, or a kernel that refuses the mapping
            raise ArenaError(f"arena of process {ref.pid} cannot be mapped: {e.strerror}") from e
    finally:
        os.close(fd)
