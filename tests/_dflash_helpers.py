"""Shared helpers for the DFlash tests (test_dflash_*.py): engine over the fixture pair, native
references, override drafters, a chi-square test. Not a test module.

The trained target/drafter pair comes from tests/dflash_fixtures.py (owned elsewhere; only its
public functions are used). Everything heavy is memoised at module level, so the session
fixtures below can be imported into several test modules and still build / load once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable

import pytest
import torch

try:  # `python -m pytest` from the repo root puts the root on sys.path
    from tests.dflash_fixtures import (  # noqa: F401  (dflash_pair is re-exported as a fixture)
        MASK_TOKEN_ID, VOCAB_SIZE, Pair, dflash_pair, get_pair, plain_greedy, reference_generate,
        target_features)
except ImportError:  # plain `pytest`: tests/ itself is on sys.path (rootdir-relative imports)
    from dflash_fixtures import (  # type: ignore[no-redef]  # noqa: F401
        MASK_TOKEN_ID, VOCAB_SIZE, Pair, dflash_pair, get_pair, plain_greedy, reference_generate,
        target_features)

from flashpd.engine.drafter import DFlashDrafter, load_drafter
from flashpd.engine.generate import NativeGenerator
from flashpd.engine.loader import load_target
from flashpd.engine.qwen3 import Qwen3ForCausalLM
from flashpd.engine.runner import ModelRunner, RunnerConfig
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.sequence import Sequence
from flashpd.engine.spec_decode import DFlashGenerator, Seam
from flashpd.engine.scheduler import generate

KV_BLOCK = 16  # paged-cache block size of every runner built here


def solo_run(pair: tuple, prompt: list[int], params: SamplingParams, method: str) -> tuple[list[int], list[int]]:
    """One request alone on a fresh 256-block runner of pair = (target, drafter, taps): (its output, its DFlash
    acceptance lengths), the uninterrupted run a scheduler's request is compared with."""
    target, drafter, taps = pair
    runner = ModelRunner(target, 256, KV_BLOCK, taps=taps)
    gen = DFlashGenerator(runner, drafter, ()) if method == "dflash" else NativeGenerator(runner)
    s = generate(gen, [prompt], [params])[0]
    return s.output, s.stats.acceptance_lengths


def greedy(max_tokens: int, ignore_eos: bool = True) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)


@dataclass
class Engine:
    """flashpd's view of the fixture pair: target + drafter loaded by flashpd's loaders, one runner."""

    pair: Pair
    target: Qwen3ForCausalLM
    drafter: DFlashDrafter
    runner: ModelRunner
    _native: dict = field(default_factory=dict)

    @property
    def vocab(self) -> int:
        return self.target.cfg.vocab_size

    def dflash(self, stop_ids: Iterable[int] = (), draft_width: int | None = None, guesses=None) -> DFlashGenerator:
        """A fresh DFlashGenerator (own draft cache) on the shared runner; given `guesses` ((seq, width) ->
        width-1 tokens), one whose drafts are those instead of the drafter's (an injected Seam)."""
        seam = None if guesses is None else Seam(guesses=guesses)
        return DFlashGenerator(self.runner, self.drafter, stop_ids, draft_width, seam=seam)

    def native(self, prompts: list[list[int]], max_tokens: int | list[int], stop_ids: Iterable[int] = (),
               ignore_eos: bool = True) -> list[list[int]]:
        """Native greedy outputs of flashpd's NativeGenerator on the same runner (memoised)."""
        ms = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
        stops = frozenset(stop_ids)
        todo = [(p, m) for p, m in zip(prompts, ms) if (tuple(p), m, stops, ignore_eos) not in self._native]
        for i in range(0, len(todo), 8):
            chunk = todo[i:i + 8]
            seqs = run_checked(NativeGenerator(self.runner, stops), [p for p, _ in chunk],
                               [greedy(m, ignore_eos) for _, m in chunk])
            for (p, m), s in zip(chunk, seqs):
                self._native[(tuple(p), m, stops, ignore_eos)] = list(s.output)
        return [self._native[(tuple(p), m, stops, ignore_eos)] for p, m in zip(prompts, ms)]


_ENGINES: dict[int, Engine] = {}


def engine_for(pair: Pair, num_blocks: int = 1024) -> Engine:
    if id(pair) not in _ENGINES:
        target = load_target(pair.target_dir)
        drafter = load_drafter(pair.draft_dir, target)
        runner = ModelRunner(target, num_blocks=num_blocks, kv_block_size=KV_BLOCK,
                             taps=tuple(drafter.cfg.target_layer_ids), config=RunnerConfig(cuda_graphs=False))
        _ENGINES[id(pair)] = Engine(pair, target, drafter, runner)
    return _ENGINES[id(pair)]


