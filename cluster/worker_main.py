"""Build and run one worker of the service: the KV bridge, a prefill worker or a decode worker.

`build_worker(role, cfg, port, secret)` is what a Ray actor calls in its process and what
`python -m flashpd.cluster.worker_main` (the local launcher's child) calls; the worker is the
same either way. Its cluster secret (the bridge's token and chunk MAC key) comes from the launcher:
a Ray actor's argument, or the child's FLASHPD_CLUSTER_SECRET. It prints `metrics on ADDR` (when
enabled) and then `listening on ADDR` once it serves, and stops on SIGTERM/SIGINT or when the
process that launched it is gone. Once stopped, the process exits within EXIT_GRACE_S: a server thread
stuck in a call that never returns (a hung prefill) held the interpreter's exit for good, and with its
launcher gone nothing else would end it (it kept its GPU memory, serving nobody).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from flashpd.kv_bridge.stop_signal import StopSignal

ROLES = ("bridge", "prefill", "decode")
# threads (and concurrent calls) a worker's server has beyond the router's max_concurrent requests: its Health probes
# and lease releases must find one while every request's call is in flight (without them the pool restarted a
# healthy, fully loaded worker, failing every request on it)
CONTROL_RPCS = 16
EXIT_GRACE_S = 10.0  # a stopped worker process's exit (which joins its threads) is forced after this long
LOOP_STOP_S = 10.0  # a stopping decode worker waits this long for its engine loop to end
# a stopping worker then waits this long more for what may still use its bridge client (a prefill worker: its running
# prefill; a decode worker: its engine loop, and its load and save threads) before the client closes; still in use
# then, it is left open (a call on a closed gRPC channel can crash the process) and goes with the process
QUIESCE_S = 5.0
log = logging.getLogger(__name__)


def stall_bound(cfg) -> float:
    """How long a prefill, or a decode worker's engine step while it has requests, may run before the worker is taken
    for a hung device or kernel (its Health says not serving, so the pool restarts it): the config's stall_s (300 s
    by default, as SGLang's watchdog_timeout), but never under twice prefill_timeout_s (a prefill its router still
    waits for is not hung)."""
    return max(cfg.stall_s, 2.0 * cfg.prefill_timeout_s)


@dataclass
class RunningWorker:
    role: str
    address: str
    metrics_address: str | None = None
    closers: list[Callable[[], None]] = field(default_factory=list)
    alive_fn: Callable[[], bool] = lambda: True

    def alive(self) -> bool:
        return self.alive_fn()

    def stop(self) -> None:
        for close in reversed(self.closers):
            try:
                close()
            except Exception:  # noqa: BLE001  stopping goes on; what failed is logged
                log.exception("stopping the %s worker", self.role)
        self.closers.clear()


def _hosts(cfg) -> tuple[str, str]:
    """(bind, advertise): loopback unless allow_remote; then all interfaces, advertising
    FLASHPD_ADVERTISE_HOST (a Ray actor sets it to its node's address) or the host name's address."""
    if not cfg.allow_remote:
        return "127.0.0.1", "127.0.0.1"
    import socket  # noqa: PLC0415

    return "0.0.0.0", os.environ.get("FLASHPD_ADVERTISE_HOST") or socket.gethostbyname(socket.gethostname())


def _serve_metrics(w: RunningWorker, metrics, cfg, bind: str, adv: str) -> None:
    if cfg.worker_metrics:
        port = metrics.serve(0, bind)
        w.metrics_address = f"{adv}:{port}"
        w.closers.append(metrics.close)


def bridge_tls(cfg):
    """The service's TLS material from the config (None: plaintext): the bridge and the workers serve it, their
    clients (workers, the router's pool) verify it."""
    from flashpd.kv_bridge.tls import BridgeTls  # noqa: PLC0415

    return BridgeTls.from_paths(cfg.tls_cert, cfg.tls_key, cfg.tls_ca)


def max_chunk_bytes(cfg) -> int:
    """The largest chunk this service's model pair makes (its tensors at cfg.chunk_tokens, a header,
    the MAC): what the bridge accepts at most, read from the checkpoints' config.json without loading
    weights. An unset dtype counts as float32, the widest a worker may run."""
    from pathlib import Path  # noqa: PLC0415

    from flashpd.engine.config import load_config, read_json_object  # noqa: PLC0415
    from flashpd.engine.drafter import DFlashConfig  # noqa: PLC0415
    from flashpd.kv_bridge.chunk import max_chunk_bytes as chunk_limit  # noqa: PLC0415
    from flashpd.kv_bridge.layout import ChunkLayout  # noqa: PLC0415

    t = load_config(cfg.target)
    d = DFlashConfig.from_dict(read_json_object(Path(cfg.draft) / "config.json")) if cfg.draft else None
    return chunk_limit(ChunkLayout(t.num_hidden_layers, t.num_key_value_heads, t.head_dim, cfg.chunk_tokens,
                                   cfg.dtype or "float32", d.num_hidden_layers if d else None, None,
                                   d.num_key_value_heads if d else None, d.head_dim if d else None))


def _bridge(cfg, port: int, secret) -> RunningWorker:
    from flashpd.cluster.metrics import Metrics  # noqa: PLC0415
    from flashpd.kv_bridge.server import serve  # noqa: PLC0415
    from flashpd.kv_bridge.store import MemoryStore  # noqa: PLC0415

    if cfg.bridge_transport == "arena":  # its readers map the memory tier (same host) and read entries in place
        from flashpd.kv_bridge.arena_store import ArenaStore  # noqa: PLC0415
        store = ArenaStore(cfg.bridge_memory_bytes, secret)
    else:
        store = MemoryStore(cfg.bridge_memory_bytes, secret)
    if cfg.bridge_disk_dir:
        from flashpd.kv_bridge.disk import DiskStore, TieredStore  # noqa: PLC0415
        store = TieredStore(store, DiskStore(cfg.bridge_disk_dir, cfg.bridge_disk_bytes, secret),
                            queue_bytes=cfg.bridge_disk_queue_bytes)
    bind, adv = _hosts(cfg)
    server, bound = serve(store, bind, port, max_workers=32, max_chunk_bytes=max_chunk_bytes(cfg),
                          allow_remote=cfg.allow_remote, secret=secret, tls=bridge_tls(cfg))
    w = RunningWorker("bridge", f"{adv}:{bound}", closers=[lambda: server.stop(grace=1.0).wait(5)])
    if hasattr(store, "close"):  # closers run last first: the server stops, then queued disk writes finish
        w.closers.insert(0, store.close)
    m = Metrics("bridge")

    def lookups() -> dict:
        st = store.stats()
        if "hits_memory" in st:
            return {("memory", "hit"): st["hits_memory"], ("disk", "hit"): st["hits_disk"], ("all", "miss"): st["misses"]}
        return {("memory", "hit"): st["hits"], ("memory", "miss"): st["misses"]}

    m.live("flashpd_bridge_store_lookups", "Chunk reads of the bridge's store, by tier and result", "counter",
           ("tier", "result"), lookups)
    m.live("flashpd_bridge_store_bytes", "Bytes held by the bridge's memory tier", "gauge", (),
           lambda: {(): (store.memory if hasattr(store, "memory") else store).stats()["bytes"]})
    _serve_metrics(w, m, cfg, bind, adv)
    return w


def load_model(cfg):
    import torch  # noqa: PLC0415

    from flashpd.engine.factory import load_engine  # noqa: PLC0415
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    if cfg.gil_switch_interval_s is not None:  # the process that runs an engine loop (ServeConfig says why)
        sys.setswitchinterval(cfg.gil_switch_interval_s)
    return load_engine(cfg.target, cfg.draft, device=cfg.device, dtype=cfg.dtype,
                       kv_cache_tokens=cfg.kv_cache_tokens, token_map=cfg.draft_token_map,
                       draft_quantization=cfg.draft_quantization)


def fingerprint(cfg, llm) -> str:
    """The method fingerprint both sides of the bridge compute from the same config."""
    from flashpd.kv_bridge.keys import MethodFingerprint, weights_identity  # noqa: PLC0415

    taps = tuple(llm.drafter.cfg.target_layer_ids) if llm.drafter is not None else ()
    target = weights_identity(cfg.target, loaded=llm.target_stamps or None)  # of the files loaded, or refused
    draft = weights_identity(cfg.draft, loaded=llm.draft_stamps or None) if cfg.draft else "none"
    return MethodFingerprint(target, draft,
                             taps, str(llm.dtype).removeprefix("torch."),
                             draft_quantization=(cfg.draft_quantization or "none") if cfg.draft else "none").digest()


def host_tier(cfg, llm, backing):
    """A pinned host tier (cfg.host_cache_bytes) in front of `backing`, its slots sized to a full chunk of this
    model pair (a first, smaller target-only chunk must not size them) and allocated before serving."""
    import torch  # noqa: PLC0415

    from flashpd.engine.factory import check_fits  # noqa: PLC0415
    from flashpd.kv_bridge.host_store import HostStore  # noqa: PLC0415
    from flashpd.kv_bridge.layout import ChunkLayout  # noqa: PLC0415

    check_fits("host_cache_bytes", cfg.host_cache_bytes, torch.device("cpu"))  # pinned: it grew until the host ran out
    drafts = getattr(llm.generator, "drafts", None)
    layout = ChunkLayout.of_caches(llm.runner.cache.data, drafts.cache.data if drafts is not None else None,
                                   cfg.chunk_tokens, None)
    store = HostStore(cfg.host_cache_bytes, llm.device, backing=backing, slot_bytes=layout.payload_bytes())
    store.reserve()
    return store


def local_cache(cfg, llm, metrics):
    """Colocated: a prefix cache on the worker-local tiers (device and/or pinned host), else none."""
    if not cfg.device_cache_bytes and not cfg.host_cache_bytes:
        return None
    from flashpd.kv_bridge.prefix_cache import PrefixCache  # noqa: PLC0415

    return PrefixCache(device_tier(cfg, llm, None, metrics), fingerprint(cfg, llm), cfg.chunk_tokens,
                       stage_bytes=cfg.prefix_stage_bytes)


def device_tier(cfg, llm, backing, metrics):
    """`backing` itself, or the worker-local tiers in front of it: pinned host (cfg.host_cache_bytes > 0), then
    a DeviceStore (cfg.device_cache_bytes > 0) whose reads by tier become a live metric."""
    if cfg.host_cache_bytes:
        backing = host_tier(cfg, llm, backing)
    if not cfg.device_cache_bytes:
        return backing
    from flashpd.engine.factory import check_fits  # noqa: PLC0415
    from flashpd.kv_bridge.device_store import DeviceStore  # noqa: PLC0415

    check_fits("device_cache_bytes", cfg.device_cache_bytes, llm.device)
    store = DeviceStore(cfg.device_cache_bytes, llm.device, backing=backing)
    device_tier_metrics(metrics, store.stats)
    return store


def device_tier_metrics(metrics, stats) -> None:
    """The device tier's live families, read from `stats()` (DeviceStore.stats(), here or in an engine process)."""
    def reads() -> dict:
        st = stats()
        return {("device", "hit"): st["hits_device"], ("backing", "hit"): st["hits_backing"],
                ("all", "miss"): st["misses"]}

    metrics.live("flashpd_device_cache_reads", "Chunk reads of the worker's device tier, by tier and result",
                 "counter", ("tier", "result"), reads)
    metrics.live("flashpd_device_cache_bytes", "Bytes held by the worker's device tier", "gauge", (),
                 lambda: {(): stats()["bytes"]})


def _bridge_cache(cfg, llm, w: RunningWorker, metrics, secret, in_use: Callable[[], bool] = lambda: False):
    """A PrefixCache on the bridge, metered; its bytes / seconds / GB/s become live metrics. Its client is closed
    last of the worker's closers, unless `in_use()` says a call may still use it then (a call on a closed gRPC
    channel can crash the process): it is left open, and goes with the process."""
    from flashpd.cluster.bridge_meter import MeteredStore  # noqa: PLC0415
    from flashpd.kv_bridge.client import BridgeClient, RemoteStore  # noqa: PLC0415
    from flashpd.kv_bridge.prefix_cache import PrefixCache  # noqa: PLC0415
    import torch  # noqa: PLC0415

    on_gpu = torch.device(llm.device).type == "cuda"  # restores copy out of the arena it maps: page-locked, one DMA
    client = BridgeClient(cfg.bridge_address, timeout_s=cfg.bridge_timeout_s, secret=secret, tls=bridge_tls(cfg),
                          cooloff_s=cfg.bridge_timeout_s,
                          max_chunk_bytes=max_chunk_bytes(cfg),
                          pin_device=llm.device if cfg.bridge_transport == "arena" and on_gpu else None,
                          shm_pool_bytes=cfg.bridge_shm_pool_bytes if cfg.bridge_transport != "inline" else 0)

    def close() -> None:
        if in_use():
            log.warning("the %s worker's bridge client is left open: work that uses it still runs", w.role)
            return
        client.close()

    w.closers.append(close)
    meter = MeteredStore(RemoteStore(client, cfg.bridge_transport))
    cache = PrefixCache(device_tier(cfg, llm, meter, metrics), fingerprint(cfg, llm), cfg.chunk_tokens,
                        stage_bytes=cfg.prefix_stage_bytes)
    metrics.live("flashpd_bridge_bytes", "Bytes moved through the KV bridge", "counter", ("direction",),
                 lambda: {(d,): v for d, v in meter.bytes.items()})
    metrics.live("flashpd_bridge_seconds", "Seconds spent moving them", "counter", ("direction",),
                 lambda: {(d,): v for d, v in meter.seconds.items()})
    metrics.live("flashpd_bridge_gbps", "Average bridge rate (GB/s)", "gauge", ("direction",),
                 lambda: {(d,): v for d, v in meter.gbps().items()})
    metrics.live("flashpd_cache_tokens", "Prompt positions restored from a cache tier (hit) or computed (miss)",
                 "counter", ("tier", "result"),
                 lambda: {("bridge", "hit"): cache.stats.hit_tokens,
                          ("bridge", "miss"): cache.stats.prompt_tokens - cache.stats.hit_tokens})
    return cache


def _prefill(cfg, port: int, secret) -> RunningWorker:
    from flashpd.cluster.generation_server import new_server  # noqa: PLC0415
    from flashpd.cluster.metrics import Metrics  # noqa: PLC0415
    from flashpd.cluster.worker_services import PrefillHost, PrefillWorkerServicer  # noqa: PLC0415
    from flashpd.prefill_node.worker import PrefillWorker  # noqa: PLC0415

    if not cfg.bridge_address:
        raise ValueError("bridge_address: a prefill worker publishes to a KV bridge; none was given")
    llm = load_model(cfg)
    bind, adv = _hosts(cfg)
    metrics = Metrics("prefill")
    w = RunningWorker("prefill", "")
    host: PrefillHost | None = None
    # stopping: the running prefill ends first (bounded), as it may still restore from or publish to the bridge
    cache = _bridge_cache(cfg, llm, w, metrics, secret,
                          in_use=lambda: host is not None and not host.quiesce(QUIESCE_S))
    if cfg.kv_transport in ("device", "dist"):
        # the bridge only offers cached prefixes here (nothing is published): a bridge that fails is a miss,
        # counted and logged, not a failed prefill
        from flashpd.decode_node.bridge_import import GuardedPrefixCache  # noqa: PLC0415
        cache = GuardedPrefixCache(cache)
    worker = PrefillWorker(llm.runner, llm.drafter, cache, tuple(llm.stop_ids),
                           publish_after_answer=cfg.kv_transport == "bridge" and cfg.prefill_publish == "after_answer")
    if worker.publisher is not None:
        w.closers.append(worker.publisher.close)  # (a stopping worker's quiesce waited for its publishes)
    if wants_warmup(cfg, llm.runner):  # before serving: nothing else runs on this runner yet
        from flashpd.engine.warmup import lengths_for, warm_prefill  # noqa: PLC0415
        done = warm_prefill(worker.gen, lengths_for(llm.runner.max_positions, 1))
        log.info("prefill warm-up: %d prompts of %s tokens in %.1f s", done["requests"], done["lengths"],
                 done["seconds"])
    dist = None
    if cfg.kv_transport in ("device", "dist"):
        worker.exporter = cache_exporter(cfg, llm, worker.gen, secret)
    if cfg.kv_transport == "dist":
        dist = dist_exporter(cfg, worker.exporter, worker.gen, secret, adv)
        w.closers.append(dist.close)
    host = PrefillHost(worker, llm.runner, llm.draft_width if llm.drafter is not None else None,
                       cfg.fault_prefill_delay_s, stall_s=stall_bound(cfg))
    metrics.live("flashpd_queue_depth", "Requests waiting", "gauge", (), lambda: {(): host.waiting})
    servicer = PrefillWorkerServicer(host, metrics, dist, claim_keep_s=2 * cfg.handoff_lease_s)  # (a lease is gone)
    server, bound = new_server(bind, port, cfg.allow_remote, cfg.max_concurrent + CONTROL_RPCS,
                               {"PrefillWorker": servicer},
                               token=secret.worker_token, exclusive=True,  # a restart asks for its old port
                               tls=bridge_tls(cfg))
    w.address = f"{adv}:{bound}"
    w.closers.append(lambda: server.stop(grace=1.0).wait(5))
    if worker.exporter is not None:
        worker.exporter.address = w.address  # where decode workers release its leases
        stop = threading.Event()
        threading.Thread(target=_reap, args=(host, stop, cfg.handoff_lease_s), name="lease-reaper", daemon=True).start()
        w.closers.append(stop.set)
    _serve_metrics(w, metrics, cfg, bind, adv)
    return w


def _shared_caches(gen) -> tuple:
    """The generator's target cache and (DFlash) drafter context cache; on a CPU moved into shared memory
    (the device path's stand-in; a GPU shares them through CUDA IPC as they are)."""
    caches = (gen.runner.cache.data, gen.drafts.cache.data if getattr(gen, "drafts", None) is not None else None)
    for t in caches:
        if t is not None and t.device.type == "cpu":
            import torch.multiprocessing as mp  # noqa: PLC0415
            mp.set_sharing_strategy("file_system")  # unrelated processes share CPU tensors by file name only
            t.share_memory_()
    return caches


def cache_exporter(cfg, llm, gen, secret):
    """The prefill worker's side of the same-host device path (cfg.kv_transport == "device")."""
    from flashpd.kv_bridge.handoff import CacheExporter  # noqa: PLC0415

    target, draft = _shared_caches(gen)
    return CacheExporter(target, draft, fingerprint(cfg, llm), secret.mac_key, lease_s=cfg.handoff_lease_s)


def dist_exporter(cfg, exporter, gen, secret, host: str):
    """The prefill worker's side of the cross-host path (cfg.kv_transport == "dist"): its leases, sent over
    torch.distributed pairs (kv_bridge/dist_transfer.py); the device path's sealed export is not shipped."""
    from flashpd.kv_bridge.dist_transfer import DistExporter  # noqa: PLC0415

    exporter.blob = b""
    target, draft = _shared_caches(gen)
    return DistExporter(exporter, target, draft, secret.mac_key, host, timeout_s=cfg.handoff_lease_s)


def dist_importer(cfg, llm, scheduler, secret, host: str):
    """The decode worker's side of the cross-host path: a HandoffImport over a DistImporter (control by gRPC)."""
    from flashpd.cluster.dist_control import DistControlClient  # noqa: PLC0415
    from flashpd.cluster.worker_client import LeaseReleaser  # noqa: PLC0415
    from flashpd.decode_node.handoff_import import HandoffImport  # noqa: PLC0415
    from flashpd.kv_bridge.dist_transfer import DistImporter  # noqa: PLC0415

    gen = scheduler.spec if scheduler.spec is not None else scheduler.native
    target = gen.runner.cache.data
    draft = gen.drafts.cache.data if getattr(gen, "drafts", None) is not None else None
    control = DistControlClient(cfg.handoff_lease_s, secret.worker_token, bridge_tls(cfg))
    imp = DistImporter(target, draft, fingerprint(cfg, llm), secret.mac_key, control, host, cfg.handoff_lease_s)
    return HandoffImport(imp, LeaseReleaser(secret.worker_token, bridge_tls(cfg)))  # type: ignore[arg-type]  (CacheImporter's copy / peer_busy)


def cache_importer(cfg, llm, scheduler, secret):
    """The decode worker's side: a HandoffImport over its scheduler's caches, releasing leases by RPC."""
    from flashpd.cluster.worker_client import LeaseReleaser  # noqa: PLC0415
    from flashpd.decode_node.handoff_import import HandoffImport  # noqa: PLC0415
    from flashpd.kv_bridge.handoff import CacheImporter  # noqa: PLC0415

    gen = scheduler.spec if scheduler.spec is not None else scheduler.native
    target = gen.runner.cache.data
    draft = gen.drafts.cache.data if getattr(gen, "drafts", None) is not None else None
    return HandoffImport(CacheImporter(target, draft, fingerprint(cfg, llm), secret.mac_key),
                         LeaseReleaser(secret.worker_token, bridge_tls(cfg)))


def _reap(host, stop: threading.Event, lease_s: float) -> None:
    """Free leases past their deadline even when no prefill comes to do it."""
    while not stop.wait(max(0.05, lease_s / 4)):
        try:
            host.expire()
        except Exception:  # noqa: BLE001  the reaper outlives a failed pass; it is logged
            log.exception("expiring leases")


def decode_metrics(metrics, worker) -> None:
    """The decode worker's live families (also used by the colocated server), read from one stats dict a scrape."""
    st = metrics.per_scrape(worker.stats)
    metrics.live("flashpd_queue_depth", "Requests waiting", "gauge", (), lambda: {(): st()["waiting"]})
    metrics.live("flashpd_running_requests", "Requests in the running batch", "gauge", (), lambda: {(): st()["running"]})
    metrics.live("flashpd_kv_blocks_free", "Free KV blocks", "gauge", (), lambda: {(): st()["kv_blocks_free"]})
    metrics.live("flashpd_preemptions", "Requests preempted (recomputed when re-admitted)", "counter", (),
                 lambda: {(): st()["preemptions"]})
    metrics.live("flashpd_handoff_imports", "Prompts whose KV came from a prefill worker (device or dist path)", "counter", (),
                 lambda: {(): st()["handoff_imports"]})
    metrics.live("flashpd_prefill_holds", "Decode steps held while a prefill worker on the same GPU computed",
                 "counter", (), lambda: {(): st()["prefill_holds"]})
    metrics.live("flashpd_handoff_fallbacks", "Prefill-worker KV imports (device or dist path) that failed and were recomputed locally",
                 "counter", (), lambda: {(): st()["handoff_fallbacks"]})
    metrics.live("flashpd_jit_compiles_after_warmup", "Triton kernel variants compiled while serving (shapes the "
                 "warm-up did not meet)", "counter", (), lambda: {(): st()["jit_compiles_after_warmup"]})
    metrics.live("flashpd_graph_captures_after_warmup", "CUDA graphs captured while serving (shapes the warm-up "
                 "did not meet)", "counter", (), lambda: {(): st()["graph_captures_after_warmup"]})
    if worker.cache is not None:
        metrics.live("flashpd_recompute_fallbacks", "Bridge imports that failed and were recomputed locally",
                     "counter", ("reason",), lambda: {(k,): v for k, v in worker.failure_reasons().items()})


def wants_warmup(cfg, runner) -> bool:
    """cfg.warmup, or by default: on a GPU (where graphs and compiles are what a warm-up takes out of the
    first requests; on a CPU it would only delay the start)."""
    return cfg.warmup if cfg.warmup is not None else runner.device.type == "cuda"


def build_decode(cfg, llm, cache, metrics, sink=None):
    """A DecodeWorker whose finished requests feed the metrics (sink: EngineLoop's, for an engine process)."""
    from flashpd.decode_node.worker import DecodeWorker  # noqa: PLC0415
    from flashpd.engine.width_policy import parse_width_policy  # noqa: PLC0415

    def finished(r) -> None:
        # the tokens made here: a resumed request's output from before it resumed was counted where it was made
        metrics.observe_request(r.method, r.seq.stats.as_dict(), "ok", len(r.seq.output) - r.seq.resumed)

    def aborted(method: str, outcome: str, tokens: int) -> None:  # cancelled or failed: counted, no latency
        metrics.observe_request(method, {}, outcome, tokens)

    worker = DecodeWorker(llm.runner, llm.drafter, tuple(llm.stop_ids), cache, cfg.max_running, cfg.policy, finished,
                          warmup=wants_warmup(cfg, llm.runner), width_policy=parse_width_policy(cfg.draft_width_policy),
                          hold_fraction=cfg.session_hold_fraction, hold_steps=cfg.session_hold_steps, sink=sink,
                          stall_s=stall_bound(cfg), on_abort=aborted)  # every form: colocated, in process or not
    decode_metrics(metrics, worker)
    return worker


def _decode(cfg, port: int, secret) -> RunningWorker:
    from flashpd.cluster.generation_server import new_server  # noqa: PLC0415
    from flashpd.cluster.metrics import Metrics  # noqa: PLC0415
    from flashpd.cluster.worker_services import DecodeWorkerServicer  # noqa: PLC0415

    llm = load_model(cfg)
    bind, adv = _hosts(cfg)
    metrics = Metrics("decode")
    w = RunningWorker("decode", "")
    worker = None
    # stopping: the engine loop, and the load and save threads it leaves, end first (bounded): they may still call
    # the bridge (a loop that did not stop within LOOP_STOP_S runs on)
    cache = _bridge_cache(cfg, llm, w, metrics, secret,
                          in_use=lambda: worker is not None and not worker.quiesce(QUIESCE_S)) \
        if cfg.bridge_address else None
    worker = build_decode(cfg, llm, cache, metrics)
    if cfg.kv_transport == "device":  # before the engine loop takes its first request
        worker.scheduler.handoff = cache_importer(cfg, llm, worker.scheduler, secret)
        worker.scheduler.hold_for_prefill_s = cfg.prefill_hold_s
    elif cfg.kv_transport == "dist":
        worker.scheduler.handoff = dist_importer(cfg, llm, worker.scheduler, secret, adv)
        w.closers.append(worker.scheduler.handoff.importer.close)
    w.closers.append(lambda: worker.stop(LOOP_STOP_S))
    servicer = DecodeWorkerServicer(worker.loop, llm.tokenizer)  # Health: not serving while the loop looks hung
    server, bound = new_server(bind, port, cfg.allow_remote, cfg.max_concurrent + CONTROL_RPCS,
                               {"DecodeWorker": servicer, "Generation": servicer}, token=secret.worker_token,
                               exclusive=True, tls=bridge_tls(cfg))
    w.address = f"{adv}:{bound}"
    w.closers.append(lambda: server.stop(grace=1.0).wait(5))
    w.alive_fn = lambda: worker.loop.alive
    _serve_metrics(w, metrics, cfg, bind, adv)
    return w


def build_worker(role: str, cfg, port: int = 0, secret=None) -> RunningWorker:
    """Start one worker in this process (its servers run on their own threads). secret: the cluster's
    ClusterSecret (default: FLASHPD_CLUSTER_SECRET, else a random one of this process)."""
    from flashpd.kv_bridge.auth import resolve  # noqa: PLC0415

    if role not in ROLES:
        raise ValueError(f"role: must be one of {list(ROLES)}, got {role!r}")
    return {"bridge": _bridge, "prefill": _prefill, "decode": _decode}[role](cfg, port, resolve(secret))


def _parent_gone(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return os.getppid() != pid


def _exit_if_orphaned_while_starting(parent_pid: int | None, started: threading.Event) -> None:
    """A launcher killed while this worker loads (minutes on a GPU) must not leave it loading, then serving
    nobody: the serving loop below watches the parent from then on."""
    while not started.wait(1.0):
        if _parent_gone(parent_pid):
            print(f"launcher (pid {parent_pid}) is gone while this worker started: exiting", file=sys.stderr,
                  flush=True)
            os._exit(3)


def _exit_within(code: int, grace_s: float) -> None:
    """End this process with `code` once grace_s has passed, whatever still runs: the interpreter's exit joins the
    server's threads, and one stuck in a call that never returns would hold it for good (a daemon thread keeps
    running while the exit waits for those)."""
    def force() -> None:
        time.sleep(grace_s)
        stuck = sorted(t.name for t in threading.enumerate() if not t.daemon and t is not threading.main_thread())
        print(f"the stopped worker did not exit in {grace_s:g} s (threads still running: {', '.join(stuck) or '-'}): "
              f"exiting anyway", file=sys.stderr, flush=True)
        os._exit(code)

    threading.Thread(target=force, name="exit-watchdog", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    from flashpd.cluster.config import ServeConfig  # noqa: PLC0415

    ap = argparse.ArgumentParser(description="run one flashpd worker (the local launcher starts these)")
    ap.add_argument("--role", required=True, choices=ROLES)
    ap.add_argument("--config-json", required=True, help="the ServeConfig as JSON")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--parent-pid", type=int, help="exit when this process is gone")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {a.role} %(levelname)s %(name)s: %(message)s")
    cfg = ServeConfig.from_dict(json.loads(a.config_json), "--config-json")
    started = threading.Event()
    threading.Thread(target=_exit_if_orphaned_while_starting, args=(a.parent_pid, started), daemon=True,
                     name="parent-watch").start()
    try:
        w = build_worker(a.role, cfg, a.port)
    except (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError) as e:
        print(f"flashpd {a.role} worker: error: {e}", file=sys.stderr, flush=True)  # bad input: one line, no trace
        return 2
    finally:
        started.set()
    done = StopSignal()  # before `listening on`: a launcher may stop it the moment it reads that
    if w.metrics_address:
        print(f"metrics on {w.metrics_address}", flush=True)
    print(f"listening on {w.address}", flush=True)
    code = 0
    while not done.wait(1.0):
        if _parent_gone(a.parent_pid):
            log.warning("launcher (pid %s) is gone: stopping", a.parent_pid)
            break
        if not w.alive():
            log.error("the %s worker stopped serving: exiting", a.role)
            code = 1
            break
    w.stop()
    return code


if __name__ == "__main__":
    rc = main()
    _exit_within(rc, EXIT_GRACE_S)  # the worker is stopped: what still runs may not hold the process
    sys.exit(rc)
