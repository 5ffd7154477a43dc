"""Checkpoint loading: Hugging Face Qwen3 safetensors (single file or shards) and dummy weights.

Modules are built on the meta device and materialised directly on the target device, then each
tensor is read from safetensors straight to that device and copied into its (possibly fused)
parameter slice, so host memory never holds a second full copy of the model.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open

from flashpd.engine.config import CheckpointError, Qwen3Config, load_config, read_json_object, require_file
from flashpd.engine.qwen3 import Qwen3ForCausalLM

FLOAT_DTYPES = frozenset({"F32", "F16", "BF16"})  # safetensors' names of the dtypes a weight may have
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some exporters write; recomputed here
TIED_CHECK_ROWS = 8192  # rows of a tied checkpoint's lm_head compared with the embedding at a time


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files: the shards model.safetensors.index.json names, or model.safetensors, or every
    *.safetensors file. A directory with both model.safetensors and an index naming other files is refused:
    transformers reads the single file and an index-first reader the shards, so which model it holds is ambiguous
    (a save into a directory that held shards leaves such a pair)."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists() and (model_dir / "model.safetensors").exists() and _index_files(index) != {"model.safetensors"}:
        raise CheckpointError(f"{model_dir}: holds both model.safetensors and model.safetensors.index.json, so which "
                              f"is the checkpoint is ambiguous; remove the one that is stale")
    if index.exists():
        weight_map = _weight_map(index)
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [str(f.name) for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{model_dir}: shards named by model.safetensors.index.json are missing: {missing}")
        return files
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no model.safetensors, no index, no *.safetensors files")
    return files


def _weight_map(index: Path) -> dict[str, str]:
    weight_map = read_json_object(index).get("weight_map", {})
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise CheckpointError(f"{index}: weight_map must map tensor names to file names")
    return weight_map


def _index_files(index: Path) -> set[str]:
    return set(_weight_map(index).values())


Stamps = tuple[tuple[str, int, int, int, int], ...]


def checkpoint_stamps(model_dir: str | Path) -> Stamps:
    """(name, size, mtime, ctime, inode) of config.json and each weight file the loader reads: a file rewritten in
    place moves its ctime whatever else it keeps (cp -p, tar -x and rsync -t set mtimes; no caller can set ctime).
    What a load is checked against (`loaded_unchanged`) and what the cache's weights identity is kept under."""
    d = Path(model_dir).resolve()
    require_file(d / "config.json", model_dir)
    files = [d / "config.json", *safetensors_files(d)]
    try:
        return tuple((os.path.relpath(f, d), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
                     for f in files for st in (f.stat(),))
    except OSError as e:  # no config.json, or a shard removed between the listing and its stat
        raise CheckpointError(f"{d}: cannot read {e.filename}: {e.strerror}") from None


def loaded_unchanged(model_dir: str | Path, before: Stamps | None) -> None:
    """Refuse a load during which the checkpoint's files changed: its tensors may mix two versions, and the
    prefix cache would key this process's KV to weights it does not hold."""
    if before is None or checkpoint_stamps(model_dir) != before:  # None: unreadable before, yet it loaded
        raise CheckpointError(f"{model_dir}: the checkpoint's files changed while it was loaded; load it again once "
                              f"it is completely written")


def iter_safetensors(files: list[Path], device: str) -> Iterator[tuple[str, Callable[[], torch.Tensor], list[int]]]:
    """Yield (name, loader, shape) per tensor; the loader reads it straight to `device`."""
    for f in files:
        try:
            handle = safe_open(str(f), framework="pt", device=device)
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
            raise CheckpointError(f"{f}: unreadable safetensors file ({e})") from e
        with handle as h:
            for name in h.keys():
                sl = h.get_slice(name)
                if sl.get_dtype() not in FLOAT_DTYPES:  # copied into a float parameter it would be garbage, silently
                    raise CheckpointError(f"{f}: tensor {name} has dtype {sl.get_dtype()}, expected one of "
                                          f"{sorted(FLOAT_DTYPES)}")
                yield name, (lambda h=h, name=name: h.get_tensor(name)), list(sl.get_shape())


def target_slices(model: Qwen3ForCausalLM) -> dict[str, tuple[torch.Tensor, int, int]]:
    """HF tensor name -> (destination parameter, row offset, rows)."""
    c = model.cfg
    out: dict[str, tuple[torch.Tensor, int, int]] = {}

    def whole(name: str, p: torch.Tensor) -> None:
        out[name] = (p, 0, p.shape[0])

    whole("model.embed_tokens.weight", model.embed_tokens.weight)
    whole("model.norm.weight", model.norm.weight)
    if model.lm_head is not None:
        whole("lm_head.weight", model.lm_head.weight)
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}."
        a = layer.self_attn
        out[pre + "self_attn.q_proj.weight"] = (a.qkv_proj.weight, 0, c.q_size)
        out[pre + "self_attn.k_proj.weight"] = (a.qkv_proj.weight, c.q_size, c.kv_size)
        out[pre + "self_attn.v_proj.weight"] = (a.qkv_proj.weight, c.q_size + c.kv_size, c.kv_size)
        whole(pre + "self_attn.o_proj.weight", a.o_proj.weight)
        whole(pre + "self_attn.q_norm.weight", a.q_norm.weight)
        whole(pre + "self_attn.k_norm.weight", a.k_norm.weight)
        m = layer.mlp
        out[pre + "mlp.gate_proj.weight"] = (m.gate_up_proj.weight, 0, c.intermediate_size)
        out[pre + "mlp.up_proj.weight"] = (m.gate_up_proj.weight, c.intermediate_size, c.intermediate_size)
        whole(pre + "mlp.down_proj.weight", m.down_proj.weight)
        whole(pre + "input_layernorm.weight", layer.input_layernorm.weight)
        whole(pre + "post_attention_layernorm.weight", layer.post_attention_layernorm.weight)
    return out


