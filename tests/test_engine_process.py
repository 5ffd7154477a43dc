"""The colocated service with its engine in a child process (ServeConfig.engine_process; cluster/engine_proc.py).

Real parts only: `start_service` over the shipped demo pair on the CPU, a real child process, real gRPC and HTTP
servers on 127.0.0.1. The split service must serve what the in-process one serves, token for token and
acceptance for acceptance, both methods, concurrently; refuse what the engine refuses with the same status;
free a cancelled request's KV; count finished requests in the served metrics; and when the engine process dies,
end the streams in flight with UNAVAILABLE, refuse new ones, report not serving, and still stop cleanly.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from flashpd.cluster.config import ServeConfig
from flashpd.cluster.generation_client import (GenerationClient, GenerationResourceExhausted,
                                               GenerationUnavailable)
from flashpd.cluster.service import start_service
from flashpd.decode_node.engine_loop import Event

DEMO = Path(__file__).resolve().parents[1] / "flashpd" / "assets" / "demo_pair"
WAIT_S = 30.0
PROMPTS = [[5, 17, 300, 41, 9, 77, 1200, 3], [900, 12, 12, 13, 40, 41, 42, 43, 44, 45, 46, 2000],
           list(range(100, 140)), [7] * 20]


def _cfg(**kw) -> ServeConfig:
    return ServeConfig(target=str(DEMO / "target"), draft=str(DEMO / "drafter"), device="cpu", dtype="float32",
                       kv_cache_tokens=2048, torch_threads=1, **kw)


def _run(client: GenerationClient, prompt: list[int], method: str) -> tuple[list[int], list[int]]:
    r = client.generate_once(prompt, max_tokens=24, method=method, ignore_eos=True)
    return r.token_ids, r.stats["acceptance_lengths"]


def _idle(client: GenerationClient) -> dict:
    t0 = time.monotonic()
    while True:
        h = client.health()
        if h["running"] == 0 and h["waiting"] == 0 and h["kv_blocks_free"] == h["kv_blocks_total"] > 0:
            return h
        if time.monotonic() > t0 + WAIT_S:
            raise AssertionError(f"not idle within {WAIT_S} s: {h}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def reference():
    """What the in-process colocated service serves (tokens, acceptance lengths) for each prompt and method.
    engine_process=False: the default (None) now splits the colocated engine too, and the comparison below must
    set the two forms against each other."""
    svc = start_service(_cfg(engine_process=False))
    client = GenerationClient(svc.address, timeout_s=60.0)
    try:
        assert svc.worker is not None and client.health()["settings"]["engine_process"] is False
        yield {(i, m): _run(client, p, m) for i, p in enumerate(PROMPTS) for m in ("native", "dflash")}
    finally:
        client.close()
        svc.stop()


@pytest.fixture(scope="module")
def split():
    svc = start_service(_cfg(engine_process=True, http_port=0))
    client = GenerationClient(svc.address, timeout_s=60.0)
    yield svc, client
    client.close()
    svc.stop()


def test_the_split_service_serves_what_the_in_process_one_does(reference, split):
    svc, client = split
    assert svc.backend.pid != os.getpid() and svc.worker is None
    for (i, m), want in reference.items():
        assert _run(client, PROMPTS[i], m) == want, (i, m)
    # concurrently, both methods at once: each request still gets its solo tokens and acceptance
    got: dict = {}

    def one(i: int, m: str) -> None:
        c = GenerationClient(svc.address, timeout_s=60.0)
        try:
            got[(i, m)] = _run(c, PROMPTS[i], m)
        finally:
            c.close()

    threads = [threading.Thread(target=one, args=k) for k in reference]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == reference
    # streamed chunks carry the same tokens, and the HTTP front end serves over the same engine
    toks = [t for ch in client.generate(PROMPTS[0], max_tokens=24, method="dflash", ignore_eos=True)
            for t in ch.token_ids]
    assert toks == reference[(0, "dflash")][0]
    import openai  # noqa: PLC0415

    oai = openai.OpenAI(base_url=f"http://{svc.http_address}/v1", api_key="none", max_retries=0)
    r = oai.completions.create(model=oai.models.list().data[0].id, prompt=PROMPTS[1], max_tokens=24,
                               temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True,
                                                          "method": "native"})
    assert r.choices[0].model_extra["token_ids"] == reference[(1, "native")][0]
    _idle(client)
    # finished requests are counted in the served metrics (the front end's), by method
    text = svc.metrics.exposition()
    assert 'flashpd_requests_total{method="dflash",outcome="ok",role="colocated"}' in text
    assert 'flashpd_running_requests{role="colocated"} 0.0' in text


def test_the_engines_refusal_and_a_cancel_cross_the_process(split):
    svc, client = split
    total = client.health()["kv_blocks_total"] * client.health()["kv_block_size"]
    # fits the model's positions (the front end's check) but never this KV cache: the scheduler refuses it
    assert total + 16 < client.health()["max_positions"]
    with pytest.raises(GenerationResourceExhausted, match="KV blocks; this KV cache has"):
        client.generate_once([5] * (total + 16), max_tokens=8, method="native")
    # a stream cancelled after its first chunk frees its blocks
    it = client.generate(PROMPTS[2], max_tokens=1500, method="dflash", ignore_eos=True)
    first = next(it)
    assert first.token_ids
    it.close()
    _idle(client)
    # the refusal and the cancel are counted in the served metrics, as the router counts them (they were not); the
    # cancel's event may still be on its way when the blocks are back
    text, t0 = "", time.monotonic()
    while 'outcome="cancelled"' not in text and time.monotonic() < t0 + WAIT_S:
        text = svc.metrics.exposition()
        time.sleep(0.05)
    assert 'flashpd_requests_total{method="native",outcome="error",role="colocated"} 1.0' in text, text
    assert 'flashpd_requests_total{method="dflash",outcome="cancelled",role="colocated"} 1.0' in text, text
    # nothing is left named on either side of the pipe (refused, cancelled and finished requests alike)
    assert svc.backend.stats()["tracked_requests"] == 0
    assert not svc.backend._live and not svc.backend._taken and not svc.backend._asks


def test_a_dead_engine_ends_its_streams_and_refuses_new_ones():
    svc = start_service(_cfg(engine_process=True))
    client = GenerationClient(svc.address, timeout_s=60.0)
    try:
        it = client.generate(PROMPTS[2], max_tokens=1500, method="native", ignore_eos=True)
        assert next(it).token_ids
        os.kill(svc.backend.pid, signal.SIGKILL)
        with pytest.raises(GenerationUnavailable):
            for _ in it:
                pass
        t0 = time.monotonic()
        while client.health()["serving"]:
            assert time.monotonic() < t0 + WAIT_S, "still serving after its engine died"
            time.sleep(0.05)
        assert not svc.alive
        with pytest.raises(GenerationUnavailable):
            client.generate_once(PROMPTS[0], max_tokens=4, method="native")
        # the stream the death ended is counted as failed in the served metrics; a refusal after it, if it reached
        # the engine's front at all, too
        text = svc.metrics.exposition()
        assert any(ln.startswith('flashpd_requests_total{method="native",outcome="error",role="colocated"}')
                   for ln in text.splitlines()), text
    finally:
        client.close()
        t0 = time.monotonic()
        svc.stop()
        assert time.monotonic() - t0 < 20


def test_an_engine_that_cannot_start_fails_the_start_with_its_error(tmp_path):
    """Bad input (here a config.json without its fields) fails the start with the child's one-line message, as
    the in-process engine's load would (no traceback of the child's)."""
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="config is missing required fields") as e:
        start_service(ServeConfig(target=str(tmp_path), device="cpu", dtype="float32", engine_process=True))
    assert "Traceback" not in str(e.value) and str(tmp_path) in str(e.value)


def test_an_interrupted_start_leaves_no_engine_behind(monkeypatch):
    """Ctrl-C while the child loads: the start raises, and the child (which would load and then wait on its pipe
    for ever) is gone with it."""
    import psutil  # noqa: PLC0415

    from flashpd.cluster import engine_proc  # noqa: PLC0415

    def interrupted(self, *args):
        raise KeyboardInterrupt

    monkeypatch.setattr(engine_proc.EngineProcess, "_wait_ready", interrupted)
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    with pytest.raises(KeyboardInterrupt):
        engine_proc.EngineProcess(_cfg())
    left = [c for c in psutil.Process().children(recursive=True) if c.pid not in before]
    assert all(c.status() == psutil.STATUS_ZOMBIE for c in left if c.is_running()), left


def test_an_engine_that_never_gets_ready_fails_the_start_at_start_timeout_s(monkeypatch):
    """A child that hangs while it loads (here stopped by SIGSTOP as it starts) fails the start after
    start_timeout_s, naming it, and is killed; the start waited for ever before."""
    import subprocess  # noqa: PLC0415

    from flashpd.cluster import engine_proc  # noqa: PLC0415

    made, real = [], subprocess.Popen

    def stopped(*args, **kw):
        p = real(*args, **kw)
        os.kill(p.pid, signal.SIGSTOP)
        made.append(p)
        return p

    monkeypatch.setattr(engine_proc.subprocess, "Popen", stopped)
    raised: list[BaseException] = []

    def start() -> None:
        try:
            engine_proc.EngineProcess(_cfg(start_timeout_s=2.0))
        except BaseException as e:  # noqa: BLE001
            raised.append(e)

    t = threading.Thread(target=start, daemon=True)
    t.start()
    t.join(30)
    if t.is_alive():  # the old start: waits as long as the child lives
        made[0].kill()
        t.join(30)
        pytest.fail("the start did not give up at start_timeout_s")
    assert len(raised) == 1 and isinstance(raised[0], TimeoutError), raised
    assert "start_timeout_s: the engine process was not ready within 2 s" in str(raised[0])
    assert made and made[0].poll() is not None  # killed, not left stopped


def test_engine_process_is_colocated_only_and_on_there_by_default():
    with pytest.raises(ValueError, match="engine_process"):
        ServeConfig(target="t", mode="local", engine_process=True)
    with pytest.raises(ValueError, match="engine_process"):
        ServeConfig(target="t", engine_process="yes")
    assert ServeConfig(target="t").splits_engine and not ServeConfig(target="t", mode="local").splits_engine
    assert not ServeConfig(target="t", engine_process=False).splits_engine


def test_an_engine_loop_sink_gets_each_pass_in_one_call():
    """EngineLoop's sink (what the child forwards through): every event of a pass in one call, none in the
    handles' queues, the tokens those queues would have carried."""
    from flashpd.decode_node.engine_loop import EngineLoop  # noqa: PLC0415
    from flashpd.decode_node.scheduler import Scheduler  # noqa: PLC0415
    from flashpd.engine.factory import load_engine  # noqa: PLC0415
    from flashpd.engine.sampling import SamplingParams  # noqa: PLC0415

    llm = load_engine(str(DEMO / "target"), None, device="cpu", dtype="float32", kv_cache_tokens=4096)
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    calls: list[list[tuple]] = []
    lock = threading.Lock()

    def sink(pairs) -> None:
        with lock:
            calls.append([(h.tag, ev) for h, ev in pairs])

    # with queues: each request read until done
    loop = EngineLoop(Scheduler(llm.runner, None, tuple(llm.stop_ids)))
    want = {}
    try:
        for i, p in enumerate(PROMPTS[:3]):
            h = loop.submit(p, params)
            toks = []
            while True:
                ev = h.get(WAIT_S)
                assert ev is not None
                if ev.kind == "done":
                    break
                toks.extend(ev.tokens)
            want[i] = toks
    finally:
        loop.stop()
    loop = EngineLoop(Scheduler(llm.runner, None, tuple(llm.stop_ids)), sink=sink)
    try:
        hs = []
        for i, p in enumerate(PROMPTS[:3]):
            h, fut = loop.submit_nowait(p, params, tag=i)
            fut.result(WAIT_S)
            hs.append(h)
        t0 = time.monotonic()
        while sum(ev.kind == "done" for c in list(calls) for _, ev in c) < 3:
            assert time.monotonic() < t0 + WAIT_S
            time.sleep(0.01)
    finally:
        loop.stop()
    assert all(h.events.empty() for h in hs)
    got: dict = {}
    for c in calls:
        for tag, ev in c:
            assert isinstance(ev, Event)
            if ev.kind == "tokens":
                got.setdefault(tag, []).extend(ev.tokens)
    assert got == want
    assert any(len(c) > 1 for c in calls)  # some pass carried several requests' events in one call


