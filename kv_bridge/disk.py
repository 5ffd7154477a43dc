"""Disk tier (one file per chunk) and the memory-over-disk tiered store.

A file appears under its key's name only once it is complete: bytes go to a hidden temp file,
are fsynced, then hard-linked (or renamed) into place, so a crash mid-write leaves at most a
temp file that the next start deletes. The index is rebuilt by scanning the directory, so a
restarted process sees every entry; LRU order is the files' mtime (touched on every hit), with each
file's header read for its parent so that a prompt's leading chunks stay more recent than its tail
across a restart too (DiskStore._rebuild).
A file is trusted no more than bytes off the network: every read checks its MAC (under the store's
cluster secret), header and key, and a file that fails is deleted and read as a miss (counted in
`corrupt_dropped`).

One process owns a directory (an exclusive flock on the directory, waited for a while: a restarted
worker's predecessor may still be flushing): the byte budget bounds the directory, and no other process
deletes this one's files. A second process gets DiskTierInUse. The directory's tag file (`.flashpd-disk.tag`)
names the secret its files were written under, as a keyed hash: a start under another secret (a service
started again with a new one) deletes the old chunk files, which can never verify. Kept, each blocked the
put of its key (it was PRESENT) until a read dropped it, so a long prompt won its hits back one chunk a
cycle. Only files that begin with the chunk magic are entries: anything else in the directory is left alone.

The TieredStore writes its disk tier behind the caller's back: a put verifies once, stores in memory
and queues the bytes for one background writer thread, so a Put never waits for a write, an fsync
and a directory fsync. TieredStore says what a full queue, a failed write and a shutdown do.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import re
import stat
import threading
import time
import uuid
from collections import OrderedDict
from pathlib import Path

from flashpd.kv_bridge.auth import MAC_BYTES, ClusterSecret
from flashpd.kv_bridge.chunk import MAGIC, PREFIX, CorruptChunk, KVChunk, peek_parent
from flashpd.kv_bridge.layout import ChunkLayout
from flashpd.kv_bridge.shm import write_all
from flashpd.kv_bridge.lru import ChainLRU
from flashpd.kv_bridge.store import IndexedStore, MemoryStore, PutResult, decode_checked, leading, verify_checked

log = logging.getLogger(__name__)

DEFAULT_QUEUE_BYTES = 512 << 20  # bytes waiting for the disk writer (cluster/config.py: bridge_disk_queue_bytes)
CLOSE_FLUSH_S = 5.0  # what a clean shutdown waits for the queue (a launcher SIGKILLs 10 s after SIGTERM)
WRITER_IDLE_S = 5.0  # an idle writer thread exits; the next queued write starts another
_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,199}\Z")  # a file name, never a path
_TMP_PREFIX = ".tmp-"
# A temp file older than this is an interrupted write (a writer process killed): the start-up scan deletes it. A
# younger one may be a write in progress by another process sharing the directory (a chunk takes well under a
# second), unless its name says it was this host's and its writer is gone (`_temp_name`): then it goes at once.
STALE_TMP_S = 600.0
TAG_NAME = ".flashpd-disk.tag"
OWNER_WAIT_S = 15.0  # how long a start waits for another process to let the directory go


class DiskTierInUse(RuntimeError):
    """Another process holds the disk tier's directory: give each bridge its own `bridge_disk_dir`."""


# resolved directory -> (its descriptor, holding the lock; stores of this process open on it): the lock is the
# process's, so a store opened again in one process (a restart in place) shares it
_OWNED: dict[str, tuple[int, int]] = {}
_OWNED_LOCK = threading.Lock()
# directories of stores finalized unclosed: let go at the next _own or _disown. A finalizer takes no lock (the
# cyclic collector may run it in a thread that holds _OWNED_LOCK already)
_FINALIZED: list[str] = []


def _let_go_finalized() -> None:
    """(_OWNED_LOCK held.)"""
    while _FINALIZED:
        _release(_FINALIZED.pop())


def _release(key: str) -> None:
    """(_OWNED_LOCK held.) One store fewer on the directory; the last one closes the descriptor, and the lock."""
    fd, n = _OWNED.pop(key)
    if n > 1:
        _OWNED[key] = (fd, n - 1)
    else:
        os.close(fd)


