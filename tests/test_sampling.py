"""Sampling parameters, the filtered distribution, seeded sampling, stop tokens and max_tokens."""
from __future__ import annotations

import pytest
import torch

from conftest import hf_greedy, hf_logits, new_runner, random_prompts
from flashpd.engine.generate import NativeGenerator
from flashpd.engine.sampling import (GREEDY_BELOW, TOP_P_MIN, SamplingParams, argmax_chunks, draw, entry_keys,
                                    filtered_probs, greedy_tokens, probs_from_logits, sample_tokens, unit)
from flashpd.engine.sequence import Sequence
from flashpd.engine.scheduler import PromptTooLong, generate

SPEC = dict(tie=False, layers=2, heads=4, kv_heads=2, hidden=64, head_dim=16, seed=30)


@pytest.fixture(scope="module")
def ckpt(make_checkpoint):
    return make_checkpoint(**SPEC)


def _generate(d, prompts, params, stop_ids=(), num_blocks=96):
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    runner = new_runner(d, num_blocks=num_blocks)
    free0 = runner.allocator.num_free
    seqs = generate(NativeGenerator(runner, stop_ids=stop_ids), prompts, params)
    assert runner.allocator.num_free == free0, "finished sequences must free their blocks"
    return seqs


# ---- greedy_tokens: argmax in two reductions -------------------------------------------------------

def test_greedy_tokens_is_argmax_first_maximum_ties_and_nan():
    """greedy_tokens gives torch.argmax's index everywhere: Qwen3's vocabulary (128 chunks), a
    vocabulary no chunking splits (one chunk), rows of many ties (integer logits in a narrow range, so the
    maximum recurs across chunks and the first must win), bf16, and NaN (argmax's maximum)."""
    assert argmax_chunks(151936) == 128 and argmax_chunks(151936, 32) == 32 and argmax_chunks(151936, 1) == 1
    assert argmax_chunks(4096) == 8 and argmax_chunks(1021) == 1
    g = torch.Generator().manual_seed(0)
    for v, dtype in ((151936, torch.bfloat16), (4096, torch.float32), (1021, torch.float32)):
        x = torch.randint(-3, 4, (3, 5, v), generator=g).to(dtype)  # each row's maximum many times over
        x[0, 0] = -1.0
        x[0, 0, v - 1] = 5.0  # the maximum only in the last chunk
        x[1, 1, 7] = float("nan")  # NaN wins
        x[2, 2] = 2.0  # every entry ties
        assert torch.equal(greedy_tokens(x), x.argmax(-1))
        for rows in (1, 4, 300):  # 128, 128 and 8 chunks at Qwen3's vocabulary
            y = torch.randn(rows, v, generator=g).to(dtype)
            assert torch.equal(greedy_tokens(y), y.argmax(-1))


# ---- SamplingParams.validate ------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(max_tokens=0), "max_tokens must be positive, got 0"),
    (dict(max_tokens=-3), "max_tokens must be positive, got -3"),
    (dict(temperature=-0.1), "temperature must be a finite number >= 0, got -0.1"),
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0, got nan"),
    (dict(temperature=float("inf")), "temperature must be a finite number >= 0, got inf"),
    (dict(top_p=float("nan")), r"top_p must be in \(0, 1\], got nan"),
    (dict(seed=1 << 64), r"seed must be in \[-2\*\*63, 2\*\*64\)"),
    (dict(seed=-(1 << 63) - 1), r"seed must be in \[-2\*\*63, 2\*\*64\)"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (dict(top_p=1.01), r"top_p must be in \(0, 1\], got 1.01"),
    (dict(top_p=-0.5), r"top_p must be in \(0, 1\], got -0.5"),
    (dict(top_k=-1), r"top_k must be in \[0, 2\*\*31 - 1\] \(0 = off\), got -1"),
    (dict(top_k=1 << 31), r"top_k must be in \[0, 2\*\*31 - 1\] \(0 = off\), got 2147483648"),
    (dict(top_k=1 << 64), r"top_k must be in \[0, 2\*\*31 - 1\]"),
])
def test_validate_rejects(kwargs, match, ckpt):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs).validate()
    # and generation refuses the request before running anything
    with pytest.raises(ValueError, match=match):
        _generate(ckpt[1], [[1, 2, 3]], SamplingParams(**kwargs))


