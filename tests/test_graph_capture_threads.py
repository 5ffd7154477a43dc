"""CUDA graphs are captured while other threads of the process make their own CUDA calls.

A decode worker captures a step's graph the first time it sees a shape, while its prefix cache's save
thread copies finished prompts' chunks to the host (and its load threads read). In torch's default
"global" capture mode such a call from another thread fails the capture, and the failed capture leaves
the graph memory pool recording, so every later capture of the process fails too (seen on an H200: a
disaggregated sweep at concurrency 32 failed 11 requests with "beginAllocateToPool: already recording").
GPU only: on a CPU nothing is captured (the same padded functions run directly).
"""
from __future__ import annotations

import threading

import pytest
import torch

from flashpd.engine.cuda_graph import GraphedFn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs CUDA")


def test_captures_succeed_while_another_thread_copies_device_tensors_to_the_host():
    stop = threading.Event()
    copied = [0]
    src = torch.randn(4096, 1024, device="cuda")

    def saver() -> None:  # what PrefixCache.store_pending does: device chunks to host bytes
        while not stop.is_set():
            assert torch.equal(src[:8].cpu(), src[:8].cpu())
            copied[0] += 1

    t = threading.Thread(target=saver, daemon=True)
    t.start()
    try:
        fn = GraphedFn(lambda x, w: (x @ w).relu() + 1)
        w = torch.randn(256, 256, device="cuda")
        for rows in (1, 2, 4, 8, 16, 32, 64, 128) * 2:  # each new shape is captured, then replayed
            x = torch.randn(rows, 256, device="cuda")
            out = fn([x, w])
            torch.testing.assert_close(out, (x @ w).relu() + 1)
    finally:
        stop.set()
        t.join(10)
    assert copied[0] > 0
