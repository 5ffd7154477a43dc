"""Token sampling: greedy, temperature with top-k / top-p, seeded per request.

`probs_from_logits` is also what speculative rejection sampling compares (target p vs draft q),
so both sides of DFlash use one definition of the filtered distribution.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Temperatures below this are greedy decoding. Dividing float32 logits by a temperature this small
# overflows (1e-38 gave inf - inf = NaN in the softmax and killed the engine loop), and below it a
# sampled distribution is one-hot on the argmax anyway, up to near-ties (vLLM uses the same bound).
GREEDY_BELOW = 1e-5
SEED_RANGE = (-(1 << 63), 1 << 64)  # what torch.Generator.manual_seed takes (half-open)


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks for. max_tokens counts every generated token, the first included.

    temperature: any finite number >= 0. Below GREEDY_BELOW (1e-5), 0 included, the request is
    greedy (argmax; top_p, top_k and seed are unused): `greedy` is the one test of that, which every
    greedy-or-sampled branch reads. Otherwise tokens are drawn from softmax(logits / temperature)
    after top-k, then top-p filtering (top_p in (0, 1]; top_k 0 = off, >= the vocabulary = off)."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False

    def validate(self) -> None:
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def probs_from_logits(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """Filtered, renormalised distribution over the vocabulary (float32), rows = leading dims.

    A valid distribution for finite logits at any temperature (one below GREEDY_BELOW counts as
    GREEDY_BELOW): the logits are shifted so their maximum is 0 before the division, so every score
    is finite or -inf and the top one is exactly 0 (no overflow, never inf - inf). Both filters rank
    tokens by their logits, not by the probabilities: a huge temperature rounds those into ties (the
    filters would then keep arbitrary tokens)."""
    scores = logits.float()
    vocab = scores.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    ranked = scores  # the order of the logits, which the division below may round into ties
    scores = (scores - scores.amax(dim=-1, keepdim=True)) / max(temperature, GREEDY_BELOW)
    probs = torch.softmax(scores, dim=-1)
    if top_p < 1.0:
        order = ranked.argsort(dim=-1, descending=True)
        sorted_probs = probs.gather(-1, order)
        keep = sorted_probs.cumsum(dim=-1) - sorted_probs < top_p  # the most likely token always stays
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One sample per row of probs [..., V]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """logits [..., V] -> token ids [...]."""
    if params.greedy:
        return logits.argmax(dim=-1)
    return draw(probs_from_logits(logits, params.temperature, params.top_p, params.top_k), generator)


def step_width(width, max_tokens, emitted):
    """The width rule, the one definition every path uses: a DFlash step verifies `width` positions (the
    request's draft width under the policy's cap) or, near the end, only as many as max_tokens still admits
    (the tokens left plus the one a full acceptance never needs). Ints on the host; [B, 1] tensors of
    max_tokens and emitted tokens inside the captured device step (then `width` is the session's int)."""
    room = max_tokens - emitted + 1
    return room.clamp(1, width) if isinstance(room, torch.Tensor) else max(1, min(width, room))


def accepted_greedy(guess: torch.Tensor, truth: torch.Tensor, width: torch.Tensor | int) -> torch.Tensor:
    """The greedy acceptance rule, the one definition every path uses: how many leading guesses equal the
    target's own choice at their positions, at most width - 1. guess [B, g] (int64), truth [B, >= g] (the
    target's argmax after each verified position), width an int or [B, 1]; -> [B, 1] int64. Pure tensor ops,
    so it runs on the host and inside the captured device step alike."""
    a = (guess == truth[:, :guess.shape[1]]).to(torch.int64).cumprod(1).sum(1, keepdim=True)
    return torch.minimum(a, width - 1) if isinstance(width, torch.Tensor) else a.clamp_max(width - 1)


def rejection_sample(guesses: torch.Tensor, p: torch.Tensor, q: torch.Tensor,
                     generator: torch.Generator | None) -> tuple[int, int]:
    """Speculative sampling: guesses [g] drawn from q [g, V]; target p [g+1, V].

    Accepts guess k with probability min(1, p/q); on the first rejection draws from
    norm(max(0, p - q)), else the bonus from p's last row. Preserves p's distribution exactly.
    """
    g = guesses.shape[0]
    idx = guesses[:, None]
    pk, qk = p[:g].gather(1, idx)[:, 0], q.gather(1, idx)[:, 0]
    u = torch.rand(g, device=p.device, generator=generator)
    a = int((u * qk < pk).to(torch.int32).cumprod(0).sum())
    if a == g:
        return a, int(draw(p[g], generator))
    residual = (p[a] - q[a]).clamp_min(0)
    total = residual.sum()
    residual = residual / total if total > 0 else p[a]
    return a, int(draw(residual, generator))


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g