class TwoArgs(Exception):
    def __init__(self, a: int, b: int) -> None:
        super().__init__(f"{a}/{b}")


def test_an_exception_that_does_not_load_crosses_as_a_runtime_error():
    """An exception that pickles but does not load again would break the front end's reader (and so the service);
    it crosses as a RuntimeError naming it, and a plain one as itself."""
    from flashpd.cluster.engine_proc import _portable  # noqa: PLC0415
    from flashpd.engine.scheduler import PromptTooLong  # noqa: PLC0415

    import pickle  # noqa: PLC0415

    with pytest.raises(TypeError):  # what the reader would meet
        pickle.loads(pickle.dumps(TwoArgs(1, 2)))
    e = _portable(TwoArgs(1, 2))
    assert type(e) is RuntimeError and "TwoArgs: 1/2" in str(e)
    p = _portable(PromptTooLong("too long"))
    assert type(p) is PromptTooLong and str(p) == "too long"
    assert _portable(None) is None


def test_an_event_that_does_not_pickle_fails_its_request_alone():
    """The child's sink over a real pipe: the pass's other events arrive; the request whose event does not pickle
    gets an "error" event instead of nothing (its stream must not wait forever)."""
    import multiprocessing  # noqa: PLC0415

    from flashpd.cluster.engine_proc import _Child  # noqa: PLC0415
    from flashpd.decode_node.engine_loop import Handle  # noqa: PLC0415
    from flashpd.engine.sampling import SamplingParams  # noqa: PLC0415

    here, there = multiprocessing.Pipe()
    child = _Child(there)
    hs = []
    for tag in (1, 2, 3):
        h = Handle([5], SamplingParams(max_tokens=4), "native", None)
        h.tag = tag
        child.handles[tag] = h
        hs.append(h)
    child.sink([(hs[0], Event("tokens", tokens=[7])), (hs[1], Event("done", stats={"bad": lambda: 0})),
                (hs[2], Event("tokens", tokens=[8, 9]))])
    got = []
    while here.poll(1.0):
        got.extend(here.recv()[1])
    assert [(g[0], g[1], g[2]) for g in got] == [(1, "tokens", [7]), (2, "error", []), (3, "tokens", [8, 9])]
    assert "could not reach the front end" in str(got[1][5])
    child._drop_ended()  # what the reader does before its next command: request 2 ended (its own event, then the error)
    assert set(child.handles) == {1, 3}