def slices_state_dict(slices: dict[str, tuple[torch.Tensor, int, int]]) -> dict[str, torch.Tensor]:
    """The inverse of loading: checkpoint name -> its (un-fused) tensor, on the CPU."""
    return {name: p[off:off + rows].detach().contiguous().cpu() for name, (p, off, rows) in slices.items()}


def check_checkpoint(slices: dict[str, tuple[torch.Tensor, int, int]], files: list[Path], source: str,
                     ignore: tuple[str, ...] = ()) -> None:
    """The files' headers against `slices` (meta tensors will do): names, shapes, dtypes, and no tensor in two
    files. Run before the model is allocated, so a config that does not fit its checkpoint (an absurd size
    included) is refused here, by name, instead of in the allocator; and a duplicate cannot silently win."""
    where: dict[str, Path] = {}
    unexpected: list[str] = []
    for f in files:
        for name, _, shape in iter_safetensors([f], "cpu"):
            if name in where:
                raise CheckpointError(f"{source}: tensor {name} is in both {where[name].name} and {f.name}")
            where[name] = f
            if name not in slices:
                if not name.endswith(_IGNORED_SUFFIXES) and name not in ignore:
                    unexpected.append(name)
                continue
            dest, _, rows = slices[name]
            want = [rows, *dest.shape[1:]]
            if shape != want:
                raise CheckpointError(f"{source}: tensor {name} has shape {shape}, the config implies {want}")
    missing = sorted(set(slices) - set(where))
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"{source}: checkpoint is missing tensors {missing[:5]}{more}")
    if unexpected:
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise CheckpointError(f"{source}: checkpoint has tensors this architecture does not use: "
                              f"{unexpected[:5]}{more}")


def tied_head_shape(files: list[Path]) -> list[int] | None:
    """The shape of the files' lm_head.weight, None without one (a tied config's checkpoint may hold the copy)."""
    for name, _, shape in iter_safetensors(files, "cpu"):
        if name == "lm_head.weight":
            return shape
    return None


