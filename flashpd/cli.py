"""The `flashpd` command line: generate, demo, train-drafter, make-demo-pair, serve, client."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Callable

from flashpd.cluster import cli_serve
from flashpd.cluster.cli_serve import add_sampling_args
from flashpd.cluster.launcher import WorkerStartError
from flashpd.engine.config import CheckpointError
from flashpd.engine.sampling import SamplingParams


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help line ends with its default: "(default: X)", "(default: off)" for a flag,
    "(required)"; an option whose unset value is None or "" says in its own help line what unset means.
    Description and epilog paragraphs are wrapped, except indented ones (commands to copy), kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.required:
            return text + " (required)"
        if action.default in (None, "", argparse.SUPPRESS) or "%(default)" in text:
            return text
        if isinstance(action, argparse._StoreTrueAction):
            return text + " (default: off)"
        return text + " (default: %(default)s)"

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        fill = super()._fill_text
        return "\n\n".join(p if p.startswith(" ") else fill(p, width, indent) for p in text.split("\n\n"))


class Parser(argparse.ArgumentParser):
    """argparse with `HelpFormatter`; its subcommands' parsers are of this class too."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def _prompt_ids(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids wants comma-separated integers, got {s!r}") from None


def _at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least `low` (0 steps or a negative count used to run and write nothing,
    or fail minutes later in a tensor's reshape)."""
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"wants an integer, got {s!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {v}")
        return v
    return parse


def _number(positive: bool) -> Callable[[str], float]:
    """An argparse type: a finite float, above 0 (`positive`) or at least 0."""
    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"wants a number, got {s!r}") from None
        if not math.isfinite(v) or v < 0 or (positive and v == 0):
            raise argparse.ArgumentTypeError(f"must be a finite number {'above' if positive else 'at least'} 0, "
                                             f"got {s}")
        return v
    return parse