def test_health_reports_the_settings_and_a_sweep_against_the_service_records_them(split, tmp_path):
    """Health's settings_json is the service's own knobs (no paths); `job_sweep --address` writes them into its
    JSON instead of "unknown", so a committed sweep says how the service it measured ran."""
    from flashpd.bench import job_sweep  # noqa: PLC0415

    svc, client = split
    got = client.health()["settings"]
    assert got == json.loads(json.dumps(svc.cfg.public_settings()))
    assert got["engine_process"] is True and got["mode"] == "colocated" and got["session_hold_fraction"] == 0.5
    assert not {"target", "draft", "host", "port", "tls_key", "bridge_address"} & set(got)
    with urllib.request.urlopen(f"http://{svc.http_address}/health", timeout=10) as r:
        assert json.loads(r.read())["settings"] == got  # the HTTP front end reports the same
    out = tmp_path / "sweep.json"
    assert job_sweep.main(["--address", svc.address, "--target", str(DEMO / "target"), "--methods", "native,dflash",
                           "--concurrency", "1,2", "--prompt-pool", "2", "--requests", "2", "--max-tokens", "4",
                           "--prompt-tokens", "16", "--warmup", "0", "--client-procs", "1",
                           "--out", str(out)]) == 0
    s = json.loads(out.read_text())["settings"]
    assert s["service"] == got
    assert (s["session_hold_fraction"], s["gil_switch_interval_s"], s["draft_width_policy"], s["max_running"]) == (
        got["session_hold_fraction"], got["gil_switch_interval_s"], got["draft_width_policy"], got["max_running"])
    assert s["prompt_pool"]["prefix_cache"] == {"external": "off"}


