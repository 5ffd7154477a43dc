"""Token sampling: greedy, temperature with top-k / top-p, seeded per request, without a host sync.

`filtered_probs` is the one filtered distribution: what a token is drawn from and what speculative rejection
sampling compares (target p against draft q). Randomness is counter-based (see `uniforms`), so every path,
the captured device step included, draws the same tokens for a request.
"""
from __future__ import annotations

import math
import numbers
import os
import struct
from dataclasses import dataclass

import torch

from flashpd.engine import greedy_argmax

# Temperatures below this are greedy decoding. Dividing float32 logits by a temperature this small
# overflows (1e-38 gave inf - inf = NaN in the softmax and killed the engine loop), and below it a
# sampled distribution is one-hot on the argmax anyway, up to near-ties (vLLM uses the same bound).
GREEDY_BELOW = 1e-5  # compared in float32 everywhere (`SamplingParams.greedy`, the device's tensors)
_GREEDY_BELOW_F32 = float(struct.unpack("f", struct.pack("f", GREEDY_BELOW))[0])
SEED_RANGE = (-(1 << 63), 1 << 64)  # signed or unsigned 64-bit (half-open)
TOP_K_MAX = (1 << 31) - 1  # top_k travels as int32; any value past the vocabulary means off
TOP_P_MIN = 1.1754943508222875e-38  # float32's smallest normal: a smaller top_p rounds to 0 in float32


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks for. max_tokens counts every generated token, the first included.

    temperature: any finite number >= 0. Below GREEDY_BELOW (1e-5; both as float32 holds them), 0 included,
    the request is greedy (argmax; top_p, top_k and seed are unused): `greedy` is the one host test of that,
    which every greedy-or-sampled branch reads, and the device's float32 test agrees with it. Otherwise tokens
    are drawn from softmax(logits / temperature) after top-k, then top-p filtering (top_p in (0, 1]; top_k 0 =
    off, >= the vocabulary = off).

    A top_p in (0, TOP_P_MIN) is TOP_P_MIN (float32 cannot hold it, and every top_p below the most likely
    token's probability keeps that token alone: the same distribution)."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):  # a string here raised a bare TypeError below, before validate()
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise ValueError(f"{name} must be a number, got {v!r}")
        if 0 < self.top_p < TOP_P_MIN:
            object.__setattr__(self, "top_p", TOP_P_MIN)
        object.__setattr__(self, "_greedy", _greedy(self.temperature))  # read on every step of every row

    def validate(self) -> None:
        try:
            self._validate()
        except OverflowError as e:  # an int past float's range (10**400): a bad value, not a crash
            raise ValueError(f"a sampling value is out of range: {e}") from None

    def _validate(self) -> None:
        for name in ("max_tokens", "top_k", "seed"):  # a float here (2.5) used to pass and fail inside a step
            v = getattr(self, name)
            if not (v is None and name == "seed") and (isinstance(v, bool) or not isinstance(v, numbers.Integral)):
                raise ValueError(f"{name} must be an integer, got {v!r}")
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise ValueError(f"{name} must be a number, got {v!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k <= TOP_K_MAX:
            raise ValueError(f"top_k must be in [0, 2**31 - 1] (0 = off), got {self.top_k}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")

    @property
    def greedy(self) -> bool:
        """Greedy iff float32(temperature) < float32(GREEDY_BELOW): the test the device makes on its float32
        tensors, and the one a temperature that crossed the wire as float32 gets again, so a row is greedy or
        sampled alike on every path and in every batch."""
        return self._greedy


def _greedy(temperature: object) -> bool:
    try:
        t = min(temperature, 1.0)  # anything >= 1 is sampled (and float32 cannot hold 1e39)
        return struct.unpack("f", struct.pack("f", t))[0] < _GREEDY_BELOW_F32
    except (TypeError, OverflowError):  # not a number (validate() says so): no row is built from it
        return False


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                   filtered: bool = True) -> torch.Tensor:
    """Each row's filtered, renormalised distribution (float32): logits [R, ..., V]; temperature, top_p [R]
    float32 and top_k [R] int64, one request's parameters a row. The one definition every path samples from
    (host and captured device step alike), vectorised row by row. On a GPU the compiled step and the eager host
    path round the softmax and its scan in their own orders, so top-p's last kept token can differ between them
    in a row whose mass reaches top_p within those last bits (10-15 of 512 bf16 rows on an H100; the eager path
    gives a row the same set in any batch). Each token of a native row always takes the same path (its first
    eagerly, the rest in the device step); a DFlash row's steps can move between them (a confidence cut's and an
    undrafted step run eagerly), and its tokens already depend on its step widths (the randomness note below).

    Valid at any temperature (one below GREEDY_BELOW counts as GREEDY_BELOW): the logits are shifted so
    their maximum is 0 before the division, so every score is finite or -inf and the top one is exactly 0
    (no overflow, never inf - inf). Both filters rank tokens by their logits, not by the probabilities: a
    huge temperature rounds those into ties (the filters would then keep arbitrary tokens). A row with
    neither filter (top_p 1, top_k off) takes the plain softmax, whatever the other rows ask, so its values
    are the same in any batch. `filtered=False` (no row filters: the caller knows) skips the sort."""
    scores = logits.float()
    vocab = scores.shape[-1]
    shape = (-1,) + (1,) * (scores.dim() - 1)  # per-row parameters broadcast over the middle dims and V
    temp = temperature.float().clamp_min(GREEDY_BELOW).view(shape)
    plain = torch.softmax((scores - scores.amax(dim=-1, keepdim=True)) / temp, dim=-1)
    if not filtered:
        return plain
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab).view(shape)
    # one sort serves both filters; stable, so top-p splits a group of equal logits the same way on every
    # device (the lower ids first; CPU's default sort is not stable)
    ranked, order = scores.sort(dim=-1, descending=True, stable=True)
    kth = ranked.gather(-1, (k - 1).expand(*ranked.shape[:-1], 1))
    scores = scores.masked_fill(scores < kth, float("-inf"))  # top-k: ties with the k-th stay
    probs = torch.softmax((scores - scores.amax(dim=-1, keepdim=True)) / temp, dim=-1)
    sorted_probs = probs.gather(-1, order)  # top-k's dropped tokens sort last: they were the smallest
    tp = top_p.float().clamp_min(TOP_P_MIN).view(shape)  # > 0: the most likely token (mass before it 0) stays
    keep = (sorted_probs.cumsum(dim=-1) - sorted_probs < tp) | (tp >= 1.0)
    probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    on = ((top_p < 1.0) | (k.view(-1) < vocab)).view(shape)
    return torch.where(on, probs, plain)


