"""Continuous batching for one decode worker: native and DFlash requests join and leave between steps.

Each `step()` admits waiting requests while the KV budget allows (a request reserves its worst
case up front: prompt + max_tokens + one block of drafts, so a running request can never run out
of blocks and nothing needs preempting), prefills them (restoring a cached prefix when a prefix
cache is given), then advances every running request by one step: one DFlash draft+verify for
the DFlash ones, one decode token for the native ones. Finished requests free their blocks (and
publish their prompt to the prefix cache) at once. Outputs equal a solo run of each request.
"""
from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field

from flashpd.engine.drafter import DFlashDrafter
from flashpd.engine.generate import NativeGenerator
from flashpd.engine.runner import ModelRunner
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.sequence import Sequence
from flashpd.engine.spec_decode import DFlashGenerator


class PromptTooLong(ValueError):
    """The request can never fit this worker's KV cache or context (RESOURCE_EXHAUSTED at the API)."""


@dataclass
class Request:
    id: int
    method: str
    seq: Sequence
    reserved_blocks: int
    emitted: int = 0  # tokens already handed to the caller


@dataclass
class StepResult:
    """Tokens each request produced in this step (in order), and the requests that finished."""

    new_tokens: dict[int, list[int]] = field(default_factory=dict)
    finished: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(self, runner: ModelRunner, drafter: DFlashDrafter | None = None, stop_ids: tuple[int, ...] = (),
                 prefix_cache=None, max_running: int = 64) -> None:
        self.runner = runner
        self.native = NativeGenerator(runner, stop_ids)
        self.spec = DFlashGenerator(runner, drafter, stop_ids) if drafter is not None else None
        self.prefix_cache = prefix_cache
        self.max_running = max_running
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._ids = itertools.count()
        self._reserved = 0
        self._capacity = runner.allocator.num_free

    # ---- requests ------------------------------------------------------------------------
    def add(self, prompt: list[int], params: SamplingParams, method: str = "native",
            block_size: int | None = None, first_token: int | None = None) -> Request:
        """Queue a request; refuses at once what can never run here.

        first_token: the token a prefill worker already computed and streamed; it is committed
        as the first output instead of the decode side's own (identical in float32) choice."""
        if method not in ("native", "dflash"):
            raise ValueError(f"method must be 'native' or 'dflash', got {method!r}")
        if method == "dflash" and self.spec is None:
            raise ValueError("method 'dflash' needs a worker with a drafter")
        gen = self.spec if method == "dflash" else self.native
        seq = gen.new_sequences([prompt], [params])[0]  # validates params and the context length
        if first_token is not None and not 0 <= first_token < self.runner.model.cfg.vocab_size:
            raise ValueError(f"first_token {first_token} is outside the vocabulary")
        seq.forced_first = first_token
        if method == "dflash":
            seq.block_size = self.spec._check_block(self.spec.block_size if block_size is None else block_size)
        need = math.ceil((len(prompt) + params.max_tokens + seq.block_size) / self.runner.block_size)
        if need > self._capacity:
            raise PromptTooLong(f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} needs {need} KV "
                                f"blocks; this worker has {self._capacity}")
        req = Request(next(self._ids), method, seq, need)
        self.waiting.append(req)
        return req

    def cancel(self, req: Request) -> None:
        """Drop a request wherever it is and free its blocks (a client went away)."""
        if req in self.waiting:
            self.waiting.remove(req)
        elif req in self.running:
            self.running.remove(req)
            self.runner.allocator.free(req.seq.table)
            self._reserved -= req.reserved_blocks
        req.seq.finish_reason = req.seq.finish_reason or "cancelled"

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # ---- one iteration ------------------------------------------------------------------
    def _admit(self) -> list[Request]:
        admitted = []
        while self.waiting and len(self.running) + len(admitted) < self.max_running and \
                self._reserved + self.waiting[0].reserved_blocks <= self._capacity:
            req = self.waiting.popleft()
            self._reserved += req.reserved_blocks
            admitted.append(req)
        for method, gen in (("native", self.native), ("dflash", self.spec)):
            group = [r.seq for r in admitted if r.method == method]
            if not group:
                continue
            gen.restore_prefixes(group, self.prefix_cache)
            feats = gen.prefill(group, taps=method == "dflash")
            if method == "dflash":
                live = [(s, f) for s, f in zip(group, feats) if not s.done]
                if live:
                    gen.drafts.write_prompt([s for s, _ in live], [f for _, f in live])
        return admitted

    def step(self) -> StepResult:
        self.running.extend(self._admit())
        spec_rows = [r.seq for r in self.running if r.method == "dflash" and not r.seq.done]
        native_rows = [r.seq for r in self.running if r.method == "native" and not r.seq.done]
        if spec_rows:
            self.spec.spec_step(spec_rows)
        if native_rows:
            self.native.decode_step(native_rows)
        result = StepResult()
        still = []
        for r in self.running:
            out = r.seq.output
            if len(out) > r.emitted:
                result.new_tokens[r.id] = out[r.emitted:]
                r.emitted = len(out)
            if r.seq.done:
                (self.spec if r.method == "dflash" else self.native).finish(r.seq, self.prefix_cache)
                self._reserved -= r.reserved_blocks
                result.finished.append(r)
            else:
                still.append(r)
        self.running = still
        return result

    def run_until_idle(self, max_steps: int = 1_000_000) -> list[Request]:
        done = []
        for _ in range(max_steps):
            if self.idle:
                return done
            done.extend(self.step().finished)
        raise RuntimeError(f"scheduler still busy after {max_steps} steps")
