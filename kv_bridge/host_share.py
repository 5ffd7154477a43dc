"""Host tensors of one process read by another on the same host, mapped as plain files: no torch_shm_manager.

The exporter shares a CPU tensor with torch's file-system strategy (`share_memory_()`: a file in /dev/shm, a
refcount header in front of the data). torch's own unpickling in another process would map that file through the
exporter's torch_shm_manager and keep a socket to it; freeing the mapping writes to that socket. Under Ray a dead
actor's manager dies with it, so the importer, dropping a dead exporter's mapping, wrote to a closed socket: a C++
exception in a destructor, and the whole decode worker aborted (a peer's crash took a healthy worker down).

Here the importer opens the same file by name and maps it itself (mmap, MAP_SHARED): no manager, no refcount, and
freeing is munmap. The exporter's manager (or the launcher, after its death) still unlinks the file; a mapping
keeps its memory until it is dropped. What travels is a descriptor of plain values, sealed with the rest of the
export blob, and checked again on arrival (a name of torch's pattern in /dev/shm, a regular file of this user, the
exact file size, the data where this torch puts it). The mapping is read-only: an importer cannot change an
exporter's caches or epochs. Like torch's own mapping, it is not guarded against the file shrinking under it (the
exporter never truncates; a reader would get SIGBUS).
"""
from __future__ import annotations

import mmap
import os
import re
import stat
import threading
import warnings
from typing import NamedTuple

import torch

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"/torch_[0-9]+_[0-9]+(_[0-9]+)?")  # torch's file-system strategy names (libshm)
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                                     torch.int32, torch.uint8, torch.float8_e4m3fn)}
_header: int | None = None
_header_lock = threading.Lock()


class HostShare(NamedTuple):
    """Where a shared CPU tensor's bytes lie: its storage's file, the storage's bytes at `header` in that file, and
    the tensor's view of them (elements)."""

    name: str
    header: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def _filename(t: torch.Tensor) -> str:
    import torch.multiprocessing as mp  # noqa: PLC0415

    mp.set_sharing_strategy("file_system")
    if not t.is_shared():
        t.share_memory_()
    _, name, _ = t.untyped_storage()._share_filename_cpu_()
    return name.decode() if isinstance(name, bytes) else name


def header_bytes() -> int:
    """Where a file-system-strategy file's data starts (torch's refcount header), found once by sharing a probe
    of known bytes and reading its file: a constant of torch's allocator that no API reports."""
    global _header
    with _header_lock:
        if _header is None:
            pattern = torch.tensor(list(b"flashpd-host-share-probe-bytes!!"), dtype=torch.uint8)
            name = _filename(pattern)
            with open(SHM_DIR + name, "rb") as f:
                found = f.read().find(bytes(pattern.tolist()))
            if found < 0:
                raise RuntimeError("torch's shared-memory file does not hold its tensor's bytes; cannot share by name")
            _header = found
        return _header


def describe(t: torch.Tensor) -> HostShare:
    """The exporter's side: t's descriptor (t moved into shared memory first if it is not there yet)."""
    if t.device.type != "cpu":
        raise ValueError(f"a host share is of a CPU tensor, not {t.device}")
    name = _filename(t)
    st = t.untyped_storage()
    return HostShare(name, header_bytes(), st.nbytes(), str(t.dtype).removeprefix("torch."), tuple(t.shape),
                     tuple(t.stride()), t.storage_offset())


def attach(d: HostShare) -> torch.Tensor:
    """The importer's side: the exporter's tensor, mapped read-only from its file. ValueError for a descriptor that is not of a
    torch shared-memory file, OSError for a file that is gone; a file of another size than the descriptor's is
    refused (never grown: torch's own from_file would extend it)."""
    d = HostShare(*d)
    if not isinstance(d.name, str) or not _NAME.fullmatch(d.name):
        raise ValueError(f"host share names {d.name!r}, not a torch shared-memory file")
    dtype = _DTYPES.get(d.dtype)
    if dtype is None:
        raise ValueError(f"host share of dtype {d.dtype!r}")
    if not all(isinstance(v, int) and v >= 0 for v in (d.header, d.nbytes, d.offset, *d.shape, *d.stride)):
        raise ValueError("host share with a negative or non-integer size")
    if d.header != header_bytes():
        raise ValueError(f"host share {d.name}: data at byte {d.header}, where this torch puts it at {header_bytes()}")
    fd = os.open(SHM_DIR + d.name, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise ValueError(f"host share {d.name}: not a regular file of this user")
        if st.st_size != d.header + d.nbytes or d.nbytes == 0:
            raise ValueError(f"host share {d.name}: file of {st.st_size} bytes, descriptor says {d.header} + "
                             f"{d.nbytes}")
        mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():  # read-only on purpose: torch warns that writes through it are undefined
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(mm, dtype=torch.uint8)  # the tensor keeps the mapping alive; munmap when it goes
    if d.header % dtype.itemsize:
        raise ValueError(f"host share {d.name}: data at byte {d.header}, not aligned to {d.dtype}")
    data = raw[d.header:].view(dtype)  # as_strided's offset counts from the mapping's start, the header included
    return data.as_strided(d.shape, d.stride, data.storage_offset() + d.offset)
