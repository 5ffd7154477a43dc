"""Compiles and graph captures after the warm-up: a serving worker's check that its warm-up met every shape.

Triton compiles a kernel once per specialization: its constexprs, its launch options, and each integer argument's
"== 1" / divisible-by-16 state unless the kernel lists it in do_not_specialize. A variant first met while serving
compiles inside the requests in flight (a fraction of a second each), which shows only as a latency tail or a
slow level in a load sweep. `JitWatch` takes the count of the engine's compiled variants when the warm-up ends
and logs each kernel that gains one later, so that a shape the warm-up missed is named in the worker's log and
counted in its stats. CUDA graphs likewise: one is captured per new shape (batch bucket, block-table bucket,
width), and a capture while serving also holds the requests in flight; the watch counts `cuda_graph.captures`.
Inductor's own kernels (torch.compile) are not counted here.
"""
from __future__ import annotations

import logging
import time
from types import ModuleType

from flashpd.engine import cuda_graph
from flashpd.engine.triton_env import triton

log = logging.getLogger(__name__)


def engine_kernels() -> dict[str, object]:
    """The engine's Triton kernels by "module.name" ({} without triton). Any object with `device_caches` counts:
    a JITFunction; under the interpreter (which never compiles) there are none."""
    if triton is None:
        return {}
    from flashpd.engine import greedy_argmax, paged_attention, qkv_rope, skinny_gemm  # noqa: PLC0415
    mods: tuple[ModuleType, ...] = (paged_attention, qkv_rope, skinny_gemm, greedy_argmax)
    return {f"{m.__name__.rsplit('.', 1)[-1]}.{name}": obj for m in mods for name, obj in vars(m).items()
            if hasattr(obj, "device_caches") and hasattr(obj, "run")}


def compiled_variants(kernels: dict[str, object]) -> dict[str, int]:
    """Compiled variants each kernel holds in this process, over its devices. Triton keeps, per device, a tuple
    whose first item is the dict of compiled kernels (3.x); another layout reads as 0 rather than failing."""
    out = {}
    for name, fn in kernels.items():
        caches = getattr(fn, "device_caches", None) or {}
        out[name] = sum(len(c[0]) for c in list(caches.values())
                        if isinstance(c, tuple) and c and isinstance(c[0], dict))
    return out


class JitWatch:
    """The variants compiled and the graphs captured since construction (the end of a warm-up). `check` is cheap
    and rate-limited, so a serving loop may call it after every step; it logs a warning naming each kernel that
    compiled again, and one for the graphs captured since its last reading."""

    def __init__(self, kernels: dict[str, object] | None = None, min_interval_s: float = 1.0) -> None:
        self.kernels = engine_kernels() if kernels is None else kernels
        self.baseline = compiled_variants(self.kernels)
        self.seen = dict(self.baseline)
        self.captures_baseline = self.captures_seen = cuda_graph.captures()
        self.min_interval_s = min_interval_s
        self._next = 0.0

    def check(self, force: bool = False) -> dict[str, int]:
        """Kernels with variants compiled since the baseline -> how many (logged as they appear)."""
        now = time.monotonic()
        if force or now >= self._next:
            self._next = now + self.min_interval_s
            cur = compiled_variants(self.kernels)
            grown = {k: v - self.seen.get(k, 0) for k, v in cur.items() if v > self.seen.get(k, 0)}
            if grown:
                log.warning("Triton compiled %s after the warm-up (a shape it did not meet; the requests in "
                            "flight waited for it)", ", ".join(f"{k} +{n}" for k, n in sorted(grown.items())))
                self.seen.update(cur)
            graphs = cuda_graph.captures()
            if graphs > self.captures_seen:
                log.warning("captured %d CUDA graph(s) after the warm-up (%d in all since): shapes it did not meet "
                            "(a batch, block-table or width bucket); the requests in flight waited",
                            graphs - self.captures_seen, graphs - self.captures_baseline)
                self.captures_seen = graphs
        return {k: v - self.baseline.get(k, 0) for k, v in self.seen.items() if v > self.baseline.get(k, 0)}

    @property
    def compiled_after(self) -> int:
        """Variants compiled since the baseline, as of the last check."""
        return sum(max(0, v - self.baseline.get(k, 0)) for k, v in self.seen.items())

    @property
    def captures_after(self) -> int:
        """CUDA graphs captured since the baseline, as of the last check."""
        return self.captures_seen - self.captures_baseline