def check_tied_head(files: list[Path], embed: torch.Tensor, device: str, source: str) -> None:
    """A tied config's lm_head.weight, where the files hold one, must equal the embedding in the model's dtype: the
    engine (as transformers) takes the embedding for the head, so a different head in the file would be dropped
    silently. Compared TIED_CHECK_ROWS rows at a time (no second whole copy of the table)."""
    for f in files:
        with safe_open(str(f), framework="pt", device=device) as h:
            if "lm_head.weight" not in h.keys():
                continue
            head = h.get_slice("lm_head.weight")
            for i in range(0, embed.shape[0], TIED_CHECK_ROWS):
                rows, want = head[i:i + TIED_CHECK_ROWS], embed[i:i + TIED_CHECK_ROWS]
                if not (torch.equal(rows.to(want.dtype), want)
                        or torch.equal(rows, want.to(rows.dtype))):  # a copy stored in another dtype
                    raise CheckpointError(f"{source}: tie_word_embeddings is true but lm_head.weight differs from "
                                          f"model.embed_tokens.weight (from row {i}); set tie_word_embeddings "
                                          f"false to use the file's head, or drop the tensor")
        return


def fill_from_checkpoint(slices: dict[str, tuple[torch.Tensor, int, int]], files: list[Path],
                         device: str, source: str) -> None:
    """Copy every checkpoint tensor into its slice, after `check_checkpoint` on the same files (names, shapes, no
    tensor missing, extra or twice: the allocation between the two is the only step that runs in between); error
    on a tensor holding NaN or inf once in the model's dtype (it would generate garbage, silently)."""
    for name, load, _ in iter_safetensors(files, device):
        if name not in slices:  # ignored or an unused suffix: check_checkpoint let it through
            continue
        dest, off, rows = slices[name]
        with torch.no_grad():
            part = dest[off:off + rows]
            part.copy_(load())
            if not torch.isfinite(torch.linalg.vector_norm(part, ord=float("inf"))):  # one reduction, no copy
                raise CheckpointError(f"{source}: tensor {name} holds NaN or inf values (in {part.dtype})")


def meta_build(build: Callable[[], torch.nn.Module], source: str) -> torch.nn.Module:
    """`build()` on the meta device; a config whose sizes each pass their bound but multiply past torch's int64
    size arithmetic fails there, as a CheckpointError naming the config."""
    try:
        with torch.device("meta"):
            return build()
    except (RuntimeError, TypeError, OverflowError) as e:
        raise CheckpointError(f"{source}: the config's sizes overflow a weight's size ({e})") from None


def _meta_model(cfg: Qwen3Config, dtype: torch.dtype, source: str = "config") -> Qwen3ForCausalLM:
    return meta_build(lambda: Qwen3ForCausalLM(cfg).to(dtype), source)


def _empty_model(cfg: Qwen3Config, device: torch.device, dtype: torch.dtype) -> Qwen3ForCausalLM:
    return _meta_model(cfg, dtype).to_empty(device=device)


def load_target(model_dir: str | Path, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> Qwen3ForCausalLM:
    """Load a Hugging Face Qwen3 directory onto `device` in `dtype`."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a directory")
    cfg = load_config(model_dir)
    device = torch.device(device)
    files = safetensors_files(model_dir)
    ignored: tuple[str, ...] = ()
    if cfg.tie_word_embeddings:  # tied: some exporters still write lm_head.weight (a copy of the embedding)
        ignored = ("lm_head.weight",)
    model = _meta_model(cfg, dtype, str(model_dir / "config.json"))
    check_checkpoint(target_slices(model), files, str(model_dir), ignore=ignored)  # before any allocation
    head = tied_head_shape(files) if cfg.tie_word_embeddings else None
    if head is not None and head != list(model.embed_tokens.weight.shape):
        raise CheckpointError(f"{model_dir}: tie_word_embeddings is true but lm_head.weight has shape {head}, the "
                              f"embedding {list(model.embed_tokens.weight.shape)}")
    model = model.to_empty(device=device)
    dev = "cpu" if device.type == "cpu" else str(device if device.index is not None else f"{device.type}:0")
    fill_from_checkpoint(target_slices(model), files, dev, str(model_dir))
    if head is not None:
        check_tied_head(files, model.embed_tokens.weight, dev, str(model_dir))
    model.init_rotary(device)
    return model.eval().requires_grad_(False)


def dummy_target(cfg: Qwen3Config, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
                 seed: int = 0) -> Qwen3ForCausalLM:
    """Random weights for any config (timing at real shapes; never for quality)."""
    device = torch.device(device)
    model = _empty_model(cfg, device, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.init_rotary(device)
    return model.eval().requires_grad_(False)
