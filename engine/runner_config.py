"""RunnerConfig: every knob of a ModelRunner in one value, given at construction.

One inspectable value instead of constructor flags, attributes set afterwards and patched globals: benches
and tests build the runner they need, and a forced attention form reaches the attention dispatch through
each forward's metadata (AttnBatch.impl), not through a module global read in the hot path.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from flashpd.engine import paged_attention

AUTO = "auto"  # RunnerConfig.prefill_chunk's default: prefill_graph_tokens with CUDA graphs, else None
ATTENTION_IMPLS = ("matmul", "sdpa", "paged")
BLAS_LIBRARIES = ("cublas", "cublaslt")  # torch.backends.cuda.preferred_blas_library's CUDA names
PREFILL_KNOBS = frozenset({"prefill_graph_tokens", "prefill_chunk", "fresh_prefill"})  # ModelRunner.reconfigure


@dataclass(frozen=True)
class RunnerConfig:
    """The knobs of a ModelRunner and why each exists.

    cuda_graphs: replay CUDA graphs for small fixed shapes (decode, verify, short prefills, draft steps), so a
        step costs the weights' read, not Python and launches. None: on iff the model is on a CUDA device;
        False runs the same functions eagerly on any device (tests compare the two paths).
    compile: torch.compile each layer's small ops (norms, RoPE, SwiGLU) inside the captured graphs. None: as
        cuda_graphs. Tests turn it off (or use a cheap backend) to keep CPU runs fast.
    compile_backend: torch.compile's backend. Tests use "aot_eager": dynamo still traces every compiled
        function whole (a graph break fails) but runs the traced ATen ops without code generation.
    compile_deterministic: inductor's reduction kernels (norms, softmax, argmax) take one fixed launch config
        (its deterministic mode) instead of timing several at their first launch and keeping the fastest. The
        configs reduce in different orders, so a timed pick made a kernel's bits depend on timing noise and on
        what ran first: two compiled functions that both norm a verify's rows could round them apart, and
        DFlash parted from native in bf16 (docs/results.md). False: inductor's default (benches compare).
    compile_eager_rounding: inductor rounds every intermediate to its dtype where eager would (its
        emulate_precision_casts). Without it a fused kernel keeps intermediates in fp32 wherever its fusion did,
        fusion depends on the shape, and a decode row's bits differ between one column and a verify's 16 from
        the first layer on; with it they were the same at every layer on an H200 (bench/row_invariance.py;
        docs/results.md). Off by default (inductor's default): measured at no cost, but one column
        stays short of exact (14/16 prompts; docs/results.md).
    inductor_extra: further inductor config entries, (name, value) pairs, for benches that try one (for
        example ("combo_kernels", False), which turns a default off). Names must be inductor's; the two above
        have fields of their own.
    attention_impl: None chooses per shape and device (engine/attention.py: matmul form for small score
        sets on a GPU, the paged kernel for batched decode, fused SDPA otherwise); "matmul" or "sdpa" forces
        that form of the gathered attention on any device, never the paged kernel (tests run the GPU's forms
        against the oracles on a CPU; bench/paged_check.py compares kernels); "paged" forces the paged kernel
        for every decode and verify forward and the drafter's pass on any device triton runs on (a CPU under
        TRITON_INTERPRET=1: tests), longer forwards keeping fused SDPA.
    prefill_graph_tokens: short prefills (rows x padded width, in tokens) at or under this replay a graph.
    prefill_chunk: a lone prompt longer than this runs as consecutive chunks of this many tokens, each
        attending to the cache the earlier ones wrote, instead of one eager forward (whose overhead sets a
        long prompt's TTFT on a small model). "auto": prefill_graph_tokens with CUDA graphs, else None;
        None: one forward (as on the CPU).
    fresh_prefill: a prompt with no cached prefix attends over its own K/V with a fused causal kernel
        (AttnBatch.fresh); False: through the cache and the position mask like any other forward (benches
        compare the two).
    blas: the BLAS library torch's matmuls use on a GPU (the projections past the few-row kernel's rows:
        batched decode, verifies of several rows, prefill). "cublaslt": in a batch-32 and batch-64 decode
        step cuBLAS's heuristic picks split-K kernels and their reduction launches, cuBLASLt's does not
        (docs/results.md, issue 23). torch keeps the choice per process, so a runner built on a CUDA device
        sets it for the whole process (the last runner built wins; every engine runner asks the same by
        default). None leaves torch's choice alone.
    """

    cuda_graphs: bool | None = None
    compile: bool | None = None
    compile_backend: str = "inductor"
    compile_deterministic: bool = True
    compile_eager_rounding: bool = False
    inductor_extra: tuple[tuple[str, bool | int | float | str], ...] = ()
    attention_impl: str | None = None
    prefill_graph_tokens: int = 1024
    prefill_chunk: int | str | None = AUTO
    fresh_prefill: bool = True
    blas: str | None = "cublaslt"

    def __post_init__(self) -> None:
        for name in ("cuda_graphs", "compile"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"RunnerConfig.{name} must be True, False or None, got {getattr(self, name)!r}")
        for name in ("compile_deterministic", "compile_eager_rounding"):
            if getattr(self, name) not in (True, False):
                raise ValueError(f"RunnerConfig.{name} must be True or False, got {getattr(self, name)!r}")
        _check_inductor_extra(self.inductor_extra)
        if not isinstance(self.compile_backend, str) or not self.compile_backend:
            raise ValueError(f"RunnerConfig.compile_backend must be a backend name, got {self.compile_backend!r}")
        if self.attention_impl is not None and self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"RunnerConfig.attention_impl must be None, 'matmul', 'sdpa' or 'paged', "
                             f"got {self.attention_impl!r}")
        if self.attention_impl == "paged" and not paged_attention.available():
            raise ValueError("RunnerConfig.attention_impl 'paged' needs triton: a GPU, or TRITON_INTERPRET=1 on a CPU")
        if not _positive_int(self.prefill_graph_tokens):
            raise ValueError(f"RunnerConfig.prefill_graph_tokens must be a positive int, "
                             f"got {self.prefill_graph_tokens!r}")
        if self.prefill_chunk is not None and self.prefill_chunk != AUTO and not _positive_int(self.prefill_chunk):
            raise ValueError(f"RunnerConfig.prefill_chunk must be a positive int, None or {AUTO!r}, "
                             f"got {self.prefill_chunk!r}")
        if self.fresh_prefill not in (True, False):
            raise ValueError(f"RunnerConfig.fresh_prefill must be True or False, got {self.fresh_prefill!r}")
        if self.blas is not None and self.blas not in BLAS_LIBRARIES:
            raise ValueError(f"RunnerConfig.blas must be None, 'cublas' or 'cublaslt', got {self.blas!r}")

    def resolved(self, device: torch.device | str) -> RunnerConfig:
        """This config with its automatic values decided for a model on `device`: cuda_graphs and compile
        booleans, prefill_chunk an int or None (what ModelRunner.config holds)."""
        graphs = torch.device(device).type == "cuda" if self.cuda_graphs is None else self.cuda_graphs
        chunk = (self.prefill_graph_tokens if graphs else None) if self.prefill_chunk == AUTO else self.prefill_chunk
        return replace(self, cuda_graphs=graphs, compile=graphs if self.compile is None else self.compile,
                       prefill_chunk=chunk)


OWN_FIELDS = {"deterministic": "compile_deterministic", "emulate_precision_casts": "compile_eager_rounding"}


def _check_inductor_extra(extra: object) -> None:
    """(name, value) pairs naming inductor config entries, none of them one that has a field of its own."""
    if not isinstance(extra, tuple) or not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
                                               for p in extra):
        raise ValueError(f"RunnerConfig.inductor_extra must be a tuple of (name, value) pairs, got {extra!r}")
    if not extra:
        return
    import torch._inductor.config as inductor_config  # noqa: PLC0415 (only when entries are given)

    for name, _ in extra:
        if name in OWN_FIELDS:
            raise ValueError(f"RunnerConfig.inductor_extra: set {name!r} through RunnerConfig.{OWN_FIELDS[name]}")
        if not hasattr(inductor_config, name):
            raise ValueError(f"RunnerConfig.inductor_extra: inductor has no config entry {name!r}")


def _positive_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0
