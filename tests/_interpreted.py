"""Kernel test cases run under triton's interpreter, all in one child process.

triton.jit picks the interpreter at decoration time, its own library's functions (tl.max, ...) included:
TRITON_INTERPRET=1 must be set before triton is first imported, and a test process imports it long before
(torch.compile does). So a kernel test module lists its cases (CASES: name -> fn(kernel module, device)) and the
engine module they take (KERNELS); `report` starts one child with the variable, which runs every case on the
CPU and prints {name: "ok" or the traceback}; each test checks its case's entry (`check`). On a GPU the cases run
in the test process on CUDA tensors instead.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path
from types import ModuleType

import torch

ROOT = Path(__file__).resolve().parents[1]


class _NoPatch:
    """The scope `skip_repatching` returns: the modules stay patched."""

    def restore(self) -> None:
        pass


def skip_repatching() -> None:
    """Speed only, in the interpreter child: triton's interpreter patches triton.language for the interpreter
    (`_patch_lang`: an inspect.getmembers walk of its modules) at every launch and again at every call of one jit
    function from another (`_block`, `_dot`, `norm_rope`, ...), and undoes the launch's patch at its end: thousands
    of walks a case, a large share of the child's time (docs/results.md). Here the first patch of a set of
    modules stays, and a later patch of modules already patched returns at once, so every launch and call runs
    the same interpreted code on the same patched modules. Nothing in the child uses triton.language outside a
    kernel: on the CPU torch and inductor do not. Checked against the interpreter's own names, so that a triton
    whose interpreter differs fails here, loudly."""
    from triton.runtime import interpreter as it
    assert callable(getattr(it, "_patch_lang", None)), \
        "triton's interpreter changed: update tests/_interpreted.skip_repatching"
    real_patch, tl, core = it._patch_lang, it.tl, it.tl.core
    patched: set[int] = set()

    def patch_lang(fn) -> _NoPatch:
        langs = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and (v is tl or v is core)}
        if not langs <= patched:
            real_patch(fn)  # its scope is dropped: never restored
            patched.update(langs)
        return _NoPatch()

    it._patch_lang = patch_lang


def child(module_name: str) -> None:
    """In the child: every case of the test module `module_name` (a file name in tests/, without .py) under the
    interpreter; prints the report as JSON."""
    skip_repatching()
    mod = importlib.import_module(module_name)
    assert mod.KERNELS.available() and mod.KERNELS.INTERPRET, "start the child with TRITON_INTERPRET=1"
    torch.set_num_threads(1)
    report = {}
    for name, fn in mod.CASES.items():
        try:
            fn(mod.KERNELS, "cpu")
            report[name] = "ok"
        except Exception:  # noqa: BLE001 (reported to the parent)
            report[name] = traceback.format_exc()
    print(json.dumps(report))


@functools.lru_cache(maxsize=None)
def report(module_name: str) -> dict[str, str]:
    """Run `child(module_name)` in a process started with TRITON_INTERPRET=1 (the repository root its working
    directory, tests/ on its path, as under pytest); its report, once a process."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = f"import sys; sys.path.insert(0, 'tests'); from _interpreted import child; child({module_name!r})"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600, check=False)  # a bound on a hang, well past the slowest child on 2 cores
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check(module: ModuleType, name: str) -> None:
    """A kernel test module's case `name`: run here on CUDA where there is a GPU, else its entry in the
    interpreter child's report must be "ok"."""
    if torch.cuda.is_available():  # pragma: no cover (GPU machines: the compiled kernels)
        module.CASES[name](module.KERNELS, "cuda")
        return
    result = report(Path(module.__file__).stem)[name]
    assert result == "ok", result
