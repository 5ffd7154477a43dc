"""Build a reduced draft vocabulary (engine/token_map.py) from token frequencies in a text corpus (FR-Spec's recipe).

    python -m flashpd.training.token_map --target flashpd/assets/demo_pair/target --size 1024 --out hot1024.json

Counts every token of the corpus under the target's tokenizer.json and keeps the `--size` most frequent ids plus the
target's stop ids. The default corpus is the demo recipe's training split (training/text_data.py: stdlib and torch
source, never its held-out files, whose windows are the evaluation prompts); `--text` names other files or folders.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from flashpd.engine.config import read_json_object
from flashpd.engine.token_map import build_token_map, save_token_map
from flashpd.training.progress import bar
from flashpd.training.text_data import corpus_files, read_texts, split_files

TEXT_SUFFIXES = (".txt", ".md", ".py", ".json", ".jsonl")


def text_files(paths: list[str]) -> list[Path]:
    """Files named, and the text files (by suffix) under folders named, in a stable order."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(f"{p}: no such file or folder")
    if not out:
        raise FileNotFoundError(f"no text files under {paths}")
    return out


def count_tokens(tok: Tokenizer, texts: list[str], vocab_size: int, batch: int = 256) -> torch.Tensor:
    """How often each id occurs in texts -> counts [vocab_size] (int64)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    progress = bar(desc="count", total=len(texts), unit="file")
    for i in range(0, len(texts), batch):
        for e in tok.encode_batch(texts[i:i + batch], add_special_tokens=False):
            if e.ids:
                ids = torch.tensor(e.ids, dtype=torch.int64)
                if int(ids.max()) >= vocab_size:
                    raise ValueError(f"the tokenizer makes id {int(ids.max())}, outside the target's vocabulary "
                                     f"[0, {vocab_size}): tokenizer and target disagree")
                counts += torch.bincount(ids, minlength=vocab_size)
        progress.update(min(batch, len(texts) - i))
    progress.close()
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="the target's checkpoint directory (config.json, tokenizer.json)")
    ap.add_argument("--size", type=int, required=True, help="how many ids the map keeps (stop ids included)")
    ap.add_argument("--out", required=True, help="the map to write (a JSON list of ids)")
    ap.add_argument("--text", nargs="+", help="files or folders to count (default: the demo recipe's training split)")
    ap.add_argument("--force", action="store_true", help="replace --out if it exists")
    a = ap.parse_args(argv)
    tdir, out = Path(a.target), Path(a.out)
    t0 = time.perf_counter()
    try:
        # what would lose a file or fail after the count, refused before it
        if out.exists() and (out.is_dir() or not a.force):
            raise ValueError(f"--out {out} exists" + ("" if out.is_dir() else "; pass --force to replace it"))
        if not out.parent.is_dir():
            raise ValueError(f"--out {out}: no directory {out.parent}")
        if a.size < 1:
            raise ValueError(f"--size must be at least 1, got {a.size}")
        cfg = read_json_object(tdir / "config.json")
        vocab = cfg.get("vocab_size")
        if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
            raise ValueError(f"{tdir / 'config.json'}: vocab_size must be a positive integer, got {vocab!r}")
        if not (tdir / "tokenizer.json").is_file():
            raise ValueError(f"{tdir}: no tokenizer.json (the corpus is counted under the target's tokenizer)")
        tok = Tokenizer.from_file(str(tdir / "tokenizer.json"))
        eos = cfg.get("eos_token_id")
        stops = [eos] if isinstance(eos, int) else list(eos or [])
        files = text_files(a.text) if a.text else split_files(corpus_files())[0]
        texts = read_texts(files)
        counts = count_tokens(tok, texts, vocab)
        if int(counts.sum()) == 0:
            raise ValueError(f"the {len(files)} text files hold no tokens (empty, or not readable as text): "
                             f"{', '.join(str(f) for f in files[:3])}{' ...' if len(files) > 3 else ''}")
        ids = build_token_map(counts, a.size, stops)
    except (OSError, ValueError) as e:  # CheckpointError is a ValueError
        print(f"token_map: {e}", file=sys.stderr)
        return 2
    save_token_map(ids, out)
    total = int(counts.sum())
    covered = int(counts[ids].sum())
    print(f"{len(files)} files, {total} tokens; the {a.size} ids kept cover {covered / max(1, total):.4f} of them "
          f"({time.perf_counter() - t0:.0f} s) -> {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