def test_a_stuck_engine_never_blocks_a_sender(monkeypatch):
    """An engine process that stops reading (here: stopped by SIGSTOP; a step that hangs) fills its socket. Writes
    to it block, so they happen on one writer thread: a submit waits at most its own timeout for room and fails
    with TimeoutError, a cancel and a health read return (not serving, within STATS_TIMEOUT_S), and none of them
    holds its thread for as long as the engine is stuck. Once the engine reads again, it serves as before."""
    from flashpd.cluster import engine_proc
    from flashpd.engine.sampling import SamplingParams

    monkeypatch.setattr(engine_proc, "OUTBOX_MAX_BYTES", 256 << 10, raising=False)
    svc = start_service(_cfg(engine_process=True))
    be = svc.backend
    big = [5] * 300_000  # about 600 KB pickled: more than the socket holds (refused by the engine, once it reads)
    try:
        os.kill(be.pid, signal.SIGSTOP)
        out: dict[str, object] = {}

        def call(name: str, fn) -> None:
            t0 = time.monotonic()
            try:
                out[name] = fn()
            except BaseException as e:  # noqa: BLE001  checked below
                out[name] = e
            out[name + "_s"] = time.monotonic() - t0

        params = SamplingParams(max_tokens=4)
        first = threading.Thread(target=call, args=("first", lambda: be.submit(big, params, timeout_s=1.0)))
        first.start()
        time.sleep(0.5)  # its message is queued and being written, the socket full
        threads = [threading.Thread(target=call, args=("second", lambda: be.submit(big, params, timeout_s=1.0))),
                   threading.Thread(target=call, args=("counts", be.counts))]
        for t in threads:
            t.start()
        for t in [first, *threads]:
            t.join(engine_proc.STATS_TIMEOUT_S + 5)
        assert not any(t.is_alive() for t in [first, *threads]), out
        assert isinstance(out["first"], TimeoutError) and isinstance(out["second"], TimeoutError), out
        assert "not reading" in str(out["second"]) and out["second_s"] < 3, out
        assert out["counts"].serving is False and out["counts_s"] < engine_proc.STATS_TIMEOUT_S + 2, out
    finally:
        os.kill(be.pid, signal.SIGCONT)
    try:
        client = GenerationClient(svc.address, timeout_s=60.0)
        r = client.generate_once(PROMPTS[0], max_tokens=4, method="native", ignore_eos=True)
        assert len(r.token_ids) == 4
        _idle(client)
        client.close()
    finally:
        t0 = time.monotonic()
        svc.stop()
        assert time.monotonic() - t0 < 20


