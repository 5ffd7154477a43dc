"""cuBLASLt's candidate algorithms for one projection shape, each callable: y = x @ w.T in bf16 (fp32 accumulate).

torch calls cuBLAS with its heuristic's first pick and offers no other (TunableOp on CUDA has only that one). At
a decode batch's row counts that pick reads the smaller projections well below the copy rate (docs/results.md).
This module asks cuBLASLt's heuristic for its ranked list of algorithms and runs any of them, so
bench/gemm_shapes.py can time each in a step-like CUDA graph ("lt:N" variants). Measured and not taken by the engine
(docs/results.md).

A binding through ctypes to the libcublasLt torch already loaded (no build step, no new package). The structs are
cuBLASLt's public ABI: an algorithm is 8 opaque 64-bit words, a heuristic result adds its workspace size, status,
waves count and 4 reserved ints. The row-major product is computed as cuBLAS sees torch's F.linear: the column-major
y^T [N, M] = op_T(W viewed [K, N]) @ x viewed [K, M].
"""
from __future__ import annotations

import ctypes
import functools

import torch

CUBLAS_COMPUTE_32F = 68
CUDA_R_32F = 0
CUDA_R_16F = 2
CUDA_R_16BF = 14
CUBLAS_OP_N = 0
CUBLAS_OP_T = 1
DESC_TRANSA = 3
DESC_TRANSB = 4
PREF_MAX_WORKSPACE_BYTES = 1
# cublasLtMatmulAlgoConfigAttributes_t: what `describe` reads back from an algorithm
CONFIG_ATTRS = {"algo_id": 0, "tile_id": 1, "splitk_num": 2, "reduction_scheme": 3, "cta_swizzling": 4,
                "custom_option": 5, "stages_id": 6, "inner_shape_id": 7, "cluster_shape_id": 8}
DTYPES = {torch.bfloat16: CUDA_R_16BF, torch.float16: CUDA_R_16F}


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL:
    """The libcublasLt mapped into this process by torch (after a first matmul on the GPU)."""
    torch.nn.functional.linear(torch.ones(1, 16, device="cuda", dtype=torch.bfloat16),
                               torch.ones(16, 16, device="cuda", dtype=torch.bfloat16))
    torch.cuda.synchronize()
    with open("/proc/self/maps") as f:
        paths = sorted({line.split()[-1] for line in f if "libcublasLt" in line})
    if not paths:
        raise RuntimeError("libcublasLt is not mapped in this process; torch's CUDA build did not load it")
    return ctypes.CDLL(paths[0])


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} returned cublasStatus {status}")


class LtGemm:
    """y [M, N] = x [M, K] @ w [N, K].T for one (M, N, K) and dtype, through any of cuBLASLt's ranked algorithms."""

    def __init__(self, m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16, max_algos: int = 32,
                 workspace_bytes: int = 64 << 20):
        lib = library()
        self.m, self.n, self.k, self.dtype = m, n, k, dtype
        dt = DTYPES[dtype]
        self.handle = ctypes.c_void_p()
        _check(lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), CUBLAS_COMPUTE_32F, CUDA_R_32F),
               "cublasLtMatmulDescCreate")
        for attr, op in ((DESC_TRANSA, CUBLAS_OP_T), (DESC_TRANSB, CUBLAS_OP_N)):
            v = ctypes.c_int32(op)
            _check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(v), ctypes.sizeof(v)),
                   "cublasLtMatmulDescSetAttribute")
        self.layouts = []
        for rows, cols, ld in ((k, n, k), (k, m, k), (n, m, n)):  # A = W as [K, N], B = x as [K, M], C = y^T
            lay = ctypes.c_void_p()
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), dt, ctypes.c_uint64(rows),
                                                  ctypes.c_uint64(cols), ctypes.c_int64(ld)),
                   "cublasLtMatrixLayoutCreate")
            self.layouts.append(lay)
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        ws = ctypes.c_uint64(workspace_bytes)
        _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws),
                                                        ctypes.sizeof(ws)), "cublasLtMatmulPreferenceSetAttribute")
        results = (HeuristicResult * max_algos)()
        count = ctypes.c_int(0)
        a, b, c = self.layouts
        _check(lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, a, b, c, c, pref, max_algos, results,
                                                  ctypes.byref(count)), "cublasLtMatmulAlgoGetHeuristic")
        lib.cublasLtMatmulPreferenceDestroy(pref)
        # every result's workspace is within the preference's bound, so one buffer of that size serves them all
        self.results = [results[i] for i in range(count.value) if results[i].state == 0]
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device="cuda")
        self._alpha = ctypes.c_float(1.0)
        self._beta = ctypes.c_float(0.0)

    def __len__(self) -> int:
        return len(self.results)

    def describe(self, i: int) -> dict[str, float]:
        """Algorithm i's configuration as cuBLASLt reports it, its workspace and its waves count."""
        lib = library()
        r = self.results[i]
        out: dict[str, float] = {"workspace_bytes": r.workspace_size, "waves_count": r.waves_count}
        for name, attr in CONFIG_ATTRS.items():
            v = ctypes.c_uint32(0)
            written = ctypes.c_size_t(0)
            st = lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(r.algo), attr, ctypes.byref(v),
                                                          ctypes.sizeof(v), ctypes.byref(written))
            if st == 0:
                out[name] = v.value
        return out

    def __call__(self, x: torch.Tensor, w: torch.Tensor, i: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ w.T by algorithm i, on torch's current stream (so a CUDA graph captures it)."""
        assert x.shape == (self.m, self.k) and w.shape == (self.n, self.k) and x.dtype == w.dtype == self.dtype
        assert x.is_contiguous() and w.is_contiguous()
        y = torch.empty((self.m, self.n), dtype=self.dtype, device=x.device) if out is None else out
        r = self.results[i]
        a, b, c = self.layouts
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        _check(library().cublasLtMatmul(
            self.handle, self.desc, ctypes.byref(self._alpha), ctypes.c_void_p(w.data_ptr()), a,
            ctypes.c_void_p(x.data_ptr()), b, ctypes.byref(self._beta), ctypes.c_void_p(y.data_ptr()), c,
            ctypes.c_void_p(y.data_ptr()), c, ctypes.byref(r.algo), ctypes.c_void_p(self.workspace.data_ptr()),
            ctypes.c_size_t(r.workspace_size), stream), "cublasLtMatmul")
        return y