@pytest.mark.parametrize("kwargs", [dict(), dict(max_tokens=1), dict(temperature=0.0), dict(top_p=1.0),
                                    dict(top_p=1e-9), dict(top_k=0), dict(top_k=1), dict(temperature=2.5),
                                    dict(temperature=1e-45), dict(temperature=1e-40), dict(temperature=3.4e38),
                                    dict(top_k=(1 << 31) - 1), dict(seed=(1 << 64) - 1), dict(seed=-(1 << 63))])
def test_validate_accepts(kwargs):
    SamplingParams(**kwargs).validate()


def test_a_top_p_float32_cannot_hold_is_its_smallest_normal_and_keeps_the_top_token():
    assert SamplingParams(top_p=1e-50).top_p == TOP_P_MIN == float(torch.tensor(TOP_P_MIN, dtype=torch.float32))
    assert SamplingParams(top_p=1e-30).top_p == 1e-30 and SamplingParams(top_p=0.0).top_p == 0.0  # 0 stays invalid
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    for tp in (0.0, 1e-50):  # even a tensor holding 0 keeps the most likely token
        probs = filtered_probs(logits, torch.tensor([1.0]), torch.tensor([tp]), torch.tensor([0]))
        assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_greedy_property():
    assert SamplingParams().greedy and SamplingParams(temperature=0.0, top_k=5).greedy
    assert not SamplingParams(temperature=0.8).greedy
    # below GREEDY_BELOW a temperature is greedy (dividing by it would overflow float32)
    assert GREEDY_BELOW == 1e-5
    for t in (1e-45, 1e-40, 1e-38, 1e-30, 1e-6, 9.99e-6):
        assert SamplingParams(temperature=t, seed=3).greedy, t
    assert not SamplingParams(temperature=1e-5).greedy and not SamplingParams(temperature=1e30).greedy


# ---- probs_from_logits ------------------------------------------------------------------------

def _reference_probs(logits: torch.Tensor, t: float, top_p: float, top_k: int) -> torch.Tensor:
    """Plain per-row Python version of top-k then top-p filtering (HF order), float64."""
    out = torch.zeros(logits.shape, dtype=torch.float64)
    flat_in, flat_out = logits.reshape(-1, logits.shape[-1]).double(), out.view(-1, logits.shape[-1])
    for r in range(flat_in.shape[0]):
        s = flat_in[r] / t
        order = sorted(range(len(s)), key=lambda i: -s[i].item())
        if 0 < top_k < len(s):
            order = order[:top_k]
        p = torch.softmax(s[order], dim=0)
        kept, mass = [], 0.0
        for i, pi in zip(order, p.tolist()):
            if mass >= top_p:
                break
            kept.append((i, pi))
            mass += pi
        z = sum(pi for _, pi in kept)
        for i, pi in kept:
            flat_out[r, i] = pi / z
    return out


@pytest.mark.parametrize("t,top_p,top_k", [(1.0, 1.0, 0), (0.7, 1.0, 0), (1.0, 1.0, 5), (0.8, 0.9, 0),
                                           (0.8, 0.5, 12), (1.3, 0.95, 40), (1.0, 1e-6, 0), (1.0, 1.0, 1)])
def test_probs_from_logits_against_reference(t, top_p, top_k):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 64, generator=g) * 3
    probs = probs_from_logits(logits, t, top_p, top_k)
    assert probs.shape == logits.shape and probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 3), rtol=0, atol=1e-5)
    torch.testing.assert_close(probs.double(), _reference_probs(logits, t, top_p, top_k), rtol=0, atol=1e-6)
    nonzero = (probs > 0).sum(-1)
    if top_k:
        assert (nonzero <= top_k).all()
        top = logits.topk(top_k, dim=-1).indices
        outside = torch.ones_like(probs, dtype=torch.bool).scatter(-1, top, False)
        assert (probs[outside] == 0).all()
    if top_k == 0 and top_p == 1.0:
        torch.testing.assert_close(probs, torch.softmax(logits / t, -1), rtol=0, atol=1e-6)
        assert (nonzero == 64).all()
    if top_p == 1e-6 or top_k == 1:
        assert (nonzero == 1).all()
        assert torch.equal(probs.argmax(-1), logits.argmax(-1))


