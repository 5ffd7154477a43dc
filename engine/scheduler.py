"""The engine's one driver: continuous batching, native and DFlash requests joining and leaving between steps.

`LLM.generate` runs a whole batch through it (`generate` below) and a decode worker's engine loop feeds it
request by request (decode_node/scheduler.py adds the import of a prefill worker's KV). Each `step()` admits waiting requests while the KV budget allows, prefills them (restoring a
cached prefix when a prefix cache is given), then advances every running request by one step: one
DFlash draft+verify for the DFlash ones, one decode token for the native ones. Finished requests
free their blocks (and publish their prompt to the prefix cache) at once. Outputs equal a solo run
of each request (a sampled DFlash one's where its draft widths and draft values are the solo run's: sampling.py's
counter-based randomness says when they are not).

While the batch is stable (nothing waiting, every running request of one method, and free
KV for each to its end), it steps in the device loop (engine/device_loop.py): the host reads step k
while the GPU runs step k+1, so a token reaches the stream one step later than it is computed. An
arrival, a cancel or a finished row ends that session: the step in flight is read and the rows go
back to the stepwise loop with their state and only the blocks they use. `overlap = False` turns it off.
Fresh requests admitted into an empty batch go from their prefill into a session with no host round
trip in between (DeviceLoop.begin_after_prefill): the first step is queued behind the prefill.

One request fails alone. An exception while admitting a group (prefix restore, prefill, recompute)
retries each of its requests alone from scratch, and fails only those that fail alone. An exception
in a batch step rolls every row back to the tokens it already streamed and preempts it (a row streamed to its end
before the step, riding a drain or hold session, is finished as usual: nothing of it is lost); re-admitted
(recomputed exactly), each such suspect takes its next step alone, and a row whose solo step fails
too is failed; the rows that passed alone beside it are cleared (MAX_BATCH_FAULTS counts only faults nobody
was failed for, which only a batch shows). A failed request frees its blocks and comes back in `StepResult.failed`; the other
rows go on, with the tokens, acceptance lengths and per-position acceptance of an undisturbed run (sampled rows too: their
draws are keyed by token index, engine/sampling.py, so a rolled-back row draws the same tokens again).

A width policy whose cap is 1 at a batch size (engine/width_policy.py: BatchWidth, "batch:caps=1-16/65-1")
turns speculation off there: when a step's DFlash rows are at least that many, they step with no draft pass
(`step_undrafted`: a native step that also writes the drafter's context), stepwise, and draft again from the
first step with fewer rows. Their tokens are the target's either way.

A serving session restarts at each finished row and each arrival: the host reads the step in flight, finishes and
admits, and uploads every row's state again. At 128 rows on a small model that restart is the larger part of a
step's host time, and a DFlash row finishes nearly every step there. `hold_fraction > 0` (ServeConfig
`session_hold_fraction`) batches them: finished rows ride along frozen and ready arrivals wait until together they
reach that share of the session's rows, or the first of them has waited `hold_steps` steps, or no row is left
running. A held row's tokens are streamed as they come; its end (and its blocks' release) waits, at most
hold_steps steps. Outputs are the same either way.

Two admission policies:
- reserve (default): a request reserves its worst case up front (prompt + max_tokens + one draft width of
  drafts), so a running request never runs out of blocks and nothing is ever preempted.
- preempt: a request is admitted when the FREE blocks cover its next step (after what the running
  ones need for theirs), so many more requests share the cache; when a step cannot get its blocks,
  the newest running request is preempted: its blocks are freed and it goes back to the head of
  the queue, and when re-admitted its prompt + output so far is recomputed (recompute.py) without
  sampling anything, so its output and acceptance lengths stay those of an uninterrupted run. Its prompt's
  cached prefix is fetched off the engine loop meanwhile (the recompute starts from it).
"""
from __future__ import annotations

import itertools
import logging
import math
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from flashpd.engine.drafter import DFlashDrafter
from flashpd.engine.generate import NativeGenerator, sample_rows
from flashpd.engine.kv_cache import blocks_needed
from flashpd.engine.runner import ModelRunner
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.sequence import Sequence
from flashpd.engine.spec_decode import DFlashGenerator
from flashpd.engine.width_policy import WidthPolicy
from flashpd.engine.recompute import recompute

log = logging.getLogger(__name__)

# A row implicated in this many failed batch steps is failed even if its solo steps pass: a fault
# that only shows in a batch (e.g. memory) must not loop forever through recover / re-admit.
MAX_BATCH_FAULTS = 3
LOAD_THREADS = 4  # prefix fetches in flight at once (each mostly waits on the bridge)
# prefix fetches started ahead of admission, done or not: the queue's first requests only. A fetch holds its prefix
# (on the cache's device, from a host tier) until its request is admitted, so a fetch per queued request held one
# copy each (64 queued requests of a 4,096-token prefix: some 40 GB at Qwen3-8B); a later start also sees
# prefixes published meanwhile
LOAD_AHEAD = 2 * LOAD_THREADS
LOAD_POLL_S = 0.05  # an idle engine waits this long at most for a load before looking again
SAVE_WAIT_S = 60.0  # a fetch waits at most this long for the saves before it (each bounded by its store's timeout)


REQUEST_FAILED = "request failed"  # how a RequestFailed's message (an INTERNAL status's details) starts


class RequestFailed(RuntimeError):
    """One request could not be served (an exception while computing it); the other requests go on.
    The API answers it with INTERNAL and this message, which starts with REQUEST_FAILED (so a router
    tells it from a worker that went away)."""


class PromptTooLong(ValueError):
    """The request can never fit this worker's KV cache or context (RESOURCE_EXHAUSTED at the API)."""


