"""The public Python API: `LLM(...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import logging
import operator
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from flashpd.engine.config import CheckpointError
from flashpd.engine.factory import DTYPES, default_device, kv_blocks_for, resolve_dtype  # noqa: F401 (its names too)
from flashpd.engine.factory import load_engine
from flashpd.engine import scheduler
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.sequence import RequestStats
from flashpd.engine.kv_cache import blocks_needed
from flashpd.engine.warmup import SHORT_LENGTHS, lengths_for, random_prompts

log = logging.getLogger(__name__)
WARM_LENGTHS = (*SHORT_LENGTHS, 100)  # the warm-up's prompts: short ones (engine/warmup.py says why) and a padded one


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


class LLM:
    """A target (and optionally a DFlash drafter) loaded on one device (engine/factory.py's load_engine),
    generating in batches."""

    def __init__(self, target: str | Path, draft: str | Path | None = None, method: str | None = None,
                 block_size: int | None = None, device: str | None = None, dtype: str | torch.dtype | None = None,
                 kv_cache_tokens: int | None = None, kv_block_size: int = 16,
                 speculative_token_map: str | Path | None = None, speculative_quantization: str | None = None,
                 warmup: bool | None = None) -> None:
        # block_size (the contract's public spelling) is the DFlash draft width; kv_block_size the KV page size;
        # speculative_token_map (SGLang's spelling): a file of hot ids, the draft's vocabulary (engine/token_map.py);
        # speculative_quantization (vLLM's speculative_config "quantization"): "fp8" draft weights;
        # warmup: compile and capture before the first request (None: on a GPU, where that takes a minute on a cold
        # cache and otherwise lands inside the first request's TTFT: docs/results.md)
        e = load_engine(target, draft, device, dtype, kv_cache_tokens, method=method, draft_width=block_size,
                        kv_block_size=kv_block_size, token_map=speculative_token_map,
                        draft_quantization=speculative_quantization)
        self.device, self.dtype, self.method, self.block_size = e.device, e.dtype, e.method, e.draft_width
        self.model, self.tokenizer, self.stop_ids, self.drafter = e.model, e.tokenizer, e.stop_ids, e.drafter
        self.runner, self.generator = e.runner, e.generator
        # one engine (runner, KV blocks, device loop) under every call: calls from several threads run one at
        # a time (each batches its own prompts); interleaved they gave each other's tokens
        self._lock = threading.Lock()
        self.warmup_s = self._warm() if (self.device.type == "cuda" if warmup is None else warmup) else None

    @torch.inference_mode()
    def _warm(self) -> float:
        """Throwaway requests through the engine's one driver, as a worker's warm-up (engine/warmup.py) at batch 1:
        short random prompts and a longer one (WARM_LENGTHS; those a small KV cache cannot hold are skipped), greedy,
        sampled and top-p (the device step's three graphs), long enough for DFlash's verify and draft. Other shapes
        (other prompt widths, batches) still compile when first met. Returns its seconds."""
        t0 = time.perf_counter()
        n = 2 * (self.block_size or 1) + 2
        room, bs = self.runner.allocator.num_free, self.runner.kv_block_size
        # a prompt whose worst case does not fit a small KV cache is skipped, as the workers' warm-up skips it
        lengths = [t for t in lengths_for(self.runner.max_positions, n, WARM_LENGTHS)
                   if blocks_needed(t, n, self.block_size or 1, bs) + 1 <= room]
        prompts = random_prompts(lengths, self.model.cfg.vocab_size)
        log.info("warming up on %s: compiling kernels and capturing CUDA graphs (a minute or more on a cold cache, "
                 "seconds once cached)", self.device)
        for kw in ({}, dict(temperature=1.0, seed=0), dict(temperature=1.0, top_p=0.9, seed=0)):
            sp = SamplingParams(max_tokens=n, ignore_eos=True, **kw)
            for p in prompts:
                scheduler.generate(self.generator, [p], [sp])
        took = time.perf_counter() - t0
        log.info("warm in %.1f s", took)
        return took

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this target has no tokenizer.json: pass token ids instead of text")
            return self.tokenizer.encode(prompt)
        prompt = _as_seq(prompt)  # a numpy array, a torch tensor
        if not _seq(prompt):  # bytes would read as ids of their bytes; a dict as its keys
            raise ValueError(f"a prompt is a str or a list of token ids, got {type(prompt).__name__}")
        ids = []
        for t in prompt:  # int(7.9) would quietly be 7
            try:
                if isinstance(t, bool):
                    raise TypeError
                ids.append(operator.index(t))
            except TypeError:
                raise ValueError(f"prompt token ids must be integers, got {t!r}") from None
        vocab = self.model.cfg.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        return ids

    @torch.inference_mode()
    def generate(self, prompts: str | list[int] | list[str | list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        prompts = _prompt_list(prompts)
        ids = [self.encode(p) for p in prompts]
        params = SamplingParams() if sampling_params is None else sampling_params  # [] is no default: refused
        if isinstance(params, tuple):
            params = list(params)
        plist = params if isinstance(params, list) else [params] * len(ids)
        bad = [type(p).__name__ for p in plist if not isinstance(p, SamplingParams)]
        if bad:
            raise ValueError(f"sampling_params must be SamplingParams or a list of them, got {bad[0]}")
        with self._lock:
            seqs = scheduler.generate(self.generator, ids, plist)  # the engine's one driver, as a worker's
        return [RequestOutput(s.prompt, s.output, self.tokenizer.decode(s.output) if self.tokenizer else None,
                              s.finish_reason or "length", s.stats) for s in seqs]


_BYTES = (bytes, bytearray, memoryview)  # never token ids: they read as the ids of their bytes


def _seq(x: object) -> bool:
    """A sequence of items (list, tuple, range, deque, ...), not text nor bytes."""
    return isinstance(x, Sequence) and not isinstance(x, (str, *_BYTES))


def _as_seq(x: object) -> object:
    """A numpy array or a torch tensor as a list (bytes-likes left as they are, to be refused)."""
    return x.tolist() if hasattr(x, "tolist") and not isinstance(x, _BYTES) and not _seq(x) else x


def _prompt_list(prompts) -> list:
    """generate's prompts as a list of prompts: one text or one sequence of ids (a numpy array or a tensor too) is
    one prompt; a sequence of texts or of id sequences is many. bytes, a dict, a generator and the like are refused
    by name (bytes ran as the ids of their bytes)."""
    if isinstance(prompts, str):
        return [prompts]
    prompts = _as_seq(prompts)
    if not _seq(prompts):
        raise ValueError(f"prompts must be a str, a list of token ids or a list of those, got {type(prompts).__name__}")
    if not prompts:
        return []
    first = prompts[0]
    many = isinstance(first, str) or _seq(first) or isinstance(first, _BYTES) or getattr(first, "ndim", 0) >= 1
    return list(prompts) if many else [prompts]


__all__ = ["LLM", "RequestOutput", "SamplingParams", "CheckpointError"]
