"""The few-row kernel's forms compiled for sm_90 without a GPU: registers a thread, shared memory, and the PTX's
loads (cp.async: pipelined through shared memory; ld.global: to registers), conversions and exponentials.

    for REV in c3cd836 a002e97; do
      git show $REV:engine/skinny_gemm.py > sg_$REV.py       # then point its triton import at triton itself:
      sed -i 's/^from flashpd.engine.triton_env import INTERPRET, tl, triton.*/import triton\\nimport triton.language as tl\\nINTERPRET = False/' sg_$REV.py
      sed -i "s/flashpd::/k$REV::/" sg_$REV.py              # its custom ops under another namespace
      python registers_sm90.py sg_$REV                       # >> registers_sm90.log
    done

Pointers and the sizes and strides that are multiples of 16 at the 8B shapes carry tt.divisibility 16, as triton's
launcher specializes them at run time (without it nothing is vectorized or pipelined). Triton's own ptxas and
cuobjdump (its nvidia backend's bin/) build and read the cubin.
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
sg_fused = __import__(sys.argv[1])

BIN = os.path.join(os.path.dirname(nvidia.__file__), "bin")
SIG = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "g_ptr": "*bf16", "r_ptr": "*bf16", "M": "i32",
       "N": "i32", "K": "i32", "sxm": "i32", "swn": "i32", "sym": "i32", "srm": "i32", "eps": "fp32"}
print("triton", triton.__version__, "kernel", sys.argv[1])
for name, norm, swiglu, resid in (("plain", False, False, False), ("norm", True, False, False),
                                  ("swiglu+residual", False, True, True)):
    for stages, bk, warps in ((6, 128, 2), (2, 128, 2), (6, 64, 2), (6, 128, 4)):
        const = {"BM": 16, "BN": 16, "BK": bk, "EVEN_K": True, "F32": False, "ROWWISE": False, "NORM": norm,
                 "SWIGLU": swiglu, "RESID": resid}
        div16 = [n for n in SIG if n.endswith("_ptr") or n in ("N", "K", "sxm", "swn", "sym", "srm")]
        attrs = {(list(SIG).index(n),): [["tt.divisibility", 16]] for n in div16}  # as the launcher specializes them
        src = ASTSource(fn=sg_fused._skinny_kernel, signature={**SIG, **{c: "constexpr" for c in const}},
                        constexprs=const, attrs=attrs)
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
