"""A request in flight: its tokens, its block table, its sampling state and its stats."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from flashpd.engine.kv_cache import BlockTable
from flashpd.engine.sampling import SamplingParams


@dataclass
class RequestStats:
    """Per request, the same from every step path (the device step, the two-pass seams, the confidence cut).
    acceptance_lengths: tokens committed per DFlash verify step (empty for native). No draft or verify times: the
    device step runs both passes in one graph with no sync between them, so a split would exist only on the
    two-pass paths (the benches time the passes: bench/dflash_step.py, bench/profile_step.py)."""

    acceptance_lengths: list[int] = field(default_factory=list)
    ttft_ms: float | None = None
    latency_ms: float | None = None
    # steps by guesses accepted and by guesses made (width - 1): two increments a step, where per-position
    # counters cost a loop over the width for every row of every step (the host's time at 128 rows)
    _by_accepted: list[int] = field(default_factory=list, repr=False)
    _by_guesses: list[int] = field(default_factory=list, repr=False)
    # (width, accepted) a step, beside acceptance_lengths: what `rollback` takes out of the histograms again
    _steps: list[tuple[int, int]] = field(default_factory=list, repr=False)

    def record_step(self, kept: int, width: int, accepted: int) -> None:
        """One speculative step: `kept` tokens committed, `accepted` of its width - 1 guesses taken."""
        self.acceptance_lengths.append(kept)
        acc, guesses = self._by_accepted, self._by_guesses
        if len(guesses) < width:  # accepted <= width - 1: both histograms grow together
            acc.extend([0] * (width - len(acc)))
            guesses.extend([0] * (width - len(guesses)))
        acc[accepted] += 1
        guesses[width - 1] += 1
        self._steps.append((width, accepted))

    def rollback(self, output_len: int, stepless: int = 1) -> None:
        """Drop the last steps until the rest account for an output of `output_len` tokens, the first `stepless`
        of them no step's (the prefill's first token; a resumed request's output from before it resumed): a
        rolled-back step runs again (or never, cancelled), so every count of it goes, or the redone step would be
        counted twice in the per-position acceptance."""
        al = self.acceptance_lengths
        total = sum(al)
        while al and stepless + total > output_len:
            total -= al.pop()
            self._unrecord(*self._steps.pop())

    def _unrecord(self, width: int, accepted: int) -> None:
        """Take one step out of both histograms; trailing positions no kept step drafted go too (as if never
        drafted: no position_acceptance of 0 / 0)."""
        acc, guesses = self._by_accepted, self._by_guesses
        acc[accepted] -= 1
        guesses[width - 1] -= 1
        while guesses and not guesses[-1]:  # accepted <= width - 1: acc is 0 there too
            guesses.pop()
            acc.pop()

    @property
    def position_accepts(self) -> list[int]:
        """Per draft position k (up to the widest step's guesses): the steps that accepted it."""
        return self._at_least(self._by_accepted)

    @property
    def position_drafted(self) -> list[int]:
        """Per draft position k: the steps that drafted it."""
        return self._at_least(self._by_guesses)

    def _at_least(self, hist: list[int]) -> list[int]:
        """[steps whose count exceeds k for k < the most guesses any step made] from a histogram of counts."""
        out, above = [], sum(hist)
        for k in range(len(self._by_guesses) - 1):
            above -= hist[k] if k < len(hist) else 0
            out.append(above)
        return out

    @property
    def tau(self) -> float | None:
        a = self.acceptance_lengths
        return sum(a) / len(a) if a else None

    def as_dict(self) -> dict:
        d = {"acceptance_lengths": list(self.acceptance_lengths), "tau": self.tau,
             "ttft_ms": self.ttft_ms, "latency_ms": self.latency_ms}
        if self.acceptance_lengths:
            d.update(position_acceptance=[a / n for a, n in zip(self.position_accepts, self.position_drafted)])
        return d


@dataclass
class Sequence:
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    seed: int = 0  # what its draws are keyed by (sampling.request_seed); unused by greedy requests
    table: BlockTable = field(default_factory=BlockTable)
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    t_start: float = field(default_factory=time.perf_counter)
    draft_width: int = 1  # DFlash draft width of this request (1 = native)
    draft_len: int = 0  # positions whose drafter context K/V is cached
    pending: "torch.Tensor | None" = None  # tapped target states of accepted positions not yet in the draft cache
    pending_rows: int = 0  # how many leading rows of `pending` are real
    forced_first: int | None = None  # disaggregation: the first token a prefill worker already streamed
    resumed: int = 0  # output tokens a worker that died streamed before this one resumed the request

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def last_token(self) -> int:
        return self.output[-1] if self.output else self.prompt[-1]

    def commit(self, tokens: list[int]) -> list[int]:
        """Append tokens, stopping exactly at a stop token or max_tokens; returns what was kept."""
        kept: list[int] = []
        for tok in tokens:
            if self.done:
                break
            self.output.append(tok)
            kept.append(tok)
            if not self.params.ignore_eos and tok in self.stop_ids:
                self.finish_reason = "stop"
            elif len(self.output) >= self.params.max_tokens:
                self.finish_reason = "length"
        return kept


FLOAT32_MAX = 3.4e38  # a larger finite temperature samples as this one (float32 would make it inf)


def host_values(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on `device` without a host sync: on a GPU through pinned memory, asynchronously (a copy
    from pageable memory waits for the stream, e.g. for the prefill just queued)."""
    cuda = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=cuda).to(device, non_blocking=cuda)


def row_params(seqs: list[Sequence], device: torch.device) -> tuple[torch.Tensor, ...]:
    """The rows' sampling parameters as tensors (sampling.filtered_probs, sampling.draw): temperature and
    top_p [R] float32, top_k and seed [R] int64."""
    return (host_values([min(s.params.temperature, FLOAT32_MAX) for s in seqs], torch.float32, device),
            host_values([s.params.top_p for s in seqs], torch.float32, device),
            host_values([s.params.top_k for s in seqs], torch.int64, device),
            host_values([s.seed for s in seqs], torch.int64, device))


def any_filtered(seqs: list[Sequence], vocab: int) -> bool:
    """Whether a sampled row asks for top-p or top-k (else filtered_probs may skip its sort)."""
    return any(not s.params.greedy and (s.params.top_p < 1.0 or 0 < s.params.top_k < vocab)
               for s in seqs)


def next_index(s: Sequence) -> int:
    """The index in prompt + output of the token this sequence decides next (what its draws are keyed by)."""
    return len(s.prompt) + len(s.output)
