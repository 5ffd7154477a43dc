"""Does a demo pair's drafter generalise? Block accuracy on text it trained on against unseen text.

    python -m flashpd.bench.draft_gap --pair flashpd/assets/demo_pair --corpus stdlib+torch --out J.json

The target regenerates greedy continuations of windows from two sources: the recipe's drafter-prompt
files (what the drafter trained on, as fresh windows) and the held-out stdlib files. One draft block is
anchored every `--stride` positions of each continuation. It is the training forward, so it is the
inference draft pass. Reported per source and per block position: how often the first k guesses are all
right, and the static tau they imply (1 + the sum over positions). A large gap between the sources means
the drafter memorised its prompts; a small one, that it is bound by capacity or training instead.
"""
from __future__ import annotations

import argparse

import torch
from tokenizers import Tokenizer

from flashpd.bench.common import write_json
from flashpd.demo import PAIR
from flashpd.engine.drafter import load_drafter
from flashpd.engine.loader import load_target
from flashpd.training.demo_recipe import windows
from flashpd.training.text_data import CORPORA, corpus_files, encode_files, read_texts, split_files, split_three, \
    stdlib_files
from flashpd.training.train_drafter import _pad, block_logits, regenerate


@torch.no_grad()
def block_accuracy(target, drafter, data: list[list[int]], starts: list[int], span: int, stride: int) -> list[float]:
    """Per block position k: the fraction of anchored blocks whose first k guesses are all right."""
    b = drafter.cfg.block_size
    hits, count = torch.zeros(b - 1), 0
    for i in range(0, len(data), 8):
        seqs, _ = _pad(data[i:i + 8], str(target.embed_tokens.weight.device))
        a = torch.tensor(starts[i:i + 8])[:, None] + torch.arange(0, span - b, stride)[None]
        guess = block_logits(drafter, target, seqs, a.to(seqs.device)).argmax(-1)
        lpos = a.to(seqs.device)[:, :, None] + torch.arange(1, b, device=seqs.device)
        truth = seqs.gather(1, lpos.clamp_max(seqs.shape[1] - 1).view(len(a), -1)).view_as(lpos)
        valid = (lpos < torch.tensor([len(x) for x in data[i:i + 8]], device=seqs.device)[:, None, None]).all(-1)
        run = (guess == truth).float().cumprod(-1)[valid]
        hits += run.sum(0).cpu()
        count += run.shape[0]
    return (hits / max(1, count)).tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", default=str(PAIR), help="directory with target/ and drafter/")
    ap.add_argument("--corpus", choices=CORPORA, default="stdlib+torch", help="the recipe's text the pair was made from")
    ap.add_argument("--prompts", type=int, default=48, help="windows per source")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--stride", type=int, default=4)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--no-stdlib-tests", action="store_true",
                    help="leave the stdlib's test package out of the drafter-prompt files, as on an interpreter that "
                         "ships none (the GPU machine's, where demo pair v1 was made)")
    ap.add_argument("--out", default="bench/results/draft_gap.json")
    a = ap.parse_args()
    dtype = torch.float32 if a.device == "cpu" else torch.bfloat16
    target = load_target(f"{a.pair}/target", a.device, dtype)
    drafter = load_drafter(f"{a.pair}/drafter", target)
    tok = Tokenizer.from_file(f"{a.pair}/target/tokenizer.json")
    files = corpus_files(a.corpus)
    if a.no_stdlib_tests:
        std, kept = set(stdlib_files()), set(stdlib_files(include_tests=False))
        files = [f for f in files if f in kept or f not in std]
    sources = {"drafter-prompt files": split_three(files)[1],
               "held-out stdlib files": split_files(stdlib_files())[1]}
    gen = torch.Generator().manual_seed(a.seed)
    rows = {}
    for name, files in sources.items():
        stream = torch.tensor([t for ids in encode_files(tok, read_texts(files)) for t in ids])
        prompts = windows(stream, a.prompts, 32, 700, gen)
        data = regenerate(target, prompts, a.new_tokens, batch=16, log=lambda m: None)
        acc = block_accuracy(target, drafter, data, [len(p) - 1 for p in prompts], a.new_tokens, a.stride)
        rows[name] = {"files": len(files), "prompts": len(prompts), "position_run_accuracy": acc,
                      "static_tau": 1 + sum(acc)}
        print(f"{name}: first position {acc[0]:.2f}, static tau {1 + sum(acc):.2f}", flush=True)
    write_json(a.out, {"bench": "draft_gap", "pair": a.pair, "corpus": a.corpus, "device": a.device,
                       "dtype": str(dtype).removeprefix("torch."), "new_tokens": a.new_tokens, "stride": a.stride,
                       "sources": rows,
                       "command": f"python -m flashpd.bench.draft_gap --pair {a.pair} --corpus {a.corpus} "
                                  f"--prompts {a.prompts} --new-tokens {a.new_tokens} --stride {a.stride} "
                                  f"--seed {a.seed}{' --no-stdlib-tests' if a.no_stdlib_tests else ''} --out {a.out}"})


if __name__ == "__main__":
    main()
