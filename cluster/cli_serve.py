"""`flashpd serve CONFIG` and `flashpd client`: run the generation service, and talk to it.

CONFIG is JSON: {"target": DIR, "draft": DIR (optional), "device": "cpu"|"cuda", "dtype": ...,
"host": "127.0.0.1", "port": 0, "kv_cache_tokens": N, "allow_remote": false}. The server prints
`listening on HOST:PORT` once it serves, and stops cleanly on SIGINT/SIGTERM.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

_CONFIG_KEYS = {"target", "draft", "device", "dtype", "host", "port", "kv_cache_tokens", "allow_remote"}


def add_serve(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="serve the generation gRPC API from a JSON config")
    s.add_argument("config", help="JSON: target, draft, device, dtype, host, port, kv_cache_tokens")


def add_client(sub: argparse._SubParsersAction, prompt_ids) -> None:
    c = sub.add_parser("client", help="send one request to a generation server")
    c.add_argument("--address", default="127.0.0.1:50051")
    g = c.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", help="prompt text (the server needs a tokenizer)")
    g.add_argument("--prompt-ids", type=prompt_ids, help="comma-separated token ids")
    c.add_argument("--method", default="", choices=["", "native", "dflash"])
    c.add_argument("--block-size", type=int, default=0)
    from flashpd.cli import add_sampling_args  # noqa: PLC0415 (flashpd.cli imports this module lazily)
    add_sampling_args(c)
    c.add_argument("--timeout", type=float, default=60.0, help="deadline in seconds")
    c.add_argument("--stream", action="store_true", help="print text/tokens as they arrive")


def load_config(path: str) -> dict:
    with open(path) as f:
        cfg = json.load(f)
    if not isinstance(cfg, dict) or "target" not in cfg:
        raise ValueError(f"{path}: config must be a JSON object with at least 'target'")
    unknown = set(cfg) - _CONFIG_KEYS
    if unknown:
        raise ValueError(f"{path}: unknown config keys {sorted(unknown)} (known: {sorted(_CONFIG_KEYS)})")
    return cfg


def cmd_serve(a: argparse.Namespace) -> int:
    from flashpd.cluster.engine_loop import EngineLoop  # noqa: PLC0415
    from flashpd.cluster.generation_server import serve_generation  # noqa: PLC0415
    from flashpd.decode_node.scheduler import Scheduler  # noqa: PLC0415
    from flashpd.llm import LLM  # noqa: PLC0415

    cfg = load_config(a.config)
    llm = LLM(cfg["target"], cfg.get("draft"), device=cfg.get("device"), dtype=cfg.get("dtype"),
              kv_cache_tokens=cfg.get("kv_cache_tokens"))
    loop = EngineLoop(Scheduler(llm.runner, llm.drafter, tuple(llm.stop_ids)))
    host = cfg.get("host", "127.0.0.1")
    server, port = serve_generation(loop, host, int(cfg.get("port", 0)), llm.tokenizer,
                                    allow_remote=bool(cfg.get("allow_remote", False)))
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    print(f"listening on {host}:{port}", flush=True)
    while not done.wait(1.0) and loop.alive:
        pass
    server.stop(grace=2.0).wait(5)
    loop.stop(10)
    return 0


def cmd_client(a: argparse.Namespace) -> int:
    from flashpd.cluster.generation_client import GenerationClient, GenerationError  # noqa: PLC0415

    prompt = a.prompt if a.prompt is not None else a.prompt_ids
    kw = dict(max_tokens=a.max_tokens, method=a.method, block_size=a.block_size, temperature=a.temperature,
              top_p=a.top_p, top_k=a.top_k, seed=a.seed, ignore_eos=a.ignore_eos)
    try:
        with GenerationClient(a.address, a.timeout) as c:
            if a.stream:
                toks = []
                for ch in c.generate(prompt, **kw):
                    toks.extend(ch.token_ids)
                    print(ch.text if ch.text else " ".join(map(str, ch.token_ids)), end=" " if not ch.text else "",
                          flush=True)
                    if ch.finished:
                        print()
                        print(json.dumps({"token_ids": toks, "finish_reason": ch.finish_reason, "stats": ch.stats}))
            else:
                r = c.generate_once(prompt, **kw)
                print(json.dumps({"token_ids": r.token_ids, "text": r.text, "finish_reason": r.finish_reason,
                                  "stats": r.stats}))
    except GenerationError as e:
        print(f"flashpd: error: {e}", file=sys.stderr)
        return 1
    return 0