def test_top_k_zero_outside_exactly_k():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0, 2.5, 0.0]])
    p = probs_from_logits(logits, 1.0, top_k=3)
    assert (p[0, [0, 2, 5]] == 0).all()
    e = torch.exp(torch.tensor([3.0, 2.0, 2.5]))
    torch.testing.assert_close(p[0, [1, 3, 4]], e / e.sum())
    # top_k >= vocab keeps everything
    torch.testing.assert_close(probs_from_logits(logits, 1.0, top_k=6), torch.softmax(logits, -1))


EXTREME_T = [0.0, 1e-45, 1e-40, 1e-38, 1e-30, 1e-6, 1e-5, 1e-4, 1.0, 1e30, 3.4e38]
FILTERS = [(1.0, 0), (1e-9, 0), (1e-45, 0), (0.5, 0), (1.0, 1), (1.0, 3), (0.9, 5), (1.0, (1 << 31) - 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1.0, 30.0, 3e4])
def test_probs_from_logits_is_a_distribution_at_any_temperature(dtype, scale):
    """Finite, >= 0, rows summing to 1 and accepted by multinomial, for every temperature a request may
    carry and every filter; 1e-38 used to give NaN (logits / t overflowed to inf, then inf - inf)."""
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(3, 64, generator=g) * scale).clamp(-3e4, 3e4)
    logits[:, 7] = 2 * logits.abs().max()  # one clear maximum per row (ties make the argmax ambiguous)
    logits = logits.to(dtype)
    for t in EXTREME_T:
        for top_p, top_k in FILTERS:
            p = probs_from_logits(logits, t, top_p, top_k)
            assert p.dtype == torch.float32 and torch.isfinite(p).all() and (p >= 0).all(), (t, top_p, top_k)
            torch.testing.assert_close(p.sum(-1), torch.ones(3), rtol=0, atol=1e-5)
            tok = draw(p, torch.zeros(3, dtype=torch.int64), torch.arange(3))
            assert (p.gather(-1, tok[:, None]) > 0).all()
            if t < GREEDY_BELOW or top_k == 1 or top_p < 1e-6:
                assert torch.equal(p.argmax(-1), logits.float().argmax(-1)) and (p.max(-1).values > 0.99).all()
            if top_k and top_k < 64 and top_p == 1.0:  # chosen on the logits (ties included), whatever t is
                kept = logits.float() >= logits.float().topk(top_k, dim=-1).values[:, -1:]
                assert not (p > 0)[~kept].any(), (t, top_k)
                if t >= 1e30:  # flat: every kept token has mass, and only those
                    assert torch.equal(p > 0, kept), (t, top_k)


def test_huge_temperature_is_near_uniform_and_tiny_is_argmax():
    logits = torch.tensor([[2.0, -1.0, 5.0, 0.5]])
    torch.testing.assert_close(probs_from_logits(logits, 1e30), torch.full((1, 4), 0.25))
    torch.testing.assert_close(probs_from_logits(logits, 1e30, top_k=2), torch.tensor([[0.5, 0.0, 0.5, 0.0]]))
    for t in (1e-40, 1e-6):
        assert probs_from_logits(logits, t).tolist() == [[0.0, 0.0, 1.0, 0.0]]
        one = torch.tensor([1])
        assert sample_tokens(logits, torch.tensor([t]), torch.tensor([1.0]), one * 0, one, one).tolist() == [2]
        # sampled, not greedy, just above the bound: the one-hot distribution still gives the argmax
        assert sample_tokens(logits, torch.tensor([2e-5]), torch.tensor([1.0]), one * 0, one, one).tolist() == [2]