def _own(directory: Path, wait_s: float) -> str:
    """Take this process's exclusive lock on the directory (flock on the directory itself, so a read-only one
    works too), waiting up to wait_s for another process to let it go; the key to give back to _disown."""
    key = str(directory.resolve())
    fd = None
    deadline = time.monotonic() + wait_s
    try:
        while True:
            with _OWNED_LOCK:
                _let_go_finalized()
                if key in _OWNED:  # this process holds it already (another store, or another thread just now)
                    held, n = _OWNED[key]
                    _OWNED[key] = (held, n + 1)
                    return key
                if fd is None:
                    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    pass
                except OSError as e:  # a file system without flock: ownership cannot be enforced there; said once
                    log.warning("disk tier %s: cannot lock the directory (%s); make sure no other process uses it",
                                directory, e)
                    _OWNED[key], fd = (fd, 1), None
                    return key
                else:
                    _OWNED[key], fd = (fd, 1), None
                    return key
            if time.monotonic() >= deadline:  # the wait is outside the lock: other directories are not held up
                raise DiskTierInUse(f"disk tier {directory}: another process holds it (waited {wait_s:g} s); "
                                    f"give each bridge its own bridge_disk_dir")
            time.sleep(0.05)
    finally:
        if fd is not None:
            os.close(fd)


def _disown(key: str) -> None:
    with _OWNED_LOCK:
        _let_go_finalized()
        _release(key)


def _host_tag() -> str | None:
    """Who may judge a temp file's writer by its pid: this host's boot and pid namespace, hashed (another
    container's or machine's pids mean nothing here). None where either cannot be read: then no one is."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pidns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return None
    return hashlib.blake2b("\0".join([os.uname().nodename, boot, pidns]).encode(), digest_size=4).hexdigest()


_HOST = _host_tag()


def _temp_name(key: str) -> str:
    """.tmp-<host tag>-<pid>-<key>-<random>: at most 5 + 8 + 1 + 7 + 1 + 200 + 1 + 16 = 239 characters (with no
    tag, "unknown" and age alone decide)."""
    return f"{_TMP_PREFIX}{_HOST or 'unknown'}-{os.getpid()}-{key}-{uuid.uuid4().hex[:16]}"


def _writer_gone(name: str) -> bool:
    """Whether a temp file's name says this host's process wrote it and that process is gone. Names of other
    hosts, and of older versions (no tag), are judged by age alone."""
    host, _, rest = name[len(_TMP_PREFIX):].partition("-")
    pid, _, _ = rest.partition("-")
    if _HOST is None or host != _HOST or not pid.isdigit():
        return False
    if int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: a live process of another user
        return False
    return False


def _check_key(key: str) -> None:
    if not _KEY_RE.match(key):
        raise ValueError(f"key {key!r} is not a valid file name (letters, digits, _ . -)")


def _open_directory(directory: Path) -> None:
    """Make the tier's directory the owner's alone (0700; its files are made 0600), or, where it exists already, say
    once when other users may write in it: they cannot forge an entry (each is MAC-checked, and links and special
    files are left unread), but they can delete the tier's entries (a sticky bit aside) or fill its disk."""
    try:
        directory.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    st = os.stat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"disk tier directory {directory}: not a directory")
    if st.st_mode & 0o022:
        log.warning("disk tier directory %s is writable by other users (mode %o): they can delete its entries or "
                    "fill its disk (not forge one); chmod 700 it", directory, st.st_mode & 0o7777)


