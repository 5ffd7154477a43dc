"""The public Python API: `LLM(...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from flashpd.engine.config import CheckpointError
from flashpd.engine.generate import NativeGenerator
from flashpd.engine.loader import load_target
from flashpd.engine.runner import ModelRunner
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.sequence import RequestStats
from flashpd.engine.tokenizer import TextTokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    stats: RequestStats

    def as_dict(self) -> dict:
        d = {"token_ids": self.token_ids, "finish_reason": self.finish_reason, "stats": self.stats.as_dict()}
        if self.text is not None:
            d["text"] = self.text
        return d


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def kv_blocks_for(model: torch.nn.Module, block_size: int, device: torch.device, max_tokens: int | None) -> int:
    """Size the paged cache: `max_tokens` positions if given, else a share of free device memory."""
    cfg = model.cfg
    per_token = 2 * cfg.num_hidden_layers * cfg.kv_size * model.embed_tokens.weight.element_size()
    if max_tokens is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            max_tokens = int(free * 0.5) // per_token
        else:
            max_tokens = min(131072, (2 << 30) // per_token)
    return max(2, max_tokens // block_size + 1)


class LLM:
    """A target (and optionally a DFlash drafter) loaded on one device, generating in batches."""

    def __init__(self, target: str | Path, draft: str | Path | None = None, method: str | None = None,
                 block_size: int | None = None, device: str | None = None, dtype: str | torch.dtype | None = None,
                 kv_cache_tokens: int | None = None, kv_block_size: int = 16) -> None:
        self.device = torch.device(device or default_device())
        self.dtype = resolve_dtype(dtype, str(self.device))
        self.method = method or ("dflash" if draft else "native")
        if self.method not in ("native", "dflash"):
            raise ValueError(f"method must be 'native' or 'dflash', got {self.method!r}")
        if self.method == "dflash" and draft is None:
            raise ValueError("method 'dflash' needs a drafter (draft=DIR / --draft DIR)")
        self.model = load_target(target, self.device, self.dtype)
        self.tokenizer = TextTokenizer.from_dir(target)
        self.stop_ids = self.model.cfg.eos_token_ids
        self.drafter = None
        taps: tuple[int, ...] = ()
        if self.method == "dflash":
            from flashpd.engine.drafter import load_drafter  # noqa: PLC0415 (only dflash needs it)
            self.drafter = load_drafter(draft, self.model, self.device, self.dtype)
            taps = tuple(self.drafter.cfg.target_layer_ids)
            self.block_size = self.drafter.cfg.block_size if block_size is None else block_size
        else:
            if block_size not in (None, 1):
                raise ValueError(f"block_size {block_size} needs method 'dflash' and a drafter")
            self.block_size = 1
        num_blocks = kv_blocks_for(self.model, kv_block_size, self.device, kv_cache_tokens)
        self.runner = ModelRunner(self.model, num_blocks, kv_block_size, taps=taps)
        if self.drafter is not None:
            from flashpd.engine.spec_decode import DFlashGenerator  # noqa: PLC0415
            self.generator = DFlashGenerator(self.runner, self.drafter, self.stop_ids, self.block_size)
        else:
            self.generator = NativeGenerator(self.runner, self.stop_ids)

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this target has no tokenizer.json: pass token ids instead of text")
            return self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        vocab = self.model.cfg.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        return ids

    @torch.inference_mode()
    def generate(self, prompts: str | list[int] | list[str | list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        ids = [self.encode(p) for p in prompts]  # type: ignore[arg-type]
        params = sampling_params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(ids)
        seqs = self.generator.generate(ids, plist)
        return [RequestOutput(s.prompt, s.output, self.tokenizer.decode(s.output) if self.tokenizer else None,
                              s.finish_reason or "length", s.stats) for s in seqs]


__all__ = ["LLM", "RequestOutput", "SamplingParams", "CheckpointError"]