@dataclass
class SchedulerStats:
    preemptions: int = 0
    recomputed_tokens: int = 0  # positions recomputed when preempted requests were re-admitted
    failed_requests: int = 0  # requests failed alone (an exception while serving them)
    handoff_imports: int = 0  # prompts whose KV came over the device path (no prefill here)
    prefill_holds: int = 0  # steps held while a prefill worker on this GPU computed (see hold_for_prefill_s)
    prefill_hold_ms: float = 0.0  # the time they waited in all
    batch_faults: int = 0  # batch steps that raised and were recovered by re-admitting their rows
    finish_errors: int = 0  # publishes to the prefix cache that raised at a request's end (output unaffected)
    load_errors: int = 0  # async prefix fetches that raised: read again on the engine thread at admission
    undrafted_row_steps: int = 0  # DFlash row-steps taken with no draft (the width policy's cap of 1: step_undrafted)


@dataclass
class Request:
    id: int
    method: str
    seq: Sequence
    reserved_blocks: int
    emitted: int = 0  # tokens already handed to the caller
    preemptions: int = 0
    holds_reservation: bool = False  # policy "reserve": counted in Scheduler._reserved
    handoff: object | None = None  # a decode node's lease on the prompt's KV elsewhere (decode_node/scheduler.py)
    load: Future | None = None  # its prefix's fetch (or, handoff_load, its lease's), running off the engine loop
    wants_load: bool = False  # a fetch not started yet (Scheduler._start_loads: the queue's first only)
    handoff_load: bool = False  # `load` receives its lease's KV (a decode node's dist path), not a prefix
    batch_faults: int = 0  # failed batch steps it was part of


@dataclass
class StepResult:
    """Tokens each request produced in this step (in order), and the requests that finished."""

    new_tokens: dict[int, list[int]] = field(default_factory=dict)
    finished: list[Request] = field(default_factory=list)
    failed: list[tuple[Request, RequestFailed]] = field(default_factory=list)