def test_uniforms_stay_inside_zero_one_and_are_fine_near_zero():
    """Every 32-bit key maps to a float32 uniform in (0, 1) whose E = -log1p(-u) is finite and positive (a
    uniform of 1.0 made the exponential race divide 0 by 0). Near 0, where the race's winners are, keys keep
    their order and E is -log1p(-(k + 1/2) / 2**32): a coarser grid there (least E 6e-8) left tokens of probability
    below about 5e-8 almost never drawn, and made ties that the lower id won."""
    k = torch.tensor([0, 1, 511, 512, (1 << 31), (1 << 32) - 513, (1 << 32) - 512, (1 << 32) - 1])
    u = unit(k)
    assert u.dtype == torch.float32 and bool((u > 0).all()) and bool((u < 1).all()), u.tolist()
    e = -torch.log1p(-u)
    assert bool(torch.isfinite(e).all()) and bool((e > 0).all())
    assert u[-1].item() == 1 - 2 ** -24 and u[0].item() == 2 ** -33
    low = torch.arange(1 << 20)
    e = -torch.log1p(-unit(low))
    assert bool((e[1:] > e[:-1]).all())  # distinct and in order: no ties among the smallest keys
    torch.testing.assert_close(e.double(), -torch.log1p(-(low.double() + 0.5) / 2 ** 32), rtol=1e-6, atol=0)


def test_entry_streams_are_not_shifted_copies():
    """Two row keys that differ by d times the entry constant gave the same entry keys shifted by d (a draft
    guess and its residual draw could share their numbers). Now they share no more than chance does."""
    k1 = torch.tensor([123456789])
    for d in (1, 7, -86187):
        k2 = (k1 + d * 0x27D4EB2F) & 0xFFFFFFFF
        a, b = entry_keys(k1, 4096)[0], entry_keys(k2, 4096)[0]
        shifted = a[max(d, 0):4096 + min(d, 0)] == b[max(-d, 0):4096 - max(d, 0)] if abs(d) < 4096 else None
        if shifted is not None:
            assert int(shifted.sum()) <= 2, d
        assert len(set(a.tolist()) & set(b.tolist())) <= 3, d  # 4096**2 / 2**32 = 0.004 expected
    # 100 random pairs and shifts: no entry lines up (XOR with id x constant, unhashed, left 7 a pair at 151,936 ids)
    g = torch.Generator().manual_seed(2)
    same = 0
    for _ in range(100):
        k1 = torch.randint(0, 1 << 32, (1,), generator=g)
        d = int(torch.randint(-4095, 4096, (1,), generator=g))
        a, b = entry_keys(k1, 4096)[0], entry_keys((k1 + d * 0x27D4EB2F) & 0xFFFFFFFF, 4096)[0]
        lo, hi = max(d, 0), 4096 + min(d, 0)
        same += int((a[lo:hi] == b[lo - d:hi - d]).sum())
    assert same == 0


