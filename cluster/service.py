"""Start the whole service from a ServeConfig, in one of its three modes.

- colocated: a decode worker (prefill and decode on one engine) behind the API; by default the engine runs in a
  child process of its own (cluster/engine_proc.py), `engine_process: false` keeps it in this one.
- local: the router in this process; bridge, prefill and decode workers as local processes.
- ray: the router in this process; the workers as Ray actors (joins the Ray job's cluster, or
  `ray_address`, or starts a local one). Nothing imports ray unless this mode is asked for.
The generation API (proto/generation.proto) is the same in all three, and so is the OpenAI-compatible
HTTP API (cluster/http_api.py) that `http_port` adds over the same backend. A disaggregated start makes
a fresh cluster secret (kv_bridge/auth.py), or reads the one `secret_file` keeps across starts, and its launcher
hands it to every worker: the bridge accepts calls and chunks only from processes that hold it.
"""
from __future__ import annotations

import logging
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import grpc

from flashpd.cluster.config import ServeConfig
from flashpd.cluster.api_key import load_api_key
from flashpd.cluster.generation_server import serve_generation
from flashpd.cluster.launcher import Launcher
from flashpd.cluster.metrics import Metrics
from flashpd.kv_bridge.auth import ClusterSecret

log = logging.getLogger(__name__)


@dataclass
class Service:
    cfg: ServeConfig
    address: str
    server: grpc.Server
    backend: object  # EngineLoop (colocated) or Router
    metrics: Metrics
    metrics_address: str | None = None
    worker: object | None = None  # colocated: the DecodeWorker
    pool: object | None = None  # ray / local: the WorkerPool
    closers: list[Callable[[], None]] = field(default_factory=list)
    tokenizer: object | None = None  # the target's (engine/tokenizer.py), None without tokenizer.json
    http: object | None = None  # the HTTP API's server (cluster/http_server.py) when http_port is set
    http_address: str | None = None

    @property
    def alive(self) -> bool:
        return bool(self.backend.alive)

    def stop(self) -> None:
        """Stop serving, then the workers (each step bounded)."""
        self.server.stop(grace=2.0).wait(10)
        for close in reversed(self.closers):
            try:
                close()
            except Exception:  # noqa: BLE001  the rest still stops; what failed is logged
                log.exception("stopping the service")
        self.closers.clear()


def make_launcher(cfg: ServeConfig, secret: ClusterSecret) -> Launcher:
    if cfg.mode == "local":
        from flashpd.cluster.local_launcher import LocalLauncher  # noqa: PLC0415
        return LocalLauncher(secret=secret)
    try:
        from flashpd.cluster.ray_launcher import RayLauncher  # noqa: PLC0415  (imports ray)
    except ModuleNotFoundError as e:
        if e.name != "ray":
            raise
        raise RuntimeError("mode 'ray' needs Ray, which is not installed: pip install -c constraints.txt -e '.[ray]'") \
            from None
    return RayLauncher(cfg.ray_address, secret)


def start_service(cfg: ServeConfig, launcher: Launcher | None = None) -> Service:
    """launcher: one made for this start (default: by mode, with a fresh cluster secret); a launcher
    passed in made its own fresh secret when it was built."""
    check_ports_free(cfg)  # before any worker starts (minutes on a GPU), not after
    api_key = load_api_key(cfg.api_key_file) if cfg.api_key_file is not None else None  # (a bad file: before them too)
    if cfg.http_port is not None:
        from flashpd.cluster.http_api import sampling_defaults  # noqa: PLC0415

        sampling_defaults(cfg.target)  # a bad generation_config.json is refused now too
    if cfg.mode == "colocated":
        svc = _colocated(cfg, api_key)
    else:
        if launcher is not None and cfg.secret_file:
            raise ValueError("secret_file: a launcher passed in brings its own secret")
        secret = ClusterSecret.from_file(cfg.secret_file) if cfg.secret_file else ClusterSecret.generate()
        svc = _disaggregated(cfg, launcher or make_launcher(cfg, secret), api_key)
    try:
        if cfg.metrics_port is not None:
            try:
                port = svc.metrics.serve(cfg.metrics_port, "0.0.0.0" if cfg.allow_remote else cfg.host)
            except OSError as e:
                raise OSError(f"metrics_port: cannot serve on {cfg.metrics_port} ({e.strerror or e})") from None
            svc.metrics_address = f"{cfg.host}:{port}"
            svc.closers.insert(0, svc.metrics.close)
        if cfg.http_port is not None:
            _start_http(svc, cfg, api_key)
    except BaseException:  # the workers and servers already started go too
        svc.stop()
        raise
    return svc


def check_ports_free(cfg: ServeConfig) -> None:
    """Refuse a fixed public port that another process holds now, naming the field (OSError). The real bind
    comes later, so a port taken meanwhile still fails there."""
    for name, port, host in (("port", cfg.port, cfg.host), ("http_port", cfg.http_port, cfg.host),
                             ("metrics_port", cfg.metrics_port, "0.0.0.0" if cfg.allow_remote else cfg.host)):
        if not port:
            continue
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed socket's TIME_WAIT is no holder
            try:
                s.bind((host.strip("[]"), port))
            except OSError as e:
                raise OSError(f"{name}: {host}:{port} is in use or cannot be bound ({e.strerror or e})") from None


