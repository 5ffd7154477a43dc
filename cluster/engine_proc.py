"""The colocated engine in a process of its own, behind the same Backend the gRPC and HTTP front ends use.

In one process the engine loop shares the interpreter lock with every front-end thread: at a hundred streams
those threads hand it back and forth for each message, and the engine's step waits its turn each time it wants
it back (vLLM's EngineCore and SGLang's scheduler process are split off for the same reason). `EngineProcess`
starts a child process (`python -m flashpd.cluster.engine_proc`: no fork of a process that holds CUDA and threads,
and no re-import of the caller's main module) that loads the model and runs the DecodeWorker exactly as the
colocated service does in-process (cluster/worker_main.build_decode: warm-up, session hold, prefix cache), and
talks to it over a private socket pair (no address: nothing else can reach it, so its messages are pickles):

- to the child: ("config", ServeConfig as a dict) first, then ("submit", rid, prompt, params, method,
  draft_width, first_token), ("cancel", rid), ("stats", qid), ("stop",);
- from the child: ("ready", facts) or ("failed", text) once, then ("taken", rid, refusal or None),
  ("events", [(rid, kind, tokens, finish_reason, stats, error), ...]) -- one message for each pass of the
  engine loop, whatever the number of streams (EngineLoop's sink) -- and ("stats", qid, DecodeWorker.stats()).

A reader thread here puts each event into its request's `Handle` queue, so the front ends see the handles they
see in-process (coalescing included). Refusals come back as the exceptions the scheduler raised (PromptTooLong,
ValueError); an exception that does not survive a pickle round trip comes back as a RuntimeError naming it. The
child exits when its pipe closes (this process gone) or its engine loop dies, and ignores SIGINT and SIGTERM (a
terminal's Ctrl-C, a group's or a cgroup's SIGTERM reach it too; the front end stops it); when the child dies, every request in flight
ends with an "error" event (EngineStopped), new submissions are refused, and `alive` turns false.
"""
from __future__ import annotations

import argparse
import itertools
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from multiprocessing.connection import Connection
from typing import Callable

from flashpd.cluster.launcher import WorkerStartError
from flashpd.decode_node.engine_loop import DEFAULT_SUBMIT_TIMEOUT_S, EngineStopped, Event, Handle
from flashpd.engine.load import Load
from flashpd.engine.sampling import SamplingParams

log = logging.getLogger(__name__)
# what a start fails with on bad input (a wrong checkpoint, config value or path): the parent raises its message alone
INPUT_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)

FINAL = ("done", "cancelled", "error")
OUTCOMES = {"done": "ok", "cancelled": "cancelled", "error": "error"}  # the served metrics' outcome label
STATS_TIMEOUT_S = 5.0  # a stats round trip (health, metrics) waits at most this long
# bytes of messages queued for the engine process and not yet written: its socket is full when it stops reading (a
# stuck step); a submit then waits for room at most its own timeout and fails, instead of blocking its thread (and
# every other sender, cancels and health reads included) for as long as the engine is stuck
OUTBOX_MAX_BYTES = 64 << 20
LOOP_CHECK_S = 1.0  # how often the idle engine process checks that its engine loop still runs
# what counts() says of an engine that cannot say (gone, not answering, its stats failing)
NOT_SERVING = Load(running=0, waiting=0, kv_blocks_free=0, kv_blocks_total=0, kv_block_size=0, serving=False)


class EngineStatsFailed(RuntimeError):
    """The engine process is there but its own stats call failed (its answer was {"error": ...})."""


def _portable(e: BaseException | None) -> BaseException | None:
    """e itself when it survives a pickle round trip (an exception whose __init__ wants other arguments pickles but
    does not load, and would break the front end's reader), else a RuntimeError naming it."""
    if e is None:
        return None
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001  whatever the exception holds that does not pickle
        return RuntimeError(f"{type(e).__name__}: {e}")


