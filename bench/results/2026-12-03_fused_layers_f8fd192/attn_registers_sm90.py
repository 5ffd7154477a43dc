"""The paged kernel (HEAD's engine/paged_attention.py) compiled for sm_90 without a GPU: registers a thread
(and spills), shared memory and pipelined loads, walking (a batch) and per chunk, with a register cap (maxnreg).

    sed 's/^from flashpd.engine.triton_env import INTERPRET, tl, triton.*/import triton\\nimport triton.language as tl\\nINTERPRET = False/; s/flashpd::/kx::/' \\
        engine/paged_attention.py > pa_mod.py
    python attn_registers_sm90.py                       # > attn_registers_sm90.log (triton 3.6.0)

Printed per row: (registers, local-memory bytes) from cuobjdump.
"""
import os, re, subprocess, sys
import triton, triton.backends.nvidia as nvidia
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
sys.path.insert(0, os.getcwd())
import pa_mod as pa
BIN = os.path.join(os.path.dirname(nvidia.__file__), "bin")
names = ["q_ptr","k_ptr","v_ptr","bt_ptr","pos_ptr","out_ptr","m_ptr","l_ptr","acc_ptr","qk_scale","HKV","M","n_keys",
 "sq_h","sq_b","sq_m","so_h","so_b","so_t","so_g","sk_blk","sk_off","sk_h","sv_blk","sv_off","sv_h","sbt_b","spos_b"]
types = ["*bf16","*bf16","*bf16","*i64","*i64","*bf16","*fp32","*fp32","*fp32","fp32"] + ["i32"]*18
sig = dict(zip(names, types))
for split, warps, stages, mr in ((False, 2, 4, None), (False, 2, 4, 168), (False, 2, 4, 128), (False, 2, 3, 128), (True, 4, 4, None)):
    const = {"G": 4, "PAGE": 16, "D": 128, "D_PAD": 128, "BM": 16, "BN": 32, "KPC": 32, "SPLIT": split, "F32": False, "INTERPRET": False}
    div16 = [n for n in names if n.endswith("_ptr") or n in ("n_keys","sq_h","sq_b","sq_m","so_h","so_b","so_t","so_g","sk_blk","sk_off","sk_h","sv_blk","sv_off","sv_h")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    src = ASTSource(fn=pa._attn_kernel, signature={**sig, **{c: "constexpr" for c in const}}, constexprs=const, attrs=attrs)
    cc = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages, **({"maxnreg": mr} if mr else {})})
    open("a.cubin", "wb").write(cc.asm["cubin"])
    u = subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-resource-usage", "a.cubin"], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+).*LOCAL:(\d+)", u).groups()
    ptx = cc.asm["ptx"]
    print(f"split {split} warps {warps} stages {stages} maxnreg {mr}: {regs} regs, shared {cc.metadata.shared} B, cp.async {len(re.findall('cp.async', ptx))}, ld.global {len(re.findall('ld.global', ptx))}")