def _start_http(svc: Service, cfg: ServeConfig, api_key: str | None) -> None:
    """The HTTP API over the service's backend, on cfg.host:cfg.http_port; stopped first of the closers."""
    from flashpd.cluster.chat_template import load_chat_template  # noqa: PLC0415
    from flashpd.cluster.http_api import build_app, sampling_defaults  # noqa: PLC0415
    from flashpd.cluster.http_server import start_http  # noqa: PLC0415

    chat, why = load_chat_template(cfg.target)
    name = cfg.served_model_name or Path(cfg.target).resolve().name
    app = build_app(svc.backend, svc.tokenizer, name, svc.metrics, chat, why, sampling_defaults(cfg.target),
                    cfg.max_concurrent, cfg.public_settings())
    svc.http = start_http(app, cfg.host, cfg.http_port, cfg.allow_remote, cfg.max_concurrent,
                          cfg.http_allowed_origins, cfg.http_allowed_hosts, api_key)
    svc.http_address = svc.http.address
    svc.closers.append(svc.http.stop)


def _colocated(cfg: ServeConfig, api_key: str | None) -> Service:
    if cfg.splits_engine:
        return _colocated_split(cfg, api_key)
    from flashpd.cluster.worker_main import build_decode, load_model, local_cache  # noqa: PLC0415

    llm = load_model(cfg)
    metrics = Metrics("colocated")
    worker = build_decode(cfg, llm, local_cache(cfg, llm, metrics), metrics)
    try:
        server, port = serve_generation(worker.loop, cfg.host, cfg.port, llm.tokenizer, cfg.allow_remote,
                                        cfg.max_concurrent, cfg.public_settings(), api_key)
    except BaseException:
        worker.stop()
        raise
    return Service(cfg, f"{cfg.host}:{port}", server, worker.loop, metrics, worker=worker,
                   closers=[lambda: worker.stop(10)], tokenizer=llm.tokenizer)


def _colocated_split(cfg: ServeConfig, api_key: str | None) -> Service:
    """Colocated with the engine in a child process (cluster/engine_proc.py); the API, tokenizer and served
    metrics here."""
    from flashpd.cluster.engine_proc import EngineProcess  # noqa: PLC0415
    from flashpd.engine.tokenizer import TextTokenizer  # noqa: PLC0415

    if cfg.gil_switch_interval_s is not None:  # the front end's threads take turns as in the one-process form
        sys.setswitchinterval(cfg.gil_switch_interval_s)
    metrics = Metrics("colocated")
    engine = EngineProcess(cfg, on_done=lambda method, stats, n, outcome:
                           metrics.observe_request(method, stats, outcome, n))
    try:
        engine_metrics(metrics, engine.stats, bool(cfg.device_cache_bytes or cfg.host_cache_bytes),
                       bool(cfg.device_cache_bytes))
        tokenizer = TextTokenizer.from_dir(cfg.target)
        server, port = serve_generation(engine, cfg.host, cfg.port, tokenizer, cfg.allow_remote, cfg.max_concurrent,
                                        cfg.public_settings(), api_key)
    except BaseException:
        engine.stop()
        raise
    return Service(cfg, f"{cfg.host}:{port}", server, engine, metrics, closers=[lambda: engine.stop(10)],
                   tokenizer=tokenizer)


def engine_metrics(metrics: Metrics, stats: Callable[[], dict], has_cache: bool, device_tier: bool) -> None:
    """An engine process's live families, every one from a single read of its stats a scrape: each read is a round
    trip to the engine, and a stuck engine made a scrape wait out one timeout (5 s) a family reading its own (20 s
    with a device tier)."""
    from flashpd.cluster.worker_main import decode_metrics, device_tier_metrics  # noqa: PLC0415

    read = metrics.per_scrape(stats)
    decode_metrics(metrics, _EngineStats(read, has_cache))
    if device_tier:
        device_tier_metrics(metrics, lambda: read()["device_store"])


class _EngineStats:
    """What decode_metrics reads of a DecodeWorker, from the engine process's stats."""

    def __init__(self, stats: Callable[[], dict], has_cache: bool) -> None:
        self.stats = stats
        self.cache = self if has_cache else None

    def failure_reasons(self) -> dict[str, int]:
        """As DecodeWorker.failure_reasons: the engine's bridge imports that failed and were recomputed, by reason."""
        return self.stats().get("import_failures_by_reason", {})


def _disaggregated(cfg: ServeConfig, launcher: Launcher, api_key: str | None) -> Service:
    from flashpd.cluster.router import Router  # noqa: PLC0415
    from flashpd.cluster.worker_pool import WorkerPool  # noqa: PLC0415
    from flashpd.engine.tokenizer import TextTokenizer  # noqa: PLC0415

    # the secret its workers got from the launcher (a Launcher without one: this process's own)
    pool = WorkerPool(cfg, launcher, launcher.secret)
    try:
        pool.start()
        router = Router(cfg, pool)
        tokenizer = TextTokenizer.from_dir(cfg.target)
        server, port = serve_generation(router, cfg.host, cfg.port, tokenizer, cfg.allow_remote, cfg.max_concurrent,
                                        cfg.public_settings(), api_key)
    except BaseException:
        pool.shutdown()
        raise
    return Service(cfg, f"{cfg.host}:{port}", server, router, router.metrics, pool=pool,
                   closers=[pool.shutdown, router.stop], tokenizer=tokenizer)
