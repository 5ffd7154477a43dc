"""`flashpd serve [--config] FILE` and `flashpd client`: run the generation service, and talk to it.

FILE is JSON or YAML with the keys of cluster/config.py's ServeConfig, e.g. {"target": DIR,
"draft": DIR, "mode": "colocated" | "local" | "ray", "device": "cpu"|"cuda", "dtype": ...,
"host": "127.0.0.1", "port": 0, "kv_cache_tokens": N, "prefill_workers": 1, "decode_workers": 1,
"metrics_port": 0, "http_port": 0}. The server prints `metrics on HOST:PORT` and `http on HOST:PORT` (the
OpenAI-compatible HTTP API; `--http-port N` sets http_port too) when enabled, and then
`listening on HOST:PORT` once it serves, and stops cleanly (workers included) on SIGINT/SIGTERM.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys

from flashpd.kv_bridge.stop_signal import StopSignal


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """The sampling options every generating command takes (contract.md's defaults)."""
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens at most (the first token counts)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the likeliest tokens up to "
                                                            "this probability mass (1: off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens only (0: off)")
    p.add_argument("--seed", type=int, help="seed of a sampled request (unset: unseeded; greedy ignores it)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="keep going past stop tokens until --max-tokens")


def add_serve(sub: argparse._SubParsersAction) -> None:
    desc = "Serve the generation gRPC API (and optionally the OpenAI-compatible HTTP API) from a JSON or YAML config."
    s = sub.add_parser("serve", help="serve the generation gRPC API from a JSON or YAML config", description=desc,
                       epilog="The config's keys and defaults: ServeConfig in cluster/config.py (the README's "
                              "Configuration table).")
    s.add_argument("config", nargs="?", metavar="CONFIG",
                   help="the config file: JSON or YAML with ServeConfig's keys (target, draft, mode, ...); "
                        "this or --config")
    s.add_argument("--config", dest="config_opt", metavar="FILE", help="the config file, as an option; this or CONFIG")
    s.add_argument("--http-port", type=int, metavar="PORT",
                   help="also serve the OpenAI-compatible HTTP API on this port (0: any free port); "
                        "overrides the config's http_port (unset: the config's)")


def add_client(sub: argparse._SubParsersAction, prompt_ids) -> None:
    c = sub.add_parser("client", help="send one request to a generation server",
                       description="Send one request to a running `flashpd serve` (gRPC) and print the result as "
                                   "JSON.")
    c.add_argument("--address", default="127.0.0.1:50051", help="HOST:PORT of the server's gRPC API")
    g = c.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", help="prompt text (the server needs a tokenizer); this or --prompt-ids")
    g.add_argument("--prompt-ids", type=prompt_ids, help="the prompt as comma-separated token ids; this or --prompt")
    c.add_argument("--method", default="", choices=["native", "dflash"],
                   help="decoding method (unset: the server's default, dflash when it has a drafter)")
    c.add_argument("--block-size", type=int, default=0,
                   help="DFlash block width, 2..16 (0: the server's default, its drafter's)")
    add_sampling_args(c)
    c.add_argument("--timeout", type=float, default=60.0, help="deadline of the request in seconds")
    c.add_argument("--api-key-file", metavar="FILE",
                   help="a file holding the server's API key (its api_key_file; mode 600), sent with the request "
                        "(unset: FLASHPD_API_KEY's, if set)")
    c.add_argument("--stream", action="store_true",
                   help="print text (or token ids) as they arrive, then the result as JSON")


def _announce(line: str) -> None:
    """One line, text and newline in one write: a launcher reads these, and under Ray the driver's copies of its
    actors' logs share this stdout (print writes the newline apart, and a copy landed in between once)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _interrupt(*_) -> None:
    raise KeyboardInterrupt("SIGTERM while the service started")


def cmd_serve(a: argparse.Namespace) -> int:
    import logging  # noqa: PLC0415

    from flashpd.cluster.config import load_config  # noqa: PLC0415
    from flashpd.cluster.service import start_service  # noqa: PLC0415

    path = a.config_opt or a.config
    if not path or (a.config and a.config_opt and a.config != a.config_opt):
        raise ValueError("serve: give one config file (CONFIG or --config FILE)")
    cfg = load_config(path)
    if a.http_port is not None:
        cfg = cfg.with_(http_port=a.http_port)
    if cfg.mode != "ray" and (cfg.device or "").startswith("cuda"):  # (ray: the workers' hosts have the GPUs)
        import torch  # noqa: PLC0415

        if not torch.cuda.is_available():
            raise ValueError(f"{path}: device {cfg.device!r}, but this machine has no CUDA device (or torch is a "
                             "CPU build)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _interrupt)  # while starting: start_service's cleanup stops what it started
    svc = start_service(cfg)
    done = StopSignal()
    if svc.metrics_address:
        _announce(f"metrics on {svc.metrics_address}")
    if svc.http_address:
        _announce(f"http on {svc.http_address}")
    _announce(f"listening on {svc.address}")
    while not done.wait(1.0) and svc.alive:
        pass
    svc.stop()
    if not done.requested:  # nobody asked it to stop: its engine or workers died (the log says how)
        print("flashpd: error: the service stopped serving (its engine or workers died; see the log)",
              file=sys.stderr)
        return 1
    return 0


def cmd_client(a: argparse.Namespace) -> int:
    from flashpd.cluster.generation_client import GenerationClient, GenerationError  # noqa: PLC0415

    prompt = a.prompt if a.prompt is not None else a.prompt_ids
    if a.method == "native" and a.block_size:  # as `flashpd generate` refuses it: not silently ignored
        raise ValueError(f"--block-size {a.block_size} needs --method dflash")
    kw = dict(max_tokens=a.max_tokens, method=a.method, block_size=a.block_size, temperature=a.temperature,
              top_p=a.top_p, top_k=a.top_k, seed=a.seed, ignore_eos=a.ignore_eos)
    key = None
    if a.api_key_file:
        from flashpd.cluster.api_key import load_api_key  # noqa: PLC0415

        key = load_api_key(a.api_key_file)
    try:
        with GenerationClient(a.address, a.timeout, api_key=key) as c:
            if a.stream:
                toks, texts = [], []
                for ch in c.generate(prompt, **kw):
                    toks.extend(ch.token_ids)
                    if ch.text is not None:
                        texts.append(ch.text)
                    print(ch.text if ch.text else " ".join(map(str, ch.token_ids)), end=" " if not ch.text else "",
                          flush=True)
                    if ch.finished:  # the same last line as without --stream
                        print()
                        print(json.dumps({"token_ids": toks, "text": "".join(texts) if texts else None,
                                          "finish_reason": ch.finish_reason, "stats": ch.stats}))
            else:
                r = c.generate_once(prompt, **kw)
                print(json.dumps({"token_ids": r.token_ids, "text": r.text, "finish_reason": r.finish_reason,
                                  "stats": r.stats}))
    except GenerationError as e:
        print(f"flashpd: error: {e}", file=sys.stderr)
        return 1
    return 0
