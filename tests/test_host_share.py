"""Host tensors shared by file name (kv_bridge/host_share.py): mapped by the importer itself, so a dead exporter's
torch_shm_manager cannot take the importer down; descriptors that are not torch shared-memory files are refused."""
from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch

from flashpd.kv_bridge import host_share


def _mapped(name: str) -> int:
    with open("/proc/self/maps") as f:
        return sum(name in line for line in f)


def test_a_mapping_shares_the_exporters_bytes_and_goes_with_its_tensor():
    t = torch.arange(24, dtype=torch.float32).view(2, 3, 4)[1]  # a view at an offset
    d = host_share.describe(t)
    v = host_share.attach(d)
    assert torch.equal(v, t) and v.shape == t.shape
    t[0, 0] = -5.0  # the exporter's writes are the importer's reads
    assert v[0, 0].item() == -5.0
    b = torch.zeros(5, dtype=torch.bfloat16)
    assert host_share.attach(host_share.describe(b)).dtype == torch.bfloat16
    before = _mapped(d.name)
    del v
    gc.collect()
    assert _mapped(d.name) == before - 1  # munmap with the tensor, nothing else to tell


def test_descriptors_that_are_not_a_torch_shm_file_of_that_size_are_refused():
    t = torch.zeros(6, dtype=torch.int64)
    d = host_share.describe(t)
    size = os.path.getsize(host_share.SHM_DIR + d.name)
    for bad in (d._replace(name="/../etc/passwd"), d._replace(name="/torch_1_2/../x"), d._replace(dtype="object"),
                d._replace(header=-64), d._replace(stride=(1.5,))):
        with pytest.raises(ValueError):
            host_share.attach(bad)
    with pytest.raises(ValueError, match="file of"):
        host_share.attach(d._replace(nbytes=d.nbytes + 8))  # never grows the exporter's file
    assert os.path.getsize(host_share.SHM_DIR + d.name) == size
    with pytest.raises(RuntimeError):  # a view past the storage
        host_share.attach(d._replace(shape=(100,)))
    with pytest.raises(FileNotFoundError):
        host_share.attach(d._replace(name="/torch_1_1_1"))
    with pytest.raises(ValueError, match="where this torch puts it"):  # a view over torch's refcount header
        host_share.attach(d._replace(header=0, nbytes=d.nbytes + d.header))


def test_only_a_regular_file_is_mapped(tmp_path):
    d = host_share.describe(torch.zeros(4, dtype=torch.int64))
    name = f"/torch_{os.getpid()}_4242_7"
    path = host_share.SHM_DIR + name
    os.mkdir(path)
    try:
        with pytest.raises(ValueError, match="regular file"):
            host_share.attach(d._replace(name=name))
    finally:
        os.rmdir(path)
    os.symlink(host_share.SHM_DIR + d.name, path)
    try:
        with pytest.raises(OSError):  # not followed
            host_share.attach(d._replace(name=name))
    finally:
        os.unlink(path)


_EXPORTER = r'''
import pickle, sys, torch
import torch.multiprocessing as mp
mp.set_sharing_strategy("file_system")
from flashpd.kv_bridge.auth import ClusterSecret
from flashpd.kv_bridge.handoff import CacheExporter
t = torch.randn(2, 2, 8, 4, 1, 3); t.share_memory_()
d = torch.randn(1, 2, 8, 4, 1, 3); d.share_memory_()
ex = CacheExporter(t, d, "fp", ClusterSecret.from_hex(sys.argv[1]).mac_key)
h = ex.lease([5, 2], 20, lambda: None)
sock = t.untyped_storage()._share_filename_cpu_()[0]
blob = pickle.dumps((h.__dict__, t[:, :, [5, 2]].clone(), sock))
sys.stdout.buffer.write(len(blob).to_bytes(8, "little") + blob)  # sized: the manager holds the pipe open too
sys.stdout.flush()
sys.stdin.read()
'''

# The decode side, in a process of its own: an abort there must fail this test, not end pytest.
_IMPORTER = r'''
import gc, glob, os, pickle, signal, subprocess, sys, time, torch
from flashpd.kv_bridge.auth import ClusterSecret
from flashpd.kv_bridge.handoff import CacheImporter, Handoff
secret = sys.argv[1]
ex = subprocess.Popen([sys.executable, "-c", sys.argv[2], secret], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                      start_new_session=True)
n = int.from_bytes(ex.stdout.read(8), "little")
hd, want, sock = pickle.loads(ex.stdout.read(n))
t, d = torch.zeros(2, 2, 6, 4, 1, 3), torch.zeros(1, 2, 6, 4, 1, 3)
imp = CacheImporter(t, d, "fp", ClusterSecret.from_hex(secret).mac_key)
imp.copy(Handoff(**hd), [3, 0])
assert torch.equal(t[:, :, [3, 0]], want)
# the exporter's torch_shm_manager: the process holding a socket bound at its path
inodes = set()
with open("/proc/net/unix") as f:
    for line in f.readlines()[1:]:
        parts = line.split()
        if len(parts) >= 8 and parts[7] == sock.decode():
            inodes.add(parts[6])
managers = set()
for fd in glob.glob("/proc/[0-9]*/fd/*"):
    try:
        link = os.readlink(fd)
    except OSError:
        continue
    if link.startswith("socket:[") and link[8:-1] in inodes:
        managers.add(int(fd.split("/")[2]))
managers -= {os.getpid(), ex.pid}
assert managers, "the exporter's manager was not found"
os.killpg(ex.pid, signal.SIGKILL)  # as Ray kills an actor: the process and, here by hand, its manager
for pid in managers:
    os.kill(pid, signal.SIGKILL)
ex.wait()
from flashpd.cluster.launcher import unlink_shared_memory
unlink_shared_memory(ex.pid)  # as the launcher does: the killed manager never will
time.sleep(0.2)
imp.forget(hd["exporter_id"])  # what a restarted exporter's first handoff does
gc.collect()
print("survived", flush=True)
'''


def test_an_importer_outlives_a_dead_exporters_shm_manager():
    """Under Ray a killed prefill actor's torch_shm_manager dies with it. A decode worker that had imported from it
    then aborted (a C++ exception in a destructor: it told the dead manager it let the mapping go) as soon as it
    dropped the dead exporter's tensors."""
    from tests.test_handoff import SECRET  # noqa: PLC0415

    r = subprocess.run([sys.executable, "-c", _IMPORTER, SECRET.export_hex(), _EXPORTER], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "survived" in r.stdout, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