class DiskStore(IndexedStore):
    """Persistent LRU store of whole chunk files within a byte budget; thread-safe within a process."""

    _index: ChainLRU[int]  # key -> file size, least recently used first

    def __init__(self, directory: str | Path, byte_budget: int, secret: ClusterSecret | None = None,
                 owner_wait_s: float = OWNER_WAIT_S) -> None:
        super().__init__(byte_budget, secret)
        self.directory = Path(directory)
        _open_directory(self.directory)
        self._c.update(write_errors=0, temp_files_removed=0, touch_errors=0, files_vanished=0, space_evictions=0,
                       other_secret_dropped=0, foreign_dropped=0, foreign_refused=0)
        self._owner: str | None = _own(self.directory, owner_wait_s)
        try:
            self._scan()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Let the directory go (another process may open it). Idempotent; the store is not used after it."""
        owner, self._owner = self._owner, None
        if owner is not None:
            _disown(owner)

    def __del__(self) -> None:
        owner, self._owner = getattr(self, "_owner", None), None
        if owner is not None:  # no lock here (see _FINALIZED); the next _own or _disown lets the directory go
            _FINALIZED.append(owner)

    def _tag(self) -> bytes:
        """What the tag file holds under this store's secret: a keyed hash, nothing of the secret itself."""
        return b"FPDT1" + self._mac.hasher(1).update(b"flashpd disk tier: files written under this secret").digest()

    def _same_secret(self) -> bool:
        try:
            return (self.directory / TAG_NAME).read_bytes() == self._tag()
        except OSError:
            return False

    def _write_tag(self) -> None:
        tmp = self.directory / _temp_name("tag")
        try:
            _write_file(tmp, self._tag())
            os.replace(tmp, self.directory / TAG_NAME)
        except OSError as e:  # a full disk, EACCES (_scan skips read-only ones): files dropped again next start
            log.warning("disk tier %s: cannot write its tag file (%s)", self.directory.name, e)
        finally:
            _unlink(tmp)

    def _scan(self) -> None:
        same = self._same_secret()
        writable = os.access(self.directory, os.W_OK)
        found: list[tuple[int, str, int, str | None]] = []
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if entry.name.startswith(_TMP_PREFIX):  # a write not yet (or never to be) published: never visible
                    if _stale(entry):
                        _unlink(entry.path)
                        self._c["temp_files_removed"] += 1
                    continue
                try:
                    if not (entry.is_file(follow_symlinks=False) and _KEY_RE.match(entry.name)
                            and _is_chunk_file(entry.path)):
                        continue
                    st = entry.stat(follow_symlinks=False)
                except OSError:  # gone since the listing, or not statable: no entry
                    continue
                if not same:  # written under another secret (or before tags): can never verify under this one
                    if writable:
                        _unlink(entry.path)
                    self._c["other_secret_dropped"] += 1  # (a read-only directory: left there, not indexed)
                    continue
                found.append((st.st_mtime_ns, entry.name, st.st_size, _header_parent(entry.path)))
        if not same:
            if self._c["other_secret_dropped"]:
                log.info("disk tier %s: %d chunk files written under another secret %s", self.directory.name,
                         self._c["other_secret_dropped"], "dropped" if writable else "ignored (read-only)")
            if writable:
                self._write_tag()
        self._rebuild(found)
        with self._lock:
            self._evict_to(0)  # the budget may have shrunk since the last run

    def _rebuild(self, found: list[tuple[int, str, int, str | None]]) -> None:
        """The index from the scan's (mtime, key, size, parent), in the order the running store keeps
        (_restart_order says why mtimes alone are not that order). Parents come from headers not yet verified:
        they only order eviction, and a read verifies the bytes (and relearns the parent, _touch) before
        anything is served."""
        size = {name: n for _, name, n, _ in found}
        self._parent = {name: p for _, name, _, p in found if p}
        for name in _restart_order(found):
            self._index[name] = size[name]
            self._bytes += size[name]

    def _path(self, key: str) -> Path:
        return self.directory / key

    # -- writes ---------------------------------------------------------------------------------
    def put_bytes(self, key: str, data: bytes, verified: bool = False) -> PutResult:
        """Write one entry atomically. Raises CorruptChunk (counted) unless the bytes verify."""
        _check_key(key)
        self._verify_incoming(key, data, verified)
        with self._lock:
            early = self._admission(key, len(data))
            if early is not None:
                return early
        tmp = self.directory / _temp_name(key)
        try:
            try:
                _write_file(tmp, data)
            except OSError as e:  # the file system is full below this tier's budget (other users of the disk):
                # room is made from this tier's least recently used files, and the write tried once more
                if e.errno not in (errno.ENOSPC, errno.EDQUOT) or not self._free_space(key, data):
                    raise
                _unlink(tmp)
                _write_file(tmp, data)
            with self._lock:
                if key in self._index:  # another writer finished first: keep theirs
                    self._c["duplicate_puts"] += 1
                    return PutResult.PRESENT
                if not self._evict_to(len(data), self._link(key, data)):
                    self._parent.pop(key, None)
                    self._c["chain_refused"] += 1  # only its own prompt's chunks were left to evict
                    return PutResult.REFUSED
                if not _publish(tmp, self._path(key)):
                    size = _chunk_file_size(self._path(key))
                    if size != len(data):  # not a chunk of this key (an operator's file, a link, a FIFO): never
                        # indexed, so never read, evicted or removed; the entry stays in memory only
                        self._parent.pop(key, None)
                        self._c["foreign_refused"] += 1
                        log.warning("disk tier %s: %s... names a file that is not its chunk; not written to disk",
                                    self.directory.name, key[:16])
                        return PutResult.REFUSED
                    self._c["duplicate_puts"] += 1  # the file exists (e.g. another process): first wins
                    self._index[key] = size
                    self._bytes += size
                    self._freshen(key)
                    return PutResult.PRESENT
                self._index.insert(key, len(data), lambda k: self._parent.get(k, ""))
                self._bytes += len(data)
                self._c["puts"] += 1
            _fsync_dir(self.directory)
            return PutResult.STORED
        except OSError as e:  # disk full, EIO, a directory gone: refused, counted, logged; never raised
            with self._lock:
                if key not in self._index:  # a link (or stat) that failed after _link: its parent leaves with it
                    self._parent.pop(key, None)
                self._c["write_errors"] += 1
                n = self._c["write_errors"]
            if _sparse(n):
                log.warning("disk tier %s: writing %s... failed (%s); %d write errors so far",
                            self.directory.name, key[:16], e, n)
            return PutResult.REFUSED
        finally:
            _unlink(tmp)

    def _free_space(self, key: str, data: bytes) -> bool:
        """After a write found the file system full: drop least recently used files (never the incoming entry's
        own prompt's, as `_evict_to`) until they add up to the incoming size; whether any went. Without this a
        disk filled by others below the budget refused every write and evicted nothing, freezing the tier."""
        with self._lock:
            keep = self._link(key, data)
            if key not in self._index:
                self._parent.pop(key, None)  # recorded again when the retried write is published
            freed = 0
            while self._index and freed < len(data) and self._may_evict(keep):
                victim, size = self._index.popitem(last=False)
                self._parent.pop(victim, None)
                self._bytes -= size
                _unlink(self._path(victim))
                self._c["evictions"] += 1
                self._c["space_evictions"] += 1
                freed += size
            return freed > 0

    def _evict_to(self, incoming: int, keep: str | None = "") -> bool:
        """Drop least recently used files until `incoming` more bytes fit (lock held); False, with nothing more
        dropped, when only `keep` (the incoming entry's own prompt) is left to drop, or keep is None (an orphan:
        IndexedStore._link)."""
        while self._index and self._bytes + incoming > self.byte_budget:
            if not self._may_evict(keep):
                return False
            key, size = self._index.popitem(last=False)
            self._parent.pop(key, None)
            self._bytes -= size
            _unlink(self._path(key))
            self._c["evictions"] += 1
        return True

    # -- reads ----------------------------------------------------------------------------------
    # A read holds the file open until it has verified the bytes (or dropped the file): a file found corrupt is
    # dropped only if the key's path still names that very file (_drop_corrupt). Between a failed read and its
    # drop, another reader may drop the same file and a put publish a good one under the key; dropping by name
    # then took the good file and its index entry. The open descriptor pins the inode, so its number cannot be
    # reused by the new file meanwhile.
    def get(self, key: str, layout: ChunkLayout | None = None) -> KVChunk | None:
        found = self._read(key)
        if found is None:
            return None
        data, fd, st = found
        try:
            chunk = self._decode(key, data, layout, st)
        finally:
            os.close(fd)
        if chunk is None:
            return None
        self._touch(key, chunk.parent)
        return chunk

    def get_bytes(self, key: str) -> bytes | None:
        found = self._read(key)
        if found is None:
            return None
        data, fd, st = found
        try:
            try:
                verify_checked(key, data, self._mac)
            except CorruptChunk:
                self._drop_corrupt(key, st)
                return None
        finally:
            os.close(fd)
        self._touch(key, peek_parent(data))
        return data

    def _read(self, key: str) -> tuple[bytes, int, os.stat_result] | None:
        """The entry's bytes, its file's descriptor, still open (the caller closes it once the bytes are verified
        or the file dropped), and that file's fstat; None on a miss (a file that cannot be read is dropped)."""
        with self._lock:
            size = self._index.get(key)
            if size is None:
                self._c["misses"] += 1
        if size is None:
            return None
        path = self._path(key)
        try:  # never through a link, never waiting on a FIFO's writer
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:  # evicted between the index check and the open, or removed from under the store
            self._drop_missing(key)
            return None
        except OSError as e:  # EACCES, ...: a miss, and it leaves the index; with no descriptor to pin the file,
            if e.errno == errno.ELOOP:  # a symbolic link in the entry's place
                self._drop_foreign(key, "a symbolic link", _lstat(path))
                return None
            log.warning("disk tier: reading %s... failed (%s); dropped, a miss", key[:16], e)
            self._drop_corrupt(key, _stat(path))  # it is named by what the path holds right after the failure
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):  # a FIFO, a device, a directory: not read at all
                try:
                    self._drop_foreign(key, "not a regular file", st)
                finally:
                    os.close(fd)
                return None
            if st.st_size != size:  # not the file indexed: dropped unread (a 2 GiB file was read whole, then refused)
                log.warning("disk tier: %s... holds %d bytes, its entry %d; dropped, a miss", key[:16], st.st_size,
                            size)
                try:
                    self._drop_corrupt(key, st)
                finally:
                    os.close(fd)
                return None
            return _read_fd(fd), fd, st
        except OSError as e:  # EIO, EISDIR, ...: the entry cannot be served; a miss, and it leaves the index
            log.warning("disk tier: reading %s... failed (%s); dropped, a miss", key[:16], e)
            try:
                self._drop_corrupt(key, _fstat(fd))
            finally:
                os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise

    def _touch(self, key: str, parent: str | None) -> None:
        """A hit: the entry and its prompt's chunks before it become the most recent (its parent confirmed from
        verified bytes: a restart's scan read it unverified). Only the entry's own mtime is touched; a restart
        rebuilds the chain order from mtimes and parents (_restart_order)."""
        with self._lock:
            if parent and key in self._index:  # not one evicted since its read: _parent holds held keys only
                if self._parent.get(key) != parent:
                    self._index.forget_chain()  # a chain the index knows may have grown by this link
                self._parent[key] = parent
            self._freshen(key)
            self._c["hits"] += 1
        try:
            os.utime(self._path(key))  # the LRU order a restart rebuilds
        except FileNotFoundError:
            pass
        except OSError as e:  # a read-only file system (EROFS), EACCES: the hit stands; only the order is not kept
            with self._lock:
                first = not self._c["touch_errors"]
                self._c["touch_errors"] += 1
            if first:
                log.warning("disk tier: cannot record a hit's recency on disk (%s); hits are still served", e)

    def _drop_missing(self, key: str) -> None:
        """A miss whose file is gone. If the key is still indexed and its path still names nothing, the file was
        removed from under the store (an operator, another bridge sharing the directory): the entry leaves the index
        and its bytes the budget. Kept, Lookup went on reporting it, every Get missed it, and a put of it again was
        PRESENT, never rewritten. (An eviction between the index check and the open removed the entry already.)"""
        with self._lock:
            self._c["misses"] += 1
            if key in self._index and not os.path.lexists(self._path(key)):
                size = self._index.pop(key, None)
                self._parent.pop(key, None)
                if size is not None:
                    self._bytes -= size
                self._c["files_vanished"] += 1

    def _drop_foreign(self, key: str, what: str, found: os.stat_result | None) -> None:
        """The key's path holds something this tier never writes (a link, a FIFO, a device; `found`, its lstat or
        fstat): the entry leaves the index and its bytes the budget, and the thing stays where it is (not this
        tier's to remove). Kept indexed, every Get read it again (a link to /dev/zero without end, a FIFO blocking a
        thread for good). As _drop_corrupt, only while the path still names `found`: a late drop leaves the
        entry of a file put since."""
        with self._lock:
            dropped = found is not None and _same_file(_lstat(self._path(key)), found)
            if dropped:
                size = self._index.pop(key, None)
                self._parent.pop(key, None)
                if size is not None:
                    self._bytes -= size
                self._c["foreign_dropped"] += 1
            self._c["misses"] += 1
        if dropped:
            log.warning("disk tier: %s... is %s, not a chunk file; dropped from the index, left in place", key[:16],
                        what)

    def _drop_corrupt(self, key: str, found: os.stat_result | None) -> None:
        """A read found the file `found` (its fstat, taken while the file was held open) corrupt or unreadable: a
        miss; the file and the key's index entry go only if the key's path still names that file. Otherwise the
        file was dropped already (another reader of it, an eviction) and whatever the path names now (a put
        since: a new inode) is left alone, and so is its index entry. Every change to this directory's files
        and the index is made under the lock, so while the path names `found` the entry describes it. (Another
        process sharing the directory may still replace the file between the stat and the unlink here.)"""
        path = self._path(key)
        with self._lock:
            if found is not None and _same_file(_stat(path), found):
                size = self._index.pop(key, None)
                self._parent.pop(key, None)
                if size is not None:
                    self._bytes -= size
                _unlink(path)
            self._c["corrupt_dropped"] += 1
            self._c["misses"] += 1

    def stats(self) -> dict:
        with self._lock:
            return {**self._c, "bytes": self._bytes, "entries": len(self._index), "byte_budget": self.byte_budget}


