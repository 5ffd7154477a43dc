"""Load a target (and optionally a DFlash drafter) onto one device, ready to generate.

`load_engine(...)` is what the public `flashpd.LLM` and the service's workers
(cluster/worker_main.py) build themselves from: the model, its tokenizer and stop ids, the
drafter, a `ModelRunner` with a paged KV cache sized by `kv_blocks_for`, and a generator.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from flashpd.engine.config import CheckpointError
from flashpd.engine.generate import NativeGenerator
from flashpd.engine.loader import Stamps, checkpoint_stamps, load_target, loaded_unchanged
from flashpd.engine.runner import ModelRunner, RunnerConfig
from flashpd.engine.tokenizer import TextTokenizer

if TYPE_CHECKING:
    from flashpd.engine.drafter import DFlashDrafter
    from flashpd.engine.qwen3 import Qwen3ForCausalLM
    from flashpd.engine.width_policy import WidthPolicy

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device to load on (None: cuda when available), or a ValueError naming it: torch's own error for an
    unknown name, and an assertion deep in the loader for cuda on a machine without one, were no message for a
    user."""
    try:
        dev = torch.device(device or default_device())
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r}: not a device name ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: this machine has no CUDA device (or torch is a CPU build)")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: flashpd runs on 'cpu' or 'cuda'")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def memory_bytes(device: torch.device) -> int:
    """All the memory of `device` (a GPU's, or the host's physical memory for the CPU): what no cache can exceed."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits(name: str, nbytes: int, device: torch.device, what: str = "") -> None:
    """A ValueError naming `name` when nbytes exceed all of the device's memory: a cache sized past it failed deep
    in an allocator with a traceback (or, for a host tier, grew until the machine ran out of memory)."""
    total = memory_bytes(device)
    if nbytes > total:
        raise ValueError(f"{name}: {what or f'{nbytes} bytes'} need {nbytes / 2 ** 30:.1f} GiB, more than the "
                         f"{total / 2 ** 30:.1f} GiB {device.type} memory of this machine")


def kv_blocks_for(model: torch.nn.Module, kv_block_size: int, device: torch.device, max_tokens: int | None) -> int:
    """Size the paged cache: `max_tokens` positions if given (refused past the device's memory), else a share of
    free device memory."""
    cfg = model.cfg
    per_token = 2 * cfg.num_hidden_layers * cfg.kv_size * model.embed_tokens.weight.element_size()
    given = max_tokens is not None
    if max_tokens is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            max_tokens = int(free * 0.5) // per_token
        else:
            max_tokens = min(131072, (2 << 30) // per_token)
    blocks = max(2, max_tokens // kv_block_size + 1)
    check_fits("kv_cache_tokens" if given else "kv_block_size", blocks * kv_block_size * per_token, device,
               f"{blocks} blocks of {kv_block_size} positions of the target's KV")
    return blocks


@dataclass
class EngineParts:
    """A loaded model pair: what `LLM` and the service's workers use of it."""
    device: torch.device
    dtype: torch.dtype
    method: str  # "native" | "dflash"
    draft_width: int  # DFlash's draft width (1 for native)
    model: Qwen3ForCausalLM
    tokenizer: TextTokenizer | None
    stop_ids: tuple[int, ...]
    drafter: DFlashDrafter | None
    runner: ModelRunner
    generator: NativeGenerator  # a DFlashGenerator when there is a drafter
    # the target's and drafter's files as they were when loaded (loader.checkpoint_stamps; () for none): a cache
    # identity hashed later must be of these files, not of a checkpoint rewritten since
    target_stamps: Stamps = ()
    draft_stamps: Stamps = ()


def _stamps(model_dir: str | Path) -> "Stamps | None":
    """The checkpoint's stamps before its load, or None where they cannot be read (no config.json, no weights): the
    load then fails with the loader's own message, in its order (the config's fields first)."""
    try:
        return checkpoint_stamps(model_dir)
    except CheckpointError:
        return None


def load_engine(target: str | Path, draft: str | Path | None = None, device: str | None = None,
                dtype: str | torch.dtype | None = None, kv_cache_tokens: int | None = None, *,
                method: str | None = None, draft_width: int | None = None, kv_block_size: int = 16,
                width_policy: WidthPolicy | None = None, runner_config: RunnerConfig | None = None,
                token_map: str | Path | None = None, draft_quantization: str | None = None) -> EngineParts:
    """Load `target` (and `draft`) on `device` (default: cuda when available) in `dtype` (default:
    bfloat16 on cuda, float32 on cpu). `method` defaults to "dflash" with a drafter, else "native";
    `kv_cache_tokens` sizes the paged cache (default: a share of free device memory); `width_policy`: how
    wide a DFlash step verifies (engine/width_policy.py; default the whole draft width); `runner_config`: the
    ModelRunner's knobs (engine/runner_config.py; default RunnerConfig(): graphs and compile iff CUDA);
    `token_map`: a file of hot token ids the drafter alone drafts from (engine/token_map.py; default: all);
    `draft_quantization`: the drafter's few-row passes in "fp8" weights (DFlashDrafter.quantize; default: the
    checkpoint's dtype)."""
    if not (isinstance(kv_block_size, int) and not isinstance(kv_block_size, bool) and kv_block_size >= 1):
        raise ValueError(f"kv_block_size must be a positive integer, got {kv_block_size!r}")
    if kv_cache_tokens is not None and not (isinstance(kv_cache_tokens, int) and not isinstance(kv_cache_tokens, bool)
                                            and kv_cache_tokens >= 1):
        raise ValueError(f"kv_cache_tokens must be a positive integer or None, got {kv_cache_tokens!r}")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, str(dev))
    method = method or ("dflash" if draft else "native")
    if method not in ("native", "dflash"):
        raise ValueError(f"method must be 'native' or 'dflash', got {method!r}")
    if method == "dflash" and draft is None:
        raise ValueError("method 'dflash' needs a drafter (draft=DIR / --draft DIR)")
    if token_map is not None and method != "dflash":
        raise ValueError("a token map (the draft's vocabulary) needs method 'dflash' and a drafter")
    if draft_quantization is not None and method != "dflash":
        raise ValueError("a draft quantization needs method 'dflash' and a drafter")
    if draft_quantization not in (None, "fp8"):
        raise ValueError(f"draft quantization must be 'fp8' or unset, got {draft_quantization!r}")
    # (None: not stampable now; the loader then names what is wrong, or the files changed while it read them)
    target_stamps = _stamps(target) if Path(target).is_dir() else ()
    draft_stamps = _stamps(draft) if method == "dflash" and Path(draft).is_dir() else ()
    model = load_target(target, dev, dt)
    tokenizer = TextTokenizer.from_dir(target)
    stop_ids = model.cfg.eos_token_ids
    drafter = None
    taps: tuple[int, ...] = ()
    if method == "dflash":
        from flashpd.engine.drafter import load_drafter  # noqa: PLC0415 (only dflash needs it)
        drafter = load_drafter(draft, model, dev, dt)
        if token_map is not None:
            from flashpd.engine.token_map import load_token_map  # noqa: PLC0415
            drafter.set_token_map(load_token_map(token_map, model.cfg.vocab_size))
        drafter.quantize(draft_quantization)
        taps = tuple(drafter.cfg.target_layer_ids)
        draft_width = drafter.cfg.block_size if draft_width is None else draft_width
    else:
        if draft_width not in (None, 1):  # the user's spelling is LLM's block_size
            raise ValueError(f"block_size {draft_width} needs method 'dflash' and a drafter")
        draft_width = 1
    num_blocks = kv_blocks_for(model, kv_block_size, dev, kv_cache_tokens)
    runner = ModelRunner(model, num_blocks, kv_block_size, taps=taps, config=runner_config)
    if drafter is not None:
        from flashpd.engine.spec_decode import DFlashGenerator  # noqa: PLC0415
        generator = DFlashGenerator(runner, drafter, stop_ids, draft_width, width_policy=width_policy)
    else:
        generator = NativeGenerator(runner, stop_ids)
    if target_stamps != ():  # after the whole load: a file rewritten meanwhile may have given tensors of two versions
        loaded_unchanged(target, target_stamps)
    if draft_stamps != ():
        loaded_unchanged(draft, draft_stamps)
    return EngineParts(dev, dt, method, draft_width, model, tokenizer, stop_ids, drafter, runner, generator,
                       target_stamps, draft_stamps)