class _Child:
    """The child's side: the DecodeWorker and the pipe (sends from the engine and reader threads, one lock)."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self.lock = threading.Lock()
        # rid -> handle, for cancels; only the reader thread adds and removes. The engine thread names the requests
        # that ended (final event, refusal) in `ended`, and the reader drops them before its next command: it added
        # each handle before any command after its submit, so an end is never dropped before its handle is there.
        self.handles: dict[int, Handle] = {}
        self.ended: deque[int] = deque()
        self.worker = None

    def _drop_ended(self) -> None:
        while self.ended:
            self.handles.pop(self.ended.popleft(), None)

    def send(self, msg: tuple) -> None:
        with self.lock:
            self.conn.send(msg)

    def sink(self, pairs: list[tuple[Handle, Event]]) -> None:
        """EngineLoop's sink: one pass's events as one message. Should one of them not pickle, the others still go,
        and that request ends with an "error" event here and is cancelled there (it must not wait forever)."""
        out = []
        for h, ev in pairs:
            if ev.kind in FINAL:
                self.ended.append(h.tag)
            out.append((h.tag, ev.kind, ev.tokens, ev.finish_reason, ev.stats, _portable(ev.error)))
        try:
            self.send(("events", out))
        except (OSError, EOFError):
            raise  # the front end is gone: the loop logs it, and the reader stops the engine
        except Exception:  # noqa: BLE001  pickling failed before a byte was written: send them one by one
            for item, (h, _) in zip(out, pairs):
                try:
                    self.send(("events", [item]))
                except (OSError, EOFError):
                    raise
                except Exception as e:  # noqa: BLE001  this one does not cross: fail its request alone
                    log.exception("an event of request %s does not pickle; failing the request", item[0])
                    self.ended.append(item[0])
                    if self.worker is not None:
                        self.worker.loop.cancel(h)
                    err = RuntimeError(f"the engine's event ({item[1]}) could not reach the front end: "
                                       f"{type(e).__name__}: {e}")
                    self.send(("events", [(item[0], "error", [], None, None, err)]))

    def taken(self, rid: int, fut: Future) -> None:
        e = fut.exception()
        if e is not None:
            self.ended.append(rid)
        self.send(("taken", rid, _portable(e)))

    def _next(self) -> tuple | None:
        """The next command; None once the pipe closed, or once the engine loop died (a failed step whose requests
        could not even be failed): this process then exits, and the front end sees its engine gone, not alive and
        refusing every request."""
        while True:
            if not self.worker.loop.alive:  # on every pass: a front end that kept sending (requests, Health every
                # second) never let a poll time out, and the child lived on, answering stats and refusing each request
                log.error("the engine loop stopped: ending the engine process")
                return None
            try:
                if self.conn.poll(LOOP_CHECK_S):
                    return self.conn.recv()
            except (EOFError, OSError):
                log.warning("the front end is gone: stopping the engine")
                return None

    def serve(self) -> None:
        """Commands until "stop", the pipe closes or the engine loop dies."""
        loop = self.worker.loop
        while True:
            msg = self._next()
            if msg is None:
                return
            self._drop_ended()
            op = msg[0]
            if op == "submit":
                _, rid, prompt, params, method, draft_width, first_token = msg
                try:
                    h, fut = loop.submit_nowait(prompt, params, method, draft_width, first_token, tag=rid)
                except Exception as e:  # noqa: BLE001  EngineStopped: the submitter gets it
                    self.send(("taken", rid, _portable(e)))
                    continue
                self.handles[rid] = h
                fut.add_done_callback(lambda f, rid=rid: self.taken(rid, f))
            elif op == "cancel":
                h = self.handles.get(msg[1])
                if h is not None:
                    loop.cancel(h)
            elif op == "stats":
                try:
                    st = self.worker.stats()
                    st["tracked_requests"] = len(self.handles)  # requests this side still names (0 when idle)
                    if self.worker.cache is not None:
                        st["import_failures_by_reason"] = self.worker.failure_reasons()
                        store = self.worker.cache.cache.store
                        if type(store).__name__ == "DeviceStore":  # the device tier's metrics, served by the parent
                            st["device_store"] = store.stats()
                except Exception as e:  # noqa: BLE001  the asker gets the error, the engine goes on
                    st = {"error": f"{type(e).__name__}: {e}"}
                self.send(("stats", msg[1], st))
            elif op == "stop":
                return


def engine_main(conn: Connection, parent_pid: int | None = None) -> None:
    """The child process: build the colocated DecodeWorker, report ready (or failed), serve the pipe, stop."""
    from flashpd.cluster.config import ServeConfig  # noqa: PLC0415
    from flashpd.cluster.metrics import Metrics  # noqa: PLC0415
    from flashpd.cluster.worker_main import (_exit_if_orphaned_while_starting, build_decode,  # noqa: PLC0415
                                             load_model, local_cache)

    child = _Child(conn)
    # the serving process killed while this one loads and warms up (minutes on a GPU, holding its memory) must not
    # leave it to finish for nobody: it reads the pipe, and so sees it close, only once serving. The parent's pid
    # comes from its command line: one killed while this process still imported is gone before getppid() is read
    started = threading.Event()
    threading.Thread(target=_exit_if_orphaned_while_starting, args=(parent_pid, started), daemon=True,
                     name="parent-watch").start()
    try:
        op, cfg_dict = conn.recv()
        if op != "config":
            raise ValueError(f"the engine process's first message must be its config, got {op!r}")
        cfg = ServeConfig.from_dict(cfg_dict, "engine process config")
        llm = load_model(cfg)
        metrics = Metrics("engine")  # what build_decode feeds; the front end keeps the served metrics
        child.worker = build_decode(cfg, llm, local_cache(cfg, llm, metrics), metrics, sink=child.sink)
    except BaseException as e:  # noqa: BLE001  the parent raises it: bad input as its message, the rest with this text
        child.send(("failed", {"input": isinstance(e, INPUT_ERRORS), "message": str(e) or type(e).__name__,
                               "traceback": traceback.format_exc()}))
        return
    finally:
        started.set()
    loop = child.worker.loop
    child.send(("ready", {"has_drafter": loop.has_drafter, "default_draft_width": loop.default_draft_width,
                          "vocab_size": loop.vocab_size, "max_positions": loop.max_positions}))
    try:
        child.serve()
    finally:
        child.worker.stop(10)


class EngineProcess:
    """A Backend (cluster/generation_server.py) whose engine runs in a child process (module doc).

    on_done(method, stats, output_tokens, outcome) sees each request's end here, "ok", "cancelled" or "error"
    (the served metrics)."""

    def __init__(self, cfg, on_done: Callable[[str, dict, int, str], None] | None = None,
                 progress_s: float = 30.0) -> None:
        mine, theirs = socket.socketpair()
        self._proc = subprocess.Popen([sys.executable, "-m", "flashpd.cluster.engine_proc", "--fd",
                                       str(theirs.fileno()), "--log-level", str(logging.getLogger().getEffectiveLevel()),
                                       "--parent-pid", str(os.getpid())], pass_fds=(theirs.fileno(),))
        theirs.close()
        self._conn = Connection(mine.detach())
        self.on_done = on_done
        self._outbox: deque[bytes] = deque()  # pickled messages for the writer thread, in order
        self._outbox_bytes = 0
        self._out_cv = threading.Condition()
        self._closing = False
        self._write_error: BaseException | None = None
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._taken: dict[int, Future] = {}
        self._live: dict[int, tuple[Handle, list[int]]] = {}  # rid -> handle, [tokens streamed]
        self._asks: dict[int, Future] = {}
        self._stopping = False
        self._dead: EngineStopped | None = None
        self._stats_error: str | None = None  # the last stats failure logged (None: stats answer)
        try:
            try:
                self._conn.send(("config", cfg.to_dict()))
            except OSError:  # (BrokenPipeError) the child died at once: _wait_ready reports its exit
                pass
            facts = self._wait_ready(progress_s, cfg.start_timeout_s)
        except BaseException:  # a failed or interrupted start leaves no child and no open socket behind
            if self._proc.poll() is None:
                self._proc.kill()
                self._wait(5)
            self._conn.close()
            raise
        self.has_drafter: bool = facts["has_drafter"]
        self.default_draft_width: int | None = facts["default_draft_width"]
        self.vocab_size: int = facts["vocab_size"]
        self.max_positions: int = facts["max_positions"]
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self._reader.start()
        self._writer = threading.Thread(target=self._write, name="engine-writer", daemon=True)
        self._writer.start()

    def _wait_ready(self, progress_s: float, timeout_s: float) -> dict:
        """The child's "ready" facts; a child that hangs is given start_timeout_s (then killed by the caller)."""
        t0 = last = time.monotonic()
        while not self._conn.poll(min(1.0, timeout_s)):
            if self._proc.poll() is not None:
                raise WorkerStartError(f"the engine process exited (code {self._proc.returncode}) before it was "
                                       "ready")
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"start_timeout_s: the engine process was not ready within {timeout_s:g} s "
                                   "(loading, compiling and warming up)")
            if time.monotonic() - last >= progress_s:
                last = time.monotonic()
                log.info("waiting for the engine process (loading, warming up): %.0f s", last - t0)
        try:
            msg = self._conn.recv()
        except (EOFError, OSError):  # the child went away mid-message (a reset connection is an OSError)
            self._wait(10)
            raise WorkerStartError(f"the engine process exited (code {self._proc.returncode}) before it was "
                                   "ready") from None
        if msg[0] != "ready":
            self._wait(10)
            info = msg[1]
            if info["input"]:  # a wrong checkpoint, config or path: the user's to fix, said in one line
                log.debug("the engine process failed to start:\n%s", info["traceback"])
                raise ValueError(info["message"])
            raise RuntimeError(f"the engine process failed to start:\n{info['traceback']}")
        log.info("engine process %d ready after %.1f s", self._proc.pid, time.monotonic() - t0)
        return msg[1]

    # ---- Backend ----------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._dead is None and not self._stopping and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def submit(self, prompt: list[int], params: SamplingParams, method: str = "native",
               draft_width: int | None = None, timeout_s: float = DEFAULT_SUBMIT_TIMEOUT_S,
               first_token: int | None = None, handoff=None, deadline_s: float | None = None) -> Handle:
        """As EngineLoop.submit: the handle once the engine took the request, or its refusal raised (deadline_s:
        as EngineLoop's, not needed)."""
        if handoff is not None:
            raise ValueError("a device-path handoff needs the engine in the serving process (engine_process off)")
        rid = next(self._ids)
        h = Handle(list(prompt), params, method, draft_width, first_token)
        h.tag = rid
        fut: Future = Future()
        with self._lock:
            alive = self.alive
            if alive:
                self._taken[rid] = fut
                self._live[rid] = (h, [0])
        if not alive:
            self._ended(method, {}, 0, "error")
            raise EngineStopped("engine process is not running") from self._dead
        end = time.monotonic() + timeout_s
        try:
            self._send(("submit", rid, h.prompt, params, method, draft_width, first_token), wait_s=timeout_s)
        except BaseException:  # not queued (stopped, no room in time, does not pickle): nothing of it stays named
            with self._lock:
                self._taken.pop(rid, None)
                entry = self._live.pop(rid, None)
            if entry is not None:  # (_gone may have ended it meanwhile, counted there)
                self._ended(method, {}, 0, "error")
            raise
        try:
            fut.result(timeout=max(0.0, end - time.monotonic()))
        except FutureTimeout:
            self.cancel(h)
            raise TimeoutError(f"the engine did not take the request within {timeout_s:g} s") from None
        except BaseException:
            with self._lock:
                self._live.pop(rid, None)
            raise
        return h

    def cancel(self, h: Handle) -> None:
        """Ask the engine to drop the request (idempotent; nothing once it ended or the engine is gone)."""
        h.cancel_requested = True
        if self.alive:
            try:
                self._send(("cancel", h.tag))
            except EngineStopped:  # gone meanwhile: its requests end with an "error" event
                pass

    def stats(self) -> dict:
        """DecodeWorker.stats() of the engine (a round trip; raises EngineStopped, TimeoutError, or
        EngineStatsFailed when the engine's own stats call failed)."""
        qid = next(self._ids)
        fut: Future = Future()
        with self._lock:
            if not self.alive:
                raise EngineStopped("engine process is not running") from self._dead
            self._asks[qid] = fut
        try:
            self._send(("stats", qid))
        except EngineStopped:
            with self._lock:
                self._asks.pop(qid, None)
            raise
        try:
            st = fut.result(timeout=STATS_TIMEOUT_S)
        except FutureTimeout:
            with self._lock:
                self._asks.pop(qid, None)
            raise TimeoutError(f"the engine process did not answer within {STATS_TIMEOUT_S:g} s") from None
        if "error" in st:
            raise EngineStatsFailed(f"engine stats: {st['error']}")
        return st

    def counts(self) -> Load:
        """The engine's load, or not serving when it cannot say (gone, not answering, or its stats call failed): an
        engine that cannot report its state is not healthy, and Health and /health must say so, not fail."""
        try:
            st = self.stats()
        except (EngineStopped, TimeoutError, OSError) as e:  # said once in the log, as a stats call's failure
            self._note_stats(str(e) or type(e).__name__)
            return NOT_SERVING
        except EngineStatsFailed as e:
            self._note_stats(str(e))
            return NOT_SERVING
        self._note_stats(None)
        return Load(running=st["running"], waiting=st["waiting"], kv_blocks_free=st["kv_blocks_free"],
                    kv_blocks_total=st["kv_blocks_total"], kv_block_size=st["kv_block_size"],
                    serving=False if st.get("serving") is False else None)  # the engine's loop looks hung

    def _note_stats(self, error: str | None) -> None:
        """Log a stats failure once per distinct message, and its end once: health probes read counts() every few
        seconds, and a log line each time would bury everything else."""
        with self._lock:
            last, self._stats_error = self._stats_error, error
        if error is not None and error != last:
            log.error("the engine process cannot report its state (%s): not serving until it can", error)
        elif error is None and last is not None:
            log.warning("the engine process reports its state again: serving again")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the engine (requests in flight end with an "error" event) and reap the process."""
        self._stopping = True
        try:
            self._send(("stop",))
        except EngineStopped:
            pass
        if not self._wait(timeout_s):  # (it ignores SIGTERM, as SIGINT: main says why)
            log.warning("engine process %d did not stop within %g s: killing it", self._proc.pid, timeout_s)
            self._proc.kill()
            self._wait(5)
        self._reader.join(5)  # the child's end closed with it: the reader has met EOF
        with self._out_cv:
            self._closing = True
            self._out_cv.notify_all()
        self._writer.join(5)  # a write to the exited child has failed by now
        self._conn.close()

    def _wait(self, timeout_s: float) -> bool:
        """Whether the child exited within timeout_s."""
        try:
            self._proc.wait(timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False

    # ---- the pipe ---------------------------------------------------------------------------------
    def _send(self, msg: tuple, wait_s: float | None = None) -> None:
        """Queue msg for the writer thread; never blocks on the socket. wait_s: while OUTBOX_MAX_BYTES are queued
        (the engine stopped reading), wait at most this long for room, then raise TimeoutError; None: queue it
        anyway (the small control messages: cancel, stats, stop, which must never wait behind a stuck engine)."""
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)  # what Connection.send writes, recv() loads
        end = time.monotonic() + (wait_s or 0.0)
        with self._out_cv:
            while True:
                if self._write_error is not None:
                    e = self._write_error
                    raise EngineStopped(f"engine process is gone ({type(e).__name__}: {e})")
                if wait_s is None or not self._outbox or self._outbox_bytes + len(data) <= OUTBOX_MAX_BYTES:
                    break
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the engine process is not reading: {self._outbox_bytes} bytes of messages "
                                       f"wait to be written to it")
                self._out_cv.wait(left)
            self._outbox.append(data)
            self._outbox_bytes += len(data)
            self._out_cv.notify_all()

    def _write(self) -> None:
        """The writer thread: the queued messages to the socket in order (a write blocks while the engine does
        not read; only this thread waits then). A failed write means the engine is gone."""
        while True:
            with self._out_cv:
                while not self._outbox and not self._closing:
                    self._out_cv.wait()
                if not self._outbox:
                    return
                data = self._outbox[0]
            try:
                self._conn.send_bytes(data)
            except (OSError, ValueError) as e:  # a closed pipe: the engine is gone (the reader ends its requests)
                with self._out_cv:
                    self._write_error = e
                    self._outbox.clear()
                    self._outbox_bytes = 0
                    self._out_cv.notify_all()
                return
            with self._out_cv:
                self._outbox.popleft()
                self._outbox_bytes -= len(data)
                self._out_cv.notify_all()

    def _read(self) -> None:
        try:
            while True:
                msg = self._conn.recv()
                if msg[0] == "events":
                    self._deliver(msg[1])
                elif msg[0] == "taken":
                    self._on_taken(msg[1], msg[2])
                elif msg[0] == "stats":
                    with self._lock:
                        fut = self._asks.pop(msg[1], None)
                    if fut is not None:
                        fut.set_result(msg[2])
        except (EOFError, OSError):
            pass
        except Exception:  # noqa: BLE001  a reader bug ends the service loudly, not silently
            log.exception("engine reader failed")
        finally:
            self._gone()

    def _ended(self, method: str, stats: dict, tokens: int, outcome: str) -> None:
        """One request's end to the on_done hook (the served metrics), each request once."""
        if self.on_done is not None:
            try:
                self.on_done(method, stats, tokens, outcome)
            except Exception:  # noqa: BLE001  a broken observer must not stop serving; it is logged
                log.exception("on_done hook failed")

    def _on_taken(self, rid: int, refusal: BaseException | None) -> None:
        """The engine took the request, or refused it. A refused request gets no events, so it is no longer live
        here whether or not its submitter still waits (one that timed out does not, and would leave it named)."""
        entry = None
        with self._lock:
            fut = self._taken.pop(rid, None)
            if refusal is not None:
                entry = self._live.pop(rid, None)
        if entry is not None:  # counted as the router counts a refusal
            self._ended(entry[0].method, {}, 0, "error")
        if fut is not None:
            fut.set_exception(refusal) if refusal is not None else fut.set_result(None)

    def _deliver(self, events: list[tuple]) -> None:
        for rid, kind, tokens, finish_reason, stats, error in events:
            with self._lock:
                entry = self._live.get(rid) if kind not in FINAL else self._live.pop(rid, None)
            if entry is None:
                continue
            h, n = entry
            if kind == "tokens":
                n[0] += len(tokens)
            elif kind in FINAL:
                self._ended(h.method, stats or {}, n[0], OUTCOMES[kind])
            h.events.put(Event(kind, tokens=tokens, finish_reason=finish_reason, stats=stats, error=error))

    def _gone(self) -> None:
        """The pipe closed: fail what waits on the engine."""
        self._wait(1)
        err = EngineStopped(f"engine process stopped (exit code {self._proc.returncode})")
        if not self._stopping:
            log.error("%s", err)
        with self._lock:
            self._dead = err
            taken, self._taken = self._taken, {}
            asks, self._asks = self._asks, {}
            live, self._live = self._live, {}
        for fut in [*taken.values(), *asks.values()]:
            fut.set_exception(err)
        for h, n in live.values():
            self._ended(h.method, {}, n[0], "error")
            h.events.put(Event("error", error=err))