def test_a_submit_that_timed_out_and_was_then_refused_leaves_nothing_named(split):
    """A submit that gives up while the engine is busy (here stopped) is refused once the engine reads it: nothing
    waits for it any more, and the refusal still drops it from the requests in flight (it stayed there for ever,
    holding its prompt)."""
    from flashpd.engine.sampling import SamplingParams  # noqa: PLC0415

    svc, client = split
    be = svc.backend
    h = client.health()
    too_long = [5] * (h["kv_blocks_total"] * h["kv_block_size"] + 16)  # the scheduler refuses it
    os.kill(be.pid, signal.SIGSTOP)
    try:
        with pytest.raises(TimeoutError):
            be.submit(too_long, SamplingParams(max_tokens=4), timeout_s=0.3)
    finally:
        os.kill(be.pid, signal.SIGCONT)
    t0 = time.monotonic()
    while be._taken:  # the refusal came back
        assert time.monotonic() < t0 + WAIT_S
        time.sleep(0.05)
    _idle(client)
    assert not be._live and be.stats()["tracked_requests"] == 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_ctrl_c_at_the_terminal_does_not_end_the_engines_requests(sig):
    """SIGINT reaches the engine process with the rest of the terminal's process group, a SIGTERM to the group (kill
    -TERM -PGID) or the service's cgroup (systemd's default) likewise; the front end alone stops it, so a stream in
    flight goes on to its end (it ended with UNAVAILABLE, the engine gone under the front end; under SIGTERM at once,
    exit code -15)."""
    svc = start_service(_cfg(engine_process=True))
    client = GenerationClient(svc.address, timeout_s=60.0)
    try:
        it = client.generate(PROMPTS[2], max_tokens=200, method="native", ignore_eos=True)
        toks = list(next(it).token_ids)
        os.kill(svc.backend.pid, sig)
        for ch in it:
            toks.extend(ch.token_ids)
        assert len(toks) == 200 and svc.alive
        assert len(client.generate_once(PROMPTS[0], max_tokens=4, method="native", ignore_eos=True).token_ids) == 4
    finally:
        client.close()
        svc.stop()