@pytest.fixture(scope="session")
def dflash_engine(dflash_pair: Pair) -> Engine:  # noqa: F811  (dflash_pair is the imported fixture)
    return engine_for(dflash_pair)


def run_checked(gen, prompts: list[list[int]], params: list[SamplingParams], **kw) -> list[Sequence]:
    """generate(gen, ...) plus the invariants every run must keep: every KV block handed back,
    output within max_tokens, a finish reason, and (DFlash) sum(acceptance_lengths) == len(output) - 1."""
    alloc = gen.runner.allocator
    free_before = alloc.num_free
    seqs = generate(gen, prompts, params, **kw)
    assert alloc.num_free == free_before, f"KV blocks leaked: {free_before - alloc.num_free}"
    for s, sp in zip(seqs, params):
        assert 1 <= len(s.output) <= sp.max_tokens
        assert s.finish_reason in ("stop", "length")
        if isinstance(gen, DFlashGenerator):
            al = s.stats.acceptance_lengths
            assert sum(al) == len(s.output) - 1, (al, len(s.output))
            assert all(1 <= a <= s.draft_width for a in al), al
    return seqs


# ---- drafters that are not the model (an injected Seam) ------------------------------------------

def oracle_override(continuations: dict[tuple, list[int]], shift: int = 0, vocab: int | None = None):
    """Guesses = the target's own native continuation (shift=0) or a guaranteed-wrong token
    ((native + shift) % vocab) at every drafted position, looked up by (prompt, len(output))."""
    calls: list[int] = []

    def override(s: Sequence, w: int) -> list[int]:
        nat = continuations[tuple(s.prompt)]
        n = len(s.output)
        assert n + w - 2 < len(nat), "drafted past max_tokens"
        calls.append(w)
        g = nat[n:n + w - 1]
        return [(t + shift) % vocab for t in g] if shift else list(g)

    override.calls = calls  # type: ignore[attr-defined]
    return override


def oracle_acceptance(max_tokens: int, width: int, stop_at: int | None = None) -> list[int]:
    """Acceptance lengths of a drafter that is always right: full blocks, then the clipped remainder.
    stop_at: output index of the first stop token (the run ends after it)."""
    remaining = (max_tokens if stop_at is None else stop_at + 1) - 1
    out = []
    while remaining > 0:
        out.append(min(width, remaining))
        remaining -= out[-1]
    return out


# ---- statistics ---------------------------------------------------------------------------------

def chi2_sf(stat: float, df: int) -> float:
    """Upper tail of the chi-square distribution (P[X >= stat])."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def chi2_gof(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int, float]:
    """Goodness of fit of observed `counts` to `probs` (any shape, flattened). Cells with expected
    count < min_expected are pooled into one. A count in a zero-probability cell is an outright
    failure (p = 0). Returns (statistic, df, p-value)."""
    counts = counts.reshape(-1).double()
    probs = probs.reshape(-1).double()
    probs = probs / probs.sum()
    n = counts.sum()
    zero = probs <= 1e-12
    if counts[zero].sum() > 0:
        return math.inf, 0, 0.0
    exp = probs * n
    small = (exp < min_expected) & ~zero
    big = ~small & ~zero
    obs_cells = [counts[big]]
    exp_cells = [exp[big]]
    if small.any():
        obs_cells.append(counts[small].sum()[None])
        exp_cells.append(exp[small].sum()[None])
    o, e = torch.cat(obs_cells), torch.cat(exp_cells)
    if e.numel() > 1 and e[-1] < min_expected and small.any():  # pooled cell still tiny: merge it into the last big one
        o = torch.cat([o[:-2], (o[-2] + o[-1])[None]])
        e = torch.cat([e[:-2], (e[-2] + e[-1])[None]])
    stat = float(((o - e) ** 2 / e).sum())
    df = int(o.numel()) - 1
    return stat, df, chi2_sf(stat, df)


def chi2_two_sample(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int, float]:
    """Homogeneity test of two count vectors (same cells): are they draws from one distribution?"""
    a, b = a.reshape(-1).double(), b.reshape(-1).double()
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    na, nb = a.sum(), b.sum()
    tot = a + b
    ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
    stat = float(((a - ea) ** 2 / ea).sum() + ((b - eb) ** 2 / eb).sum())
    df = int(keep.sum()) - 1
    return stat, df, chi2_sf(stat, df)