class Scheduler:
    """The one driver of the engine: `LLM.generate` (through `generate` below) and a decode worker's engine
    loop both run their requests through it."""

    def __init__(self, runner: ModelRunner, drafter: DFlashDrafter | None = None, stop_ids: tuple[int, ...] = (),
                 prefix_cache=None, max_running: int = 64, policy: str = "reserve",
                 width_policy: WidthPolicy | None = None, native: NativeGenerator | None = None,
                 spec: DFlashGenerator | None = None) -> None:
        """policy: KV admission ('reserve' or 'preempt', module doc). width_policy: how wide a DFlash step
        verifies (engine/width_policy.py; default the request's whole draft width). A policy that cuts by
        confidence keeps those batch sizes out of the device loop (DeviceLoop.usable), so they step here.
        native / spec: the executors to step with, when the caller has its own (a step width, a drafter's
        seams, a prefill budget: `generate`); by default they are built from runner, drafter and stop_ids."""
        if policy not in ("reserve", "preempt"):
            raise ValueError(f"policy must be 'reserve' or 'preempt', got {policy!r}")
        for g in (native, spec):
            if g is not None and g.runner is not runner:
                raise ValueError("an injected generator must step this scheduler's runner")
        if spec is not None and not spec.speculative:
            raise ValueError("spec must be a DFlashGenerator")
        self.policy = policy
        self.stats = SchedulerStats()
        self.runner = runner
        self.native = native if native is not None else NativeGenerator(runner, stop_ids)
        if spec is None and drafter is not None:
            spec = DFlashGenerator(runner, drafter, stop_ids, width_policy=width_policy)
        self.spec = spec
        self.prefix_cache = prefix_cache
        self.max_running = max_running
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._ids = itertools.count()
        self._reserved = 0
        self._capacity = runner.allocator.num_free
        # a stable batch of greedy requests (nothing waiting, one method) steps in the device loop, the
        # host reading each step while the next one runs (engine/device_loop.py); any change ends it
        self.overlap = True
        # an offline batch (`generate`): nothing arrives or leaves early, so a session runs until its last row
        # ends (finished rows ride along frozen and are finished with it) and fresh requests go from their
        # prefill straight into it (_may_start); a serving scheduler ends a session at each finish instead
        self.drain = False
        self._session = None
        self._session_gen: NativeGenerator | None = None
        # serving: a device-loop session goes on past finished rows and ready arrivals until they reach
        # hold_fraction of its rows or the first of them has waited hold_steps steps (module doc); 0: none held
        self.hold_fraction = 0.0
        self.hold_steps = 4
        self._hold_since: int | None = None  # self.steps when the session's first held event came
        self.steps = 0  # step() calls
        self.overlapped_steps = 0  # steps run that way (tests check the path is taken)
        self.sessions_ended = 0  # device-loop sessions ended (a finish, an admission): the serving log reads it
        self.admitted = 0  # requests admitted (prefilled or recomputed), for the same log
        self._suspects: set[int] = set()  # rows of a failed batch step: their next step runs alone
        # ends decided between steps (a cancel's session end that raised: _end_session_for_cancel), reported with the
        # next step's result
        self._pending = StepResult()
        self.async_load = True  # prefix fetches on a thread pool (False: inside admission, as restore does)
        self._loader: ThreadPoolExecutor | None = None
        self._save_pool: ThreadPoolExecutor | None = None
        # the pools close() let go, whose threads may still run a fetch or a queued save through the stores (a worker
        # closing its bridge client waits for them: DecodeWorker.quiesce)
        self.let_go: list[ThreadPoolExecutor] = []
        self._saves: list[Future] = []  # saves not yet known to be done

    # ---- requests ------------------------------------------------------------------------
    def add(self, prompt: list[int], params: SamplingParams, method: str = "native",
            draft_width: int | None = None, first_token: int | None = None, handoff: object | None = None,
            resumed: list[int] | tuple[int, ...] = ()) -> Request:
        """Queue a request; refuses at once what can never run here.

        first_token: the token a prefill worker already computed and streamed; it is committed
        as the first output instead of the decode side's own (identical in float32) choice.
        handoff: that prefill's lease on the prompt's KV (the device path): imported at admission
        instead of prefilling, when this scheduler has a `handoff` importer.
        resumed: the request's output so far, streamed by a worker that died. The request is queued as a
        preempted one is (its caches rebuilt from prompt + resumed at admission, nothing sampled), so it
        continues where that worker stopped; only what follows is streamed. Output that already ends the request
        is refused (`finish_of` says so first)."""
        try:
            if resumed and handoff is not None:  # (the decode worker's RPC refuses it first, as it needs first_token)
                raise ValueError("handoff: not with resumed output (the prompt and it are recomputed here)")
            req = self._add(prompt, params, method, draft_width, first_token, resumed)
        except BaseException:
            if handoff is not None:
                self._release_lease(handoff)
            raise
        req.handoff = handoff
        try:
            # the worker side's start-load: bridge I/O and verification run off the engine loop; the request is
            # admitted once its data is here, and the running batch never waits for it (a resumed request too: its
            # prompt's prefix is fetched so, and the recompute at its admission starts from it)
            req.wants_load = self._wants_load(req)
            self._start_loads()
        except BaseException:
            self._withdraw(req)
            raise
        return req

    def _withdraw(self, req: Request) -> None:
        """Undo an add that raised after queueing its request (starting the loads: a thread that could not start):
        the caller has no handle on it, so it must not stay queued and run, nor keep its lease or fetch."""
        if req in self.waiting:
            self.waiting.remove(req)
        self._release(req)

    def _wants_load(self, req: Request) -> bool:
        """Whether the request's data is fetched off the engine loop before its admission: its prefix, from the
        prefix cache (a decode node also fetches a lease's KV: decode_node/scheduler.py)."""
        return req.handoff is None and self.async_load and hasattr(self.prefix_cache, "fetch")

    def _may_load(self) -> bool:
        """Whether any request may want a fetch (else _start_loads need not walk the queue)."""
        return hasattr(self.prefix_cache, "fetch")

    def _submit_load(self, req: Request) -> Future:
        """Start the request's fetch on the load threads: its prefix, after the saves queued before a new request
        (a prompt finished earlier is then a hit, as with synchronous saves). A preempted or resumed request's
        fetch waits for none: it was a restore at admission, which never waited on saves."""
        gen = self.spec if req.method == "dflash" else self.native
        saves = [] if req.seq.output else [f for f in self._saves if not f.done()]
        return self._loads().submit(self._fetch_after, saves, gen, list(req.seq.prompt))

    def _start_loads(self) -> None:
        """Start the fetches of the first queued requests that want one, up to LOAD_AHEAD held at once. Fetches
        start in queue order (a preempted request's, queued first, before the rest), so the walk stops at the
        window's end."""
        if not self._may_load():  # no request wants one
            return
        held = 0
        for r in self.waiting:
            if r.load is not None:
                held += 1
            if held >= LOAD_AHEAD:
                return
            if r.wants_load:
                r.load = self._submit_load(r)
                r.wants_load = False
                held += 1

    def _loads(self) -> ThreadPoolExecutor:
        if self._loader is None:
            self._loader = ThreadPoolExecutor(max_workers=LOAD_THREADS, thread_name_prefix="kv-load")
        return self._loader

    @staticmethod
    def _ready(r: Request) -> bool:
        """Admissible now: nothing loading for it, or its load finished."""
        return r.load.done() if r.load is not None else not r.wants_load

    def _has_ready(self) -> bool:
        return any(self._ready(r) for r in self.waiting)

    def finish_of(self, params: SamplingParams, output: list[int] | tuple[int, ...]) -> str | None:
        """How `output` alone ends a request with these params ("stop", "length"), or None: it goes on. The
        sequences' own rule (Sequence.commit); pure, so any thread may ask."""
        s = Sequence([0], params, self.native.stop_ids)
        s.commit(list(output))
        return s.finish_reason

    def _add(self, prompt: list[int], params: SamplingParams, method: str, draft_width: int | None,
             first_token: int | None, resumed: list[int] | tuple[int, ...] = ()) -> Request:
        if method not in ("native", "dflash"):
            raise ValueError(f"method must be 'native' or 'dflash', got {method!r}")
        if method == "dflash" and self.spec is None:
            raise ValueError("method 'dflash' needs a worker with a drafter")
        gen = self.spec if method == "dflash" else self.native
        seq = gen.new_sequences([prompt], [params])[0]  # validates params and the context length
        vocab = self.runner.model.cfg.vocab_size
        if first_token is not None and not 0 <= first_token < vocab:
            raise ValueError(f"first_token {first_token} is outside the vocabulary")
        if prompt and not (0 <= min(prompt) and max(prompt) < vocab):  # on a GPU an embedding's bad index is a
            # device-side assert that ends the process (the front ends check too; this is the engine's own bound)
            raise ValueError(f"prompt ids must lie in [0, {vocab}): got {min(prompt)}..{max(prompt)}")
        seq.forced_first = first_token
        if resumed:
            if first_token is not None:
                raise ValueError("first_token: not with resumed output (the prompt and it are recomputed here)")
            if not all(0 <= t < vocab for t in resumed):
                raise ValueError(f"resumed output ids must lie in [0, {vocab})")
            seq.commit(list(resumed))
            seq.resumed = len(resumed)
            if seq.done:
                raise ValueError(f"the resumed output ends the request already ({seq.finish_reason}): nothing is "
                                 f"left to generate")
        if method == "dflash":
            seq.draft_width = self.spec._check_width(self.spec.draft_width if draft_width is None else draft_width)
        need = blocks_needed(len(prompt), params.max_tokens, seq.draft_width, self.runner.kv_block_size)
        if need > self._capacity:
            raise PromptTooLong(f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} needs {need} KV "
                                f"blocks; this KV cache has {self._capacity}")
        req = Request(next(self._ids), method, seq, need)
        req.emitted = len(seq.output)  # a resumed request's output so far is the caller's already
        self.waiting.append(req)
        return req

    def cancel(self, req: Request) -> None:
        """Drop a request wherever it is and free its blocks (a client went away). One not yet reported finished
        ends "cancelled" with the tokens it streamed: ending the session may have committed its in-flight step
        (even its last token), which nobody will stream."""
        live = req in self.waiting or req in self.running
        self._end_session_for_cancel(req)  # the batch changes: the device hands the others back first
        if req in self.waiting:
            self.waiting.remove(req)
        elif req in self.running:
            self.running.remove(req)
        self._release(req)
        if live:
            _rollback(req)
            req.seq.finish_reason = "cancelled"

    def _end_session_for_cancel(self, req: Request) -> None:
        """End the session before a cancel. Its end reads the step in flight, so a fault there is a batch step's
        fault: the other rows are recovered as in step() (_recover), and what that ends (a row streamed to its end,
        one at its last allowed fault) is reported by the next step(). Raising instead kept the cancelled request's
        blocks, reservation and lease, and the engine loop then failed every other request (abort_all)."""
        try:
            self._end_session()
        except Exception as e:  # noqa: BLE001  one cancel must not leak, nor end the others
            if req in self.running:  # cancelled, not recovered: it is neither re-admitted nor reported
                self.running.remove(req)
            self._recover(e, self._pending)

    def _release(self, req: Request) -> None:
        """Give back everything a request holds: its KV blocks, (policy reserve) its reservation, and a
        prefill worker's lease it never imported (its fetch, if one runs, ends on its thread and is dropped)."""
        self.runner.allocator.free(req.seq.table)  # no-op for one that holds none
        if req.handoff is not None:
            self._release_lease(req.handoff)
            req.handoff = None
        if req.load is not None:
            req.load.cancel()  # a fetch already running finishes on its thread; its result is dropped
            req.load = None
        req.wants_load = req.handoff_load = False
        if req.holds_reservation:
            self._reserved -= req.reserved_blocks
            req.holds_reservation = False
        self._suspects.discard(req.id)

    def _fail(self, req: Request, e: BaseException, result: StepResult) -> None:
        """Fail one request alone: free what it holds and report it; the others are untouched."""
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        req.seq.finish_reason = "error"
        self.stats.failed_requests += 1
        log.warning("request %d failed alone (%s: %s)", req.id, type(e).__name__, e)
        err = e if isinstance(e, RequestFailed) else RequestFailed(f"{REQUEST_FAILED}: {type(e).__name__}: {e}")
        if err is not e:
            err.__cause__ = e  # `generate` raises the error itself
        result.failed.append((req, err))

    @property
    def capacity(self) -> int:
        """KV blocks this scheduler may use in all (the allocator's free blocks when it was made)."""
        return self._capacity

    @property
    def idle(self) -> bool:
        """Nothing queued or running, and no end left to report (a cancel's recovery: _end_session_for_cancel)."""
        return not self.waiting and not self.running and not self._pending.finished and not self._pending.failed

    # ---- one iteration ------------------------------------------------------------------
    def _width(self, r: Request) -> int:
        """Positions the request's next step may write: its whole DFlash draft width (a verify pads narrower rows
        to the batch's widest, at most its draft width) or 1."""
        return r.seq.draft_width if r.method == "dflash" else 1

    def _step_blocks(self, r: Request) -> int:
        """Blocks the request still has to get for its next step."""
        s = r.seq
        return 0 if s.done else self.runner.allocator.blocks_needed(s.table, s.table.num_tokens + self._width(r))

    def _admit_blocks(self, r: Request) -> int:
        """Blocks a waiting request needs to be prefilled (or recomputed) and take its first step."""
        s = r.seq
        ctx = len(s.prompt) + max(len(s.output) - 1, 0)
        return blocks_needed(ctx, 0, self._width(r), self.runner.kv_block_size)

    def _pick(self) -> list[Request]:
        """Waiting requests to admit now, in queue order, skipping those whose prefix is still loading."""
        admitted: list[Request] = []
        if self.policy == "reserve":
            for req in [r for r in self.waiting if self._ready(r)]:
                if len(self.running) + len(admitted) >= self.max_running or \
                        self._reserved + req.reserved_blocks > self._capacity:
                    break
                self._reserved += req.reserved_blocks
                req.holds_reservation = True
                admitted.append(req)
        else:
            free = self.runner.allocator.num_free - sum(self._step_blocks(r) for r in self.running)
            for req in [r for r in self.waiting if self._ready(r)]:
                if len(self.running) + len(admitted) >= self.max_running:
                    break
                need = self._admit_blocks(req)
                if need > free:
                    break
                free -= need
                admitted.append(req)
        for req in admitted:
            self.waiting.remove(req)
        return admitted

    def _admit(self, result: StepResult) -> list[Request]:
        """Prefill (or, preempted earlier, recompute) the requests _pick lets in; a group that raises is
        retried one request at a time from scratch, and a request that fails alone is failed."""
        admitted = self._pick()
        preempted = {r.id for r in admitted if r.seq.output}  # before any prefill gives the fresh ones output
        ok: list[Request] = []
        for method, gen in (("native", self.native), ("dflash", self.spec)):
            for fresh in (True, False):
                group = [r for r in admitted if r.method == method and (r.id not in preempted) == fresh]
                if not group:
                    continue
                try:
                    self._prepare(gen, group, fresh, method, whole=len(group) == len(admitted))
                    ok.extend(group)
                    continue
                except Exception as e:  # noqa: BLE001  which request is at fault is not known yet
                    log.warning("admitting %d %s request(s) failed (%s: %s); retrying each alone", len(group),
                                method, type(e).__name__, e)
                for r in group:
                    try:
                        self._reset(gen, r, fresh)
                        self._prepare(gen, [r], fresh, method, whole=len(admitted) == 1)
                        ok.append(r)
                    except Exception as e:  # noqa: BLE001
                        self._fail(r, e, result)
        return ok

    def _prepare(self, gen: NativeGenerator, group: list[Request], fresh: bool, method: str,
                 whole: bool = False) -> None:
        """Prefill (fresh) or recompute (preempted) a group of one method. whole: the group is everything this
        step admits (it may then start a device-loop session from its prefill: _may_start)."""
        seqs = [r.seq for r in group]
        if fresh:
            local = [r for r in group if not self._import(r, method)]
            sync = []
            for r in local:
                got = self._take_fetched(r)
                if got is None:
                    sync.append(r.seq)
                    continue
                self.runner.allocator.ensure(r.seq.table, len(r.seq.prompt))
                self.prefix_cache.apply(gen, r.seq, got)
            if local:
                gen.restore_prefixes(sync, self.prefix_cache)
                if whole and len(local) == len(group) and self._may_start(gen, seqs):
                    first: list[torch.Tensor] = []
                    gen.prefill_request(seqs, defer=first)
                    sess = gen.loop().begin_after_prefill(seqs, torch.cat(first) if len(first) > 1 else first[0])
                    self._session, self._session_gen = sess, gen
                else:
                    gen.prefill_request([r.seq for r in local])
        else:  # preempted earlier (or resumed): rebuild their caches, sample nothing
            fetched = [self._take_fetched(r) for r in group]
            self.stats.recomputed_tokens += recompute(gen, seqs, self.prefix_cache, taps=method == "dflash",
                                                      fetched=fetched)

    def _take_fetched(self, r: Request):
        """The request's finished prefix fetch (_pick admits no request still loading), taken off it so a retry of
        this admission never reads it again; None: nothing fetched, or the fetch failed (counted, logged): its
        prefix is restored on the engine thread instead."""
        if r.load is None:
            return None
        fut, r.load = r.load, None
        try:
            return fut.result()
        except Exception as e:  # a store's own error (an OSError of a disk tier, ...): read it here
            self.stats.load_errors += 1
            log.warning("request %d: its prefix fetch failed (%s: %s); restoring on the engine thread",
                        r.id, type(e).__name__, e)
            return None

    def _import(self, r: Request, method: str) -> bool:
        """Admit a fresh request from KV computed elsewhere instead of prefilling it: a decode node imports a
        prefill worker's lease here (decode_node/scheduler.py). False: prefill it here."""
        r.handoff = None  # a lease nothing here can import expires at its deadline
        return False

    def _release_lease(self, lease: object) -> None:
        """Give back a lease a request will not import (decode_node/scheduler.py); nothing to do here."""

    def release_unused_lease(self, lease: object) -> None:
        """A lease carried by a request this scheduler will never take (refused or cancelled before it was
        added): given back at once, not at its deadline. Thread-safe (the release is an asynchronous RPC)."""
        self._release_lease(lease)

    def _hold_for_prefill(self) -> None:
        """Let a prefill sharing this GPU go first (decode_node/scheduler.py); nothing to wait for here."""

    def _reset(self, gen: NativeGenerator, r: Request, fresh: bool) -> None:
        """Undo a failed admission: no blocks, no draft state; a fresh request also gets a fresh sequence
        (its first token is decided again, with the same draws: as if it had never been tried)."""
        s = r.seq
        self.runner.allocator.free(s.table)
        s.draft_len, s.pending, s.pending_rows = 0, None, 0
        if fresh:
            new = gen.new_sequences([s.prompt], [s.params])[0]
            new.forced_first, new.draft_width, new.t_start, new.seed = s.forced_first, s.draft_width, s.t_start, s.seed
            r.seq = new

    def _make_room(self) -> None:
        """Preempt the newest running requests until every other one can take its next step."""
        alloc = self.runner.allocator
        while sum(self._step_blocks(r) for r in self.running) > alloc.num_free:
            victims = [r for r in self.running if not r.seq.done]
            if len(victims) <= 1:
                raise RuntimeError("a lone request cannot get the blocks of its next step "
                                   f"({alloc.num_free} free); its worst case was admitted as fitting")
            self._preempt(victims[-1])

    def _preempt(self, r: Request) -> None:
        """Preempt a running request for its blocks. Its prompt's cached prefix is fetched off the engine loop at
        once (it heads the queue: its fetch starts first), so its re-admission applies it rather than reading the
        store on the engine thread while the batch waits; requests behind it are admitted meanwhile, as past any
        request still loading. Within LOAD_AHEAD fetches held in all (each holds its prefix until admission); past
        it, and after a batch fault (_recover), the prefix is restored at admission."""
        self.running.remove(r)
        self._preempt_out(r)
        r.preemptions += 1
        self.stats.preemptions += 1
        held = sum(q.load is not None for q in self.waiting)  # (a fetch not started holds nothing yet)
        r.wants_load = held < LOAD_AHEAD and self._wants_load(r)
        if r.wants_load:
            self._start_loads()

    def _preempt_out(self, r: Request) -> None:
        """Free a request's blocks and queue it first again; re-admitted, it is recomputed."""
        s = r.seq
        self._release(r)
        s.draft_len, s.pending, s.pending_rows = 0, None, 0
        self.waiting.appendleft(r)  # victims are taken newest first, so the queue keeps their order

    # ---- the device loop for stable batches -----------------------------------------------
    def _overlap_gen(self) -> NativeGenerator | None:
        """The generator whose device loop can step the whole running batch now, or None: nothing
        waiting, one method, greedy rows its loop takes, and free KV to every row's end."""
        if not self.overlap or self._has_ready() or not self.running or any(r.seq.done for r in self.running):
            return None
        methods = {r.method for r in self.running}
        if len(methods) != 1:
            return None
        gen = self.spec if methods == {"dflash"} else self.native
        seqs = [r.seq for r in self.running]
        if gen is self.spec and not gen.width_policy.speculates(len(seqs)):
            return None  # no speculation at this size: step_undrafted, stepwise (the loop's DFlash step drafts)
        if not gen.device_loop or not gen.loop().usable(seqs):
            return None
        alloc = self.runner.allocator
        need = sum(alloc.blocks_needed(s.table, len(s.prompt) + s.params.max_tokens) for s in seqs)
        return gen if need <= alloc.num_free else None

    def _may_start(self, gen: NativeGenerator, seqs: list[Sequence]) -> bool:
        """Whether fresh requests go from their prefill straight into a device-loop session with no host round
        trip in between (DeviceLoop.begin_after_prefill): they are the whole batch (nothing running, nothing
        else ready to admit), their loop takes them from the prefill (NativeGenerator.overlaps_start), DFlash
        speculates at this batch size, and the KV to every row's end is free."""
        if not self.drain or not self.overlap or self._session is not None or self.running or self._suspects \
                or self._has_ready():
            return False
        if gen.speculative and not gen.width_policy.speculates(len(seqs)):
            return False
        if not gen.overlaps_start(seqs):
            return False
        alloc = self.runner.allocator
        return sum(alloc.blocks_needed(s.table, len(s.prompt) + s.params.max_tokens) for s in seqs) <= alloc.num_free

    def _end_session(self) -> None:
        """Read what the device still has in flight and hand the rows back to the stepwise loop."""
        self._hold_since = None
        if self._session is not None:
            self._session_gen.loop().end(self._session)
            self._session, self._session_gen = None, None
            self.sessions_ended += 1

    def _end_session_or_recover(self, result: StepResult) -> None:
        """End the session between steps (an arrival, a finished row). Ending it reads the step in flight, so a
        fault there is a batch step's fault, recovered as in _advance: not an error out of step() (which fails
        every request in flight)."""
        try:
            self._end_session()
        except Exception as e:  # noqa: BLE001  one row's fault must not end the others
            self._recover(e, result)

    def _advance(self, result: StepResult) -> None:
        """One step of every running request; a step that raises is recovered (see the module doc)."""
        try:
            if self._suspects:
                self._advance_suspects(result)
            else:
                self._advance_batch()
        except Exception as e:  # noqa: BLE001  one row's fault must not end the others
            self._recover(e, result)

    def _advance_suspects(self, result: StepResult) -> None:
        """Rows of a failed batch step take their next step alone (a row that fails alone is failed); the
        others step together. A suspect takes one step here, alone: stepping it again with the others would take
        blocks that policy preempt did not make room for (_make_room covers one step a row)."""
        passed, culprit = [], False
        suspects = [r for r in self.running if r.id in self._suspects]
        for r in suspects:
            if r.seq.done:
                self._suspects.discard(r.id)
                continue
            try:
                self._step_rows([r])
                self._suspects.discard(r.id)
                passed.append(r)
            except Exception as e:  # noqa: BLE001
                self._fail(r, e, result)
                culprit = True
        if culprit:  # the fault was the failed row's: the others' count starts again
            for r in passed:
                r.batch_faults = 0
        stepped = {r.id for r in suspects}
        rest = [r for r in self.running if r.id not in stepped and not r.seq.done]
        if rest:
            self._step_rows(rest)

    def _step_rows(self, rows: list[Request]) -> None:
        spec_rows = [r.seq for r in rows if r.method == "dflash" and not r.seq.done]
        native_rows = [r.seq for r in rows if r.method == "native" and not r.seq.done]
        if spec_rows:
            if self.spec.width_policy.speculates(len(spec_rows)):
                self.spec.spec_step(spec_rows)
            else:
                step_undrafted(self.spec, spec_rows)
                self.stats.undrafted_row_steps += len(spec_rows)
        if native_rows:
            self.native.decode_step(native_rows)

    def _recover(self, e: BaseException, result: StepResult) -> None:
        """A batch step raised: the device session (if any) is dropped, every running row goes back to the
        tokens it already streamed and is preempted (re-admitted by recompute, then stepped alone once)."""
        self.stats.batch_faults += 1
        log.warning("a step of %d row(s) failed (%s: %s); re-admitting each to find the faulty one",
                    len(self.running), type(e).__name__, e)
        try:
            self._end_session()
        except Exception:  # noqa: BLE001  the session's state is unknown: its rows are rebuilt below
            self._session, self._session_gen = None, None
        self._finish_streamed(result)
        for r in list(reversed(self.running)):  # newest first: appendleft keeps the queue's order
            r.batch_faults += 1
            if r.batch_faults >= MAX_BATCH_FAULTS:
                self._fail(r, e, result)
                continue
            _rollback(r)
            self.running.remove(r)
            self._preempt_out(r)
            self._suspects.add(r.id)

    def _finish_streamed(self, result: StepResult) -> None:
        """Finish the running rows streamed to their end in an earlier step (riding a drain or hold session until its
        end): the caller has every token of theirs, so an error after it must neither fail nor recompute them."""
        for r in [r for r in self.running if _streamed_to_end(r)]:
            self.running.remove(r)
            self._finish(r)
            result.finished.append(r)

    def _advance_batch(self) -> None:
        """One step of every running request: in the device loop when the batch allows, else stepwise."""
        if self._session is not None:
            loop, sess = self._session_gen.loop(), self._session
            self.overlapped_steps += 1
            if sess.queued and loop.may_finish(sess):
                # the step in flight likely ends every row: read it before queueing another (a step launched
                # after the last row's end would only be waited for), then launch unless it did end them
                loop.read(sess)
                if not all(s.done for s in sess.seqs):
                    loop.launch(sess)
                return
            loop.launch(sess)  # step k runs while step k-1 is read
            if len(sess.queued) == 2:
                loop.read(sess)
            return
        gen = self._overlap_gen()
        if gen is not None:
            self._session, self._session_gen = gen.loop().begin([r.seq for r in self.running]), gen
            gen.loop().launch(self._session)  # read by the next step
            self.overlapped_steps += 1
            return
        self._step_rows(self.running)

    def _holds(self) -> bool:
        """Whether the serving session goes on past its finished rows and the ready arrivals (hold_fraction):
        while they are fewer than that share of its rows, the first of them came under hold_steps steps ago, and
        a row is still running. Finished rows ride along frozen meanwhile (as in `drain`); their tokens are
        streamed as they come, only their end waits."""
        sess = self._session
        if sess is None or self.hold_fraction <= 0 or self._suspects or not self.overlap:
            return False
        done = sum(s.done for s in sess.seqs)
        if done == len(sess.seqs):
            return False
        events = done + sum(1 for r in self.waiting if self._ready(r))
        if not events:
            return True
        if self._hold_since is None:
            self._hold_since = self.steps
        return events < max(1, math.ceil(self.hold_fraction * len(sess.seqs))) and \
            self.steps - self._hold_since < self.hold_steps

    def step(self) -> StepResult:
        result = StepResult()
        self.steps += 1
        self._start_loads()  # admissions and cancels made room ahead
        if not self.running and self.waiting and not self._has_ready():  # only loads in flight: wait for one
            wait([r.load for r in self.waiting if r.load is not None and not r.load.done()], timeout=LOAD_POLL_S,
                 return_when=FIRST_COMPLETED)
        if (self._has_ready() and not self._holds()) or not self.overlap or self._suspects:
            self._end_session_or_recover(result)  # admissions (and preemptions) work on the host's view of the batch
        if self._session is None:
            self._finish_ended()  # before admissions and preemptions count the free blocks
            admitted = self._admit(result)
            self.admitted += len(admitted)
            self.running.extend(admitted)
            if self.policy == "preempt":
                self._make_room()
        if self.running:
            self._hold_for_prefill()
        self._advance(result)
        if any(r.seq.done for r in self.running) and not (
                self.drain and self._session is not None and not all(r.seq.done for r in self.running)) \
                and not self._holds():
            self._end_session_or_recover(result)  # a finished row leaves the batch: the others' in-flight step is read
        still, sent = [], []
        for r in self.running:
            out = r.seq.output
            if len(out) > r.emitted:
                result.new_tokens[r.id] = out[r.emitted:]
                sent.append((r, len(out)))
            if r.seq.done and self._session is None:  # (drain, a hold: a finished row waits for its session's end)
                self._finish(r)
                result.finished.append(r)
            else:
                still.append(r)
        self.running = still
        for r, n in sent:  # counted as handed out only with the result that hands them out (`_streamed_to_end`)
            r.emitted = n
        return self._with_pending(result)

    def _with_pending(self, result: StepResult) -> StepResult:
        """A step's result with the ends decided since the last one first (a cancel's recovery, rows whose session
        ended). Taken only as the step returns: after a step that raised, abort_all reports them."""
        pending, self._pending = self._pending, StepResult()
        for rid, toks in result.new_tokens.items():
            pending.new_tokens[rid] = pending.new_tokens.get(rid, []) + list(toks)
        result.new_tokens = pending.new_tokens
        result.finished[:0] = pending.finished
        result.failed[:0] = pending.failed
        return result

    def _finish_ended(self) -> None:
        """Finish the rows whose session ended with them done (they rode a hold or a drain, or a cancel's end of
        session read their last step): freed before admissions and preemptions count the free blocks. Else their
        blocks were still held while `_make_room` found a lone unfinished row short of its next step's blocks and
        raised, failing every request in flight. Their last tokens and ends go out with this step's result
        (pending: a step that raises after this still reports them, through abort_all)."""
        still = []
        for r in self.running:
            if not r.seq.done:
                still.append(r)
                continue
            out = r.seq.output
            if len(out) > r.emitted:
                self._pending.new_tokens[r.id] = out[r.emitted:]
                r.emitted = len(out)
            self._finish(r)
            self._pending.finished.append(r)
        self.running = still

    def _finish(self, r: Request) -> None:
        """A request's end: publish its prompt (a failure there is counted, the output stands) and free. With
        async_load the save is split as the load is: the chunks are read out of the caches here, and stored
        by a background thread (in order: a later fetch waits for the saves queued before it)."""
        gen = self.spec if r.method == "dflash" else self.native
        pc = self.prefix_cache
        try:
            if self.async_load and pc is not None and hasattr(pc, "collect"):
                pending = pc.collect(gen, r.seq)
                gen.finish(r.seq, None)
                if pending.target:
                    self._saves = [f for f in self._saves if not f.done()]
                    self._saves.append(self._saver().submit(pc.store_pending, pending))
            else:
                gen.finish(r.seq, pc)
        except Exception as e:  # noqa: BLE001  finish frees the blocks whatever publish does
            self.stats.finish_errors += 1
            log.warning("finishing request %d: %s: %s (its output is complete)", r.id, type(e).__name__, e)
        self._release(r)

    def _saver(self) -> ThreadPoolExecutor:
        if self._save_pool is None:  # one thread: saves reach the store in the order requests finished
            self._save_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-save")
        return self._save_pool

    def _fetch_after(self, saves: list[Future], gen, prompt: list[int]):
        """A fetch that first waits for the saves queued before its request arrived (on the load thread), so
        a prompt finished earlier is a hit exactly as it would be with synchronous saves."""
        wait(saves, timeout=SAVE_WAIT_S)
        return self.prefix_cache.fetch(gen, prompt)

    def close(self) -> None:
        """Let the load and save threads end: fetches not started are dropped, queued saves still reach the store
        (each bounded by its store's timeout), then the threads exit (idle, they otherwise outlive the engine loop
        that stopped). A later request starts new ones."""
        loader, saver, self._loader, self._save_pool = self._loader, self._save_pool, None, None
        self.let_go = [p for p in (loader, saver) if p is not None]
        if loader is not None:
            loader.shutdown(wait=False, cancel_futures=True)
        if saver is not None:
            saver.shutdown(wait=False)

    def flush_saves(self, timeout_s: float = SAVE_WAIT_S) -> None:
        """Wait until every queued save reached the store (a caller about to read the store directly)."""
        wait(list(self._saves), timeout=timeout_s)

    def abort_all(self, e: BaseException) -> StepResult:
        """Last resort after an error the step could not contain: fail every request, free every block,
        and leave the scheduler empty and usable. A row already streamed to its end (riding a drain or hold
        session) is finished as usual instead: the caller has all of it. Returns both, with the last tokens of rows
        whose session ended before the error (`_finish_ended`)."""
        result, self._pending = self._pending, StepResult()
        self._session, self._session_gen, self._hold_since = None, None, None
        self._finish_streamed(result)
        for r in list(self.running) + list(self.waiting):
            self._fail(r, e, result)
        return result

    def stop_all(self, also: Iterable[Request] = ()) -> StepResult:
        """The caller is going away (an engine loop's stop): end the device session if it still can be (else drop
        it), then finish as usual every row whose output is complete (streamed to its end and riding a hold or a
        drain, or ended by the session's end: the caller gets its last tokens and its end, as a clean step would
        report them) and cancel the rest as cancel_all does. Returns what to report: those tokens and ends, and the
        ends decided since the last step. `also` as in cancel_all."""
        try:
            self._end_session()
            self._finish_ended()  # the session's end committed their last step: every token is computed
        except Exception:  # noqa: BLE001  a broken session is dropped; only rows already streamed are known whole
            log.warning("a device session could not be ended cleanly; dropped")
            self._session, self._session_gen = None, None
        result, self._pending = self._pending, StepResult()
        self._finish_streamed(result)
        ended = {id(r) for r in result.finished} | {id(r) for r, _ in result.failed}
        self.cancel_all([r for r in also if id(r) not in ended])
        return result

    def cancel_all(self, also: Iterable[Request] = ()) -> None:
        """Cancel every request (a caller interrupted mid-run): the device session ended if it still can be (else
        dropped), every block and lease given back, the scheduler left empty and usable. `also`: requests the
        caller made, which an interrupt may have caught between the queue and the batch (in neither list)."""
        try:
            self._end_session()
        except Exception:  # noqa: BLE001  a session broken by the interrupt is dropped, not read
            log.warning("a device session could not be ended cleanly; dropped")
            self._session, self._session_gen = None, None
        self._pending = StepResult()  # ends not reported yet: those requests are the caller's to end now
        seen: set[int] = set()
        for r in [*self.running, *self.waiting, *also]:
            if id(r) not in seen:
                seen.add(id(r))
                self.cancel(r)

    def reset_stats(self) -> None:
        """Zero the counters (after a warm-up, whose requests are not the service's)."""
        self.stats = SchedulerStats()

    def run_until_idle(self, max_steps: int = 1_000_000) -> list[Request]:
        done = []
        for _ in range(max_steps):
            if self.idle:
                self.flush_saves()  # idle includes the finished prompts' saves
                return done
            done.extend(self.step().finished)
        raise RuntimeError(f"scheduler still busy after {max_steps} steps")


