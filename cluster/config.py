"""The service's config: one typed object read from JSON or YAML, shared by the router and every worker.

`flashpd serve --config FILE` reads it; the router hands the same dict (plus the bridge's
address) to each worker it launches, so every process agrees on the model, dtype and chunking.
Unknown keys are refused by name: a typo must not silently fall back to a default.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

MODES = ("colocated", "ray", "local")
MAX_WORKERS = 256  # prefill or decode workers a service may ask for (each a process or a Ray actor)
# the longest wait a config may set: Python's and gRPC's waits overflow on a huge finite one (1e30 killed the pool's
# supervisor thread with an OverflowError and made every health probe fail at once)
MAX_WAIT_S = 7 * 86400.0
# num_gpus a worker asks Ray for: Ray keeps resources to 4 decimals (1e-9 failed inside Ray, after the bridge
# started); infinity failed converting to an int after the bridge started
MIN_GPU_SHARE, MAX_GPU_SHARE = 1e-4, 1024.0
MAX_TORCH_THREADS = 1024  # intra-op threads a worker may ask for (100,000 crashed the engine making them)
_SCALARS = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,), "None": (type(None),)}


def _check_types(cfg: Any) -> None:
    """Each field holds a value of its annotated type (a config file's "64" for an int fails here, named, not
    deep in a worker). Only fields annotated with plain scalars and None are checked; bool is never an int."""
    for f in fields(cfg):
        names = [n.strip() for n in str(f.type).split("|")]
        if not all(n in _SCALARS for n in names):
            continue
        v = getattr(cfg, f.name)
        ok = any(isinstance(v, t) and not (isinstance(v, bool) and n in ("int", "float"))
                 for n in names for t in _SCALARS[n])
        if not ok:
            raise ValueError(f"{f.name}: must be {' or '.join('null' if n == 'None' else n for n in names)}, "
                             f"got {v!r}")


def _not_str(v: Any) -> str:
    raise ValueError(f"{v!r} is not a string")


# ServeConfig fields that name files or directories (relative ones: to where `flashpd serve` runs)
PATH_KEYS = ("target", "draft", "draft_token_map", "bridge_disk_dir", "secret_file", "tls_cert", "tls_key", "tls_ca",
             "api_key_file")

# ServeConfig fields a client may read back (Health's settings_json; `public_settings`)
PUBLIC_SETTINGS = ("mode", "device", "dtype", "kv_cache_tokens", "max_running", "session_hold_fraction",
                   "session_hold_steps", "engine_process", "policy", "draft_width_policy", "draft_token_map",
                   "draft_quantization", "max_concurrent", "prefill_workers", "decode_workers", "chunk_tokens",
                   "device_cache_bytes", "host_cache_bytes", "bridge_transport", "kv_transport", "prefill_publish",
                   "gil_switch_interval_s", "warmup")


@dataclass(frozen=True)
class ServeConfig:
    target: str
    draft: str | None = None
    mode: str = "colocated"  # colocated: one process; ray / local: router + bridge + prefill + decode workers
    device: str | None = None  # default: cuda when available
    dtype: str | None = None  # default: bfloat16 on cuda, float32 on cpu
    kv_cache_tokens: int | None = None  # per worker; default: half the free device memory
    max_running: int = 64  # requests one decode worker batches at most
    # a serving device-loop session goes on past finished rows and arrivals until they reach this share of its rows
    # or the first has waited session_hold_steps steps (engine/scheduler.py); 0: it restarts at each one
    session_hold_fraction: float = 0.5
    session_hold_steps: int = 4
    # colocated: run the engine in a child process of its own (cluster/engine_proc.py), so that the front
    # ends' threads never hold the interpreter lock its steps wait for; the API, tokenizer and served metrics stay
    # in the serving process. None: on for mode colocated (the other modes' workers are processes already)
    engine_process: bool | None = None
    policy: str = "preempt"  # decode admission: "preempt" (by free blocks, preempt by recompute) or "reserve"
    # how wide a DFlash step verifies (engine/width_policy.py parse_width_policy): "fixed" (the whole block),
    # "fixed:W", "batch:caps=1-16/33-8/65-1" (a width by the step's DFlash rows; 1 = no speculation from that
    # size on: those rows step natively, keeping their draft context, and draft again once fewer), or
    # "confidence[:threshold=..,caps=1-16/9-8/17-4,...]" (cut at the draft's first unsure position)
    draft_width_policy: str = "fixed"
    # a reduced draft vocabulary (engine/token_map.py; SGLang's --speculative-token-map): a file of hot token ids
    # whose head rows alone the drafter reads; None: the whole vocabulary. Greedy output is unchanged either way
    # (sampled keeps its distribution).
    draft_token_map: str | None = None
    # the drafter's few-row passes (a batch-1 draft) in "fp8" weights (DFlashDrafter.quantize; vLLM's
    # speculative_config "quantization"): half the bytes a draft reads; None: the checkpoint's dtype. Same greedy
    # output.
    draft_quantization: str | None = None
    # the public endpoint (router, or the colocated server)
    host: str = "127.0.0.1"
    port: int = 0
    allow_remote: bool = False  # bind beyond loopback (no authentication unless api_key_file: trusted networks)
    metrics_port: int | None = None  # Prometheus endpoint of the router / colocated server (0 = any free port)
    # the OpenAI-compatible HTTP API (cluster/http_api.py) beside the gRPC one, on `host` (None = off, 0 = any
    # free port); its model name is served_model_name (None: the target directory's name)
    http_port: int | None = None
    served_model_name: str | None = None
    # web page origins ("http(s)://host[:port]", or "*") whose browser requests the HTTP API serves besides its
    # own origin's, with CORS answers (cluster/http_origin.py: a page served elsewhere, or behind a proxy that
    # rewrites Host)
    http_allowed_origins: tuple[str, ...] = ()
    # host names (no port) the HTTP API may be addressed by when bound to loopback, besides loopback names: a proxy
    # on this host that passes its public Host through (any other name is refused: DNS rebinding)
    http_allowed_hosts: tuple[str, ...] = ()
    # a file holding the key the public APIs ask of every call but Health (gRPC metadata or HTTP header
    # `authorization: Bearer <key>`; cluster/api_key.py); None: no key (loopback or a trusted network only)
    api_key_file: str | None = None
    worker_metrics: bool = True  # each worker serves its own Prometheus endpoint (a free port, logged)
    max_concurrent: int = 256  # concurrent RPCs per server (one thread each)
    # disaggregation
    prefill_workers: int = 1
    decode_workers: int = 1
    chunk_tokens: int = 256  # positions per bridge entry
    bridge_memory_bytes: int = 1 << 30
    bridge_disk_dir: str | None = None  # adds a disk tier under the memory one
    # a file keeping the cluster secret across service starts (made, 0600, when missing); unset: a fresh secret
    # each start, under which the disk tier's earlier entries cannot verify and are deleted
    secret_file: str | None = None
    # a worker-local hot tier of cache entries kept on the model's device (kv_bridge/device_store.py),
    # in bytes; 0 = none. Colocated: the server's own prefix cache. Prefill / decode workers: in front of
    # the bridge (writes go through to it, what it serves is promoted). A hit is then a device copy.
    device_cache_bytes: int = 0
    # a worker-local tier of cache entries in pinned host memory (kv_bridge/host_store.py), in bytes; 0 = none.
    # Under the device tier when both are set; a hit is one host-to-device copy per chunk.
    host_cache_bytes: int = 0
    bridge_disk_bytes: int = 16 << 30
    # bytes of chunks waiting for the disk tier's background writer (kv_bridge/disk.py TieredStore); when full, a
    # Put's disk copy is dropped (counted: store.disk_dropped) and its memory copy kept: a Put never waits for disk
    bridge_disk_queue_bytes: int = 512 << 20
    # "shm": same-host shared memory for imports; "arena": the bridge keeps its memory tier in a shared-memory arena
    # that same-host decode workers map and read in place (kv_bridge/arena.py)
    bridge_transport: str = "inline"
    # a worker's tmpfs files allocated ahead for its same-host Put segments (kv_bridge/shm_pool.py; 0: none)
    bridge_shm_pool_bytes: int = 256 << 20
    # device memory a worker's prefix restores may fill with chunks copied to the GPU while the next is read and
    # verified, across the restores in flight (kv_bridge/stage.py; 0: the engine copies each from the host)
    prefix_stage_bytes: int = 1 << 30
    # how a prefill's KV reaches its decode worker: "bridge" (published chunks, imported by key) or "device"
    # (same host: the decode worker copies the prefill worker's blocks device to device, kv_bridge/handoff.py;
    # the prefill holds them under a lease until released or handoff_lease_s passes) or "dist" (any hosts: the
    # leased blocks travel over a torch.distributed pair, NCCL on GPUs, gloo on CPUs: kv_bridge/dist_transfer.py)
    kv_transport: str = "bridge"
    # kv_transport "bridge": "after_answer" (a prefill answers with its first token, then publishes the prompt's
    # chunks; the router waits for them before the decode call) or "before_answer" (publishes, then answers)
    prefill_publish: str = "after_answer"
    handoff_lease_s: float = 10.0
    # device path, prefill and decode worker on one GPU: the decode worker holds its next step while the
    # prefill worker computes (at most this long for one prefill; 0 = never), as a colocated engine runs a
    # prefill before its next decode step (kv_bridge/handoff.py says why)
    prefill_hold_s: float = 0.5
    # a worker's bridge calls' deadline; after one timed out (or found the bridge gone) the worker skips the bridge
    # for as long (a miss: the prompt is recomputed), so a hung bridge costs one request a timeout, not every one
    bridge_timeout_s: float = 10.0
    bridge_address: str | None = None  # set by the launcher for the workers it starts
    # TLS of the cluster's gRPC channels (PEM file paths, readable wherever a worker runs; None = plaintext):
    # the KV bridge and every prefill and decode worker serve tls_cert/tls_key (the certificate must name every
    # address dialed, the bridge's and the workers', e.g. IP SANs); their clients (workers, the router) verify it
    # against tls_ca (None: the system's roots). Wanted whenever allow_remote is on: the bearer tokens, the
    # prompts and the KV otherwise cross the network in the clear.
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    # supervision and bounds
    health_interval_s: float = 1.0
    health_timeout_s: float = 2.0
    # consecutive failed probes of a live-looking worker before it leaves rotation and is restarted (a worker
    # whose process / actor is gone: at once)
    health_failures: int = 3
    start_timeout_s: float = 900.0  # a worker compiles and captures its graphs before it is ready (engine/warmup.py)
    prefill_timeout_s: float = 120.0
    # a prefill, or a decode worker's engine step while it has requests, running longer than this is taken for a hung
    # device or kernel: the worker's Health says it is not serving, so the pool restarts it. Never under twice
    # prefill_timeout_s (worker_main.stall_bound): a prefill its router still waits for is not hung
    stall_s: float = 300.0
    request_timeout_s: float = 600.0  # the router's bound on a decode stream when the client set no deadline
    decode_retries: int = 1  # a reproducible request whose decode worker died is retried on another
    restart: bool = True
    # placement
    ray_address: str | None = None  # None: ray.init() (joins the cluster of a Ray job, else starts one)
    num_gpus: float | None = None  # per model worker; default from the GPUs the cluster has (placement.py)
    torch_threads: int | None = None  # intra-op threads per worker process
    # sys.setswitchinterval in each model-holding process and in an engine process's front end (None: Python's
    # default). Its engine thread shares the interpreter lock with one gRPC thread per stream; each time it waits
    # on the GPU it gives the lock up, and taking it back waits for a holder's interval to run out
    # (docs/results.md: the service sweep at c=128)
    gil_switch_interval_s: float | None = 0.0005
    # throwaway requests at worker start so CUDA graphs and compiles happen before serving (engine/warmup.py);
    # None: on a GPU only
    warmup: bool | None = None
    # fault injection for tests: each prefill sleeps this long first (so a test can kill it mid-request)
    fault_prefill_delay_s: float = 0.0

    @property
    def splits_engine(self) -> bool:
        """Whether the colocated service runs its engine in a child process (engine_process, None: colocated)."""
        return self.engine_process if self.engine_process is not None else self.mode == "colocated"

    def __post_init__(self) -> None:
        _check_types(self)
        if not self.target.strip():  # "" read as the current directory: ".: no config.json"
            raise ValueError("target: must be a checkpoint directory, got an empty string")
        if self.mode not in MODES:
            raise ValueError(f"mode: must be one of {list(MODES)}, got {self.mode!r}")
        if self.engine_process is not None and not isinstance(self.engine_process, bool):
            raise ValueError(f"engine_process: must be true, false or null, got {self.engine_process!r}")
        if self.engine_process and self.mode != "colocated":
            raise ValueError(f"engine_process: applies to mode 'colocated' only (its engine in a child process), got "
                             f"mode {self.mode!r}, whose workers are processes of their own already")
        from flashpd.cluster.http_origin import normalise_host, normalise_origin  # noqa: PLC0415
        for name, norm, what in (("http_allowed_origins", normalise_origin, "origins (http(s)://host[:port] or '*')"),
                                 ("http_allowed_hosts", normalise_host, "host names")):
            v = getattr(self, name)
            if isinstance(v, str) or not isinstance(v, (list, tuple)):
                raise ValueError(f"{name}: must be a list of {what}, got {v!r}")
            try:  # a YAML or JSON list: kept as a tuple (the config is frozen and hashable)
                object.__setattr__(self, name, tuple(norm(x) if isinstance(x, str) else _not_str(x) for x in v))
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
        if self.api_key_file is not None and not str(self.api_key_file).strip():  # ("" served with no key at all)
            raise ValueError("api_key_file: must be a file path (unset or null: no key), got an empty string")
        if self.secret_file is not None and self.mode == "colocated":
            raise ValueError("secret_file: applies to modes 'local' and 'ray' (the cluster secret of their workers); "
                             "a colocated service has none")
        if not 0 <= self.session_hold_fraction <= 1:
            raise ValueError(f"session_hold_fraction: must be in [0, 1], got {self.session_hold_fraction!r}")
        if self.session_hold_steps < 1:
            raise ValueError(f"session_hold_steps: must be at least 1, got {self.session_hold_steps!r}")
        if self.gil_switch_interval_s is not None and not 0 < self.gil_switch_interval_s <= 1:
            raise ValueError(f"gil_switch_interval_s: must be in (0, 1] seconds, got {self.gil_switch_interval_s!r}")
        if self.policy not in ("preempt", "reserve"):
            raise ValueError(f"policy: must be 'preempt' or 'reserve', got {self.policy!r}")
        from flashpd.engine.width_policy import parse_width_policy  # noqa: PLC0415  (torch only when validated)
        try:
            parse_width_policy(str(self.draft_width_policy))
        except (ValueError, TypeError) as e:
            raise ValueError(f"draft_width_policy: {e}") from None
        if self.draft_token_map is not None and self.draft is None:
            raise ValueError("draft_token_map: needs a drafter (draft)")
        if self.draft_quantization not in (None, "fp8"):
            raise ValueError(f"draft_quantization: must be 'fp8' or null, got {self.draft_quantization!r}")
        if self.draft_quantization is not None and self.draft is None:
            raise ValueError("draft_quantization: needs a drafter (draft)")
        if self.kv_transport not in ("bridge", "device", "dist"):
            raise ValueError(f"kv_transport: must be 'bridge', 'device' or 'dist', got {self.kv_transport!r}")
        if self.prefill_publish not in ("after_answer", "before_answer"):
            raise ValueError(f"prefill_publish: must be 'after_answer' or 'before_answer', got {self.prefill_publish!r}")
        if not 0 <= self.prefill_hold_s <= 10:
            raise ValueError(f"prefill_hold_s: must be in [0, 10] seconds, got {self.prefill_hold_s}")
        if self.bridge_transport not in ("inline", "shm", "arena"):
            raise ValueError(f"bridge_transport: must be 'inline', 'shm' or 'arena', got {self.bridge_transport!r}")
        for name in ("prefill_workers", "decode_workers"):
            if getattr(self, name) < (0 if name == "prefill_workers" else 1):
                raise ValueError(f"{name}: must be >= {0 if name == 'prefill_workers' else 1}, "
                                 f"got {getattr(self, name)}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key: give both (the bridge's certificate and its key) or neither")
        if self.tls_ca is not None and self.tls_cert is None:
            raise ValueError("tls_ca: only with tls_cert and tls_key (clients verify a bridge that serves TLS)")
        for name in ("port", "metrics_port", "http_port"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= 65535:
                raise ValueError(f"{name}: must be a port number in [0, 65535] (0: any free port)"
                                 f"{'' if name == 'port' else ' or null (off)'}, got {v!r}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 1:
            raise ValueError(f"kv_cache_tokens: must be >= 1 or null (a share of free device memory), "
                             f"got {self.kv_cache_tokens}")
        if self.device is not None and not (self.device in ("cpu", "cuda") or re.fullmatch(r"cuda:\d+", self.device)):
            raise ValueError(f"device: must be 'cpu', 'cuda', 'cuda:N' or null (cuda when available), "
                             f"got {self.device!r}")
        if self.mode != "colocated" and self.device not in (None, "cpu", "cuda", "cuda:0"):
            raise ValueError(f"device: {self.device!r} in mode {self.mode!r}: each worker sees only the GPU it is "
                             "placed on, as cuda:0 (cluster/placement.py); give 'cuda'")
        if self.dtype is not None and self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype: must be 'float32', 'bfloat16', 'float16' or null, got {self.dtype!r}")
        if self.served_model_name is not None and (not isinstance(self.served_model_name, str)
                                                   or not self.served_model_name.strip()):
            raise ValueError(f"served_model_name: must be a non-empty string, got {self.served_model_name!r}")
        if self.device_cache_bytes < 0:
            raise ValueError(f"device_cache_bytes: must be >= 0, got {self.device_cache_bytes}")
        if self.host_cache_bytes < 0:
            raise ValueError(f"host_cache_bytes: must be >= 0, got {self.host_cache_bytes}")
        if self.prefix_stage_bytes < 0:
            raise ValueError(f"prefix_stage_bytes: must be >= 0, got {self.prefix_stage_bytes}")
        if self.bridge_shm_pool_bytes < 0:
            raise ValueError(f"bridge_shm_pool_bytes: must be >= 0, got {self.bridge_shm_pool_bytes}")
        if self.bridge_disk_queue_bytes < 1:
            raise ValueError(f"bridge_disk_queue_bytes: must be >= 1, got {self.bridge_disk_queue_bytes}")
        for name in ("chunk_tokens", "max_running", "max_concurrent", "health_failures", "bridge_memory_bytes",
                     "bridge_disk_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.decode_retries < 0:
            raise ValueError(f"decode_retries: must be >= 0, got {self.decode_retries}")
        if not 0 <= self.fault_prefill_delay_s <= MAX_WAIT_S:  # NaN fails too
            raise ValueError(f"fault_prefill_delay_s: must be in [0, {MAX_WAIT_S:.0f}] seconds, "
                             f"got {self.fault_prefill_delay_s}")
        if self.torch_threads is not None and not 1 <= self.torch_threads <= MAX_TORCH_THREADS:
            raise ValueError(f"torch_threads: must be in [1, {MAX_TORCH_THREADS}] or null (torch's default), "
                             f"got {self.torch_threads}")
        ports = [(n, getattr(self, n)) for n in ("port", "http_port", "metrics_port") if getattr(self, n)]
        for i, (a, pa) in enumerate(ports):  # refused here, not once the engine has loaded and a bind fails
            for b, pb in ports[i + 1:]:
                if pa == pb:
                    raise ValueError(f"{a} and {b}: the same port {pa}; each endpoint needs its own (or 0: any free)")
        if self.num_gpus is not None and not MIN_GPU_SHARE <= self.num_gpus <= MAX_GPU_SHARE:  # NaN, inf fail too
            raise ValueError(f"num_gpus: must be > 0 (at least {MIN_GPU_SHARE}, Ray's resolution; at most "
                             f"{MAX_GPU_SHARE:.0f}) or null (from the cluster's GPUs), got {self.num_gpus}")
        for name in ("num_gpus", "ray_address"):  # refused, not ignored, as engine_process outside colocated
            if getattr(self, name) is not None and self.mode != "ray":
                raise ValueError(f"{name}: applies to mode 'ray' only, got mode {self.mode!r}")
        if self.num_gpus is not None and self.device == "cpu":
            raise ValueError(f"num_gpus: {self.num_gpus} with device 'cpu': the workers would hold GPUs they never "
                             "use (leave num_gpus unset)")
        for name in ("prefill_workers", "decode_workers"):
            if getattr(self, name) > MAX_WORKERS:
                raise ValueError(f"{name}: at most {MAX_WORKERS} a service, got {getattr(self, name)}")
        from flashpd.kv_bridge.server import is_loopback  # noqa: PLC0415  (grpc: only when a config is made)

        if not (self.allow_remote or is_loopback(self.host)):  # refused here, not after every worker started
            raise ValueError(f"host: {self.host!r} is not loopback; set allow_remote: true to expose the service")
        for name in ("health_interval_s", "health_timeout_s", "start_timeout_s", "prefill_timeout_s",
                     "request_timeout_s", "bridge_timeout_s", "stall_s", "handoff_lease_s"):
            if not 0 < getattr(self, name) <= MAX_WAIT_S:  # inf or 1e30: a wait that overflows, or a hang never noticed
                raise ValueError(f"{name}: must be in (0, {MAX_WAIT_S:.0f}] seconds, got {getattr(self, name)}")

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> "ServeConfig":
        if not isinstance(d, dict) or "target" not in d:
            raise ValueError(f"{source}: config must be a mapping with at least 'target'")
        odd = [k for k in d if not isinstance(k, str)]
        if odd:  # a YAML key such as `1:` (sorting it among names raised a bare TypeError)
            raise ValueError(f"{source}: config keys must be names, got {odd[0]!r}")
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"{source}: unknown config keys {sorted(unknown)} (known: {sorted(known)})")
        try:
            return cls(**d)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def public_settings(self) -> dict[str, Any]:
        """What a client may learn of how this service runs (Health's settings_json): the knobs a benchmark
        against a running service must record beside its figures. No paths, addresses or credentials."""
        d = {k: getattr(self, k) for k in PUBLIC_SETTINGS}
        d["engine_process"] = self.splits_engine  # resolved: null means on for colocated
        d["draft_token_map"] = self.draft_token_map is not None  # whether one is set, not where it lives
        return d

    def with_(self, **kw: Any) -> "ServeConfig":
        return replace(self, **kw)

    def with_absolute_paths(self) -> "ServeConfig":
        """This config with its file paths made absolute from this process's directory: what a worker elsewhere
        (a Ray actor runs where `ray start` ran) must get, since the paths are relative to where serve runs."""
        return replace(self, **{k: os.path.abspath(getattr(self, k)) for k in PATH_KEYS if getattr(self, k)})


def load_config(path: str | Path) -> ServeConfig:
    """Read a JSON or YAML file (by suffix; other suffixes are tried as JSON, then YAML). A key given twice is
    refused by name (the parsers keep the last one without a word)."""
    return ServeConfig.from_dict(read_config_dict(path), str(path))


def read_config_dict(path: str | Path) -> Any:
    """A config file's mapping, parsed as load_config does, not yet checked as a ServeConfig (a tool that
    fills in keys of its own first: bench/job_sweep.py)."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{p}: is a directory, not a config file (JSON or YAML)")
    try:
        text = p.read_text()
    except UnicodeDecodeError as e:
        raise ValueError(f"{p}: not a text file (JSON or YAML): {e}") from None
    if p.suffix in (".yaml", ".yml"):
        data = _yaml(text, p)
    else:
        try:
            data = json.loads(text, object_pairs_hook=_no_repeats)
        except json.JSONDecodeError as e:
            if p.suffix == ".json":
                raise ValueError(f"{p}: not valid JSON: {e}") from None
            data = _yaml(text, p)
        except _RepeatedKey as e:
            raise ValueError(f"{p}: {e}") from None
    return data


