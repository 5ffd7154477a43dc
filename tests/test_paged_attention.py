"""The Triton paged attention kernel (engine/paged_attention.py) against the gather + mask + softmax path it
replaces, and its batch invariance: a row's output is bitwise the same whatever shares its forward.

Without a GPU the kernels run under triton's interpreter (numpy on CPU tensors), which triton.jit picks at
decoration time, its own library's functions (tl.max, ...) included: TRITON_INTERPRET=1 must be set before
triton is first imported, and this process imported it long before (torch.compile does). So one child
process, started with the variable, runs every case below and reports each; each test here checks its
case's report. On a GPU the cases run in this process on CUDA tensors."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Callable

import pytest
import torch

import flashpd.engine.attention as attention
import flashpd.engine.paged_attention as engine_pa

ROOT = Path(__file__).resolve().parents[1]
SCALE = 24 ** -0.5
CASES: dict[str, Callable[[ModuleType, str], None]] = {}


def random_case(pa: ModuleType, device: str, dtype: torch.dtype, b: int, t: int, nblk: int, seed: int,
                min_pos: int = 0, hkv: int = 2) -> tuple[torch.Tensor, ...]:
    """4 query groups, head_dim 24 (padded to 32 in the kernel), blocks of 8 keys, 64 blocks."""
    return pa.random_case(b, t, hkv, 4, 24, 8, nblk, 64, dtype, device, seed=seed, min_pos=min_pos)


def check_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == ref.shape
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def matches_the_gathered_reference(pa: ModuleType, dev: str, dtype: torch.dtype, b: int, t: int, nblk: int,
                                   split: bool) -> None:
    """Rows at different positions, decode (T=1) and verify (T=16, G=4), padded table entries (the scratch
    block 0 holds random data), keys over 2 (96 keys) or 4 chunks (200 keys, rows past key 70), each chunk in a
    program of its own merged by the combine kernel (split) or all merged in one program."""
    q, k, v, bt, pos = random_case(pa, dev, dtype, b, t, nblk, seed=b * 10 + t, min_pos=70 if nblk > 20 else 0)
    assert (bt == 0).any()  # some table entries are padding
    assert pos.max() >= pa.KEYS_PER_CHUNK  # two chunks or more
    out = pa.paged_attention(q, k, v, bt, pos, SCALE, split=split)
    ref = pa.reference(q.float(), k.float(), v.float(), bt, pos, SCALE)
    check_close(out, ref, dtype)


for _dt in (torch.float32, torch.bfloat16):
    for _b, _t, _nblk, _split in ((3, 1, 12, False), (2, 16, 12, True), (3, 2, 25, True), (3, 2, 25, False)):
        CASES[f"reference-{str(_dt)[6:]}-b{_b}-t{_t}-nblk{_nblk}-split{int(_split)}"] = (
            lambda pa, dev, a=(_dt, _b, _t, _nblk, _split): matches_the_gathered_reference(pa, dev, *a))


def unwritten_slots_are_never_read(pa: ModuleType, dev: str) -> None:
    """Cache slots past every query's position (here NaN) leave the output finite and unchanged: keys past a
    tile's last position are masked loads, not zero-weighted ones."""
    q, k, v, bt, pos = random_case(pa, dev, torch.float32, 2, 4, 10, seed=7)
    ref = pa.paged_attention(q, k, v, bt, pos, SCALE)
    for i in range(bt.shape[0]):
        for key in range(int(pos[i].max()) + 1, bt.shape[1] * 8):
            k[bt[i, key // 8], key % 8] = float("nan")
            v[bt[i, key // 8], key % 8] = float("nan")
    out = pa.paged_attention(q, k, v, bt, pos, SCALE)
    assert torch.equal(out, ref)


CASES["unwritten-slots"] = unwritten_slots_are_never_read


def rows_do_not_depend_on_their_batch(pa: ModuleType, dev: str, dtype: torch.dtype) -> None:
    """A row computed alone (B=1, T=1), inside a verify of T=16 beside rows at other positions, and inside a
    call with a wider block table is bitwise the same, wherever it sits in its row tile (cols 0, 9 and 15),
    with its key chunks merged in one program or each chunk in its own program and the combine kernel: rows
    within the first chunks (min_pos 30) and rows over three or more (min_pos 130), where the wider table
    adds more chunks past every row."""
    for min_pos in (30, 130):
        q, k, v, bt, pos = random_case(pa, dev, dtype, 1, 16, 20, seed=min_pos, min_pos=min_pos, hkv=1)
        full = pa.paged_attention(q, k, v, bt, pos, SCALE, split=False)
        assert torch.equal(pa.paged_attention(q, k, v, bt, pos, SCALE, split=True), full), min_pos
        wide = torch.cat([bt, torch.zeros_like(bt)], dim=1)  # 320 keys: 5 chunks
        for split in (False, True):
            assert torch.equal(pa.paged_attention(q, k, v, wide, pos, SCALE, split=split), full), (min_pos, split)
            for col in (0, 9, 15):
                rows = slice(col * 4, col * 4 + 4)
                alone = pa.paged_attention(q[:, :, rows].contiguous(), k, v, bt, pos[:, col:col + 1], SCALE,
                                           split=split)
                assert torch.equal(alone, full[:, :, rows]), (min_pos, split, col)


def heads_last_is_the_same_numbers_in_o_proj_order(pa: ModuleType, dev: str) -> None:
    """The kernel writing [B, T, Hq*d] itself gives bitwise attention.heads_last of its kv-major output, in
    one program per row and with a program per chunk (the combine kernel writes that case)."""
    for split in (False, True):
        q, k, v, bt, pos = random_case(pa, dev, torch.bfloat16, 2, 3, 20, seed=int(split), min_pos=70)
        kv_major = pa.paged_attention(q, k, v, bt, pos, SCALE, split=split)
        out = pa.paged_attention(q, k, v, bt, pos, SCALE, heads_last=True, split=split)
        assert out.shape == (2, 3, 2 * 4 * 24)
        assert torch.equal(out, attention.heads_last(kv_major, 3)), split


CASES["heads-last"] = heads_last_is_the_same_numbers_in_o_proj_order


def compiles_at_a_verify_width_with_expanded_positions(pa: ModuleType, dev: str) -> None:
    """torch.compile of a caller that passes one position expanded over a verify's width, as a native decode at
    the verify's shapes does, a program per key chunk: the compiled call gives the eager bits. On a GPU through
    inductor (a triton_op form of the kernel failed in its scheduler on exactly this call on an H200); on the
    CPU through aot_eager (the op's fake and functionalization; inductor's CPU code adds only a C++ compile)."""
    q, k, v, bt, pos = random_case(pa, dev, torch.float32, 3, 16, 20, seed=5, min_pos=70)

    def f(q, k, v, bt, p1):
        return pa.paged_attention(q, k, v, bt, p1.expand(3, 16), SCALE, heads_last=True, split=True) * 2

    torch._dynamo.reset()
    backend = "inductor" if dev == "cuda" else "aot_eager"
    assert torch.equal(torch.compile(f, fullgraph=True, backend=backend)(q, k, v, bt, pos[:, :1]),
                       f(q, k, v, bt, pos[:, :1]))


CASES["compiled-verify-width"] = compiles_at_a_verify_width_with_expanded_positions
CASES["invariance-float32"] = lambda pa, dev: rows_do_not_depend_on_their_batch(pa, dev, torch.float32)
CASES["invariance-bfloat16"] = lambda pa, dev: rows_do_not_depend_on_their_batch(pa, dev, torch.bfloat16)


def run_cases() -> None:
    """The child: every case under the interpreter; prints {name: "ok" or the traceback} as JSON."""
    assert engine_pa.available() and engine_pa.INTERPRET, "start the child with TRITON_INTERPRET=1"
    torch.set_num_threads(1)
    report = {}
    for name, fn in CASES.items():
        try:
            fn(engine_pa, "cpu")
            report[name] = "ok"
        except Exception:  # noqa: BLE001 (reported to the parent)
            report[name] = traceback.format_exc()
    print(json.dumps(report))


@pytest.fixture(scope="module")
def interpreted() -> dict[str, str]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", "from tests.test_paged_attention import run_cases; run_cases()"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(CASES))
def test_kernel(name: str, request: pytest.FixtureRequest) -> None:
    if torch.cuda.is_available():  # pragma: no cover (GPU machines: the compiled kernels)
        CASES[name](engine_pa, "cuda")
        return
    result = request.getfixturevalue("interpreted")[name]
    assert result == "ok", result


def test_the_engine_dispatches_decode_and_verify_on_a_gpu_only():
    q = torch.zeros(8, 4, 4, 128)
    assert not attention.use_paged(q, 1)  # the CPU keeps grouped_attention, bitwise as before
    if torch.cuda.is_available():  # pragma: no cover (GPU machines)
        qc = q.cuda()
        assert attention.use_paged(qc, 1) and attention.use_paged(qc[:, :1], 1)  # decode at any batch
        assert attention.use_paged(qc[:, :1], 16)  # a verify at any batch
        assert attention.use_paged(qc, attention.PAGED_MAX_T)
        assert not attention.use_paged(qc, attention.PAGED_MAX_T + 1)  # prefill chunks
        assert not attention.use_paged(qc, 1, "matmul")  # a forced form
    assert engine_pa.KEYS_PER_CHUNK % engine_pa.BLOCK_N == 0
