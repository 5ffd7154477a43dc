"""Offline text for the demo pair: the running interpreter's standard-library Python source, and the
Python source of the installed torch package (a dependency, so present wherever flashpd runs).

Files are split into train / held-out by a hash of their path relative to their root (stable across
runs and machines with the same stdlib and torch), so held-out prompts come from files the models never
saw. A byte-level BPE tokenizer is trained on the train split with `tokenizers`.
"""
from __future__ import annotations

import functools
import hashlib
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|mask|>"]  # eos, and the drafter's mask token


def stdlib_files(root: str | None = None, include_tests: bool = True) -> list[Path]:
    """Every .py under the stdlib root. The test suite triples the text (about 19 of 31 MB): a small
    target memorises the rest within a few epochs, and a memorising target drafts badly."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "idlelib", "lib2to3", "__pycache__", "turtledemo") + (() if include_tests else ("test", "tests"))
    files = [p for p in sorted(base.rglob("*.py")) if not any(part in skip for part in p.relative_to(base).parts)]
    if not files:
        raise FileNotFoundError(f"no Python source under {base}")
    return files


def torch_files(max_bytes: int = 300_000) -> list[Path]:
    """Every .py of the installed torch package but generated tables (the few files over max_bytes):
    about 45 MB of Python, four times the stdlib without its tests. The stdlib alone (about 2 M tokens to
    train on where the interpreter ships no tests) lets the drafter memorise its prompts: block accuracy
    on held-out text fell far below that on its own prompt files."""
    import torch  # noqa: PLC0415 (text_data is imported where torch is not needed)
    base = Path(torch.__file__).parent
    return [p for p in sorted(base.rglob("*.py")) if "__pycache__" not in p.parts and p.stat().st_size <= max_bytes]


CORPORA = ("stdlib", "stdlib+torch")


def corpus_files(corpus: str = "stdlib+torch") -> list[Path]:
    if corpus not in CORPORA:
        raise ValueError(f"unknown corpus {corpus!r}: one of {', '.join(CORPORA)}")
    return stdlib_files() + (torch_files() if corpus == "stdlib+torch" else [])


@functools.lru_cache(maxsize=1)
def _packages_root() -> Path:
    import torch  # noqa: PLC0415
    return Path(torch.__file__).parent.parent


def _unit_hash(f: Path, base: Path) -> float:
    """A file's place in [0, 1]: the hash of its path under the torch package's parent (torch/...) when it
    is there, else under the stdlib root, so the split is the same on every machine."""
    try:
        rel = f.relative_to(_packages_root())
    except ValueError:
        rel = f.relative_to(base)
    return int(hashlib.sha256(str(rel).encode()).hexdigest()[:8], 16) / 0xFFFFFFFF


def split_files(files: list[Path], heldout_fraction: float = 0.05, root: str | None = None
                ) -> tuple[list[Path], list[Path]]:
    """(train, held-out) by a hash of each file's path under the stdlib root."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    train = [f for f in files if _unit_hash(f, base) >= heldout_fraction]
    held = [f for f in files if _unit_hash(f, base) < heldout_fraction]
    return train, held


def split_three(files: list[Path], heldout_fraction: float = 0.05, drafter_fraction: float = 0.25,
                root: str | None = None) -> tuple[list[Path], list[Path], list[Path]]:
    """(target-train, drafter-prompt, held-out): the target never trains on drafter-prompt files, so the
    continuations the drafter learns from show the target's behaviour on unseen text, as evaluation does.
    The held-out part is the same as split_files'."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    train, held = split_files(files, heldout_fraction, root)
    cut = heldout_fraction + drafter_fraction
    return ([f for f in train if _unit_hash(f, base) >= cut], [f for f in train if _unit_hash(f, base) < cut], held)


def drafter_prompt_sources(data_dir: str | None = None, corpus: str = "stdlib+torch"
                           ) -> tuple[list[Path], list[Path], str]:
    """(files to take training prompts from, files to take evaluation prompts from, what the latter are).
    The default is the demo recipe's split: its drafter-prompt files to train on, held-out stdlib files
    (never trained on, by target or drafter; the speedup bench's prompts come from them too) to evaluate
    on. A --data directory serves both (said so)."""
    if data_dir:
        root = Path(data_dir)
        if not root.exists():
            raise ValueError(f"--data {data_dir}: no such file or directory")
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        if not files:
            raise ValueError(f"--data {data_dir}: a directory with no files")
        return files, files, "windows of the --data files (the same files as the training prompts)"
    _, draft, _ = split_three(corpus_files(corpus))
    return draft, split_files(stdlib_files())[1], "windows of the held-out stdlib files (never trained on)"


def read_texts(files: list[Path]) -> list[str]:
    out = []
    for f in files:
        try:
            out.append(f.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return out


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_files(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    """One token list per file, each ended by <|endoftext|>."""
    eos = tok.token_to_id(SPECIAL_TOKENS[0])
    return [e.ids + [eos] for e in tok.encode_batch(texts, add_special_tokens=False)]