def generate(gen: NativeGenerator, prompts: list[list[int]], params: list[SamplingParams],
             draft_widths: list[int | None] | None = None, prefix_cache=None) -> list[Sequence]:
    """Run a batch of requests to their ends through one Scheduler around `gen` (DFlash requests when it is a
    DFlashGenerator, at `draft_widths` when given; else native ones) and return their sequences in order.

    The offline form of what a decode worker does: requests that do not fit the KV cache together wait for
    room (policy reserve), one that can never fit raises PromptTooLong before anything runs, and a prefix
    cache is restored at admission and published at each end (synchronously). A request that fails raises
    its error once the others have finished, with every KV block back."""
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
    if draft_widths is not None:
        if not gen.speculative:
            raise ValueError("draft_widths are DFlash widths; this generator is native")
        if len(draft_widths) != len(prompts):
            raise ValueError(f"{len(draft_widths)} draft widths for {len(prompts)} prompts")
    sched = Scheduler(gen.runner, stop_ids=tuple(gen.stop_ids), prefix_cache=prefix_cache,
                      max_running=max(1, len(prompts)), native=None if gen.speculative else gen,
                      spec=gen if gen.speculative else None)
    sched.async_load, sched.drain = False, True
    method = "dflash" if gen.speculative else "native"
    reqs = [sched.add(p, sp, method, draft_width=w)
            for p, sp, w in zip(prompts, params, draft_widths or [None] * len(prompts))]
    failed: list[tuple[Request, RequestFailed]] = []
    try:
        while not sched.idle:
            failed.extend(sched.step().failed)
    except BaseException:  # Ctrl-C, or an error no step contained: every block back, then raise
        sched.cancel_all(reqs)
        raise
    if failed:
        err = failed[0][1]
        raise err.__cause__ or err
    return [r.seq for r in reqs]


