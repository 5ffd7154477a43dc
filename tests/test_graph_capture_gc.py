"""cuda_graph.capture pauses Python's cycle collector for the capture and restores it after, also when the captured
code raises. (A collection mid-capture can free an old graph's pool: a driver call a capturing thread may not make.)
No GPU here: torch.cuda.graph is replaced by a recorder, the one part that needs the device."""
from __future__ import annotations

import contextlib
import gc

import pytest

from flashpd.engine import cuda_graph


@pytest.fixture
def recorder(monkeypatch):
    seen = []

    @contextlib.contextmanager
    def fake_graph(graph, pool=None, capture_error_mode="global"):
        seen.append(("enter", gc.isenabled(), capture_error_mode))
        yield
        seen.append(("exit", gc.isenabled(), capture_error_mode))

    monkeypatch.setattr(cuda_graph.torch.cuda, "graph", fake_graph)
    return seen


def test_the_collector_is_paused_inside_and_restored_after(recorder):
    assert gc.isenabled()
    with cuda_graph.capture(object(), None):
        assert not gc.isenabled()
    assert gc.isenabled()
    assert recorder == [("enter", False, "thread_local"), ("exit", False, "thread_local")]


def test_restored_when_the_capture_raises(recorder):
    with pytest.raises(RuntimeError, match="boom"):
        with cuda_graph.capture(object(), None):
            raise RuntimeError("boom")
    assert gc.isenabled()


def test_a_paused_collector_stays_paused(recorder):
    gc.disable()
    try:
        with cuda_graph.capture(object(), None):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
