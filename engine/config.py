"""Model configuration read from a Hugging Face config.json (only the fields the engine uses)."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM",)
BUILTIN_CONFIGS = ("qwen3-4b", "qwen3-8b", "qwen3-32b")
# RoPE tables of max_position_embeddings rows are built on the device at load; past this a typo is an OOM
MAX_POSITIONS = 1 << 20
# A config's sizes (vocabulary, hidden, intermediate, heads, head_dim) and its layer count at most these: past them
# a typo overflows torch's size arithmetic, or builds a million layer modules, before any weight header is read
# (every released model is far inside both; sizes that each pass but multiply past int64: loader.meta_build)
MAX_CONFIG_SIZE = 1 << 20
MAX_LAYERS = 1024


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing file, wrong architecture, shape mismatch."""


class HeadGeometry:
    """q/kv projection widths, shared by the target's and the drafter's configs."""

    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


@dataclass(frozen=True)
class Qwen3Config(HeadGeometry):
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config", eos_source: str | None = None) -> "Qwen3Config":
        """`eos_source`: the file eos_token_id came from when not `source` (generation_config.json)."""
        archs = architectures_of(d, source)
        if archs and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise CheckpointError(
                f"{source}: unsupported architecture {archs}; flashpd's target engine runs "
                f"{list(SUPPORTED_ARCHITECTURES)} (a DFlash drafter directory goes to --draft)")
        if d.get("model_type", "qwen3") != "qwen3":
            raise CheckpointError(f"{source}: unsupported model_type {d.get('model_type')!r}; expected 'qwen3'")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in d]
        if missing:
            raise CheckpointError(f"{source}: config is missing required fields {missing}")
        positive_ints(d, ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                          "num_key_value_heads", "head_dim", "max_position_embeddings"), source)
        if (d.get("max_position_embeddings") or 0) > MAX_POSITIONS:
            raise CheckpointError(f"{source}: max_position_embeddings {d['max_position_embeddings']} is over "
                                  f"{MAX_POSITIONS} (flashpd builds RoPE tables of that many rows at load)")
        positive_numbers(d, ("rms_norm_eps",), source)
        booleans(d, ("tie_word_embeddings",), source)
        check_math(d, source)
        theta = rope_theta_of(d, source)
        layer_types = d.get("layer_types") or []
        if (d.get("use_sliding_window") and d.get("sliding_window")) or "sliding_attention" in layer_types:
            raise CheckpointError(f"{source}: sliding-window attention is not supported (flashpd attends to "
                                  f"the full context)")
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=float(d.get("rms_norm_eps") or 1e-6), rope_theta=float(theta),
            max_position_embeddings=d.get("max_position_embeddings") or 40960,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            eos_token_ids=token_ids(eos, eos_source or source), raw=dict(d),
        )

    def validate(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")


def rope_theta_of(d: dict[str, Any], source: str) -> float:
    """rope_theta from a config of either transformers generation (top level, or rope_parameters). Anything this
    engine would compute differently from transformers is refused, never read past: a scaling in either field, a
    field that is not an object, two thetas that disagree (transformers 5 takes rope_parameters', older ones the top
    level's)."""
    ropes = []
    for name in ("rope_scaling", "rope_parameters"):
        rope = d.get(name)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise CheckpointError(f"{source}: {name} must be a JSON object, got {rope!r}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in (None, "default"):
            raise CheckpointError(f"{source}: rope scaling {rope_type!r} is not supported")
        ropes.append(rope)
    thetas = [t for t in (d.get("rope_theta"), *(r.get("rope_theta") for r in ropes)) if t is not None]
    for t in thetas:
        positive_numbers({"rope_theta": t}, ("rope_theta",), source)
    if len({float(t) for t in thetas}) > 1:
        raise CheckpointError(f"{source}: rope_theta values disagree ({thetas}): which one the checkpoint was trained "
                              f"with is ambiguous")
    return float(thetas[0]) if thetas else 10_000.0  # transformers' Qwen3Config default


def check_math(d: dict[str, Any], source: str) -> None:
    """Fields that would change a Qwen3 layer's arithmetic from what this engine computes: refused by name, never
    loaded as if absent (the output would differ from transformers' with nothing said)."""
    act = d.get("hidden_act")
    if act not in (None, "silu"):
        raise CheckpointError(f"{source}: hidden_act {act!r} is not supported (Qwen3's MLP is SwiGLU: 'silu')")
    prf = d.get("partial_rotary_factor")
    if prf is not None and prf != 1:
        raise CheckpointError(f"{source}: partial_rotary_factor {prf!r} is not supported (RoPE over the whole head)")
    for flag in ("attention_bias", "mlp_bias"):
        if d.get(flag) not in (None, False):
            raise CheckpointError(f"{source}: {flag}={d[flag]!r} is not supported (Qwen3's projections have no bias)")
    if d.get("quantization_config") is not None:
        raise CheckpointError(f"{source}: quantized checkpoints (quantization_config) are not supported; give "
                              f"bf16, fp16 or fp32 weights")


def architectures_of(d: dict[str, Any], source: str) -> list[str]:
    """config.json's architectures, a list of names ("Qwen3ForCausalLM" alone would be read letter by letter)."""
    archs = d.get("architectures") or []
    if not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise CheckpointError(f"{source}: architectures must be a list of names, got {archs!r}")
    return archs


def read_json_object(path: str | Path) -> dict[str, Any]:
    """A checkpoint's JSON file as a dict, or CheckpointError naming the file (not JSON, not an object)."""
    try:
        d = json.loads(Path(path).read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:  # a directory, no permission
        raise CheckpointError(f"{path}: cannot be read ({e.strerror})") from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{path}: must hold a JSON object, got {type(d).__name__}")
    return d


def positive_ints(d: dict[str, Any], names: tuple[str, ...], source: str) -> None:
    """Each of `names` that `d` holds is a positive integer (a config's "192" fails here, named), at most
    MAX_LAYERS for num_hidden_layers and MAX_CONFIG_SIZE for the rest (max_position_embeddings: the caller's)."""
    for k in names:
        v = d.get(k)
        if v is None:
            continue
        if not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
            raise CheckpointError(f"{source}: {k} must be a positive integer, got {v!r}")
        if k == "max_position_embeddings":  # bounded by the caller, with its own reason (MAX_POSITIONS)
            continue
        most = MAX_LAYERS if k == "num_hidden_layers" else MAX_CONFIG_SIZE
        if v > most:
            raise CheckpointError(f"{source}: {k} {v} is over {most}, more than any model this engine runs has")


def positive_numbers(d: dict[str, Any], names: tuple[str, ...], source: str) -> None:
    """Each of `names` that `d` holds is a finite positive number: a string would load and fail at the first
    step, and a zero or negative eps or RoPE theta would load and generate garbage."""
    for k in names:
        v = d.get(k)
        if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                                  and v > 0):
            raise CheckpointError(f"{source}: {k} must be a positive number, got {v!r}")


def booleans(d: dict[str, Any], names: tuple[str, ...], source: str) -> None:
    """Each of `names` that `d` holds is a JSON true/false (bool("false") is True: an untied head would be
    silently replaced by the embedding)."""
    for k in names:
        v = d.get(k)
        if v is not None and not isinstance(v, bool):
            raise CheckpointError(f"{source}: {k} must be true or false, got {v!r}")


def token_ids(v: Any, source: str, vocab_size: int | None = None, name: str = "eos_token_id") -> tuple[int, ...]:
    """An id or a list of ids, each an integer (in [0, vocab_size) when given: a checkpoint's): a stop id the model
    cannot produce (or a 2.7 read as 2) would silently change where generation stops."""
    if v is None:
        return ()
    ids = list(v) if isinstance(v, (list, tuple)) else [v]
    top = float("inf") if vocab_size is None else vocab_size
    for i in ids:
        if not (isinstance(i, int) and not isinstance(i, bool) and 0 <= i < top):
            within = "" if vocab_size is None else f" in [0, {vocab_size})"
            raise CheckpointError(f"{source}: {name} must be token ids{within}, got {v!r}")
    return tuple(ids)


def require_file(f: Path, model_dir: str | Path, kind: str = "a Hugging Face model directory") -> None:
    """A checkpoint's config.json exists, else the error that says what the directory is not."""
    if not optional_file(f, model_dir):
        raise CheckpointError(f"{model_dir}: no config.json (is this {kind}?)")


def optional_file(f: Path, model_dir: str | Path) -> bool:
    """Whether a checkpoint's file (config.json, tokenizer.json, generation_config.json, a chat template) is
    there; a dangling link (a broken Hugging Face cache blob, or a loop) is refused by name, not read as absent:
    a broken generation_config.json quietly took the stop tokens from config.json instead."""
    if not f.exists() and os.path.lexists(f):
        raise CheckpointError(f"{model_dir}: {f.name} is a broken link ({f} -> {os.readlink(f)})")
    return f.exists()


def builtin_config_path(name: str) -> Path:
    """Path of a config shipped as data (qwen3-4b, qwen3-8b, qwen3-32b)."""
    key = name.lower()
    if key not in BUILTIN_CONFIGS:
        raise CheckpointError(f"unknown builtin config {name!r}; choose one of {list(BUILTIN_CONFIGS)}")
    return Path(__file__).parent / "configs" / f"{key}.json"


def load_config(model_dir: str | Path) -> Qwen3Config:
    """Read config.json, then generation_config.json's stop tokens (which win, as in HF)."""
    p = Path(model_dir)
    if p.is_file() and p.suffix == ".json":
        cfg_file, gen_file = p, None
    else:
        cfg_file, gen_file = p / "config.json", p / "generation_config.json"
    require_file(cfg_file, p)
    d = read_json_object(cfg_file)
    eos_source = None
    if gen_file is not None and optional_file(gen_file, p):
        g = read_json_object(gen_file)
        if g.get("eos_token_id") is not None:
            d = {**d, "eos_token_id": g["eos_token_id"]}
            eos_source = str(gen_file)
    cfg = Qwen3Config.from_dict(d, source=str(cfg_file), eos_source=eos_source)
    token_ids(list(cfg.eos_token_ids), eos_source or str(cfg_file), cfg.vocab_size)  # a checkpoint's: in its vocab
    cfg.validate()
    return cfg