def probs_from_logits(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """One request's filtered distribution over logits [..., V] (filtered_probs with the same parameters on
    every row)."""
    flat = logits.reshape(1, -1, logits.shape[-1])
    f = torch.tensor([temperature], dtype=torch.float32, device=logits.device)
    out = filtered_probs(flat, f, f.new_tensor([top_p]), torch.tensor([top_k], device=logits.device),
                         filtered=top_p < 1.0 or 0 < top_k < logits.shape[-1])
    return out.view(logits.shape)


# ---- counter-based randomness ----------------------------------------------------------------------
# Every random number a request uses is a hash of (its seed, the index of the token it decides, a stream,
# the vocabulary entry), not a draw from a stateful generator. So a token's draws do not depend on which
# path, batch, step or retry computes it: the captured device step samples without a host round trip and
# gives the stepwise loop's tokens, a preempted and recomputed row continues exactly as if undisturbed,
# and a seeded request retried on another worker repeats itself: a native one always, a DFlash one at the same
# draft widths and draft values (a token's value depends on where in a step it is verified, as a guess or as the
# token after the accepted ones, and on the draft's probabilities; the width policy narrows steps as the batch
# grows, and under fp8 draft weights a pass of at most 16 rows reads the fp8 values and a larger one the
# checkpoint's, so the batch a sampled request shares can change its tokens: exact in distribution either way). The
# hash is 32-bit arithmetic in int64 with multipliers below 2**31 (no overflow on any backend); `unit` makes its
# uniforms.
TOKEN, DRAFT, ACCEPT = 1, 2, 3  # streams: a token drawn from the target (or a residual), a draft guess, an accept test
_M32 = 0xFFFFFFFF


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply, multiplier 0x45d9f3b) of int64 values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _M32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def _key(seed: torch.Tensor, index: torch.Tensor, stream: int) -> torch.Tensor:
    """The 32-bit key of (seed [R] int64, token index [R, ...] int64, stream)."""
    shape = (-1,) + (1,) * (index.dim() - 1)
    s = seed.view(shape)
    k = _mix((s >> 32) & _M32)
    k = _mix(k ^ (s & _M32))
    k = _mix(k ^ (index & _M32))
    return _mix((k + stream * 0x3C6EF35F) & _M32)


