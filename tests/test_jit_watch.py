"""JitWatch (engine/jit_watch.py): a serving worker counts and logs the Triton variants compiled after its
warm-up. Triton compiles only on a GPU, so the watch's reading is tested on objects laid out as Triton's
JITFunction keeps its compiled kernels (a dict per device, first in a tuple), and its use in the decode worker
on the CPU: the engine loop runs it after every step, a failing monitor does not stop serving, and the worker's
stats carry its count. tests/test_paged_attention.py checks on a GPU that a new table width compiles nothing."""
from __future__ import annotations

import logging

import torch

from flashpd.decode_node.engine_loop import EngineLoop
from flashpd.decode_node.scheduler import Scheduler
from flashpd.decode_node.worker import DecodeWorker
from flashpd.engine import cuda_graph
from flashpd.engine.jit_watch import JitWatch, compiled_variants, engine_kernels
from flashpd.engine.loader import load_target
from flashpd.engine.runner import ModelRunner
from flashpd.engine.sampling import SamplingParams

from tests._dflash_helpers import dflash_pair  # noqa: F401  (session fixture)
from tests.test_decode_worker import _drain


class FakeKernel:
    """What JitWatch reads of a JITFunction: `device_caches[device]` = (compiled kernels by key, ...), and `run`."""

    def __init__(self) -> None:
        self.device_caches: dict[int, tuple] = {0: ({}, {}, None, None, None)}

    def run(self) -> None:  # pragma: no cover (never called)
        pass

    def compile_variant(self, key: str, device: int = 0) -> None:
        self.device_caches.setdefault(device, ({}, {}, None, None, None))[0][key] = object()


def test_variants_are_counted_per_kernel_over_devices():
    a, b = FakeKernel(), FakeKernel()
    a.compile_variant("x")
    a.compile_variant("y", device=1)
    b.device_caches = {0: ["not", "a", "tuple"]}  # a layout it does not know reads as 0, not an error
    assert compiled_variants({"a": a, "b": b}) == {"a": 2, "b": 0}


def test_watch_reports_what_compiled_after_its_baseline(caplog):
    a, b = FakeKernel(), FakeKernel()
    a.compile_variant("warm")
    watch = JitWatch({"m.a": a, "m.b": b}, min_interval_s=3600.0)
    assert watch.check(force=True) == {} and watch.compiled_after == 0
    b.compile_variant("served")
    b.compile_variant("served-2")
    with caplog.at_level(logging.WARNING, logger="flashpd.engine.jit_watch"):
        assert watch.check(force=True) == {"m.b": 2}
    assert "m.b +2" in caplog.text and watch.compiled_after == 2
    a.compile_variant("later")
    assert watch.check() == {"m.b": 2}  # within the interval: not read again (a serving loop calls it every step)
    assert watch.check(force=True) == {"m.a": 1, "m.b": 2} and watch.compiled_after == 3


def test_watch_counts_graph_captures_after_its_baseline(caplog, monkeypatch):
    """Every capture goes through cuda_graph.capture, which counts it (a CPU cannot capture: the count is set)."""
    monkeypatch.setattr(cuda_graph, "_captures", 7)
    watch = JitWatch({}, min_interval_s=3600.0)
    monkeypatch.setattr(cuda_graph, "_captures", 9)
    assert watch.captures_after == 0  # as of the last check
    with caplog.at_level(logging.WARNING, logger="flashpd.engine.jit_watch"):
        assert watch.check(force=True) == {}
    assert watch.captures_after == 2 and "captured 2 CUDA graph(s) after the warm-up" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flashpd.engine.jit_watch"):
        watch.check(force=True)
    assert caplog.text == "" and watch.captures_after == 2  # nothing new: no second warning


def test_engine_kernels_on_this_machine():
    """On a CUDA build the engine's Triton kernels are found by name; a CPU build of torch has none (nothing to
    compile, and the watch reads 0)."""
    found = engine_kernels()
    if torch.backends.cuda.is_built():  # pragma: no cover (GPU machines)
        assert {"paged_attention._attn_kernel", "skinny_gemm._skinny_kernel"} <= set(found)
    else:
        assert found == {} and JitWatch().compiled_after == 0


def _scheduler(pair) -> Scheduler:
    target = load_target(pair.target_dir)
    return Scheduler(ModelRunner(target, 64, 16), None, (), None, 8, "preempt", None)


def test_engine_loop_runs_its_monitor_after_each_step_and_survives_its_failure(dflash_pair):  # noqa: F811
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    calls = []
    loop = EngineLoop(_scheduler(dflash_pair), after_step=lambda: calls.append(loop.steps))
    try:
        toks, _ = _drain(loop.submit([3, 4, 5, 6], params))
        assert len(toks) == 5 and calls and calls == sorted(calls) and calls[-1] == loop.steps
    finally:
        loop.stop()

    def broken() -> None:
        raise RuntimeError("monitor broke")

    loop = EngineLoop(_scheduler(dflash_pair), after_step=broken)
    try:
        toks2, _ = _drain(loop.submit([3, 4, 5, 6], params))
        assert toks2 == toks  # served as without the monitor
    finally:
        loop.stop()


def test_decode_worker_stats_count_compiles_after_warmup(dflash_pair):  # noqa: F811
    target = load_target(dflash_pair.target_dir)
    cold = DecodeWorker(ModelRunner(target, 64, 16), warmup=False)
    try:
        assert cold.jit is None and cold.stats()["jit_compiles_after_warmup"] == 0
    finally:
        cold.stop()
    warm = DecodeWorker(ModelRunner(target, 128, 16), max_running=2, warmup=True)
    try:
        kernel = FakeKernel()
        warm.jit.kernels, warm.jit.baseline, warm.jit.seen = {"m.k": kernel}, {"m.k": 0}, {"m.k": 0}
        kernel.compile_variant("first met while serving")
        warm.jit.min_interval_s = 0.0
        _drain(warm.submit([3, 4, 5], SamplingParams(max_tokens=2, ignore_eos=True)))
        assert warm.stats()["jit_compiles_after_warmup"] == 1
        assert warm.stats()["graph_captures_after_warmup"] == 0  # a CPU captures no graph
    finally:
        warm.stop()
