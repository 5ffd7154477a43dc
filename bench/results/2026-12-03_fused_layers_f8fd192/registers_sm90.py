"""Registers a thread of a002e97's few-row kernel takes, by form and tile, compiled for sm_90 without a GPU.

    git show a002e97:engine/skinny_gemm.py > sg_fused.py    # then point its triton import at triton itself:
    sed -i 's/^from flashpd.engine.triton_env import INTERPRET, tl, triton.*/import triton\\nimport triton.language as tl\\nINTERPRET = False/' sg_fused.py
    sed -i 's/flashpd::/kx::/' sg_fused.py                  # its custom ops under another namespace
    python registers_sm90.py                                # > registers_sm90.log

Triton's own ptxas and cuobjdump (its nvidia backend's bin/) build and read the cubin.
"""
import os
import re
import subprocess
import sys

import triton
import triton.backends.nvidia as nvidia
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.getcwd())
import sg_fused  # noqa: E402

BIN = os.path.join(os.path.dirname(nvidia.__file__), "bin")
SIG = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "g_ptr": "*bf16", "r_ptr": "*bf16", "M": "i32",
       "N": "i32", "K": "i32", "sxm": "i32", "swn": "i32", "sym": "i32", "srm": "i32", "eps": "fp32"}
print("triton", triton.__version__)
for name, norm, swiglu, resid in (("plain", False, False, False), ("norm", True, False, False),
                                  ("swiglu+residual", False, True, True)):
    for stages, bk, warps in ((6, 128, 2), (2, 128, 2), (6, 64, 2), (6, 128, 4)):
        const = {"BM": 16, "BN": 16, "BK": bk, "EVEN_K": True, "F32": False, "ROWWISE": False, "NORM": norm,
                 "SWIGLU": swiglu, "RESID": resid}
        src = ASTSource(fn=sg_fused._skinny_kernel, signature={**SIG, **{c: "constexpr" for c in const}},
                        constexprs=const)
        cc = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
        with open("kernel.cubin", "wb") as f:
            f.write(cc.asm["cubin"])
        usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-resource-usage", "kernel.cubin"],
                               capture_output=True, text=True, check=True).stdout
        regs = int(re.search(r"REG:(\d+)", usage).group(1))
        ptx = cc.asm["ptx"]
        print(f"{name:16s} stages {stages} BK {bk:3d} warps {warps}: {regs} registers; in the PTX "
              f"{len(re.findall(r'ld.global', ptx))} ld.global, {len(re.findall(r'cp.async', ptx))} cp.async, "
              f"{len(re.findall(r'cvt[.]', ptx))} cvt, {len(re.findall(r'ex2[.]', ptx))} ex2, "
              f"{cc.metadata.shared} B shared", flush=True)
