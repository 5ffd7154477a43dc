"""How many tokens a second the gRPC front end can stream when the engine is far faster than the host.

    python -m flashpd.bench.stream_rate --concurrency 8,32,128 --out bench/results/stream_rate.json

On an H200 the demo pair's engine steps 128 rows in about 0.56 ms, yet the colocated service made about 3,600
tokens/s at concurrency 128, native and DFlash alike in messages a second (docs/results.md, "Service sweeps"): the
host's per-message work, not the engine, set the rate. This measures that work alone on any machine: a server
process runs the real `GenerationServicer` and gRPC server over a stand-in engine that every `--step-ms` gives
each live request `--tokens-per-step` tokens (the stand-in is the one part here that is not the real system: no
engine on a CPU steps at a GPU's rate), and this process drives it with the real client (bench/load_gen.run_load),
at each concurrency, with token events that queued behind a stream merged into one message
(decode_node/engine_loop.coalesce, the default) and without (COALESCE_MAX_TOKENS = 1). It reports tokens and
messages a second as the clients received them.
"""
from __future__ import annotations

import argparse
import json
import queue
import subprocess
import sys
import threading
import time

from flashpd.bench.common import command_line, git_revision, machine, write_json


class _Stream:
    def __init__(self, n: int) -> None:
        self.events: queue.Queue = queue.Queue()
        self.left = n

    def get(self, timeout: float):
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            return None


class StandIn:
    """A backend (generation_server.Backend) that gives each live request `per_step` tokens every `step_s`."""

    has_drafter = False
    default_draft_width = None
    vocab_size = 4096
    max_positions = 1 << 16
    alive = True

    def __init__(self, step_s: float, per_step: int) -> None:
        from flashpd.decode_node.engine_loop import Event  # noqa: PLC0415

        self.Event, self.step_s, self.per_step = Event, step_s, per_step
        self.live: list[_Stream] = []
        self.lock = threading.Lock()
        self.steps = 0
        threading.Thread(target=self._run, daemon=True).start()

    def counts(self):
        from flashpd.engine.load import Load  # noqa: PLC0415

        return Load(running=len(self.live), waiting=0, kv_blocks_free=1, kv_blocks_total=1, kv_block_size=16)

    def submit(self, prompt, params, method, draft_width, timeout_s, first_token=None, **kw) -> _Stream:
        h = _Stream(params.max_tokens)
        with self.lock:
            self.live.append(h)
        return h

    def cancel(self, h) -> None:
        with self.lock:
            if h in self.live:
                self.live.remove(h)

    def _run(self) -> None:
        while True:
            t0 = time.perf_counter()
            with self.lock:
                live = list(self.live)
            for h in live:
                k = min(self.per_step, h.left)
                h.left -= k
                h.events.put(self.Event("tokens", tokens=[7] * k))
                if h.left == 0:
                    h.events.put(self.Event("done", finish_reason="length", stats={}))
                    self.cancel(h)
            self.steps += 1
            rest = self.step_s - (time.perf_counter() - t0)
            if rest > 0:
                time.sleep(rest)


def serve(step_ms: float, per_step: int, coalesce_max: int) -> None:
    """The server process: prints its port, then serves until its stdin closes."""
    from flashpd.cluster.generation_server import serve_generation  # noqa: PLC0415
    from flashpd.decode_node import engine_loop  # noqa: PLC0415

    engine_loop.COALESCE_MAX_TOKENS = coalesce_max
    srv, port = serve_generation(StandIn(step_ms / 1e3, per_step), max_workers=512)
    print(port, flush=True)
    sys.stdin.read()
    srv.stop(0)


def drive(port: int, concurrency: int, requests: int, max_tokens: int) -> dict:
    from flashpd.bench.load_gen import run_load  # noqa: PLC0415
    from flashpd.cluster.generation_client import GenerationClient  # noqa: PLC0415

    chunks = [0]
    lock = threading.Lock()
    real = GenerationClient.generate

    def counting(self, *a, **kw):
        for ch in real(self, *a, **kw):
            with lock:
                chunks[0] += 1
            yield ch

    GenerationClient.generate = counting
    try:
        res, wall = run_load(f"127.0.0.1:{port}", [[5] * 16] * requests, concurrency, max_tokens=max_tokens,
                             ignore_eos=True)
    finally:
        GenerationClient.generate = real
    toks = sum(len(r.tokens) for r in res)
    errors = sum(1 for r in res if r.error)
    return {"concurrency": concurrency, "requests": requests, "tokens": toks, "seconds": wall,
            "tokens_per_s": toks / wall, "messages_per_s": chunks[0] / wall, "errors": errors}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", default="8,32,128")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--step-ms", type=float, default=0.56, help="the stand-in engine's step (the demo pair's at "
                    "batch 128 on an H200)")
    ap.add_argument("--tokens-per-step", type=int, default=1, help="tokens a request gets a step (1: native; "
                    "DFlash's tau at 4)")
    ap.add_argument("--serve", nargs=3, type=float, metavar=("STEP_MS", "PER_STEP", "COALESCE_MAX"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--repeat", type=int, default=2, help="the two forms in turn, this many times each")
    ap.add_argument("--out", default="bench/results/stream_rate.json")
    a = ap.parse_args()
    if a.serve:
        serve(a.serve[0], int(a.serve[1]), int(a.serve[2]))
        return
    rows = []
    for form, cmax in [("merged", None), ("one message a step", 1)] * a.repeat:
        if cmax is None:
            from flashpd.decode_node.engine_loop import COALESCE_MAX_TOKENS  # noqa: PLC0415
            cmax = COALESCE_MAX_TOKENS
        proc = subprocess.Popen([sys.executable, "-m", "flashpd.bench.stream_rate", "--serve", str(a.step_ms),
                                 str(a.tokens_per_step), str(cmax)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True)
        try:
            port = int(proc.stdout.readline())
            for c in (int(x) for x in a.concurrency.split(",")):
                r = drive(port, c, a.requests, a.max_tokens)
                r.update(form=form, coalesce_max_tokens=cmax)
                rows.append(r)
                print(f"{form:>18} c={c:<4} {r['tokens_per_s']:8.0f} tokens/s  {r['messages_per_s']:7.0f} messages/s"
                      f"  errors {r['errors']}", flush=True)
        finally:
            proc.stdin.close()
            proc.wait(30)
    write_json(a.out, {"bench": "stream_rate", "git": git_revision(), "machine": machine(),
                       "command": command_line("flashpd.bench.stream_rate"), "step_ms": a.step_ms,
                       "tokens_per_step": a.tokens_per_step, "max_tokens": a.max_tokens, "rows": rows})
    print(json.dumps({"wrote": a.out}))


if __name__ == "__main__":
    main()
