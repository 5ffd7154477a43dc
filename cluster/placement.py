"""Where each worker runs: GPU shares for Ray actors, GPU indices for local processes.

One GPU: every model worker gets a fraction of it (Ray's fractional num_gpus; locally they share
device 0). Several: prefill and decode workers get whole, separate GPUs when there are enough,
else equal fractions. No GPU: num_gpus 0 (CPU). A Ray cluster whose node types carry the custom
resources `flashpd_prefill` / `flashpd_decode` / `flashpd_bridge` (ray_configs/cluster.yaml)
pins each role to its node type.
"""
from __future__ import annotations

import math


def gpu_share(cfg, n_gpus: float) -> float:
    """num_gpus of one prefill or decode worker."""
    if cfg.num_gpus is not None:
        return float(cfg.num_gpus)
    if n_gpus <= 0 or (cfg.device or "cuda") == "cpu":
        return 0.0
    n = cfg.prefill_workers + cfg.decode_workers
    if n_gpus >= n:
        return 1.0
    return 1.0 / math.ceil(n / int(n_gpus)) if n_gpus >= 1 else n_gpus / n


def ray_options(role: str, cfg, cluster_resources: dict[str, float]) -> dict:
    """Options for ActorClass.options(...) of one worker."""
    if role == "bridge":
        opts: dict = {"num_cpus": 0, "num_gpus": 0}
    else:
        opts = {"num_cpus": 1, "num_gpus": gpu_share(cfg, cluster_resources.get("GPU", 0.0))}
    pin = f"flashpd_{role}"
    if cluster_resources.get(pin, 0) > 0:
        opts["resources"] = {pin: 0.001}
    return opts


def local_gpu(role: str, index: int, cfg, n_gpus: int) -> int | None:
    """CUDA device for a local worker process: prefill from the first GPUs, decode from the last,
    so one of each on two GPUs are apart; None for the bridge or without GPUs."""
    if role == "bridge" or n_gpus <= 0 or (cfg.device or "cuda") == "cpu":
        return None
    if role == "prefill":
        return index % n_gpus
    return (n_gpus - 1 - index) % n_gpus
