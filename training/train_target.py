"""Train a small Qwen3-architecture target from scratch (the demo pair's target).

Plain next-token cross-entropy over random windows of a token stream, AdamW, warmup + cosine,
bf16 autocast on a GPU. Whatever it writes is a Hugging Face Qwen3 directory.
"""
from __future__ import annotations

import math
import time
from typing import Callable

import torch
import torch.nn.functional as F

from flashpd.engine.config import Qwen3Config
from flashpd.engine.loader import dummy_target
from flashpd.engine.qwen3 import Qwen3ForCausalLM
from flashpd.training.progress import bar, log_line


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def random_windows(stream: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - length - 1, (batch,), generator=gen)
    return torch.stack([stream[s:s + length + 1] for s in starts.tolist()])


def train_target(cfg: Qwen3Config, stream: torch.Tensor, *, steps: int, batch: int, seq_len: int, lr: float,
                 device: str, seed: int = 0, val_stream: torch.Tensor | None = None, eval_every: int = 100,
                 log: Callable[[str], None] = log_line) -> Qwen3ForCausalLM:
    """stream: one long int64 token tensor (files joined by eos). Returns the trained model (float32).

    With val_stream (text the target never trains on), the loss on a fixed batch of it is logged
    every `eval_every` steps and the weights with the lowest validation loss are returned: a target
    that memorises its training files continues unseen text erratically, which no drafter predicts."""
    for name, s in (("training", stream), ("validation", val_stream)):
        if s is not None and s.numel() <= seq_len + 1:  # checked before any step: the windows cannot be drawn
            raise ValueError(f"the target's {name} text has {s.numel()} tokens, too few for {seq_len}-token windows "
                             "(more text: a larger max_files, or none)")
    torch.manual_seed(seed)
    model = dummy_target(cfg, device, torch.float32, seed=seed)
    with torch.no_grad():  # GPT-style init: smaller output projections keep early training stable
        for layer in model.layers:
            layer.self_attn.o_proj.weight.mul_(1 / math.sqrt(2 * cfg.num_hidden_layers))
            layer.mlp.down_proj.weight.mul_(1 / math.sqrt(2 * cfg.num_hidden_layers))
    model.train().requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=device == "cuda")
    gen = torch.Generator().manual_seed(seed)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else torch.autocast("cpu", enabled=False)
    val = None
    if val_stream is not None:
        val = random_windows(val_stream, min(batch, 16), seq_len, torch.Generator().manual_seed(seed + 1)).to(device)
    best: tuple[float, dict[str, torch.Tensor]] | None = None
    t0 = time.perf_counter()
    progress = bar(range(steps), desc="target", unit="step")
    for step in progress:
        x = random_windows(stream, batch, seq_len, gen).to(device, non_blocking=True)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, max(1, steps // 20))
        with amp:
            hidden, _ = model.causal_forward(x[:, :-1])
            loss = F.cross_entropy(model.logits(hidden).float().view(-1, cfg.vocab_size), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % eval_every == 0 or step == steps - 1:
            msg = f"target step {step} loss {loss.item():.4f}"
            if val is not None:
                v = validation_loss(model, val, amp)
                msg += f" val {v:.4f}"
                if best is None or v < best[0]:
                    best = (v, {k: t.detach().clone() for k, t in model.state_dict().items()})
            progress.set_postfix(loss=f"{loss.item():.3f}")
            log(f"{msg} ({time.perf_counter() - t0:.0f} s)")
    progress.close()
    if best is not None:
        model.load_state_dict(best[1])
        log(f"kept the weights with the lowest validation loss ({best[0]:.4f})")
    return model.eval().requires_grad_(False)


@torch.no_grad()
def validation_loss(model: Qwen3ForCausalLM, x: torch.Tensor, amp) -> float:
    with amp:
        hidden, _ = model.causal_forward(x[:, :-1])
        return F.cross_entropy(model.logits(hidden).float().view(-1, model.cfg.vocab_size), x[:, 1:].reshape(-1)).item()