@pytest.mark.parametrize("asking", [False, True])
def test_an_engine_process_whose_loop_died_exits(asking):
    """The child's engine loop can die (a step failed, and failing its requests failed too) while the process and
    its pipe live on. The child then leaves its command loop (and so exits), as a dead in-process loop turns the
    service not alive; it went on reading commands, refusing every request while it looked alive. asking: a front
    end that keeps sending (a Health probe's stats every 0.2 s): the child looked at its loop only when a second
    passed with no command, so under steady traffic it lived on, answering stats (Health said serving)."""
    import multiprocessing  # noqa: PLC0415
    from types import SimpleNamespace  # noqa: PLC0415

    from flashpd.cluster.engine_proc import _Child  # noqa: PLC0415
    from flashpd.decode_node.engine_loop import EngineLoop  # noqa: PLC0415
    from flashpd.decode_node.scheduler import Scheduler  # noqa: PLC0415
    from flashpd.engine.factory import load_engine  # noqa: PLC0415
    from flashpd.engine.sampling import SamplingParams  # noqa: PLC0415

    llm = load_engine(str(DEMO / "target"), None, device="cpu", dtype="float32", kv_cache_tokens=1024)
    sched = Scheduler(llm.runner, None, tuple(llm.stop_ids))

    def broken(*_a, **_k):
        raise RuntimeError("device lost")

    sched.step, sched.abort_all = broken, broken
    here, there = multiprocessing.Pipe()
    child = _Child(there)
    child.worker = SimpleNamespace(loop=EngineLoop(sched, sink=child.sink), stats=lambda: {})
    served = threading.Thread(target=child.serve, daemon=True)
    served.start()
    here.send(("submit", 1, PROMPTS[0], SamplingParams(max_tokens=4), "native", None, None))
    deadline = time.monotonic() + 10
    i = 0
    while asking and served.is_alive() and time.monotonic() < deadline:
        i += 1
        try:
            here.send(("stats", i))
        except OSError:
            break
        time.sleep(0.2)
    served.join(10)
    assert not child.worker.loop.alive
    assert not served.is_alive(), "the engine process still serves commands with a dead engine loop"
    here.close()


def test_the_recompute_fallbacks_family_is_read_from_the_engine_process(caplog):
    """With a prefix cache, the served metrics read the engine's import failures by reason through the engine
    process's stats; every scrape failed there (what decode_metrics calls was missing), logged its traceback and
    left the family empty."""
    import logging  # noqa: PLC0415

    svc = start_service(_cfg(engine_process=True, device_cache_bytes=16 << 20))
    try:
        with caplog.at_level(logging.ERROR, logger="flashpd.cluster.metrics"):
            text = svc.metrics.exposition()
        assert "flashpd_recompute_fallbacks" in text
        assert not [r for r in caplog.records if "could not be read" in r.getMessage()], caplog.text
    finally:
        svc.stop()


# Loaded by the engine process (PYTHONPATH): while the file TEST_ENGINE_STATS_FAIL names exists, the engine's own
# stats call raises its text, as a device or allocator fault would; the engine loop itself goes on serving.
_STATS_FAIL = """\
import os
flag = os.environ.get("TEST_ENGINE_STATS_FAIL")
if flag:
    from flashpd.decode_node.worker import DecodeWorker
    real = DecodeWorker.stats
    def stats(self):
        if os.path.exists(flag):
            raise RuntimeError(open(flag).read())
        return real(self)
    DecodeWorker.stats = stats
"""