def uniforms(seed: torch.Tensor, index: torch.Tensor, stream: int, vocab: int | None = None) -> torch.Tensor:
    """Uniforms in (0, 1), float32: one per (row, index) [R, ...], or with `vocab` one per entry [R, ..., vocab].

    An entry's key is the row's key XOR a hash of the entry's id: the row's key plus id x constant (the first
    form) made two rows' streams shifted copies of each other whenever their keys differed by d x constant,
    |d| < V (7.6e-5 of index pairs at Qwen3's vocabulary: a draft guess and its residual draw then shared
    their numbers)."""
    k = _key(seed, index, stream)
    return unit(k if vocab is None else entry_keys(k, vocab))


def entry_keys(k: torch.Tensor, vocab: int) -> torch.Tensor:
    """Each vocabulary entry's 32-bit key under row keys k [R, ...] -> [R, ..., vocab]."""
    v = torch.arange(vocab, dtype=torch.int64, device=k.device)
    return _mix(k[..., None] ^ _mix((v * 0x27D4EB2F + 0x165667B1) & _M32))


def unit(k: torch.Tensor) -> torch.Tensor:
    """32-bit keys -> float32 uniforms in (0, 1): (k + 1/2) / 2**32, fine near 0 (2**-33 apart there) and at
    most 1 - 2**-24. `draw` turns u into Exp(1) as -log1p(-u), so its small values are fine where the race
    needs them: the least E is 1.2e-10, and ties between entries are about V / 2**32 rare.

    Two earlier forms: midpoints of 2**24 cells, whose top one rounded to 1.0 (-log(1.0) = 0: the race took
    0 / 0 = NaN for a token of probability 0, one draw in about 110 at Qwen3's 151,936 entries); then 2**23
    cells with E = -log(u), whose least E of 6e-8 left tokens of probability below about 5e-8 almost never
    drawn and made about one draw in 110 a tie that the lower id won."""
    return ((k.float() + 0.5) * (1.0 / (1 << 32))).clamp_max(1.0 - 2.0 ** -24)