def _length_range(s: str) -> tuple[int, int]:
    """--prompt-len "min,max": 1 <= min <= max."""
    try:
        lo, hi = (int(x) for x in s.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"wants min,max (two integers), got {s!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"wants 1 <= min <= max, got {s!r}")
    return lo, hi


def parse_speculative_config(text: str) -> dict:
    """vLLM's spelling: {"method": "dflash", "model": DIR, "num_speculative_tokens": K} -> block_size
    (--block-size's dest: the draft width) K+1; an optional "token_map": FILE (the draft's vocabulary,
    --speculative-token-map's dest) and "quantization": "fp8" (the drafter's weights in its few-row passes)."""
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError("--speculative-config must be a JSON object")
    unknown = set(cfg) - {"method", "model", "num_speculative_tokens", "token_map", "quantization"}
    if unknown:
        raise ValueError(f"--speculative-config: unsupported keys {sorted(unknown)}")
    if cfg.get("method") != "dflash":
        raise ValueError(f"--speculative-config: method must be 'dflash', got {cfg.get('method')!r}")
    if not cfg.get("model") or not isinstance(cfg["model"], str):
        raise ValueError(f"--speculative-config: 'model' (the drafter directory, a path) is required, got "
                         f"{cfg.get('model')!r}")
    out = {"method": "dflash", "draft": cfg["model"]}
    if "num_speculative_tokens" in cfg:
        k = cfg["num_speculative_tokens"]
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"--speculative-config: num_speculative_tokens must be a positive integer, got {k!r}")
        out["block_size"] = k + 1
    if "token_map" in cfg:
        if not isinstance(cfg["token_map"], str) or not cfg["token_map"]:
            raise ValueError(f"--speculative-config: token_map must be a file path, got {cfg['token_map']!r}")
        out["token_map"] = cfg["token_map"]
    if "quantization" in cfg:
        if cfg["quantization"] != "fp8":
            raise ValueError(f"--speculative-config: quantization must be 'fp8', got {cfg['quantization']!r}")
        out["quantization"] = "fp8"
    return out


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate for one prompt (native or DFlash)",
                       description="Generate for one prompt, natively or with DFlash, and print the text (with "
                                   "--json: one JSON object).")
    p.add_argument("--target", required=True, help="Hugging Face Qwen3 checkpoint directory")
    p.add_argument("--draft", help="z-lab DFlash drafter directory (unset: native decoding only)")
    p.add_argument("--method", choices=["native", "dflash"],
                   help="decoding method (unset: dflash when a drafter is given, else native)")
    p.add_argument("--block-size", type=int, help="DFlash draft width, 2..16 (unset: the drafter's)")
    p.add_argument("--speculative-config",
                   help='the drafter in vLLM\'s form, instead of --draft: \'{"method": "dflash", "model": DIR, '
                        '"num_speculative_tokens": 15}\' (K tokens: draft width K+1; unset: --draft); '
                        '"quantization": "fp8" drafts from fp8 weights (same greedy output; sampled keeps its '
                        'distribution)')
    p.add_argument("--speculative-token-map", metavar="FILE",
                   help="a reduced draft vocabulary: a JSON list (or torch file) of hot token ids the drafter alone "
                        "drafts from (SGLang's spelling; build one with `python -m flashpd.training.token_map`). "
                        "Same greedy output (sampled keeps its distribution), less head to read a step")
    add_sampling_args(p)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", help="prompt text (needs the target's tokenizer.json); this or --prompt-ids")
    g.add_argument("--prompt-ids", type=_prompt_ids, help="the prompt as comma-separated token ids; this or --prompt")
    p.add_argument("--device", choices=["cpu", "cuda"], help="unset: cuda when available, else cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="unset: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (token_ids, text, finish_reason, stats) as the last line")
    p.add_argument("--no-warmup", action="store_true",
                   help="on a GPU, skip the warm-up before the request: its compiles and CUDA graph captures then "
                        "fall inside the request's ttft and latency")


def cmd_generate(a: argparse.Namespace) -> int:
    import logging  # noqa: PLC0415

    from flashpd.llm import LLM  # noqa: PLC0415 (keeps `flashpd --help` fast)

    progress = logging.getLogger("flashpd.llm")  # the warm-up's start and end, on stderr
    if not progress.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("flashpd: %(message)s"))
        progress.addHandler(handler)
        progress.setLevel(logging.INFO)

    method, draft, width, token_map = a.method, a.draft, a.block_size, a.speculative_token_map
    quantization, spec_width = None, False
    if a.speculative_config:
        spec = parse_speculative_config(a.speculative_config)
        if draft and draft != spec["draft"]:
            raise ValueError("--draft and --speculative-config name different drafters")
        if token_map and spec.get("token_map") and token_map != spec["token_map"]:
            raise ValueError("--speculative-token-map and --speculative-config name different token maps")
        method, draft = method or spec["method"], spec["draft"]
        if width is not None and spec.get("block_size") not in (None, width):  # as two drafters are: not one dropped
            raise ValueError(f"--block-size {width} and --speculative-config's num_speculative_tokens "
                             f"{spec['block_size'] - 1} (width {spec['block_size']}) disagree")
        spec_width = width is None  # the width is the speculative config's, not a flag's
        width = spec.get("block_size") if width is None else width
        token_map = token_map or spec.get("token_map")
        quantization = spec.get("quantization")
    if method == "native" and draft:
        draft = token_map = quantization = None  # an explicit native run ignores the drafter
        if spec_width:  # and the speculative config's width with it (a --block-size flag is refused)
            width = None
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                            top_k=a.top_k, seed=a.seed, ignore_eos=a.ignore_eos)
    params.validate()
    llm = LLM(target=a.target, draft=draft, method=method, block_size=width, device=a.device, dtype=a.dtype,
              speculative_token_map=token_map, speculative_quantization=quantization,
              warmup=False if a.no_warmup else None)
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