def test_a_token_of_probability_zero_is_never_drawn():
    """A one-hot distribution (top-k 1 at any temperature, a residual with one survivor) draws its token for
    every seed. When the top uniform rounded to 1.0, about one seed in 2,900 drew another token here (4,096
    entries; one in 110 at Qwen3's)."""
    n, v = 20000, 4096
    probs = torch.zeros(n, v)
    probs[:, 7] = 1.0
    seeds = torch.arange(n, dtype=torch.int64)
    for index in (0, 1):
        assert bool((draw(probs, seeds, torch.full((n,), index)) == 7).all())
    one = torch.ones(n, dtype=torch.int64)  # the same through the filters: top_k 1 at a huge temperature
    logits = torch.randn(n // 10, v, generator=torch.Generator().manual_seed(3))
    r = logits.shape[0]
    tok = sample_tokens(logits, torch.full((r,), 1e30), torch.ones(r), one[:r], seeds[:r], one[:r])
    assert torch.equal(tok, logits.argmax(-1))


def test_greedy_is_decided_in_float32_on_host_and_device():
    """`SamplingParams.greedy` and the device's float32 test agree at and around the bound, so a row is greedy
    or sampled alike whatever shares its batch and whichever path (the wire's float32 included) it took."""
    bound = torch.tensor(GREEDY_BELOW, dtype=torch.float32).item()
    ts = [0.0, 1e-40, 9.9999993e-06, 9.9999995e-06, 9.9999999e-06, bound, GREEDY_BELOW, 1.00000001e-05, 0.7, 3e38,
          torch.nextafter(torch.tensor(bound), torch.tensor(0.0)).item()]
    for t in ts:
        device = bool(torch.tensor([t], dtype=torch.float32) < GREEDY_BELOW)
        assert SamplingParams(temperature=t).greedy == device, t
        wire = torch.tensor(t, dtype=torch.float32).item()  # what a float32 proto field carries
        assert SamplingParams(temperature=wire).greedy == device, t
    # a row on the bound's float32 side that float64 called greedy: sampled alone and beside a sampled row alike
    t = 9.9999999e-06
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    seeds, index = torch.tensor([5, 6]), torch.tensor([10, 10])
    for i in range(40):
        alone = sample_tokens(logits[:1], torch.tensor([t]), torch.ones(1), torch.zeros(1, dtype=torch.int64),
                              seeds[:1], index[:1] + i)
        both = sample_tokens(logits, torch.tensor([t, 0.8]), torch.ones(2), torch.zeros(2, dtype=torch.int64),
                             seeds, index + i)
        assert alone[0] == both[0]


def test_top_p_splits_ties_by_id_on_every_device():
    """Top-p keeps the lower ids of a group of equal logits it cuts (a stable sort), not whatever order the
    device's sort left them in."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randint(0, 4, (64, 300), generator=g).float()  # many ties at every level
    top_p = torch.rand(64, generator=g) * 0.9 + 0.05
    p = filtered_probs(logits, torch.ones(64), top_p, torch.zeros(64, dtype=torch.int64))
    for row, tp in zip(range(64), top_p.tolist()):
        order = sorted(range(300), key=lambda i: (-logits[row, i].item(), i))
        soft = torch.softmax(logits[row], -1).double()
        mass, kept = 0.0, []
        for i in order:
            if mass < tp:
                kept.append(i)
            mass += soft[i].item()
        assert sorted((p[row] > 0).nonzero().view(-1).tolist()) == sorted(kept), row


def test_extreme_temperatures_through_the_generator(ckpt):
    """A batch mixing tiny, huge and ordinary temperatures runs to the end; the tiny ones are greedy."""
    hf, d = ckpt
    prompts = random_prompts([6, 20, 9, 13, 30], hf.config.vocab_size, seed=39)
    temps = [1e-40, 1e-38, 0.8, 1e30, 1e-6]
    params = [SamplingParams(max_tokens=16, temperature=t, seed=i, ignore_eos=True) for i, t in enumerate(temps)]
    seqs = _generate(d, prompts, params)
    for s, p, t in zip(seqs, prompts, temps):
        assert len(s.output) == 16 and all(0 <= x < hf.config.vocab_size for x in s.output)
        if t < GREEDY_BELOW:
            assert s.output == hf_greedy(hf, p, 16), t


# ---- sampling through NativeGenerator -------------------------------------------------------

SAMPLED = dict(max_tokens=32, temperature=0.8, top_k=20, top_p=0.9, ignore_eos=True)


def test_seeded_sampling_is_reproducible(ckpt):
    hf, d = ckpt
    prompts = random_prompts([9, 40], hf.config.vocab_size, seed=31)
    p = SamplingParams(seed=1234, **SAMPLED)
    a = [s.output for s in _generate(d, prompts, p)]
    b = [s.output for s in _generate(d, prompts, p)]
    assert a == b
    assert all(len(x) == 32 for x in a)
    # another seed gives another stream; sampling is not greedy decoding here
    c = [s.output for s in _generate(d, prompts, SamplingParams(seed=99, **SAMPLED))]
    assert c != a
    greedy = [hf_greedy(hf, q, 32) for q in prompts]
    assert a != greedy
    # the seed belongs to the request: alone, or next to other (differently seeded) requests
    alone = _generate(d, [prompts[1]], p)[0].output
    assert alone == a[1]
    mixed = _generate(d, [prompts[0], prompts[1], prompts[0]],
                      [SamplingParams(seed=7, **SAMPLED), p, SamplingParams(**{**SAMPLED, "temperature": 0.0})])
    assert mixed[1].output == a[1]
    assert mixed[2].output == greedy[0]   # a greedy row in a sampled batch stays greedy


def test_sampled_tokens_lie_in_the_filtered_support(ckpt):
    """Every sampled token is one the filter keeps, judged on HF's logits at that position."""
    hf, d = ckpt
    prompts = random_prompts([5, 17, 60], hf.config.vocab_size, seed=32)
    params = SamplingParams(seed=5, max_tokens=24, temperature=1.0, top_k=4, top_p=0.8, ignore_eos=True)
    for s, prompt in zip(_generate(d, prompts, params), prompts):
        logits = hf_logits(hf, prompt + s.output)[len(prompt) - 1:-1]
        allowed = probs_from_logits(logits, 1.0, 0.8, 4) > 0
        assert allowed.sum(-1).max() <= 4
        for k, tok in enumerate(s.output):
            assert allowed[k, tok], f"step {k}: token {tok} outside the top-k/top-p set"
        assert len(set(s.output)) > 1


@pytest.mark.parametrize("extra", [dict(top_k=1), dict(top_p=1e-6), dict(top_k=1, top_p=0.5), dict(top_p=1e-50),
                                   dict(top_p=5e-324)])
def test_degenerate_filters_equal_greedy(ckpt, extra):
    """top_p below float32's smallest normal is that normal (float32 would hold 0 and keep no token)."""
    hf, d = ckpt
    prompts = random_prompts([1, 7, 64], hf.config.vocab_size, seed=33)
    params = SamplingParams(max_tokens=32, temperature=0.8, seed=11, ignore_eos=True, **extra)
    out = [s.output for s in _generate(d, prompts, params)]
    assert out == [hf_greedy(hf, p, 32) for p in prompts]


# ---- stop tokens and max_tokens ---------------------------------------------------------------

def test_commit_stops_at_the_first_stop_token_of_a_multi_token_step():
    """What a speculative step commits: tokens up to and including a stop token, or up to max_tokens."""
    s = Sequence([1, 2], SamplingParams(max_tokens=10), frozenset({7, 9}))
    assert s.commit([3, 4]) == [3, 4] and not s.done
    assert s.commit([5, 7, 8, 9]) == [5, 7]
    assert s.output == [3, 4, 5, 7] and s.finish_reason == "stop" and s.last_token == 7
    assert s.commit([6]) == [] and s.output == [3, 4, 5, 7]   # nothing after finishing

    s = Sequence([1], SamplingParams(max_tokens=3), frozenset({7}))
    assert s.commit([3, 4, 5, 6]) == [3, 4, 5] and s.finish_reason == "length"

    s = Sequence([1], SamplingParams(max_tokens=3, ignore_eos=True), frozenset({7}))
    assert s.last_token == 1
    assert s.commit([7, 7, 7, 7]) == [7, 7, 7] and s.finish_reason == "length"


def _first_new_at(tokens, start):
    """Index k >= start of a token that does not occur before k."""
    return next(k for k in range(start, len(tokens)) if tokens[k] not in tokens[:k])


def test_stops_exactly_at_a_stop_token(ckpt):
    hf, d = ckpt
    (prompt,) = random_prompts([12], hf.config.vocab_size, seed=34)
    ref = hf_greedy(hf, prompt, 40)
    k = _first_new_at(ref, 6)
    eos = ref[k]
    (s,) = _generate(d, [prompt], SamplingParams(max_tokens=40), stop_ids=[eos])
    assert s.output == ref[:k + 1]          # the stop token is the last token, included
    assert s.output[-1] == eos and s.finish_reason == "stop"
    # ignore_eos runs on to max_tokens through the same token
    (s,) = _generate(d, [prompt], SamplingParams(max_tokens=40, ignore_eos=True), stop_ids=[eos])
    assert s.output == ref and s.finish_reason == "length"
    # the earliest of several stop tokens wins
    k2 = _first_new_at(ref, k + 1)
    (s,) = _generate(d, [prompt], SamplingParams(max_tokens=40), stop_ids=[ref[k2], eos])
    assert s.output == ref[:k + 1] and s.finish_reason == "stop"
    # a stop token after max_tokens does not matter
    (s,) = _generate(d, [prompt], SamplingParams(max_tokens=k), stop_ids=[eos])
    assert s.output == ref[:k] and s.finish_reason == "length"
    # a stop token exactly at max_tokens is reported as a stop
    (s,) = _generate(d, [prompt], SamplingParams(max_tokens=k + 1), stop_ids=[eos])
    assert s.output == ref[:k + 1] and s.finish_reason == "stop"


def test_stop_on_the_first_token(ckpt):
    hf, d = ckpt
    (prompt,) = random_prompts([20], hf.config.vocab_size, seed=35)
    first = hf_logits(hf, prompt)[-1].argmax().item()
    (s,) = _generate(d, [prompt], SamplingParams(max_tokens=16), stop_ids=[first])
    assert s.output == [first] and s.finish_reason == "stop"


def test_one_sequence_stopping_does_not_disturb_the_batch(ckpt):
    hf, d = ckpt
    prompts = random_prompts([12, 33, 4], hf.config.vocab_size, seed=36)
    refs = [hf_greedy(hf, p, 30) for p in prompts]
    k = _first_new_at(refs[0], 4)
    eos = refs[0][k]
    seqs = _generate(d, prompts, SamplingParams(max_tokens=30), stop_ids=[eos])
    assert seqs[0].output == refs[0][:k + 1] and seqs[0].finish_reason == "stop"
    for s, r in zip(seqs[1:], refs[1:]):
        cut = r.index(eos) + 1 if eos in r else len(r)
        assert s.output == r[:cut]
        assert s.finish_reason == ("stop" if eos in r else "length")


@pytest.mark.parametrize("max_tokens", [1, 2, 5])
def test_max_tokens_counts_the_first_token(ckpt, max_tokens):
    hf, d = ckpt
    prompts = random_prompts([1, 30], hf.config.vocab_size, seed=37)
    runner = new_runner(d, num_blocks=16)
    calls = []
    forward = runner.forward
    runner.forward = lambda *a, **k: calls.append(len(a[0])) or forward(*a, **k)
    gen = NativeGenerator(runner)
    gen.device_loop = False  # the stepwise loop, whose steps are counted here (test_device_loop.py: the other)
    seqs = generate(gen, prompts, [SamplingParams(max_tokens=max_tokens)] * 2)
    for s, p in zip(seqs, prompts):
        assert s.output == hf_greedy(hf, p, max_tokens)
        assert s.finish_reason == "length"
    steps = gen._loop.single_steps if gen._loop is not None else 0
    assert (len(calls), steps) == (1, max_tokens - 1)  # one prefill forward, then max_tokens - 1 decode steps
    assert runner.allocator.num_free == 15


def test_max_tokens_one_sampled(ckpt):
    hf, d = ckpt
    (prompt,) = random_prompts([10], hf.config.vocab_size, seed=38)
    (s,) = _generate(d, [prompt], SamplingParams(max_tokens=1, temperature=1.0, top_k=3, seed=2))
    assert len(s.output) == 1 and s.finish_reason == "length"
    assert s.output[0] in hf_logits(hf, prompt)[-1].topk(3).indices.tolist()


def test_generate_refuses_bad_requests(ckpt):
    hf, d = ckpt
    with pytest.raises(ValueError, match="empty"):
        _generate(d, [[]], SamplingParams())
    with pytest.raises(ValueError, match="exceeds"):   # max_pos is 1024
        _generate(d, [[1] * 1000], SamplingParams(max_tokens=64), num_blocks=128)
    with pytest.raises(PromptTooLong, match="KV cache has 7"):  # one request that can never fit
        _generate(d, [[1] * 100], SamplingParams(max_tokens=64), num_blocks=8)


def test_generate_queues_a_batch_larger_than_the_cache(ckpt):
    """Requests that fit one at a time but not together wait for room (the scheduler's reserve policy) and
    come out as each would alone."""
    hf, d = ckpt
    prompts = random_prompts([40, 33, 47], hf.config.vocab_size, seed=39)
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    seqs = _generate(d, prompts, sp, num_blocks=9)  # each needs 4 blocks of the 8 usable: two at a time
    for s, p in zip(seqs, prompts):
        assert s.output == hf_greedy(hf, p, 20)


def test_a_sampling_value_that_is_not_a_number_is_a_valueerror_at_construction():
    """SamplingParams(top_p="1") raised a bare TypeError from its own constructor, before validate() could name it."""
    for kw in (dict(top_p="1"), dict(temperature="hot"), dict(temperature=None), dict(top_p=True)):
        with pytest.raises(ValueError, match="must be a number"):
            SamplingParams(**kw)