def draw(probs: torch.Tensor, seed: torch.Tensor, index: torch.Tensor, stream: int = TOKEN) -> torch.Tensor:
    """One token per distribution: probs [R, ..., V], seed [R], index [R, ...] (the token's index in
    prompt + output) -> [R, ...] int64. An exponential race, argmax(p / E) with E ~ Exp(1) per entry,
    which picks token v with probability p_v (gpt-fast samples this way) and needs no host sync."""
    # E > 0 always (u > 0); the floor holds it so under any log1p a compiler emits: 0 / 0 is NaN, which
    # argmax takes as the maximum, so a token of probability 0 would win
    e = (-torch.log1p(-uniforms(seed, index, stream, probs.shape[-1]))).clamp_min(1e-30)
    return (probs / e).argmax(dim=-1)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1) (the first maximum; the first NaN if any), computed as the maximum, then the least
    index that holds it: both reductions are exact in any order, so every kernel a compiler makes of them,
    for any shape, picks the same token by construction. (Inductor's argmax kernels also broke ties as eager
    does in every case tried on an H200: docs/results.md.)

    Each row is split into n equal chunks first: one compiled reduction over a 151,936-entry row is one
    program walking it alone (38 us on an H200, for any number of rows up to about one per SM); n is chosen
    so that all rows make about ARGMAX_PROGRAMS programs.

    Where engine/greedy_argmax.py's kernels apply (a GPU), they give the same token in one pass over the logits."""
    if greedy_argmax.applies(logits):
        return greedy_argmax.greedy_argmax(logits)
    v = logits.shape[-1]
    n = argmax_chunks(v, min(256, max(1, ARGMAX_PROGRAMS // max(1, logits.numel() // v))))
    parts = logits.reshape(*logits.shape[:-1], n, v // n)
    top = parts.amax(-1).amax(-1)[..., None, None]  # NaN if the row has one
    hit = (parts == top) | parts.isnan()
    index = torch.arange(v, device=logits.device).view(n, v // n)
    return torch.where(hit, index, v).amin(-1).amin(-1)


ARGMAX_PROGRAMS = 4096  # rows x chunks of greedy_tokens' first reduction


def argmax_chunks(v: int, most: int = 256, least: int = 512) -> int:
    """The most chunks (at most `most`, each of at least `least` entries) that split a vocabulary of v
    evenly (151,936 = 128 x 1,187); 1 where none does (a small test vocabulary)."""
    best = 1
    for n in range(2, most + 1):  # a plain loop: dynamo traces it (not max() of a generator)
        if v % n == 0 and v // n >= least:
            best = n
    return best


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                  seed: torch.Tensor, index: torch.Tensor, filtered: bool = True) -> torch.Tensor:
    """One token a row from logits [R, V]: greedy rows (temperature < GREEDY_BELOW) their argmax, the others a
    draw at token index `index` [R]."""
    probs = filtered_probs(logits, temperature, top_p, top_k, filtered)
    return torch.where(temperature < GREEDY_BELOW, greedy_tokens(logits), draw(probs, seed, index))


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


def speculative_accept(guess: torch.Tensor, q: torch.Tensor, p: torch.Tensor, width: torch.Tensor,
                       seed: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling, the one definition every path uses, vectorised over rows: guess
    [R, g] drawn from the draft distributions q [R, g, V], the target's p [R, g + 1, V], each row verifying
    width [R, 1] positions (at most width - 1 guesses count), index [R, 1] the token index of each row's first
    guess. Accepts guess k with probability min(1, p_k / q_k) (uniform at index + k, stream ACCEPT); the
    token after the a accepted ones is drawn at index + a (stream TOKEN) from norm(max(0, p_a - q_a)) after a
    rejection, else from p_a. Preserves p's distribution exactly. -> (a [R, 1], that token [R, 1])."""
    g = guess.shape[1]
    ks = torch.arange(g, device=guess.device)
    pk = p[:, :g].gather(-1, guess[..., None])[..., 0]
    qk = q.gather(-1, guess[..., None])[..., 0]
    u = uniforms(seed, index + ks, ACCEPT)
    ok = (u * qk < pk) & (ks < width - 1)
    a = ok.to(torch.int64).cumprod(1).sum(1, keepdim=True)
    pa = p.gather(1, a[..., None].expand(-1, 1, p.shape[-1]))[:, 0]  # [R, V]
    qa = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1).gather(1, a[..., None].expand(-1, 1, q.shape[-1]))[:, 0]
    rejected = a < width - 1  # a row that took every guess it could draws its bonus from p_a itself
    residual = torch.where(rejected, (pa - qa).clamp_min(0), pa)
    total = residual.sum(-1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp_min(1e-30), pa)
    return a, draw(residual[:, None], seed, index + a)


def request_seed(seed: int | None) -> int:
    """A request's seed as the int64 its draws are keyed by: its own (any value SamplingParams takes, reduced
    to 64 bits), or a fresh random one."""
    if seed is None:
        return int.from_bytes(os.urandom(8), "little", signed=True)
    seed %= 1 << 64
    return seed - (1 << 64) if seed >= 1 << 63 else seed