class TieredStore:
    """Memory over disk: reads try memory, then the disk writer's queue, then disk (promoting a hit
    into memory); writes go to memory at once and to disk behind the caller (write-behind). Both tiers
    must hold one cluster secret (what one verifies, the other stores unverified).

    Why write-behind: a synchronous disk write (write, fsync, directory fsync: milliseconds) sat on
    every Put, i.e. on a prefill's hand-over to its decode worker. Now a put verifies the bytes once,
    stores them in memory and queues them (the queue holds the bytes themselves, so a memory eviction
    before the write loses nothing) for one daemon writer thread. Until written, a queued key reads
    back from the queue and counts as present in contains/lookup.

    A full queue (pending bytes + this entry > queue_bytes; an entry larger than the whole queue is
    still taken when the queue is empty) drops this entry's DISK copy at once, counted in
    `disk_dropped` and logged: the put never waits for the disk. The new entry is the one dropped,
    not an older pending one, because it sits in memory as the most recently used entry, while an
    older pending entry may already be gone from memory and exist nowhere else. A disk that cannot
    keep up thus costs persistence and capacity beyond memory (a later miss is recomputed, exactly),
    never Put latency. A failed write (disk full, EIO) is counted in `disk_write_errors` and logged;
    the writer goes on.

    put_bytes returns STORED when this put made the entry new to the store (held in memory, or its
    disk copy queued), PRESENT when the key was already held (in memory, queued or on disk: the first
    writer wins, a later put is an idempotent no-op), REFUSED when neither tier took it (too large
    for memory, and its disk copy dropped or too large for the disk). Concurrent puts of one key give
    exactly one STORED. A put of a key held in memory but not on disk (its copy was dropped, failed or
    evicted) queues the disk copy again.

    flush(timeout) waits for the queue to drain; close(timeout) flushes within the bound, then stops
    the writer (what was still queued is dropped, counted); after close a put writes its disk copy
    synchronously, as before write-behind."""

    def __init__(self, memory: MemoryStore, disk: DiskStore, queue_bytes: int = DEFAULT_QUEUE_BYTES) -> None:
        if memory.secret != disk.secret:
            raise ValueError("the memory and disk tiers were given different cluster secrets")
        if queue_bytes < 1:
            raise ValueError(f"queue_bytes: must be >= 1, got {queue_bytes}")
        self.memory = memory
        self.disk = disk
        self.secret = memory.secret
        self.queue_bytes = queue_bytes
        self._mac = memory.secret.mac_key
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # signalled when the queue changes or the store closes
        self._pending: OrderedDict[str, bytes | memoryview] = OrderedDict()  # key -> bytes, oldest first
        self._pending_bytes = 0
        self._writing: str | None = None  # the key the writer holds (still in _pending until written)
        self._thread: threading.Thread | None = None
        self._closed = False
        self._c = dict(hits_memory=0, hits_disk=0, hits_pending=0, misses=0, corrupt_refused=0,
                       disk_queued=0, disk_written=0, disk_dropped=0, disk_write_errors=0)
        if hasattr(memory, "get_handle"):  # an arena memory tier (ArenaStore): the bridge hands out where entries lie
            self.get_handle = self._get_handle

    def put(self, chunk: KVChunk) -> bool:
        return self.put_bytes(chunk.key, chunk.to_bytes(self._mac), verified=True) is not PutResult.REFUSED

    def put_bytes(self, key: str, data: bytes, verified: bool = False) -> PutResult:
        """Verify once, store in memory, queue the disk copy; see the class docstring for the result."""
        _check_key(key)  # before anything is kept: the disk tier could never name a file after it
        if not (isinstance(data, bytes) or (isinstance(data, memoryview) and data.readonly)):
            data = bytes(data)  # the queue keeps what was verified: never a buffer the caller may change
        if not verified:
            try:
                verify_checked(key, data, self._mac)  # once for both tiers
            except CorruptChunk:
                self._count("corrupt_refused")
                raise
        with self._cond:
            closed = self._closed
            if not closed:  # one decision under the lock: concurrent puts of a key give one STORED
                held = key in self._pending or self.disk.contains(key)
                m = self.memory.put_bytes(key, data, verified=True)
                queued = False if held else self._enqueue(key, data)
        if closed:  # no writer any more: the disk copy is written here (the record of what exists)
            d = self.disk.put_bytes(key, data, verified=True)
            m = self.memory.put_bytes(key, data, verified=True)
            return d if d is not PutResult.REFUSED else m
        if held or m is PutResult.PRESENT:
            return PutResult.PRESENT
        return PutResult.STORED if m is PutResult.STORED or queued else PutResult.REFUSED

    def _enqueue(self, key: str, data: bytes | memoryview) -> bool:
        """Queue the disk copy (lock held); False when the disk can never take it or the queue is full."""
        n = len(data)
        if n > self.disk.byte_budget:  # the disk tier would refuse it: counted there, nothing queued
            with self.disk._lock:
                self.disk._c["oversize_refused"] += 1
            return False
        if self._pending and self._pending_bytes + n > self.queue_bytes:
            self._c["disk_dropped"] += 1
            if _sparse(self._c["disk_dropped"]):
                log.warning("disk tier %s: write queue full (%d of %d bytes pending): disk copy of %s... dropped, "
                            "the memory copy kept; %d dropped so far", self.disk.directory.name, self._pending_bytes,
                            self.queue_bytes, key[:16], self._c["disk_dropped"])
            return False
        self._pending[key] = data
        self._pending_bytes += n
        self._c["disk_queued"] += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._write_loop, name="tiered-disk-writer", daemon=True)
            self._thread.start()
        self._cond.notify_all()
        return True

    def _write_loop(self) -> None:
        """The writer thread: oldest queued entry first; a key leaves the queue only once it is on disk
        (or its write failed), so a reader always finds it in one of the two."""
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    if not self._cond.wait(WRITER_IDLE_S) and not self._pending:
                        self._thread = None  # idle: exit (the next _enqueue starts a writer again)
                        return
                if not self._pending:  # closed, nothing left: the directory goes with the last writer
                    self._thread = None
                    self._cond.notify_all()
                    break
                key, data = next(iter(self._pending.items()))
                self._writing = key
            try:
                result = self.disk.put_bytes(key, data, verified=True)  # an OSError: REFUSED, counted, logged
            except Exception:  # noqa: BLE001  whatever else goes wrong: counted, logged, the writer goes on
                result = None
                log.exception("disk tier %s: writing %s... failed", self.disk.directory.name, key[:16])
            with self._cond:
                self._pending.pop(key, None)
                self._pending_bytes -= len(data)
                self._writing = None
                if result is PutResult.STORED:
                    self._c["disk_written"] += 1
                elif result is not PutResult.PRESENT:  # PRESENT: another process wrote it first
                    self._c["disk_write_errors"] += 1
                self._cond.notify_all()
        self.disk.close()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done (None: without a bound); False if `timeout` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self, timeout: float = CLOSE_FLUSH_S) -> bool:
        """Flush within `timeout`, then stop the writer; what is still queued then is dropped (counted,
        logged). Returns whether everything queued reached the disk tier."""
        deadline = time.monotonic() + timeout
        drained = self.flush(timeout)
        with self._cond:
            self._closed = True
            left = [k for k in self._pending if k != self._writing]
            for k in left:
                self._pending_bytes -= len(self._pending.pop(k))
            self._c["disk_dropped"] += len(left)
            thread = self._thread
            self._cond.notify_all()
        if left:
            log.warning("disk tier %s: closed with %d writes still queued: dropped", self.disk.directory.name,
                        len(left))
        if thread is not None and thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))
        if thread is None or not thread.is_alive():  # a writer still at work keeps the directory until the end
            self.disk.close()
        return drained

    def get(self, key: str, layout: ChunkLayout | None = None) -> KVChunk | None:
        chunk = self.memory.get(key, layout)
        if chunk is not None:
            self._count("hits_memory")
            return chunk
        data = self._from_below(key)
        return None if data is None else decode_checked(key, data, self._mac, layout=layout)

    def get_bytes(self, key: str) -> bytes | None:
        data = self.memory.get_bytes(key)
        if data is not None:
            self._count("hits_memory")
            return data
        return self._from_below(key)

    def _get_handle(self, key: str):
        """Where the memory tier's arena holds the entry, a disk hit promoted into it first (as get_bytes); None
        on a miss, or when the promoted entry did not stay in memory."""
        h = self.memory.get_handle(key)
        if h is not None:
            self._count("hits_memory")
            return h
        return None if self._from_below(key) is None else self.memory.get_handle(key)

    def _from_below(self, key: str) -> bytes | None:
        """The disk tier's copy (its write queue first), verified, promoted into memory; None on a miss."""
        with self._cond:
            data = self._pending.get(key)
        if data is not None:
            try:
                verify_checked(key, data, self._mac)  # as every tier checks what it hands out
            except CorruptChunk:
                data = None  # verified when queued: cannot happen short of memory rot; the disk read decides
            else:
                self._count("hits_pending")
        if data is None:
            data = self.disk.get_bytes(key)
        if data is None:
            self._count("misses")
            return None
        self.memory.put_bytes(key, data, verified=True)
        self._count("hits_disk")  # a queued entry counts here too (hits_pending: how many of these)
        return data

    def _count(self, name: str) -> None:
        with self._lock:
            self._c[name] += 1

    def contains(self, key: str) -> bool:
        if self.memory.contains(key):
            return True
        with self._cond:
            if key in self._pending:
                return True
        return self.disk.contains(key)

    def lookup(self, keys: list[str]) -> int:
        return leading(keys, self.contains)

    def stats(self) -> dict:
        """The tiered counters, the write queue's state (disk_pending_*) and each tier's own stats."""
        with self._lock:
            own = dict(self._c, disk_pending_entries=len(self._pending), disk_pending_bytes=self._pending_bytes,
                       disk_queue_bytes=self.queue_bytes)
        return {**own, "memory": self.memory.stats(), "disk": self.disk.stats()}


