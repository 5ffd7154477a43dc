"""Shared bench plumbing: machine/git metadata, timing with device events, JSON output."""
from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch


def git_revision() -> str:
    """HEAD (+ "-dirty"); FLASHPD_GIT_REV wins, for copies of the tree that carry no .git (the GPU machine)."""
    if os.environ.get("FLASHPD_GIT_REV"):
        return os.environ["FLASHPD_GIT_REV"]
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def command_line(module: str, argv: list[str] | None = None) -> str:
    """The command as it was typed (`argv`: sys.argv[1:]), quoted so that it can be pasted back: a results
    JSON's `command` field. Parsed flags printed back would not parse again (a store_true flag as "True")."""
    return shlex.join(["python", "-m", module, *(sys.argv[1:] if argv is None else argv)])


def static_shapes() -> None:
    """torch.compile specialises every shape it meets (no automatic dynamic-shape kernels), with room for
    the bucketed shapes of a run: whether a kernel's numerics depend on the order shapes arrive in."""
    torch._dynamo.config.automatic_dynamic_shapes = False
    torch._dynamo.config.cache_size_limit = 512
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 512


def no_split_reductions() -> None:
    """Inductor sums every reduction row by row (no split across thread blocks for long, few-row reductions):
    whether a one-token step and a verify round a softmax apart because only one of them is split."""
    import torch._inductor.config as inductor_config  # noqa: PLC0415

    inductor_config.split_reductions = False


def add_compile_args(ap) -> None:
    """The compile-numerics flags the exactness probe and the speedup bench share."""
    ap.add_argument("--static-shapes", action="store_true",
                    help="torch.compile specialises every shape (no automatic dynamic-shape kernels)")
    ap.add_argument("--no-split-reductions", action="store_true",
                    help="Inductor reduces row by row (no split reductions)")


def apply_compile_args(a) -> tuple[dict, str]:
    """Apply `add_compile_args`' flags before anything compiles; -> (their JSON fields, their command text)."""
    if a.static_shapes:
        static_shapes()
    if a.no_split_reductions:
        no_split_reductions()
    return ({"static_shapes": a.static_shapes, "split_reductions": not a.no_split_reductions},
            (" --static-shapes" if a.static_shapes else "") + (" --no-split-reductions" if a.no_split_reductions else ""))


def machine() -> dict:
    m = {"python": platform.python_version(), "torch": torch.__version__, "cpu": platform.processor() or platform.machine()}
    if torch.cuda.is_available():
        m["gpu"] = torch.cuda.get_device_name(0)
        m["cuda"] = torch.version.cuda
    return m


def time_ms(fn: Callable[[], object], warmup: int = 3, reps: int = 20, device: str = "cuda") -> list[float]:
    """Wall time of each call in ms, synchronising the device around each one."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def summary(samples: list[float]) -> dict:
    s = sorted(samples)
    return {"median_ms": statistics.median(s), "min_ms": s[0], "max_ms": s[-1], "n": len(s), "samples_ms": samples}


def copy_bandwidth_gbs(nbytes: int = 4 << 30) -> dict:
    """Device-to-device copy rate, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    t = time_ms(lambda: dst.copy_(src), warmup=3, reps=20)
    med = statistics.median(t)
    return {"bytes_per_copy": 2 * nbytes, "median_ms": med, "gb_per_s": 2 * nbytes / (med * 1e-3) / 1e9}


def kernel_bench_start(name: str) -> tuple[torch.device, int, dict]:
    """A GPU-only kernel bench's start: (the device, its SM count, the copy rate), the line that reports them;
    exits with a message where there is no CUDA GPU or no triton."""
    from flashpd.engine import triton_env
    if not torch.cuda.is_available() or triton_env.triton is None:
        raise SystemExit(f"{name} needs a CUDA GPU and triton")
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    copy = copy_bandwidth_gbs()
    print(f"copy rate {copy['gb_per_s']:.0f} GB/s; {sms} SMs; PDL {triton_env.pdl(dev)}", flush=True)
    return dev, sms, copy


REPO = Path(__file__).resolve().parents[1]


def portable(x: object) -> object:
    """Strings with this checkout's absolute root (or the device machine's $OUT) made relative: a
    committed result names repository paths, never a machine's."""
    if isinstance(x, str):
        x = x.replace(str(REPO) + "/", "")
        out = os.environ.get("OUT")
        return x.replace(out.rstrip("/") + "/", "bench/results/") if out else x
    if isinstance(x, dict):
        return {k: portable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [portable(v) for v in x]
    return x


def invoked_command() -> str | None:
    """`python -m flashpd.<module> <args>` as this process was started, when it was started so (a result's JSON
    carries the command that reproduces it); None otherwise (a test calling a bench's functions)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", None)
    if not name or not name.startswith("flashpd."):
        return None
    return command_line(name)


def write_json(path: str | Path, payload: dict) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    payload = {"git": git_revision(), "machine": machine(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               **payload}
    command = invoked_command()
    if "command" not in payload and command is not None:  # a bench that writes its own keeps it
        payload["command"] = command
    p.write_text(json.dumps(portable(payload), indent=2))
    return p
