"""Disk tier (one file per chunk) and the memory-over-disk tiered store.

A file appears under its key's name only once it is complete: bytes go to a hidden temp file,
are fsynced, then hard-linked (or renamed) into place, so a crash mid-write leaves at most a
temp file that the next start deletes. The index is rebuilt by scanning the directory, so a
restarted process sees every entry; LRU order is the files' mtime, touched on every hit.
A file is trusted no more than bytes off the network: every read checks its MAC (under the store's
cluster secret), header and key, and a file that fails is deleted and read as a miss (counted in
`corrupt_dropped`). A file written under another secret (another service start, or an older chunk
format) is such a file.
"""
from __future__ import annotations

import errno
import os
import re
import threading
import uuid
from collections import OrderedDict
from pathlib import Path

from flashpd.kv_bridge.auth import ClusterSecret
from flashpd.kv_bridge.chunk import CorruptChunk, KVChunk
from flashpd.kv_bridge.layout import ChunkLayout
from flashpd.kv_bridge.shm import write_all
from flashpd.kv_bridge.store import IndexedStore, MemoryStore, PutResult, decode_checked, leading, verify_checked

_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,199}$")  # a file name, never a path
_TMP_PREFIX = ".tmp-"


def _check_key(key: str) -> None:
    if not _KEY_RE.match(key):
        raise ValueError(f"key {key!r} is not a valid file name (letters, digits, _ . -)")


class DiskStore(IndexedStore):
    """Persistent LRU store of whole chunk files within a byte budget; thread-safe within a process."""

    _index: OrderedDict[str, int]  # key -> file size, least recently used first

    def __init__(self, directory: str | Path, byte_budget: int, secret: ClusterSecret | None = None) -> None:
        super().__init__(byte_budget, secret)
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._c.update(write_errors=0, temp_files_removed=0)
        self._scan()

    def _scan(self) -> None:
        found = []
        for entry in os.scandir(self.directory):
            if entry.name.startswith(_TMP_PREFIX):  # an interrupted write: never visible
                _unlink(entry.path)
                self._c["temp_files_removed"] += 1
            elif entry.is_file(follow_symlinks=False) and _KEY_RE.match(entry.name):
                st = entry.stat(follow_symlinks=False)
                found.append((st.st_mtime_ns, entry.name, st.st_size))
        for _, name, size in sorted(found):
            self._index[name] = size
            self._bytes += size
        with self._lock:
            self._evict_to(0)  # the budget may have shrunk since the last run

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
        tmp = self.directory / f"{_TMP_PREFIX}{key}-{uuid.uuid4().hex}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            with self._lock:
                if key in self._index:  # another writer finished first: keep theirs
                    self._c["duplicate_puts"] += 1
                    return PutResult.PRESENT
                self._evict_to(len(data))
                if not _publish(tmp, self._path(key)):
                    self._c["duplicate_puts"] += 1  # the file exists (e.g. another process): first wins
                    size = self._path(key).stat().st_size
                    self._index[key] = size
                    self._bytes += size
                    return PutResult.PRESENT
                self._index[key] = len(data)
                self._bytes += len(data)
                self._c["puts"] += 1
            _fsync_dir(self.directory)
            return PutResult.STORED
        except OSError:
            with self._lock:
                self._c["write_errors"] += 1
            return PutResult.REFUSED
        finally:
            _unlink(tmp)

    def _evict_to(self, incoming: int) -> None:
        """Drop least recently used files until `incoming` more bytes fit (lock held)."""
        while self._index and self._bytes + incoming > self.byte_budget:
            key, size = self._index.popitem(last=False)
            self._bytes -= size
            _unlink(self._path(key))
            self._c["evictions"] += 1

    # -- reads ----------------------------------------------------------------------------------
    def get(self, key: str, layout: ChunkLayout | None = None) -> KVChunk | None:
        data = self._read(key)
        if data is None:
            return None
        chunk = self._decode(key, data, layout)
        if chunk is not None:
            self._touch(key)
        return chunk

    def get_bytes(self, key: str) -> bytes | None:
        data = self._read(key)
        if data is None:
            return None
        try:
            verify_checked(key, data, self._mac)
        except CorruptChunk:
            self._drop_corrupt(key, data)
            return None
        self._touch(key)
        return data

    def _read(self, key: str) -> bytes | None:
        with self._lock:
            known = key in self._index
        if not known:
            with self._lock:
                self._c["misses"] += 1
            return None
        try:
            data = self._path(key).read_bytes()
        except FileNotFoundError:  # evicted between the index check and the open
            with self._lock:
                self._c["misses"] += 1
            return None
        return data

    def _touch(self, key: str) -> None:
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
            self._c["hits"] += 1
        try:
            os.utime(self._path(key))  # the LRU order a restart rebuilds
        except FileNotFoundError:
            pass

    def _drop_corrupt(self, key: str, data: bytes) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._bytes -= size
                _unlink(self._path(key))
            self._c["corrupt_dropped"] += 1
            self._c["misses"] += 1

    def stats(self) -> dict:
        with self._lock:
            return {**self._c, "bytes": self._bytes, "entries": len(self._index), "byte_budget": self.byte_budget}


class TieredStore:
    """Memory over disk: reads try memory then disk (promoting a disk hit), writes go to both. Both
    tiers must hold one cluster secret (what one verifies, the other stores unverified)."""

    def __init__(self, memory: MemoryStore, disk: DiskStore) -> None:
        if memory.secret != disk.secret:
            raise ValueError("the memory and disk tiers were given different cluster secrets")
        self.memory = memory
        self.disk = disk
        self.secret = memory.secret
        self._mac = memory.secret.mac_key
        self._lock = threading.Lock()
        self._c = dict(hits_memory=0, hits_disk=0, misses=0, corrupt_refused=0)

    def put(self, chunk: KVChunk) -> bool:
        return self.put_bytes(chunk.key, chunk.to_bytes(self._mac), verified=True) is not PutResult.REFUSED

    def put_bytes(self, key: str, data: bytes, verified: bool = False) -> PutResult:
        if not verified:
            try:
                verify_checked(key, data, self._mac)  # once for both tiers
            except CorruptChunk:
                self._count("corrupt_refused")
                raise
        d = self.disk.put_bytes(key, data, verified=True)
        m = self.memory.put_bytes(key, data, verified=True)
        # the disk tier is the record of what exists (first writer wins there); memory only if disk refused
        return d if d is not PutResult.REFUSED else m

    def get(self, key: str, layout: ChunkLayout | None = None) -> KVChunk | None:
        chunk = self.memory.get(key, layout)
        if chunk is not None:
            self._count("hits_memory")
            return chunk
        data = self._from_disk(key)
        return None if data is None else decode_checked(key, data, self._mac, layout=layout)

    def get_bytes(self, key: str) -> bytes | None:
        data = self.memory.get_bytes(key)
        if data is not None:
            self._count("hits_memory")
            return data
        return self._from_disk(key)

    def _from_disk(self, key: str) -> bytes | None:
        data = self.disk.get_bytes(key)
        if data is None:
            self._count("misses")
            return None
        self.memory.put_bytes(key, data, verified=True)
        self._count("hits_disk")
        return data

    def _count(self, name: str) -> None:
        with self._lock:
            self._c[name] += 1

    def contains(self, key: str) -> bool:
        return self.memory.contains(key) or self.disk.contains(key)

    def lookup(self, keys: list[str]) -> int:
        return leading(keys, self.contains)

    def stats(self) -> dict:
        with self._lock:
            own = dict(self._c)
        return {**own, "memory": self.memory.stats(), "disk": self.disk.stats()}


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
