"""Same-host transports checked at start: which workers must share a host, and whether they do.

bridge_transport "shm" and "arena" pass KV through files in the bridge's and the workers' /dev/shm, and
kv_transport "device" passes it between a prefill and a decode worker through CUDA IPC and /dev/shm files. Ray
may place actors on any node: such a worker on another host started fine, then each of its requests failed its
publish or import and recomputed its prompt (a warning a request, the prefill's work wasted). A service now
refuses to start, or a restarted worker to serve, where a same-host transport spans two hosts.

A host is what those files and processes need in common: one kernel boot, one /dev/shm mount and one pid
namespace (the arena is opened through /proc/<pid>/fd; shm cleanup judges writers by pid). Ray node ids are not
hosts: two Ray nodes of one machine share all three.
"""
from __future__ import annotations

import hashlib
import os
import socket
import sys
from typing import Iterable

from flashpd.cluster.launcher import Launched, WorkerStartError


def host_identity() -> dict:
    """This process's host: {"key": what must match, "host": its name, "node": its Ray node id or None}. A part
    that cannot be read (not Linux) counts as its name, so two such processes match only by host name."""
    name = socket.gethostname()
    parts = []
    for read in (lambda: open("/proc/sys/kernel/random/boot_id").read().strip(),
                 lambda: str(os.stat("/dev/shm").st_dev), lambda: str(os.stat("/proc/self/ns/pid").st_ino)):
        try:
            parts.append(read())
        except OSError:
            parts.append(name)
    node = None
    ray = sys.modules.get("ray")  # a Ray process has it imported already; importing it here costs ~0.7 s
    try:
        if ray is not None and ray.is_initialized():
            node = ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001  not in a Ray process after all: no node id to name
        pass
    return {"key": hashlib.blake2b("\0".join(parts).encode(), digest_size=8).hexdigest(), "host": name,
            "node": node}


def same_host_sets(cfg) -> list[tuple[str, bool]]:
    """(the transport, whether the bridge is in the set) for each same-host transport the config uses."""
    out = []
    if cfg.bridge_transport in ("shm", "arena"):  # (the prefix cache's reads go through it whatever kv_transport)
        out.append((f"bridge_transport {cfg.bridge_transport!r}", True))
    if cfg.kv_transport == "device" and cfg.prefill_workers > 0:  # (none: nothing is handed between workers)
        out.append(("kv_transport 'device'", False))
    return out


def _where(w: Launched) -> str:
    h = w.host or {}
    node = f", Ray node {h['node'][:12]}" if h.get("node") else ""
    return f"{w.role} worker {w.index} on {h.get('host', '?')}{node}"


def check_colocated(cfg, bridge: Launched | None, workers: Iterable[Launched]) -> None:
    """Raise WorkerStartError naming the transport and two workers on different hosts, where a same-host
    transport spans hosts. A worker whose host is unknown (host None) is not checked."""
    workers = [w for w in workers if w.role in ("prefill", "decode") and w.host is not None]
    for transport, with_bridge in same_host_sets(cfg):
        group = ([bridge] if with_bridge and bridge is not None and bridge.host is not None else []) + workers
        if not group:
            continue
        first = group[0]
        for w in group[1:]:
            if w.host["key"] != first.host["key"]:
                fix = "'inline'" if with_bridge else "'dist' (or 'bridge')"
                raise WorkerStartError(
                    f"{transport} needs {'the bridge and ' if with_bridge else ''}every prefill and decode worker "
                    f"on one host, but {_where(first)} and {_where(w)} are not (another kernel, /dev/shm or pid "
                    f"namespace): use {fix}, or pin the roles to one node (ray_configs/cluster.yaml's "
                    f"flashpd_* resources)")