def step_undrafted(gen: DFlashGenerator, seqs: list[Sequence]) -> None:
    """One token for each DFlash row with no draft pass: a native step (the target's own token: greedy rows
    take its argmax, sampled rows draw from it) whose forward also writes the drafter's context of the new
    position (its taps, through the sink a prefill uses), so that the row can draft again at the next step.
    A row's pending context (the positions its last verify accepted) is written first, eagerly (no compile or
    capture for these few rows). The step counts as one of acceptance length 1 (tau: tokens per target step).
    What it costs beside a native step: engine/width_policy.py's module doc."""
    runner = gen.runner
    alloc = runner.allocator
    gen.drafts.write_pending(seqs)
    for s in seqs:
        assert s.draft_len == s.table.num_tokens, "draft context out of step with the target"
        alloc.ensure(s.table, s.table.num_tokens + 1)
    out = runner.forward([s.table for s in seqs], [[s.last_token] for s in seqs], "last",
                         sink=gen.drafts.write_forward_context)
    for s, tok in zip(seqs, sample_rows(out.logits[:, -1], seqs)):
        s.draft_len += 1
        s.stats.record_step(len(s.commit([tok])), 1, 0)


def _streamed_to_end(r: Request) -> bool:
    """Finished, and every token of it handed to the caller: only its end (its session's) is still to come."""
    return r.seq.done and len(r.seq.output) == r.emitted


def _rollback(r: Request) -> None:
    """Back to the tokens already streamed (whole steps): a failed step may have committed part of its
    rows' tokens; with them go their steps' stats (acceptance lengths and per-position counts: the steps
    run again) and any finish they set."""
    s = r.seq
    if len(s.output) > r.emitted:
        del s.output[r.emitted:]
        s.finish_reason = None
    s.stats.rollback(len(s.output), max(1, s.resumed))
