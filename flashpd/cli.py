"""The `flashpd` command line: generate, demo."""
from __future__ import annotations

import argparse
import json
import sys

from flashpd.engine.config import CheckpointError
from flashpd.engine.sampling import SamplingParams


def _prompt_ids(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids wants comma-separated integers, got {s!r}") from None


def parse_speculative_config(text: str) -> dict:
    """vLLM's spelling: {"method": "dflash", "model": DIR, "num_speculative_tokens": K} -> block K+1."""
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError("--speculative-config must be a JSON object")
    unknown = set(cfg) - {"method", "model", "num_speculative_tokens"}
    if unknown:
        raise ValueError(f"--speculative-config: unsupported keys {sorted(unknown)}")
    if cfg.get("method") != "dflash":
        raise ValueError(f"--speculative-config: method must be 'dflash', got {cfg.get('method')!r}")
    if not cfg.get("model"):
        raise ValueError("--speculative-config: 'model' (the drafter directory) is required")
    out = {"method": "dflash", "draft": cfg["model"]}
    if "num_speculative_tokens" in cfg:
        k = cfg["num_speculative_tokens"]
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"--speculative-config: num_speculative_tokens must be a positive integer, got {k!r}")
        out["block_size"] = k + 1
    return out


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate for one prompt (native or DFlash)")
    p.add_argument("--target", required=True, help="Hugging Face Qwen3 directory")
    p.add_argument("--draft", help="z-lab DFlash drafter directory")
    p.add_argument("--method", choices=["native", "dflash"])
    p.add_argument("--block-size", type=int)
    p.add_argument("--speculative-config", help='vLLM form: \'{"method": "dflash", "model": DIR, "num_speculative_tokens": 15}\'')
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--ignore-eos", action="store_true")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt")
    g.add_argument("--prompt-ids", type=_prompt_ids)
    p.add_argument("--device", choices=["cpu", "cuda"])
    p.add_argument("--dtype", choices=["float32", "bfloat16"])
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def cmd_generate(a: argparse.Namespace) -> int:
    from flashpd.llm import LLM  # noqa: PLC0415 (keeps `flashpd --help` fast)

    method, draft, block = a.method, a.draft, a.block_size
    if a.speculative_config:
        spec = parse_speculative_config(a.speculative_config)
        if draft and draft != spec["draft"]:
            raise ValueError("--draft and --speculative-config name different drafters")
        method, draft = method or spec["method"], spec["draft"]
        block = block or spec.get("block_size")
    if method == "native" and draft:
        draft = None  # an explicit native run ignores the drafter
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                            top_k=a.top_k, seed=a.seed, ignore_eos=a.ignore_eos)
    params.validate()
    llm = LLM(target=a.target, draft=draft, method=method, block_size=block, device=a.device, dtype=a.dtype)
    out = llm.generate([a.prompt if a.prompt is not None else a.prompt_ids], params)[0]
    if a.json:
        print(json.dumps(out.as_dict()))
    else:
        print(out.text if out.text is not None else " ".join(map(str, out.token_ids)))
        s = out.stats
        tau = f", tau {s.tau:.2f}" if s.tau is not None else ""
        print(f"[{len(out.token_ids)} tokens, {out.finish_reason}, ttft {s.ttft_ms:.1f} ms, "
              f"latency {s.latency_ms:.1f} ms{tau}]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flashpd", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    _add_generate(sub)
    d = sub.add_parser("demo", help="run the shipped demo model: native vs DFlash")
    d.add_argument("--device", choices=["cpu", "cuda"])
    a = parser.parse_args(argv)
    try:
        if a.cmd == "generate":
            return cmd_generate(a)
        from flashpd.demo import run_demo  # noqa: PLC0415
        return run_demo(device=a.device)
    except (ValueError, CheckpointError, FileNotFoundError) as e:
        print(f"flashpd: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