TRAIN_EXAMPLE = """\
How it runs: the target regenerates a continuation of each prompt (greedy: the drafter learns what the target
says), the drafter trains on them, and the written drafter is evaluated on held-out prompts (tau, and
exactness against native decoding) into OUT/eval.json. Progress bars go to stderr on a terminal; the
log lines go to stdout.

A small run that finishes in a few minutes on a 2-core CPU, from the repository root (the demo pair's
target; a drafter trained this briefly accepts little: the run shows the pipeline end to end):

  flashpd train-drafter --target flashpd/assets/demo_pair/target --out small-drafter \\
      --device cpu --num-prompts 16 --prompt-len 32,64 --new-tokens 32 --steps 50 \\
      --seqs-per-step 4 --anchors 16 --eval-prompts 2

  flashpd generate --target flashpd/assets/demo_pair/target --draft small-drafter \\
      --device cpu --prompt 'import os' --max-tokens 32
"""


def _add_training(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("train-drafter", help="train a DFlash drafter for a target (z-lab format checkpoints)",
                       description="Train a DFlash drafter for a target; checkpoints are z-lab drafter directories.",
                       epilog=TRAIN_EXAMPLE)
    t.add_argument("--target", required=True, help="the target's Hugging Face Qwen3 checkpoint directory")
    t.add_argument("--out", required=True, help="drafter directory (checkpoints, trainer state, eval.json): new or "
                                                "empty, or with --resume the run's own")
    t.add_argument("--data", help="directory of text files (or one file) to take prompts from (needs the target's "
                                  "tokenizer.json); unset: the demo recipe's text if the target has a tokenizer "
                                  "(its drafter-prompt files of the stdlib and torch's source to train on, held-out "
                                  "stdlib files to evaluate on), else random token prompts")
    t.add_argument("--layers", type=_at_least(1), default=2, help="draft layers")
    t.add_argument("--intermediate-size", type=_at_least(1), help="draft MLP width (unset: the target's)")
    t.add_argument("--block-size", type=_at_least(2), default=16, help="DFlash draft width the drafter is trained for")
    t.add_argument("--taps", type=_at_least(1), default=5, help="number of target layers tapped")
    t.add_argument("--mask-token-id", type=_at_least(0),
                   help="token id of a block's masked positions (unset: the target's last vocabulary id)")
    t.add_argument("--steps", type=_at_least(1), default=1000,
                   help="training steps (a checkpoint every quarter of them)")
    t.add_argument("--seqs-per-step", type=_at_least(1), default=8, help="sequences per training step")
    t.add_argument("--anchors", type=_at_least(1), default=128,
                   help="blocks per sequence in a step (anchored at random positions of the regenerated part)")
    t.add_argument("--lr", type=_number(positive=True), default=1e-3,
                   help="peak learning rate (linear warm-up over the first 5%% of steps, cosine decay to a tenth)")
    t.add_argument("--kl-weight", type=_number(positive=False), default=0.0,
                   help="weight of KL(target || drafter) beside the cross-entropy on the target's tokens")
    t.add_argument("--attention", choices=["auto", "mask", "flex"], default="auto",
                   help="the blocks' attention in training: flex (CUDA), an explicit mask, or auto (flex on CUDA)")
    t.add_argument("--num-prompts", type=_at_least(1), default=512,
                   help="training prompts whose continuations the target regenerates")
    t.add_argument("--prompt-len", type=_length_range, default="32,512", help="min,max prompt tokens")
    t.add_argument("--new-tokens", type=_at_least(1), default=256, help="tokens the target regenerates per prompt")
    t.add_argument("--eval-prompts", type=_at_least(0), default=8,
                   help="held-out prompts the written drafter is evaluated on (0: no evaluation)")
    t.add_argument("--seed", type=int, default=0, help="seed of the prompts, the drafter's initialisation and "
                                                       "its training")
    t.add_argument("--resume", action="store_true",
                   help="continue from the checkpoint in --out (the continuations are regenerated first)")
    t.add_argument("--device", choices=["cpu", "cuda"], help="unset: cuda when available, else cpu")
    m = sub.add_parser("make-demo-pair", help="the demo pair's whole recipe (tokenizer, target, drafter, eval)",
                       description="The demo pair's whole recipe: BPE tokenizer, target from scratch, regenerated "
                                   "continuations, drafter, held-out evaluation (eval.json).")
    m.add_argument("--out", required=True, help="directory of the pair: target/, drafter/, drafter-train/ "
                                                "(checkpoints), eval.json")
    m.add_argument("--device", choices=["cpu", "cuda"], help="unset: cuda when available, else cpu")
    m.add_argument("--seed", type=int, default=0, help="seed of the prompts, training and evaluation")
    m.add_argument("--target-steps", type=_at_least(1), default=600, help="training steps of the target (from scratch)")
    m.add_argument("--drafter-steps", type=_at_least(1), default=17000, help="training steps of the drafter")
    m.add_argument("--num-prompts", type=_at_least(1), default=12288,
                   help="prompts whose continuations the target regenerates")
    m.add_argument("--vocab-size", type=_at_least(256), default=4096, help="BPE vocabulary of the demo tokenizer")
    m.add_argument("--drafter-seqs", type=_at_least(1), default=16,
                   help="sequences per drafter step (128 anchors each)")
    m.add_argument("--drafter-lr", type=_number(positive=True), default=1.5e-3, help="the drafter's peak learning rate")
    m.add_argument("--corpus", choices=["stdlib", "stdlib+torch"], default="stdlib+torch",
                   help="training text: the stdlib's Python, or it and the installed torch package's")
    m.add_argument("--kl-weight", type=_number(positive=False), default=0.0,
                   help="weight of KL(target || drafter) beside the drafter's cross-entropy")
    m.add_argument("--drafter-attention", choices=["auto", "mask", "flex"], default="auto",
                   help="the drafter's training attention: flex on CUDA by default (auto); mask is how v2 was made")
    m.add_argument("--drafter-intermediate", type=_at_least(1), default=896,
                   help="the draft layers' MLP width (the target's is 512; the pair must stay within 16 MB)")
    m.add_argument("--new-tokens", type=_at_least(1), default=128, help="tokens the target regenerates per prompt")
    m.add_argument("--regen-batch", type=_at_least(1),
                   help="prompts regenerated at once (unset: 256 on CUDA, 32 on CPU)")
    m.add_argument("--drafter-gamma", type=_number(positive=True), default=4.0,
                   help="decay of the drafter's loss weight over block positions, exp(-(k-1)/gamma): 4 (demo pairs "
                        "v5 and v6) weighs a block's first guesses more than DFlash's 7 at block 16")
    m.add_argument("--max-files", type=_at_least(1),
                   help="a quick run: the first N files of each part of the split (target, drafter prompts, "
                        "held-out); unset: every file")
    m.add_argument("--target", help="a target this recipe made before (with its tokenizer.json): copied into --out, "
                                    "and only the drafter's stages run (drafter settings compared on one target); "
                                    "unset: the whole recipe")


def check_train_out(a: argparse.Namespace) -> None:
    """train-drafter's --out, refused before any work where the run would lose something: the target itself (it
    would be overwritten by a drafter), a directory that is not empty without --resume (another checkpoint, or a
    user's files), --resume with no trainer state to continue, or --resume with other drafter settings than the
    checkpoint's (they were ignored, and train_config.json recorded them)."""
    out, target = Path(a.out), Path(a.target)
    if out.exists() and target.exists() and out.resolve() == target.resolve():
        raise ValueError(f"--out {a.out} is the target's directory: the drafter would overwrite the target")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {a.out} is a file, not a directory")
    if a.data and not Path(a.data).exists():
        raise ValueError(f"--data {a.data}: no such file or directory")
    state = out / "trainer_state.pt"
    if not a.resume:
        if out.is_dir() and any(out.iterdir()):
            raise ValueError(f"--out {a.out} is not empty: pass --resume to continue the run whose checkpoint it "
                             f"holds, or choose a new directory")
        return
    if not state.exists():
        raise ValueError(f"--resume: {a.out} holds no trainer_state.pt to continue from")
    from flashpd.engine.config import read_json_object  # noqa: PLC0415
    saved = read_json_object(out / "config.json")
    dc = saved.get("dflash_config") or {}
    given = {"--layers": (a.layers, saved.get("num_hidden_layers")),
             "--block-size": (a.block_size, saved.get("block_size")),
             "--taps": (a.taps, len(dc.get("target_layer_ids") or [])),
             "--intermediate-size": (a.intermediate_size, saved.get("intermediate_size")),
             "--mask-token-id": (a.mask_token_id, dc.get("mask_token_id"))}
    differ = [f"{k} {v} (the checkpoint's: {w})" for k, (v, w) in given.items() if v is not None and v != w]
    if differ:
        raise ValueError(f"--resume: {', '.join(differ)}; resume with the checkpoint's settings")
    import torch  # noqa: PLC0415

    from flashpd.training.train_drafter import check_same_save  # noqa: PLC0415
    try:
        saved_state = torch.load(state, map_location="cpu")
    except Exception as e:  # noqa: BLE001  (EOFError, an unpickling error, ...): named, not a traceback
        raise ValueError(f"--resume: {state} cannot be read ({type(e).__name__}: {e})") from None
    check_same_save(out, saved_state)  # before the target loads and the data is regenerated (minutes)


def check_pair_out(a: argparse.Namespace) -> None:
    """make-demo-pair's --out, refused before any work if it holds files, unless --target is its own target/ (the
    drafter's stages run again on that pair's target, replacing its drafter): a run would merge into another
    pair, replacing its drafter and eval.json beside a stale log."""
    out = Path(a.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {a.out} is a file, not a directory")
    own = a.target is not None and Path(a.target).resolve() == (out / "target").resolve()
    if out.is_dir() and any(out.iterdir()) and not own:
        raise ValueError(f"--out {a.out} is not empty: choose a new directory (or pass --target {out / 'target'} to "
                         f"train that pair's drafter again)")


def cmd_train_drafter(a: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415

    from flashpd.engine.export import write_model_json  # noqa: PLC0415
    from flashpd.engine.loader import load_target  # noqa: PLC0415
    from flashpd.engine.tokenizer import TextTokenizer  # noqa: PLC0415
    from flashpd.training.progress import log_line  # noqa: PLC0415
    from flashpd.training.train_drafter import DrafterTrainConfig, evaluate_tau, regenerate, train_drafter  # noqa

    check_train_out(a)  # before minutes of regeneration
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    log_line(f"loading the target {a.target} ({device})")
    target = load_target(a.target, device, dtype)
    lo, hi = a.prompt_len
    gen = torch.Generator().manual_seed(a.seed)
    tok = TextTokenizer.from_dir(a.target)
    n = a.num_prompts + a.eval_prompts
    eval_source = "random token prompts"
    if tok is not None:
        from flashpd.training.demo_recipe import windows  # noqa: PLC0415
        from flashpd.training.text_data import drafter_prompt_sources, read_texts  # noqa: PLC0415
        train_files, eval_files, eval_source = drafter_prompt_sources(a.data)
        log_line(f"tokenizing {len(train_files)} + {len(eval_files)} text files to take prompts from")
        prompts = []
        for files, count in ((train_files, a.num_prompts), (eval_files, a.eval_prompts)):
            stream = torch.tensor([t for ids in tok.encode_many(read_texts(files)) for t in ids])
            if stream.numel() < hi + 2:
                raise ValueError(f"{'--data' if a.data else 'the recipe split'} gives {stream.numel()} tokens, "
                                 f"fewer than --prompt-len max {hi}")
            prompts += windows(stream, count, lo, hi, gen)
    elif a.data:
        raise ValueError("--data needs the target's tokenizer.json")
    else:
        vocab = target.cfg.vocab_size
        prompts = [torch.randint(0, vocab, (int(k),), generator=gen).tolist()
                   for k in torch.randint(lo, hi + 1, (n,), generator=gen)]
    train_prompts, eval_prompts = prompts[:a.num_prompts], prompts[a.num_prompts:]
    log_line(f"the target regenerates {len(train_prompts)} continuations of up to {a.new_tokens} tokens ({device})")
    # 32 prompts at a time on a CPU, as the demo recipe does there: the progress bar moves as batches finish
    data = regenerate(target, train_prompts, a.new_tokens, batch=128 if device == "cuda" else 32)
    tc = DrafterTrainConfig(layers=a.layers, intermediate_size=a.intermediate_size, block_size=a.block_size,
                            num_taps=a.taps, mask_token_id=a.mask_token_id,
                            steps=a.steps, seqs_per_step=a.seqs_per_step, anchors=a.anchors, lr=a.lr, seed=a.seed,
                            save_every=max(1, a.steps // 4), kl_weight=a.kl_weight,
                            attention=a.attention)
    train_drafter(target, data, [len(p) for p in train_prompts], a.out, tc, resume=a.resume)
    if eval_prompts:
        from flashpd.engine.drafter import load_drafter  # noqa: PLC0415 (evaluate what was written)
        log_line(f"evaluating the drafter on {len(eval_prompts)} held-out prompts")
        rows = evaluate_tau(target, load_drafter(a.out, target), eval_prompts, max_tokens=min(128, a.new_tokens))
        report = {"heldout": rows, "tau_mean": sum(r["tau"] for r in rows) / len(rows), "eval_prompts": eval_source}
        write_model_json(Path(a.out, "eval.json"), report, indent=1)
        for r in rows:
            print(f"held-out prompt {r['prompt_len']:5d} tokens: tau {r['tau']:.2f} exact {r['exact']}")
    print(f"drafter written to {a.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="flashpd", description=__doc__, epilog="`flashpd COMMAND --help` lists a command's options "
                                                              "with their defaults.")
    parser.add_argument("--version", action="version", version=f"flashpd {_version()}",
                        help="print flashpd's version and exit")
    sub = parser.add_subparsers(dest="cmd", metavar="COMMAND")
    _add_generate(sub)
    d = sub.add_parser("demo", help="run the shipped demo model: native vs DFlash",
                       description="Run the shipped demo pair on three held-out prompts, native against DFlash.")
    d.add_argument("--device", choices=["cpu", "cuda"], help="unset: cuda when available, else cpu")
    _add_training(sub)
    cli_serve.add_serve(sub)
    cli_serve.add_client(sub, _prompt_ids)
    a = parser.parse_args(argv)
    if a.cmd is None:  # no command: what there is to run
        parser.print_help()
        return 0
    if getattr(a, "device", None) == "cuda":
        import torch  # noqa: PLC0415

        if not torch.cuda.is_available():
            print("flashpd: error: --device cuda, but this machine has no CUDA device (or torch is a CPU build); "
                  "use --device cpu", file=sys.stderr)
            return 2
    try:
        if a.cmd == "generate":
            return cmd_generate(a)
        if a.cmd == "serve":
            return cli_serve.cmd_serve(a)
        if a.cmd == "client":
            return cli_serve.cmd_client(a)
        if a.cmd == "train-drafter":
            return cmd_train_drafter(a)
        if a.cmd == "make-demo-pair":
            import torch  # noqa: PLC0415

            from flashpd.training.demo_recipe import make_demo_pair  # noqa: PLC0415
            check_pair_out(a)
            dev = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
            make_demo_pair(a.out, dev, seed=a.seed, target_steps=a.target_steps, drafter_steps=a.drafter_steps,
                           vocab_size=a.vocab_size, drafter_seqs=a.drafter_seqs, drafter_lr=a.drafter_lr,
                           num_prompts=a.num_prompts, corpus=a.corpus, kl_weight=a.kl_weight,
                           drafter_intermediate=a.drafter_intermediate, drafter_attention=a.drafter_attention,
                           regen_batch=a.regen_batch, target_dir=a.target, new_tokens=a.new_tokens,
                           drafter_gamma=a.drafter_gamma, max_files=a.max_files)
            return 0
        from flashpd.demo import run_demo  # noqa: PLC0415
        return run_demo(device=a.device)
    except (ValueError, CheckpointError, OSError) as e:  # OSError: a missing, unreadable or wrong-kind path
        print(f"flashpd: error: {e}", file=sys.stderr)
        return 2
    except WorkerStartError as e:  # its message names the worker, its exit and its log's tail
        print(f"flashpd: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM while `serve` starts: what started was stopped
        print(f"flashpd: interrupted{f' ({e})' if str(e) else ''}", file=sys.stderr)
        return 130


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    try:
        return version("flashpd")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
