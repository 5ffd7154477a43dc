"""CUDA-graph capture of a pure function of tensors, one graph per input shape.

Callers pad their inputs to a few bucketed shapes; each new shape is warmed up on a side
stream and captured once, all graphs sharing one memory pool. A replay copies the inputs
into the static buffers and returns the (static) outputs: read them before the next replay.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

Outputs = object  # whatever the function returns: tensors, or tuples / lists of tensors
_captures = 0  # graphs captured in this process (a serving worker's watch reads it: engine/jit_watch.py)


def captures() -> int:
    """CUDA graphs captured in this process so far (every capture goes through `capture`)."""
    return _captures


def pack_host(arrays: Sequence[np.ndarray], device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Move several int64 host arrays in ONE copy. Returns the flat device tensor and views of it
    shaped like each array."""
    flat = np.concatenate([a.reshape(-1) for a in arrays])
    dev = torch.from_numpy(flat).to(device)
    out, off = [], 0
    for a in arrays:
        out.append(dev[off:off + a.size].view(a.shape))
        off += a.size
    return dev, out


def bucket(n: int, minimum: int = 1) -> int:
    """The power of two (times `minimum`) at or above n."""
    b = minimum
    while b < n:
        b *= 2
    return b


@contextmanager
def capture(graph: torch.cuda.CUDAGraph, pool: tuple) -> Iterator[None]:
    """torch.cuda.graph in thread_local error mode with Python's cycle collector paused. A collection inside the
    capture can free a dead graph from an earlier cycle (an engine built and dropped, as a per-prompt evaluation
    does); its private pool's memory is then returned to the driver, a call a capturing thread may not make: the
    capture fails, and the pool stays unusable for every later one (seen on an H200 at random prompts).
    thread_local: the serving threads beside the engine (a prefix cache's saves and loads) keep making their own
    CUDA calls while a graph is captured here; in the default "global" mode any such call fails the capture."""
    global _captures
    _captures += 1
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            yield
    finally:
        if was_enabled:
            gc.enable()


class GraphedFn:
    def __init__(self, fn: Callable[..., Outputs], pool: tuple | None = None) -> None:
        self.fn = fn
        self.pool = pool
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], Outputs]] = {}

    def __call__(self, inputs: Sequence[torch.Tensor], **static_kwargs: int) -> Outputs:
        """Replay (capturing first if new) fn(*inputs, **static_kwargs); kwargs are part of the shape key."""
        if inputs[0].device.type != "cuda":  # the same padded code path, run directly (CPU tests exercise it)
            return self.fn(*inputs, **static_kwargs)
        key = tuple((tuple(x.shape), x.dtype) for x in inputs) + tuple(sorted(static_kwargs.items()))
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._graphs[key] = self._capture(inputs, static_kwargs)
        graph, static, out = entry
        for dst, src in zip(static, inputs):
            dst.copy_(src, non_blocking=True)
        graph.replay()
        return out

    def _capture(self, inputs: Sequence[torch.Tensor],
                 kwargs: dict[str, int]) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor], Outputs]:
        dev = torch.device("cuda", torch.cuda.current_device())
        static = [x.to(dev).clone() for x in inputs]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile / autotune / allocate outside the capture
                self.fn(*static, **kwargs)
        torch.cuda.current_stream().wait_stream(stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with capture(graph, self.pool):
            out = self.fn(*static, **kwargs)
        return graph, static, out
