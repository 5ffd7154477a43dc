"""A reduced draft vocabulary (FR-Spec; SGLang's `--speculative-token-map`): the drafter reads only the head rows of
a set of frequent ("hot") token ids.

Why: with a large vocabulary the shared head is a large share of what a draft pass reads each step (see
docs/results.md for the Qwen3-8B shape), read to rank every token when the drafter's guesses mostly lie in a small
set. Restricting the draft's argmax to hot ids changes which guesses the drafter makes, never the output: the
target verifies every guess against its own full head, so the tokens stay those of plain greedy decoding (sampled
rows: the draft distribution q is zero off the hot set, and rejection sampling is exact for any q). A confidence
width policy reads the draft's confidence over the hot ids.

The file is a list of token ids: JSON (`[3, 17, ...]`) or a torch file of a 1-D integer tensor or list (SGLang's
`.pt`, loaded with `weights_only`). `build_token_map` makes one from token counts (training/token_map.py counts a
text corpus under the target's tokenizer).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch


class TokenMapError(ValueError):
    """A token map file that cannot serve this target (the message names the file and what is wrong)."""


def parse_token_ids(ids: Iterable, vocab_size: int, source: str) -> torch.Tensor:
    """Validate hot ids -> a sorted int64 tensor. Sorted, so that the draft's argmax over the reduced head breaks
    ties toward the least target id, as the full head's argmax does: a map of every id drafts what no map does."""
    try:
        t = torch.as_tensor(list(ids) if not isinstance(ids, torch.Tensor) else ids)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TokenMapError(f"{source}: not a list of token ids ({e})") from None
    if t.dim() != 1:
        raise TokenMapError(f"{source}: a token map is a 1-D list of ids, got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise TokenMapError(f"{source}: empty token map")
    if t.dtype in (torch.bool,) or t.is_floating_point() or t.is_complex():
        raise TokenMapError(f"{source}: token ids must be integers, got {t.dtype}")
    t = t.to(torch.int64)
    lo, hi = int(t.min()), int(t.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise TokenMapError(f"{source}: token id {bad} is outside the target's vocabulary [0, {vocab_size})")
    s = torch.sort(t).values
    dup = s[1:] == s[:-1]
    if bool(dup.any()):
        raise TokenMapError(f"{source}: token id {int(s[1:][dup][0])} appears more than once")
    return s


def load_token_map(path: str | Path, vocab_size: int) -> torch.Tensor:
    """Read and validate a token map file (JSON list, or a torch file of a 1-D tensor or list) -> sorted int64 ids."""
    p = Path(path)
    if not p.is_file():
        raise TokenMapError(f"{p}: no such token map file")
    if p.suffix == ".json":
        try:
            ids = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TokenMapError(f"{p}: not valid JSON ({e})") from None
        if not isinstance(ids, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
            raise TokenMapError(f"{p}: a JSON token map is a list of integer ids")
    else:
        try:
            ids = torch.load(p, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 (torch raises many kinds for a bad file; all mean the same here)
            raise TokenMapError(f"{p}: not a readable torch file of token ids ({type(e).__name__}: {e})") from None
    return parse_token_ids(ids, vocab_size, str(p))


def build_token_map(counts: torch.Tensor, size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """The `size` most counted ids of counts [V] (ties: the lesser id), plus `always` (stop ids: a row whose
    target ends must be able to draft its end), sorted."""
    v = counts.numel()
    if not 1 <= size <= v:
        raise ValueError(f"token map size must be in [1, {v}], got {size}")
    must = sorted({int(i) for i in always})
    for i in must:
        if not 0 <= i < v:
            raise ValueError(f"id {i} is outside the vocabulary [0, {v})")
    if len(must) > size:
        raise ValueError(f"token map size {size} is smaller than the {len(must)} ids it must hold")
    key = counts.to(torch.float64).clone()
    key[must] = float("inf")
    order = torch.argsort(-key, stable=True)  # stable: equal counts keep id order
    return torch.sort(order[:size]).values


def save_token_map(ids: torch.Tensor, path: str | Path) -> None:
    """Write ids as a JSON list (readable, diffable; load_token_map also reads torch files), atomically
    (export.write_model_file): a write cut short leaves the old file or none, never half a map."""
    from flashpd.engine.export import write_model_json  # noqa: PLC0415 (the model stack, only when writing)
    write_model_json(path, [int(i) for i in ids])
