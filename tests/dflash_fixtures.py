"""Tiny DFlash target + drafter pair for CPU tests (a helper module, not a test file).

``build_pair`` makes, deterministically and in ~12-17 s on 2 CPU cores (one thread):

* a tiny ``Qwen3ForCausalLM`` target (float32, 5 layers, vocab 128, hidden 64, 4 q / 2 kv
  heads, head_dim 16), saved with ``save_pretrained``. It is random (HF init) except for
  two hand-set attention layers that make its greedy continuation *learnable but not
  trivial*: x[t+1] == x[t+1-8] about 85% of the time, and the other steps deviate
  depending on a token 29 positions back, so deviations keep coming and never lock into a
  loop (see ``_build_target``). Top-1/top-2 logit margins: median ~50, 1st percentile
  ~0.6; held-out prompts are picked so that every greedy decision of their first 96
  tokens has margin >= 0.1. eos (126) and the mask id (127) are never emitted greedily.
* a ``dflash.model.DFlashDraftModel`` drafter (the reference class of ``dflash==0.1.0``)
  trained briefly on the target's own greedy continuations of random prompts, saved with
  ``save_pretrained`` (safetensors: fc, hidden_norm, norm, layers.*; no embed_tokens, no
  lm_head). Its drafts copy the period from the CONTEXT features (the periodic structure is
  only visible there), so acceptance exercises the context K/V path, the RoPE positions of
  context and block, and the draft-cache bookkeeping. With the reference
  ``dflash_generate`` at block 16 and 64 new tokens, acceptance lengths vary (1 to 16)
  within every prompt; tau per prompt ~2-8, mean ~3.9 over the 8 held-out prompts
  (seeds 0/1/2: 3.86/3.89/4.19).

Training recipe (what the ports agree on, see shared/design/dflash.md): for a sequence x
with target taps feats (tap j = HF hidden_states[j+1], concatenated in tap order), each
anchor a makes a block [x[a], MASK x (B-1)] at positions a..a+B-1 that sees the context
features of positions [0, a) plus its own block (bidirectional), no other block; loss = CE
at block positions k=1..B-1 against x[a+k], weighted exp(-(k-1)/gamma). All anchors of a
batch go through ONE call of the reference forward: the blocks are concatenated after the
context and an explicit boolean attention mask isolates them (``_masked_block_forward``;
test_dflash_fixture.py checks it equals the naive per-anchor call).

Use from pytest (session scope): import the fixture into conftest.py or a test module::

    from tests.dflash_fixtures import dflash_pair  # noqa: F401

or call ``get_pair(base_dir)`` / ``build_pair(tmp_dir)`` directly.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

# Geometry of the tiny pair. Tests may read these.
VOCAB_SIZE = 128
HIDDEN = 64
INTERMEDIATE = 128
TARGET_LAYERS = 5
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 16
MAX_POS = 4096
ROPE_THETA = 10000.0
RMS_EPS = 1e-6
MASK_TOKEN_ID = VOCAB_SIZE - 1
EOS_TOKEN_ID = VOCAB_SIZE - 2
# The target is a random Qwen3 with two hand-set attention layers (see _build_target):
# its greedy continuation mostly repeats the token COPY_PERIOD positions back, and
# deviates (unpredictably for a drafter) depending on the token FAR_OFFSET back.
CODE_DIMS = 32  # residual dims 0..31 carry a random N(0,1) code per token
BIAS_DIM = HIDDEN - 1  # constant in every embedding: makes q/k of the set heads token-independent
BIAS_VALUE = 4.0
COPY_PERIOD = 8
FAR_OFFSET = 29
COPY_GAIN = 3.0  # attention output scale of the copy / far heads
ATTN_SHARPNESS = 5.5  # q_norm / k_norm weight of the set heads
DEVIATION = 1.0  # lm_head weight on the far-token channel (higher: more deviations)
LM_HEAD_SCALE = 4.0  # "sharpening": scales every logit (margins), greedy choices unchanged
# Includes tap 0 (catches off-by-one on hidden_states[j+1]) and never the last
# layer (HF's last hidden_states entry is after the final norm). 3 taps, so the
# number of taps differs from the number of draft layers.
TARGET_LAYER_IDS = [0, 2, 3]
# Held-out prompt lengths (5..300).
HELDOUT_LENGTHS = [5, 12, 33, 64, 100, 157, 230, 300]
# Every greedy decision over the first HELDOUT_CHECK_TOKENS tokens of a held-out prompt has
# a top-1/top-2 logit margin of at least HELDOUT_MIN_MARGIN (no near-ties).
HELDOUT_CHECK_TOKENS = 96
HELDOUT_MIN_MARGIN = 0.1


@dataclass
class Pair:
    target_dir: Path
    draft_dir: Path
    hf_target: object  # transformers Qwen3ForCausalLM, eval, float32
    ref_drafter: object  # dflash.model.DFlashDraftModel, eval, float32
    prompts: list[list[int]]  # held-out prompts (token ids, lengths 5..300, no mask/eos id)
    block_size: int
    mask_token_id: int = MASK_TOKEN_ID
    eos_token_id: int = EOS_TOKEN_ID
    target_layer_ids: list[int] = field(default_factory=lambda: list(TARGET_LAYER_IDS))
    build_seconds: float = 0.0
    final_loss: float = float("nan")
    prompt_margins: list[float] = field(default_factory=list)  # min greedy margin per prompt


# ---------------------------------------------------------------------------
# configs / models
# ---------------------------------------------------------------------------


def target_config():
    from transformers import Qwen3Config

    cfg = Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=TARGET_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POS,
        rms_norm_eps=RMS_EPS,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        tie_word_embeddings=False,
        eos_token_id=EOS_TOKEN_ID,
        architectures=["Qwen3ForCausalLM"],
    )
    return cfg


def drafter_config(drafter_layers: int = 1, block_size: int = 16):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=drafter_layers,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POS,
        rms_norm_eps=RMS_EPS,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        tie_word_embeddings=False,
        architectures=["DFlashDraftModel"],
        num_target_layers=TARGET_LAYERS,
        block_size=block_size,
        dflash_config={
            "mask_token_id": MASK_TOKEN_ID,
            "target_layer_ids": list(TARGET_LAYER_IDS),
        },
    )


def _offset_head(attn, offset: int, out_rows: slice, in_kv_heads, gain: float):
    """Make every q head of `attn` attend (content-independently) to key position
    t - offset, and write the CODE_DIMS of that position into residual rows `out_rows`.

    q and k read only BIAS_DIM, so after q_norm/k_norm they are constant vectors; the
    k of each RoPE pair i is pre-rotated by theta_i * offset, so the score
    sum_i cos(theta_i * (t - s - offset)) peaks at s = t - offset.
    """
    half = HEAD_DIM // 2
    theta = ROPE_THETA ** (-torch.arange(half, dtype=torch.float32) / half)
    psi = theta * offset
    attn.q_proj.weight.zero_()
    attn.k_proj.weight.zero_()
    for h in range(NUM_HEADS):
        attn.q_proj.weight[h * HEAD_DIM : h * HEAD_DIM + half, BIAS_DIM] = 1.0
    for h in range(NUM_KV_HEADS):
        attn.k_proj.weight[h * HEAD_DIM : h * HEAD_DIM + half, BIAS_DIM] = torch.cos(psi)
        attn.k_proj.weight[h * HEAD_DIM + half : (h + 1) * HEAD_DIM, BIAS_DIM] = torch.sin(psi)
    attn.q_norm.weight.fill_(ATTN_SHARPNESS)
    attn.k_norm.weight.fill_(ATTN_SHARPNESS)
    attn.v_proj.weight.zero_()
    attn.v_proj.weight[:, :CODE_DIMS] = torch.eye(NUM_KV_HEADS * HEAD_DIM, CODE_DIMS)
    attn.o_proj.weight.zero_()
    groups = NUM_HEADS // NUM_KV_HEADS
    rows = list(range(out_rows.start, out_rows.stop))
    for h in range(NUM_HEADS):
        kv = h // groups
        if kv not in in_kv_heads:
            continue
        dst = rows[in_kv_heads.index(kv) * HEAD_DIM : (in_kv_heads.index(kv) + 1) * HEAD_DIM]
        for j, r in enumerate(dst):
            attn.o_proj.weight[r, h * HEAD_DIM + j] = gain / groups


def _build_target():
    """Random tiny Qwen3 (std 0.02 init) with two hand-set layers:

    * embedding: dims 0..31 a random N(0,1) code per token, BIAS_DIM = 4 for every
      token, other dims left at the random init (std 0.02);
    * layer 4 attention ("copy head"): attends to t-(COPY_PERIOD-1) and adds that
      token's code (all 32 code dims); its MLP is zeroed;
    * layer 3 attention ("far head"): attends to t-(FAR_OFFSET-1) and writes the first
      16 code dims of that token into dims 32..47;
    * lm_head: rows = token code on dims 0..31 (so logits favour the copied token,
      then the current one) + DEVIATION * random on dims 32..47 (the far token pushes
      towards some other token; ~15% of greedy steps deviate from the period), all
      times LM_HEAD_SCALE; eos and mask rows = -5 * BIAS_DIM (never the argmax).
    Layers 0..2 stay random and tiny. So x[t+1] == x[t+1-COPY_PERIOD] about 85% of the
    time, deviations keep coming (the far token is effectively random) and never
    lock into a loop. The median top1-top2 logit margin is ~50.
    """
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM(target_config()).float().eval()
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        code = torch.randn(VOCAB_SIZE, CODE_DIMS)
        emb[:, :CODE_DIMS] = code
        emb[:, BIAS_DIM] = BIAS_VALUE
        layers = model.model.layers
        _offset_head(layers[-1].self_attn, COPY_PERIOD - 1, slice(0, CODE_DIMS), [0, 1], COPY_GAIN)
        layers[-1].mlp.down_proj.weight.zero_()
        _offset_head(layers[-2].self_attn, FAR_OFFSET - 1, slice(CODE_DIMS, CODE_DIMS + 16), [0], COPY_GAIN)
        w = model.lm_head.weight
        w.zero_()
        w[:, :CODE_DIMS] = code
        w[:, CODE_DIMS : CODE_DIMS + 16] = DEVIATION * torch.randn(VOCAB_SIZE, 16)
        # The target never emits eos or the mask id greedily.
        for tok in (EOS_TOKEN_ID, MASK_TOKEN_ID):
            w[tok] = 0.0
            w[tok, BIAS_DIM] = -5.0
        w.mul_(LM_HEAD_SCALE)
    model.generation_config.eos_token_id = EOS_TOKEN_ID
    model.generation_config.pad_token_id = EOS_TOKEN_ID
    for p in model.parameters():
        p.requires_grad_(False)
    return model


# ---------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------


def _random_prompts(gen: torch.Generator, n: int, length: int) -> torch.Tensor:
    # Never the mask or eos id in a prompt.
    return torch.randint(0, VOCAB_SIZE - 2, (n, length), generator=gen)


@torch.inference_mode()
def greedy_continue(target, prompts: torch.Tensor, n_new: int) -> torch.Tensor:
    """Plain greedy continuation, one token per forward with a KV cache.

    prompts: [N, L] equal-length prompts; returns [N, L + n_new]."""
    from transformers import DynamicCache

    cache = DynamicCache(config=target.config)
    out = target(prompts, past_key_values=cache, use_cache=True, logits_to_keep=1)
    nxt = out.logits[:, -1:].argmax(-1)
    toks = [nxt]
    for _ in range(n_new - 1):
        out = target(nxt, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        toks.append(nxt)
    return torch.cat([prompts, *toks], dim=1)


@torch.no_grad()
def target_features(target, seqs: torch.Tensor, layer_ids=TARGET_LAYER_IDS) -> torch.Tensor:
    """[N, T, len(layer_ids)*H]: tap j = hidden_states[j+1], concatenated in order."""
    out = target(seqs, output_hidden_states=True, logits_to_keep=1)
    return torch.cat([out.hidden_states[j + 1] for j in layer_ids], dim=-1).float()


# ---------------------------------------------------------------------------
# training forward (all anchors of a batch in one reference forward)
# ---------------------------------------------------------------------------


def _masked_block_forward(drafter, target, seqs, feats, anchors, block_size, mask_token_id):
    """seqs [N, T] long, feats [N, T, F], anchors [N, A] long (each >= 1).

    Returns drafter hidden states [N, A, B, H] for blocks [x[a], MASK...] at
    positions a..a+B-1 seeing context [0, a) and their own block only.
    """
    n, a_cnt = anchors.shape
    b = block_size
    ctx_len = int(anchors.max())
    target_hidden = feats[:, :ctx_len]
    block_ids = torch.full((n, a_cnt, b), mask_token_id, dtype=torch.long)
    block_ids[:, :, 0] = seqs.gather(1, anchors)
    emb = F.embedding(block_ids.view(n, a_cnt * b), target.get_input_embeddings().weight)
    block_pos = (anchors[:, :, None] + torch.arange(b)).view(n, a_cnt * b)
    position_ids = torch.cat([torch.arange(ctx_len).expand(n, ctx_len), block_pos], dim=1)
    q_block = torch.arange(a_cnt).repeat_interleave(b)  # block index of each query/noise key
    ctx_visible = torch.arange(ctx_len)[None, None, :] < anchors.repeat_interleave(b, dim=1)[:, :, None]
    blk_visible = (q_block[:, None] == q_block[None, :]).expand(n, -1, -1)
    mask = torch.cat([ctx_visible, blk_visible], dim=2)[:, None]  # [N,1,Q,K] bool
    hidden = drafter(
        target_hidden=target_hidden,
        noise_embedding=emb,
        position_ids=position_ids,
        attention_mask=mask,
    )
    return hidden.view(n, a_cnt, b, -1)


def _naive_block_forward(drafter, target, seq, feats, anchor, block_size, mask_token_id):
    """The obvious per-anchor reference call (seq [T], feats [T, F]) -> [B, H]."""
    ids = torch.full((1, block_size), mask_token_id, dtype=torch.long)
    ids[0, 0] = seq[anchor]
    emb = F.embedding(ids, target.get_input_embeddings().weight)
    hidden = drafter(
        target_hidden=feats[None, :anchor],
        noise_embedding=emb,
        position_ids=torch.arange(anchor + block_size)[None],
    )
    return hidden[0]


# ---------------------------------------------------------------------------
# build
# ---------------------------------------------------------------------------


def _train_drafter(drafter, target, gen, *, steps, block_size, log=None, lr=1e-2, anchors_per_seq=8,
                   norm_init=1.0 / LM_HEAD_SCALE, per_group=24, batch_seqs=8, n_gen=64,
                   lengths=(5, 9, 16, 30, 60, 120, 200, 300)):
    t0 = time.perf_counter()
    b = block_size
    n_new = n_gen + b  # anchors cover the tokens a test generates; labels exist to a+B-1
    # Training data: groups of equal-length random prompts, target's own greedy continuation.
    lengths = list(lengths)
    groups = []
    for length in lengths:
        prompts = _random_prompts(gen, per_group, length)
        seqs = greedy_continue(target, prompts, n_new)
        groups.append((length, seqs, target_features(target, seqs[:, : length + n_gen])))
    if log is not None:
        log(f"data ready {time.perf_counter() - t0:.2f}s")

    with torch.no_grad():
        drafter.norm.weight.fill_(norm_init)
    lm_head = target.lm_head
    gamma = 7.0 if b >= 16 else 4.0
    weights = torch.exp(-torch.arange(b - 1, dtype=torch.float32) / gamma)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    drafter.train()
    loss_val = float("nan")
    for step in range(steps):
        length, all_seqs, all_feats = groups[int(torch.randint(len(groups), (1,), generator=gen))]
        pick = torch.randperm(all_seqs.shape[0], generator=gen)[:batch_seqs]
        seqs, feats = all_seqs[pick], all_feats[pick]
        n = seqs.shape[0]
        # anchor a in [L, L+n_gen): block labels x[a+1..a+B-1] all exist.
        anchors = length + torch.stack(
            [torch.randperm(n_gen, generator=gen)[:anchors_per_seq] for _ in range(n)]
        )
        anchors, _ = anchors.sort(dim=1)
        hidden = _masked_block_forward(drafter, target, seqs, feats, anchors, b, MASK_TOKEN_ID)
        logits = lm_head(hidden[:, :, 1:])  # [N, A, B-1, V]
        label_idx = anchors[:, :, None] + torch.arange(1, b)
        labels = seqs.gather(1, label_idx.view(n, -1)).view_as(label_idx)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        loss = (ce.view(labels.shape) * weights).sum(-1).mean() / weights.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        loss_val = float(loss.detach())
        if log is not None and (step % 50 == 0 or step == steps - 1):
            acc = (logits.argmax(-1) == labels).float().mean(dim=(0, 1))
            log(f"step {step} loss {loss_val:.4f} t={time.perf_counter() - t0:.2f}s "
                f"acc@k {[round(float(v), 2) for v in acc[:6]]}")
    drafter.eval()
    return loss_val


@torch.no_grad()
def greedy_margins(target, prompts: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For equal-length prompts [N, L]: the n greedy tokens [N, n] and the top-1 minus
    top-2 logit margin [N, n] of each of those decisions (full-sequence forward)."""
    length = prompts.shape[1]
    seq = greedy_continue(target, prompts, n)
    logits = target(seq[:, :-1]).logits[:, length - 1 :].float()
    top2 = logits.topk(2, dim=-1).values
    return seq[:, length:], top2[..., 0] - top2[..., 1]