def _chunk_file_size(path: Path) -> int | None:
    """The size of the regular file at `path` when it begins with the chunk magic, else None (read through no
    link, never waiting on a FIFO)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or os.pread(fd, len(MAGIC), 0) != MAGIC:
            return None
        return st.st_size
    except OSError:
        return None
    finally:
        os.close(fd)


def _is_chunk_file(path: str) -> bool:
    """Whether the file begins with the chunk magic: only such files are the tier's entries (indexed, counted,
    evicted). Any other file in the directory is an operator's, never touched."""
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def _header_parent(path: str) -> str | None:
    """The parent key a chunk file's header names ("" for a prompt's first chunk), read without verifying
    anything (only the fixed prefix and the header); None when the file holds no readable chunk header."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(PREFIX.size)
            if len(prefix) < PREFIX.size:
                return None
            _, _, hl = PREFIX.unpack(prefix)
            if hl > size - PREFIX.size - MAC_BYTES:
                return None
            return peek_parent(prefix + f.read(hl))
    except (OSError, ValueError):
        return None


def _restart_order(found: list[tuple[int, str, int, str | None]]) -> list[str]:
    """The scanned keys, least recent first, as the running store ordered them: a hit or put of a chunk freshens
    its prompt's chunks before it, the first chunk last (store.freshen), but touches only its own file. By
    mtimes alone a prompt's FIRST chunk (put and read first) was the least recent, so the first eviction after a
    restart cut a prompt at its head, leaving the rest held and unreachable, and a put extending a prompt
    evicted that prompt's own prefix. Here a chunk's recency is the newest mtime of it and every held chunk after
    it in a prompt, ties broken deeper first (a prompt's tail is evicted before its head); and chains no hit can
    reach (a held chunk whose parent is not held, an unreadable header, a parent loop) go first of all.
    O(N log N): no chain is walked twice."""
    mtime = {name: t for t, name, _, _ in found}
    parent = {name: p for _, name, _, p in found}
    depth: dict[str, int] = {}
    reach: dict[str, bool] = {}
    for start in parent:
        path: list[str] = []
        on_path: set[str] = set()
        k, base, ok = start, -1, False
        while True:
            if k in depth:
                base, ok = depth[k], reach[k]
                break
            if k not in parent or k in on_path:  # an ancestor not held, or a loop: no hit reaches this chain
                break
            path.append(k)
            on_path.add(k)
            p = parent[k]
            if not p:  # "": a prompt's first chunk; None: a header that cannot be read
                ok = p == ""
                break
            k = p
        for i, n in enumerate(reversed(path)):
            depth[n], reach[n] = base + 1 + i, ok
    recent = dict(mtime)
    for n in sorted(parent, key=lambda n: -depth[n]):  # children before parents: a chain's max flows up once
        p = parent[n]
        if p and p in recent and depth[p] < depth[n]:
            recent[p] = max(recent[p], recent[n])
    return sorted(parent, key=lambda n: (reach[n], recent[n], -depth[n], n))


def _stale(entry: os.DirEntry) -> bool:
    """A temp file no writer still works on (see STALE_TMP_S, `_writer_gone`); one gone since the listing is not."""
    try:
        old = time.time() - entry.stat(follow_symlinks=False).st_mtime > STALE_TMP_S
    except OSError:
        return False
    return old or _writer_gone(entry.name)


def _write_file(path: Path, data: bytes) -> None:
    """data into a new file at path, fsynced (O_EXCL: never another writer's file)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, final: Path) -> bool:
    """Make tmp visible as final without ever replacing an existing entry; False if final exists."""
    try:
        os.link(tmp, final)
        return True
    except FileExistsError:
        return False
    except OSError as e:  # a filesystem without hard links: rename (atomic; same bytes for one key)
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        if final.exists():
            return False
        os.replace(tmp, final)
        return True


def _read_fd(fd: int) -> bytes:
    """The whole file behind an open descriptor, from its start."""
    with open(fd, "rb", closefd=False) as f:
        return f.read()


def _stat(path: str | Path) -> os.stat_result | None:
    try:
        return os.stat(path)
    except OSError:
        return None


def _lstat(path: str | Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None


def _fstat(fd: int) -> os.stat_result | None:
    try:
        return os.fstat(fd)
    except OSError:
        return None


def _same_file(a: os.stat_result | None, b: os.stat_result) -> bool:
    return a is not None and (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _unlink(path: str | Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:  # the entry already left the index: a file that will not go is logged, not raised
        log.warning("disk tier: could not remove %s (%s)", path, e)


def _sparse(n: int) -> bool:
    """Log the 1st, 2nd, 4th, 8th... occurrence: a full or failing disk must not flood the log."""
    return n > 0 and n & (n - 1) == 0