def _http(base: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_an_engine_that_cannot_report_its_state_is_not_serving(tmp_path, monkeypatch, caplog):
    """The engine's stats call fails in the child (its answer is {"error": ...}). counts() raised that as a
    RuntimeError: gRPC Health ended UNKNOWN with the exception's text, /health and chat's default max_tokens
    answered 500. Now the worker says it is not serving (Health answers, /health 503, so a balancer takes it out
    of rotation), chat without max_tokens gets a 503 (its default needs the KV figures), a request that names its
    max_tokens is still served, the error is logged once, not per probe, and serving resumes when stats answer."""
    import logging  # noqa: PLC0415

    (tmp_path / "sitecustomize.py").write_text(_STATS_FAIL)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    flag = tmp_path / "stats_fail"
    monkeypatch.setenv("TEST_ENGINE_STATS_FAIL", str(flag))
    svc = start_service(_cfg(engine_process=True, http_port=0))
    client = GenerationClient(svc.address, timeout_s=30.0)
    base = f"http://{svc.http_address}"
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    try:
        assert client.health()["serving"]
        flag.write_text("CUDA error: an illegal memory access was encountered")
        with caplog.at_level(logging.WARNING, logger="flashpd.cluster.engine_proc"):
            for _ in range(3):
                h = client.health()
                assert not h["serving"] and h["kv_blocks_total"] == 0, h
            status, body = _http(base, "/health")
            assert status == 503 and body["status"] == "unavailable" and body["serving"] is False, body
            status, body = _http(base, "/v1/chat/completions", chat)
            assert status == 503 and body["error"]["code"] == "service_unavailable", body
            assert "max_tokens" in body["error"]["message"], body
            status, body = _http(base, "/v1/chat/completions", {**chat, "max_tokens": 2, "ignore_eos": True})
            assert status == 200 and body["usage"]["completion_tokens"] == 2, body
            flag.unlink()
            assert client.health()["serving"]
        said = [r.getMessage() for r in caplog.records]
        assert sum("illegal memory access" in m for m in said) == 1, said
        assert any("serving again" in m for m in said), said
    finally:
        client.close()
        svc.stop()


def test_the_engine_processs_children_get_default_signals():
    """The engine process ignores SIGINT and SIGTERM (the front end stops it), and its children must not: SIG_IGN
    is inherited through fork and exec, so torch's compile workers and shared-memory manager ignored the SIGTERM of
    their own shutdowns. An exec'd child and a forked one both see the defaults; the process itself stays up."""
    code = (
        "import os, signal, subprocess, sys\n"
        "from flashpd.cluster.engine_proc import _own_signals\n"
        "_own_signals()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"  # ignored here
        "probe = 'import signal; print(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)'\n"
        "out = subprocess.run([sys.executable, '-c', probe], capture_output=True, text=True).stdout.strip()\n"
        "print('exec', out)\n"
        "r, w = os.pipe()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os.write(w, str(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL).encode()); os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "print('fork', os.read(r, 16).decode())\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines() == ["exec True", "fork True"], r.stdout


def test_the_in_process_form_counts_refusals_and_cancels_too():
    """engine_process: false serves from this process's engine loop: its refused and cancelled requests are counted
    in the served metrics as the split form's and the router's are (only finished ones were)."""
    svc = start_service(_cfg(engine_process=False))
    client = GenerationClient(svc.address, timeout_s=60.0)
    try:
        total = client.health()["kv_blocks_total"] * client.health()["kv_block_size"]
        with pytest.raises(GenerationResourceExhausted):
            client.generate_once([5] * (total + 16), max_tokens=8, method="native")
        it = client.generate(PROMPTS[2], max_tokens=1500, method="dflash", ignore_eos=True)
        assert next(it).token_ids
        it.close()
        _idle(client)
        t0 = time.monotonic()
        text = ""
        while 'outcome="cancelled"' not in text and time.monotonic() < t0 + WAIT_S:  # the loop sees the cancel
            text = svc.metrics.exposition()
            time.sleep(0.05)
        assert 'flashpd_requests_total{method="native",outcome="error",role="colocated"} 1.0' in text, text
        assert 'flashpd_requests_total{method="dflash",outcome="cancelled",role="colocated"} 1.0' in text, text
    finally:
        client.close()
        svc.stop()


def test_a_stopped_engine_loop_counts_the_request_it_refuses():
    """A request submitted to a stopped loop is refused (EngineStopped) and counted as an error, as the engine
    process's front counts one to a dead engine: it was counted nowhere."""
    from flashpd.decode_node.engine_loop import EngineLoop, EngineStopped  # noqa: PLC0415
    from flashpd.decode_node.scheduler import Scheduler  # noqa: PLC0415
    from flashpd.engine.factory import load_engine  # noqa: PLC0415
    from flashpd.engine.sampling import SamplingParams  # noqa: PLC0415

    llm = load_engine(str(DEMO / "target"), None, device="cpu", dtype="float32", kv_cache_tokens=1024)
    ended: list[tuple] = []
    loop = EngineLoop(Scheduler(llm.runner, None, tuple(llm.stop_ids)), on_abort=lambda *a: ended.append(a))
    loop.stop()
    with pytest.raises(EngineStopped):
        loop.submit(PROMPTS[0], SamplingParams(max_tokens=4), "native")
    assert ended == [("native", "error", 0)]


@pytest.mark.parametrize("after_s", [0.2, 4.0])
def test_an_engine_whose_serving_process_dies_while_it_starts_exits(after_s):
    """The serving process killed (SIGKILL, the OOM killer) while its engine process loads and warms up: the engine
    exits within seconds. It read its pipe only once serving, so it went on warming up for minutes for nobody (on a
    GPU holding the memory a restarted service needs), and died on its "ready" message (found by a review). At
    0.2 s the engine is still importing: a parent pid read then by getppid() is already init's."""
    import psutil  # noqa: PLC0415

    script = ("import sys; from flashpd.cluster.config import ServeConfig; "
              "from flashpd.cluster.engine_proc import EngineProcess; "
              f"EngineProcess(ServeConfig(target={str(DEMO / 'target')!r}, draft={str(DEMO / 'drafter')!r}, "
              "device='cpu', dtype='float32', kv_cache_tokens=2048, torch_threads=1, warmup=True, "
              "start_timeout_s=600.0))")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    engine = None
    try:
        t0 = time.monotonic()
        while engine is None and time.monotonic() - t0 < WAIT_S:
            kids = [c for c in psutil.Process(parent.pid).children() if "flashpd.cluster.engine_proc" in
                    " ".join(c.cmdline())]
            engine = kids[0] if kids else None
            time.sleep(0.1)
        assert engine is not None, "no engine process started"
        time.sleep(after_s)  # importing, loading the pair, or warming up (minutes on this CPU with warmup on)
        assert engine.is_running() and parent.poll() is None
        parent.kill()
        parent.wait(10)
        try:
            engine.wait(15)  # (a grandchild: its exit code is not this process's to read)
        except psutil.TimeoutExpired:
            pytest.fail("the engine process went on starting with its serving process gone")
    finally:
        if parent.poll() is None:
            parent.kill()
        if engine is not None and engine.is_running():
            engine.kill()


def test_an_engine_killed_while_it_starts_is_a_worker_start_error(monkeypatch):
    """The engine process dies before it is ready: the start fails with a WorkerStartError, which `flashpd serve`
    prints in one line (a RuntimeError printed the whole traceback, found by a review)."""
    from flashpd.cluster import engine_proc  # noqa: PLC0415
    from flashpd.cluster.launcher import WorkerStartError  # noqa: PLC0415

    real = subprocess.Popen

    def killed(*args, **kw):
        p = real(*args, **kw)
        os.kill(p.pid, signal.SIGKILL)
        p.wait()  # dead before its config is sent: that send meets a closed pipe (a BrokenPipeError escaped it)
        return p

    monkeypatch.setattr(engine_proc.subprocess, "Popen", killed)
    with pytest.raises(WorkerStartError, match=r"the engine process exited \(code -9\) before it was ready"):
        engine_proc.EngineProcess(_cfg())


def test_an_engine_that_does_not_answer_its_stats_is_logged_once(caplog):
    """A stuck engine process (its stats call times out) is not serving, said once in the log (nothing was said:
    only Health and /health told), and its return once."""
    import logging  # noqa: PLC0415

    from flashpd.cluster import engine_proc  # noqa: PLC0415

    ep = object.__new__(engine_proc.EngineProcess)  # counts() reads only stats() and the logged state
    ep._lock, ep._stats_error = threading.Lock(), None
    stuck = [True]

    def stats():
        if stuck[0]:
            raise TimeoutError("the engine process did not answer within 5 s")
        return {"running": 0, "waiting": 0, "kv_blocks_free": 4, "kv_blocks_total": 4, "kv_block_size": 16}

    ep.stats = stats
    with caplog.at_level(logging.WARNING, logger="flashpd.cluster.engine_proc"):
        for _ in range(3):
            assert ep.counts().serving is False
        stuck[0] = False
        assert ep.counts().kv_blocks_total == 4
    said = [r.getMessage() for r in caplog.records]
    assert sum("did not answer" in m for m in said) == 1 and any("serving again" in m for m in said), said