def _own_signals() -> None:
    """SIGINT and SIGTERM do nothing here (main says why): handlers that do nothing, not SIG_IGN, since an ignored
    signal stays ignored in every process this one starts (torch's compile workers and shared-memory manager among
    them, whose own shutdowns then could not end them); a forked child gets the defaults back."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _ignore)
    os.register_at_fork(after_in_child=_default_signals)


def _ignore(_signum: int, _frame: object) -> None:
    """SIGINT and SIGTERM in the engine process: nothing (main says why)."""


def _default_signals() -> None:
    """A child forked from the engine process gets the default SIGINT and SIGTERM back."""
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
    except ValueError:  # not the child's main thread: nothing to restore from there
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="the colocated service's engine process (EngineProcess starts it)")
    ap.add_argument("--fd", type=int, required=True, help="this end of the front end's socket pair")
    ap.add_argument("--log-level", type=int, default=logging.INFO)
    ap.add_argument("--parent-pid", type=int, default=None,
                    help="the front end's pid: this process exits if it goes while this one starts")
    a = ap.parse_args(argv)
    logging.basicConfig(level=a.log_level, format="%(asctime)s engine %(levelname)s %(name)s: %(message)s")
    # the front end alone stops this process (its pipe, "stop", a kill): a Ctrl-C at a terminal reaches the whole
    # process group, and a SIGTERM to the group (kill -TERM -PGID) or to the service's cgroup (systemd's default) every
    # process in it: neither must end the requests the front end lets finish in its grace (a group SIGTERM killed
    # this process at once, and every stream in flight failed)
    _own_signals()
    engine_main(Connection(a.fd), a.parent_pid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