class _RepeatedKey(ValueError):
    pass


def _no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for k, v in pairs:
        if k in seen:
            raise _RepeatedKey(f"key {k!r} is given twice")
        seen[k] = v
    return seen


def _yaml(text: str, p: Path) -> Any:
    import yaml  # noqa: PLC0415  (a dependency, only needed for YAML files)

    class Loader(yaml.SafeLoader):
        yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}

        def construct_mapping(self, node, deep=False):  # a key given twice: refused, not the last one kept
            keys = [self.construct_object(k, deep=deep) for k, _ in node.value
                    if k.tag != "tag:yaml.org,2002:merge"]  # `<<` merges, and a key may override what it merged
            for i, k in enumerate(keys):
                if k in keys[:i]:
                    raise yaml.constructor.ConstructorError(None, None, f"key {k!r} is given twice", node.start_mark)
            return super().construct_mapping(node, deep=deep)

    # YAML 1.2's (and JSON's) 1e3 is a float; YAML 1.1's resolver, PyYAML's, wants a dot and read it as the string
    # "1e3", which the config then refused as not a float
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9]+(?:\.[0-9]*)?[eE][-+]?[0-9]+$"),
                                 list("-+0123456789"))
    try:
        return yaml.load(text, Loader=Loader)  # noqa: S506  (a SafeLoader subclass)
    except yaml.YAMLError as e:
        raise ValueError(f"{p}: not valid YAML: {e}") from None
