"""The demo pair's recipe: tokenizer, target from scratch, regenerated data, drafter, held-out tau.

One command, fixed seeds and split:  flashpd make-demo-pair --out DIR  (its output is demo pair v6 as
shipped; the run's time: docs/results.md). `--target DIR` runs the drafter's stages alone on a target the recipe made
before (how v3, v4 and v5 were made).
Text = the running interpreter's standard-library Python and the installed torch package's Python
source (no network); held-out stdlib files are never trained on and give the evaluation prompts.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Callable

import torch

from flashpd.engine.config import Qwen3Config
from flashpd.engine.export import save_drafter, save_target, write_model_file, write_model_json
from flashpd.engine.loader import load_target
from flashpd.training.progress import log_line
from flashpd.training.text_data import SPECIAL_TOKENS, corpus_files, encode_files, read_texts, split_three, \
    stdlib_files, train_tokenizer
from flashpd.training.train_drafter import DrafterTrainConfig, evaluate_tau, regenerate, train_drafter
from flashpd.training.train_target import train_target

TARGET_SHAPE = dict(vocab_size=4096, hidden_size=192, intermediate_size=512, num_hidden_layers=14,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=48, max_position_embeddings=4096,
                    rope_theta=10000.0, tie_word_embeddings=True)


def windows(stream: torch.Tensor, n: int, lo: int, hi: int, gen: torch.Generator) -> list[list[int]]:
    if stream.numel() <= hi + 1:
        raise ValueError(f"the text has {stream.numel()} tokens, too few for windows of up to {hi} tokens "
                         "(a larger max_files, or none)")
    lens = torch.randint(lo, hi + 1, (n,), generator=gen).tolist()
    starts = torch.randint(0, stream.numel() - hi - 1, (n,), generator=gen).tolist()
    return [stream[s:s + k].tolist() for s, k in zip(starts, lens)]


def heldout_windows(tok, n: int = 16, seed: int = 0, max_files: int | None = None) -> list[list[int]]:
    """The recipe's evaluation prompts: windows of 64..2048 tokens of held-out files (never trained on); of the
    first `max_files` of them if given (a quick run)."""
    held = read_texts(split_three(stdlib_files())[2][:max_files])
    stream = torch.tensor([t for ids in encode_files(tok, held) for t in ids])
    return windows(stream, n, 64, 2048, torch.Generator().manual_seed(seed + 11))


def heldout_long_prompts(tok, n: int, length: int) -> list[list[int]]:
    """n consecutive, disjoint windows of exactly `length` tokens of the held-out files (long-prompt runs)."""
    held = read_texts(split_three(stdlib_files())[2])
    stream = [t for ids in encode_files(tok, held) for t in ids]
    if len(stream) < n * length:
        raise ValueError(f"the held-out text has {len(stream)} tokens, fewer than {n} x {length}")
    return [stream[i * length:(i + 1) * length] for i in range(n)]


def make_demo_pair(out: str | Path, device: str, seed: int = 0, target_steps: int = 600, target_batch: int = 32,
                   seq_len: int = 2048, drafter_steps: int = 17000, num_prompts: int = 12288, new_tokens: int = 128,
                   heldout_prompts: int = 16, vocab_size: int = TARGET_SHAPE["vocab_size"], drafter_seqs: int = 16,
                   drafter_lr: float = 1.5e-3, corpus: str = "stdlib+torch", kl_weight: float = 0.0,
                   drafter_intermediate: int | None = 896, drafter_attention: str = "auto",
                   regen_batch: int | None = None, target_dir: str | Path | None = None,
                   drafter_gamma: float | None = 4.0, eval_tokens: int = 256, max_files: int | None = None,
                   log: Callable[[str], None] = log_line) -> dict:
    """The whole recipe into `out` (target/, drafter/, eval.json). With `target_dir`, a target this recipe
    made before (its tokenizer.json beside it) is copied in and only the drafter's stages run: the same
    split, prompts and seeds, so drafter settings compare on one target (targets of two runs differ: GPU
    training is not bit-reproducible, and a pair's acceptance depends much on its target). `max_files`: a
    quick run on the first N files of each part of the split (tokenizing the whole corpus takes most of a small
    run's time); the parts stay disjoint."""
    if max_files is not None and max_files < 1:
        raise ValueError(f"max_files must be at least 1 (got {max_files})")
    out = Path(out)
    shape = {**TARGET_SHAPE, "vocab_size": vocab_size}
    t0 = time.perf_counter()
    train_files, draft_files, held_files = (part[:max_files] for part in split_three(corpus_files(corpus)))
    texts, draft_texts, held_texts = read_texts(train_files), read_texts(draft_files), read_texts(held_files)
    if target_dir is not None:
        from tokenizers import Tokenizer  # noqa: PLC0415

        src = Path(target_dir)
        if not (src / "tokenizer.json").exists():
            raise ValueError(f"{src}: no tokenizer.json (the recipe's targets carry theirs)")
        tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    else:
        tok = train_tokenizer(texts, vocab_size)
    eos, mask = tok.token_to_id(SPECIAL_TOKENS[0]), tok.token_to_id(SPECIAL_TOKENS[1])

    def stream_of(part: list[str]) -> torch.Tensor:
        return torch.tensor([t for ids in encode_files(tok, part) for t in ids])

    stream, draft_stream, held_stream = stream_of(texts), stream_of(draft_texts), stream_of(held_texts)
    log(f"data: {len(texts)} target files ({stream.numel()} tokens), {len(draft_texts)} drafter-prompt files "
        f"({draft_stream.numel()} tokens), {len(held_texts)} held-out files ({held_stream.numel()} tokens) of {corpus}; "
        f"tokenizer {tok.get_vocab_size()} ids ({time.perf_counter() - t0:.0f} s)")

    tdir = out / "target"
    if target_dir is not None:
        if Path(target_dir).resolve() != tdir.resolve():
            shutil.copytree(target_dir, tdir, dirs_exist_ok=True)
        shape = {k: json.loads((tdir / "config.json").read_text()).get(k, v) for k, v in shape.items()}
        log(f"target reused from {target_dir}")
    else:
        cfg = Qwen3Config.from_dict({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **shape,
                                     "eos_token_id": eos})
        model = train_target(cfg, stream, steps=target_steps, batch=target_batch, seq_len=seq_len, lr=2e-3,
                             device=device, seed=seed, val_stream=draft_stream, log=log)
        log(f"target trained ({time.perf_counter() - t0:.0f} s)")
        save_target(model, tdir, dtype=torch.bfloat16)
        # compact (not indented): the shipped pair and its tokenizer must stay within 16 MB
        write_model_file(tdir / "tokenizer.json", lambda tmp: tok.save(str(tmp), pretty=False))
        write_model_json(tdir / "generation_config.json", {"eos_token_id": eos})
        del model
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    target = load_target(tdir, device, dtype)

    gen = torch.Generator().manual_seed(seed + 7)
    prompts = windows(draft_stream, num_prompts, 32, seq_len - new_tokens - 16, gen)
    data = regenerate(target, prompts, new_tokens, batch=regen_batch or (256 if device.startswith("cuda") else 32),
                      log=log)
    log(f"regenerated ({time.perf_counter() - t0:.0f} s)")
    tc = DrafterTrainConfig(layers=2, intermediate_size=drafter_intermediate, block_size=16, num_taps=5,
                            mask_token_id=mask, steps=drafter_steps,
                            seqs_per_step=drafter_seqs, anchors=128, lr=drafter_lr, seed=seed, save_every=1000,
                            gamma=drafter_gamma, kl_weight=kl_weight, attention=drafter_attention)
    drafter = train_drafter(target, data, [len(p) for p in prompts], out / "drafter-train", tc, log=log)
    log(f"drafter trained ({time.perf_counter() - t0:.0f} s)")
    ddir = save_drafter(drafter, out / "drafter", dtype=torch.bfloat16)

    held = heldout_windows(tok, heldout_prompts, seed, max_files)
    from flashpd.engine.drafter import load_drafter  # noqa: PLC0415 (reload what ships, as users will)
    rows = evaluate_tau(target, load_drafter(ddir, target), held, max_tokens=eval_tokens)
    report = {"recipe": {"seed": seed, "target_steps": None if target_dir is not None else target_steps,
                         "target_from": str(target_dir) if target_dir is not None else None, "target_batch": target_batch, "seq_len": seq_len,
                         "drafter_steps": drafter_steps, "num_prompts": num_prompts, "new_tokens": new_tokens,
                         "corpus": corpus, "max_files": max_files, "eval_tokens": eval_tokens,
                         "target_shape": shape, "drafter": {"layers": 2, "block_size": 16, "taps": 5,
                                                                    "seqs_per_step": drafter_seqs, "lr": drafter_lr,
                                                                    "kl_weight": kl_weight, "gamma": drafter_gamma,
                                                                    "attention": drafter_attention,
                                                                    "intermediate_size": drafter.cfg.intermediate_size},
                         "device": device, "dtype_eval": str(dtype)},
              "heldout": rows, "tau_mean": sum(r["tau"] for r in rows) / len(rows),
              "tau_64_mean": sum(r["tau_64"] for r in rows) / len(rows),
              "exact": f"{sum(r['exact'] for r in rows)}/{len(rows)}", "seconds": time.perf_counter() - t0}
    pos = [sum(r["position_acceptance"][k] for r in rows) / len(rows) for k in range(len(rows[0]["position_acceptance"]))]
    report["position_acceptance_mean"] = pos  # in eval.json too (it used to reach only the log)
    write_model_json(out / "eval.json", report, indent=1)
    for r in rows:
        log(f"held-out prompt {r['prompt_len']:5d} tokens: tau {r['tau']:.2f} (first 64 tokens {r['tau_64']:.2f}) "
            f"exact {r['exact']}")
    log("acceptance rate per draft position: " + " ".join(f"{x:.2f}" for x in pos))
    log(f"tau mean {report['tau_mean']:.2f} (first 64 tokens {report['tau_64_mean']:.2f}), exact {report['exact']}, total {report['seconds']:.0f} s")
    return report