def _heldout_prompts(target, seed: int):
    """One random prompt per HELDOUT_LENGTHS entry without near-ties (deterministic)."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    prompts, margins = [], []
    for n in HELDOUT_LENGTHS:
        for _ in range(10):
            cands = _random_prompts(gen, 8, n)
            m = greedy_margins(target, cands, HELDOUT_CHECK_TOKENS)[1].min(dim=1).values
            ok = (m >= HELDOUT_MIN_MARGIN).nonzero()
            if ok.numel():
                i = int(ok[0])
                prompts.append(cands[i].tolist())
                margins.append(float(m[i]))
                break
        else:  # pragma: no cover
            raise RuntimeError(f"no held-out prompt of length {n} without near-ties")
    return prompts, margins


def build_pair(
    tmp_dir: Path,
    seed: int = 0,
    train_steps: int = 450,
    drafter_layers: int = 1,
    block_size: int = 16,
    log=None,
    **train_kw,
) -> Pair:
    """Build, train and save the pair under tmp_dir/{target,drafter}. Deterministic for a seed."""
    from dflash.model import DFlashDraftModel

    t0 = time.perf_counter()
    tmp_dir = Path(tmp_dir)
    target_dir = tmp_dir / "target"
    draft_dir = tmp_dir / "drafter"
    # One thread: deterministic across machines, and far faster for these tiny ops on
    # a small shared box (2 threads oversubscribed run 10-30x slower).
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            gen = torch.Generator().manual_seed(seed + 1)
            target = _build_target()
            torch.manual_seed(seed + 2)
            drafter = DFlashDraftModel(drafter_config(drafter_layers, block_size)).float()
            # The reference class must pick these up from the config (dflash_config first).
            assert drafter.target_layer_ids == TARGET_LAYER_IDS
            assert drafter.mask_token_id == MASK_TOKEN_ID
            assert drafter.block_size == block_size
            loss = _train_drafter(drafter, target, gen, steps=train_steps, block_size=block_size,
                                  log=log, **train_kw)
            t1 = time.perf_counter()
            prompts, margins = _heldout_prompts(target, seed)
            if log is not None:
                log(f"held-out prompts {time.perf_counter() - t1:.2f}s")
    finally:
        torch.set_num_threads(prev_threads)

    target.save_pretrained(target_dir, safe_serialization=True)
    drafter.save_pretrained(draft_dir, safe_serialization=True)
    for p in drafter.parameters():
        p.requires_grad_(False)
    return Pair(
        target_dir=target_dir,
        draft_dir=draft_dir,
        hf_target=target,
        ref_drafter=drafter,
        prompts=prompts,
        block_size=block_size,
        build_seconds=time.perf_counter() - t0,
        final_loss=loss,
        prompt_margins=margins,
    )


# ---------------------------------------------------------------------------
# reference oracle
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def _cpu_safe_stats_timer():
    """dflash_generate(return_stats=True) calls torch.cuda.synchronize(), which raises
    on a CPU-only torch; swap its timer for perf_counter while it runs."""
    import dflash.model as dm

    orig = dm._cuda_time
    if not torch.cuda.is_available():
        dm._cuda_time = time.perf_counter
    try:
        yield
    finally:
        dm._cuda_time = orig


def reference_generate(pair: Pair, prompt_ids, max_new_tokens: int, block_size: int | None = None):
    """Greedy reference DFlash decode (no stop tokens).

    Returns (new token ids [exactly max_new_tokens of them], acceptance_lengths).
    Note: the reference clips the LAST acceptance length to what fits in
    max_new_tokens, and sum(acceptance_lengths) == max_new_tokens - 1 (the first
    token comes from the prefill).
    """
    from dflash.model import dflash_generate

    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    with _cpu_safe_stats_timer():
        res = dflash_generate(
            pair.ref_drafter,
            pair.hf_target,
            ids,
            max_new_tokens=max_new_tokens,
            stop_token_ids=None,
            temperature=0.0,
            block_size=pair.block_size if block_size is None else block_size,
            return_stats=True,
        )
    return res.output_ids[0, ids.shape[1]:].tolist(), list(res.acceptance_lengths)


@torch.inference_mode()
def plain_greedy(pair: Pair, prompt_ids, max_new_tokens: int) -> list[int]:
    """Plain greedy decoding of the target (one token per forward, KV cache)."""
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    return greedy_continue(pair.hf_target, ids, max_new_tokens)[0, ids.shape[1]:].tolist()


# ---------------------------------------------------------------------------
# caching / pytest fixture
# ---------------------------------------------------------------------------

_CACHE: dict[tuple, Pair] = {}


def get_pair(base_dir: Path, seed: int = 0, train_steps: int = 450, drafter_layers: int = 1,
             block_size: int = 16) -> Pair:
    """Process-wide cache of build_pair (one build per parameter set)."""
    key = (seed, train_steps, drafter_layers, block_size)
    if key not in _CACHE:
        d = Path(base_dir) / f"dflash_pair_s{seed}_n{train_steps}_l{drafter_layers}_b{block_size}"
        _CACHE[key] = build_pair(d, seed=seed, train_steps=train_steps,
                                 drafter_layers=drafter_layers, block_size=block_size)
    return _CACHE[key]


try:
    import pytest

    @pytest.fixture(scope="session")
    def dflash_pair(tmp_path_factory) -> Pair:
        return get_pair(tmp_path_factory.mktemp("dflash"))

except ImportError:  # pragma: no cover
    pass
