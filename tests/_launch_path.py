"""Engine launch functions run on the CPU as far as the GPU's compile, in a child process.

The PTX tests compile a kernel from a signature they write themselves; what the engine's launch function builds (its
descriptors, its arguments' specialization, its constexprs and options) would first meet a compiler on the GPU. Here
a child imports triton as a CUDA build would, sets a driver that reports an sm_90 target, and replaces the JIT's
compile step with one that compiles the launch's own specialization (triton's ptxas, as the device would) and
returns no kernel, so nothing launches; the launch function returns its (unwritten) outputs. The child prints, for
each compile, the kernel's name, signature, constexprs, shared memory, warps and PTX.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

PRELUDE = r'''
import atexit, json
import torch
torch.backends.cuda.is_built = lambda: True  # a CPU build of torch: import triton as a CUDA build would
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import JITFunction


class Sm90Driver:
    """What JITFunction.run asks of a driver before it compiles: a device, a stream, the target."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


triton.runtime.driver.set_active(Sm90Driver())
BUILT = []


def _compile_only(self, key, signature, device, constexprs, options, attrs, warmup):
    _, _, target, _, _ = self.device_caches[device]
    cc = self.compile(self.ASTSource(self, signature, constexprs, attrs), target=target, options=options.__dict__)
    names = [p.name for p in self.params]
    BUILT.append({"fn": self.fn.__name__,
                  "signature": {names[k[0]] if isinstance(k, tuple) else k: str(v) for k, v in signature.items()},
                  "constexprs": {names[k[0]]: repr(v) for k, v in constexprs.items()},
                  "shared": cc.metadata.shared, "num_warps": cc.metadata.num_warps, "ptx": cc.asm["ptx"]})
    return None  # no kernel: JITFunction.run returns before any launch


JITFunction._do_compile = _compile_only
atexit.register(lambda: print(json.dumps(BUILT)))
'''


def compile_launches(body: str, timeout: int = 600) -> list[dict]:
    """Runs PRELUDE + body (Python calling the engine's launch functions on CPU tensors) in a child without
    TRITON_INTERPRET -> every compile it asked for, in order."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", PRELUDE + body], capture_output=True, text=True, env=env,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
