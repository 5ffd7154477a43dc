"""Token events that queued up behind a stream go out as one message (decode_node/engine_loop.coalesce): in order,
none lost, every `sent` flag kept; over a real gRPC server, a stream that fell behind the engine gets its tokens in
one chunk, the same tokens as a request read as it goes."""
from __future__ import annotations

import threading
import time

import pytest

from flashpd.cluster.generation_client import GenerationClient
from flashpd.cluster.generation_server import serve_generation
from flashpd.decode_node.engine_loop import COALESCE_MAX_TOKENS, EngineLoop, Event, Handle, coalesce
from flashpd.decode_node.scheduler import Scheduler
from flashpd.engine.loader import load_target
from flashpd.engine.runner import ModelRunner
from flashpd.engine.sampling import SamplingParams

from tests._dflash_helpers import dflash_pair  # noqa: F401  (session fixture)

WAIT_S = 20.0


def _handle() -> Handle:
    return Handle([1, 2], SamplingParams(max_tokens=4), "native", None)


def test_queued_token_events_merge_in_order_up_to_the_next_other_event():
    h = _handle()
    flags = [threading.Event(), threading.Event()]
    h.events.put(Event("tokens", tokens=[2, 3], sent=flags[0]))
    h.events.put(Event("tokens", tokens=[4], sent=flags[1]))
    done = Event("done", finish_reason="length")
    h.events.put(done)
    h.events.put(Event("tokens", tokens=[9]))  # never behind a final event in practice; must stay queued
    ev, nxt = coalesce(h, Event("tokens", tokens=[1]))
    assert ev.kind == "tokens" and ev.tokens == [1, 2, 3, 4]
    assert nxt is done
    assert h.events.qsize() == 1  # the event after "done" was not taken
    assert not any(f.is_set() for f in flags)
    ev.sent.set()
    assert all(f.is_set() for f in flags)


def test_a_merged_event_without_tokens_keeps_its_sent_flag():
    h = _handle()
    flag = threading.Event()
    h.events.put(Event("tokens", tokens=[], sent=flag))
    ev, nxt = coalesce(h, Event("tokens", tokens=[1]))
    assert ev.tokens == [1] and nxt is None and h.events.empty()
    ev.sent.set()
    assert flag.is_set()


def test_a_lone_event_is_returned_as_is():
    h = _handle()
    first = Event("tokens", tokens=[5])
    ev, nxt = coalesce(h, first)
    assert ev is first and nxt is None


def test_a_merge_stops_at_the_cap_and_leaves_the_rest_queued():
    h = _handle()
    for t in range(COALESCE_MAX_TOKENS + 10):
        h.events.put(Event("tokens", tokens=[t]))
    ev, nxt = coalesce(h, Event("tokens", tokens=[-1]))
    assert ev.tokens == [-1, *range(COALESCE_MAX_TOKENS - 1)] and nxt is None
    ev2, _ = coalesce(h, h.get(0))
    assert ev2.tokens == list(range(COALESCE_MAX_TOKENS - 1, COALESCE_MAX_TOKENS + 10))


class _Behind:
    """The real EngineLoop as a backend, whose submit hands the stream over only once the engine has queued the
    request's final event: the servicer then reads a stream that fell behind by every step."""

    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop

    def __getattr__(self, name: str):
        return getattr(self.loop, name)

    @staticmethod
    def _finished(h: Handle) -> bool:
        with h.events.mutex:  # the loop thread appends while this looks
            return any(e.kind == "done" for e in h.events.queue)

    def submit(self, *args, **kw) -> Handle:
        h = self.loop.submit(*args, **kw)
        deadline = time.monotonic() + WAIT_S
        while not self._finished(h):
            assert time.monotonic() < deadline, "the engine did not finish the request"
            time.sleep(0.005)
        return h


@pytest.fixture(scope="module")
def servers(dflash_pair):  # noqa: F811
    target = load_target(dflash_pair.target_dir)
    runner = ModelRunner(target, 128, 16)
    loop = EngineLoop(Scheduler(runner, None))
    behind, port_behind = serve_generation(_Behind(loop))
    live, port_live = serve_generation(loop)
    yield f"127.0.0.1:{port_behind}", f"127.0.0.1:{port_live}"
    behind.stop(grace=None).wait(10)
    live.stop(grace=None).wait(10)
    loop.stop(10)


def test_a_stream_that_fell_behind_gets_its_tokens_in_one_chunk(servers):
    behind, live = servers
    prompt = [3, 9, 27, 17, 5]
    with GenerationClient(behind, timeout_s=60.0) as c:
        chunks = list(c.generate(prompt, max_tokens=24, method="native", ignore_eos=True))
    with GenerationClient(live, timeout_s=60.0) as c:
        want = c.generate_once(prompt, max_tokens=24, method="native", ignore_eos=True)
    assert [len(ch.token_ids) for ch in chunks] == [24, 0]
    assert chunks[0].token_ids == want.token_ids and chunks[-1].finished
    assert chunks[-1].finish_reason == "length"
