#!/usr/bin/env python3
"""GPU self-test of the moe_fused_gemm plugins (needs a CUDA GPU, CuPy; no cffi, no torch).

    out[t] = sum_k topk_weights[t,k] * w2[e] @ (silu(g) * u),  [g; u] = w13[e] @ x[t],  e = topk_ids[t,k]

Shapes: x (T,H), w13 (E,2I,H), w2 (E,H,I), topk_weights (T,K) fp32, topk_ids (T,K) int32, out (T,H);
dims = {T, H, E, I, K, dtype}; aux = [router_logits (NULL), w13, w2, topk_weights, topk_ids, workspace].

For bf16 and fp16 and each case: random inputs, `out` poisoned with NaN (and guard rows around it,
guard bytes after the workspace), the call chain kernel -> kernel_fallback as the runtime does it,
compared against a float64 reference (act rounded to the dtype, as the contract says; the whole
output and its worst token row); then a second
call must give bit-identical output, a CUDA-graph replay too; invalid ids must set status bit 0.
Prints a PASS/FAIL table and timings (informative: median of 20, eager and graph replay).
Exit status: 0 every check passed on at least one library; 1 a check failed, or nothing was
tested (no library built, or none serves this device: "NOTHING TESTED"); 2 bad arguments, or no
CuPy or no CUDA device that CuPy can use.

Libraries: by default both factors/moe_fused_gemm.so (portable, mma.sync) and, where it exists and
serves this device (cc 9.0), factors/moe_fused_gemm_sm90.so (CUTLASS grouped GEMMs for prefill,
T*K/E >= 64; the portable code below that), then a side-by-side table of graph-replay times.
`--lib PATH` (repeatable) tests only the libraries named; a named one that declines the device fails.

Decode choices: the portable path reads EX_MOE_DECODE_CONFIG per call (old | nopdl | late | onewave | new | unfused | gridwait,
default new; see factors/moe_fused_gemm.cuh). Every case above runs with the default; then, unless
--no-decode, the decode shapes of ../shared/PERF.md (the project's shared reference beside the
checkout, not in it; DECODE_CASES: qwen3/olmoe/granite/deepseek T=1, mixtral
T=64, qwen3 T=64; uniform routing, weights rotated over several sets so they are not served from
L2) run once per mode on each library, each checked the same way (float64, poisoned out,
determinism, graph replay), and a table gives graph-replay time, the floor (weight bytes of the
experts hit / 4.23 TB/s) and time/floor per mode.

    python3 scripts/gpu_moe_selftest.py [--lib factors/moe_fused_gemm_sm90.so] [--no-timing] [--quick]
                                        [--no-decode] [--modes old,nopdl,late,new]
"""
import argparse
import ctypes
import os
import runpy
import sys
from ctypes import POINTER, CFUNCTYPE, Structure, c_char, c_char_p, c_int, c_int32, c_int64, c_uint32, c_void_p

import numpy as np
try:                       # a GPU script; without CuPy only --help works
    import cupy as cp
    import cupyx
except ImportError:
    cp = cupyx = None

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# standard library only, loaded by path: this script imports neither the package nor cffi
_scripts = runpy.run_path(os.path.join(ROOT, "ex_engine", "_scripts.py"))
cupy_with_gpu = _scripts["cupy_with_gpu"]

EX_DTYPE_FLOAT32, EX_DTYPE_FLOAT16, EX_DTYPE_BFLOAT16 = 0, 1, 2
ROW_SLACK = 8.0   # the worst token row may be off by this many times the tolerance (ex_engine.verify's)
EX_OK, EX_FALLBACK = 0, -1
STATUS_NAMES = {0: "EX_OK", -1: "EX_FALLBACK", 1: "EX_ERR_INVALID_ARGUMENT", 2: "EX_ERR_UNSUPPORTED_DTYPE",
                3: "EX_ERR_SHAPE", 4: "EX_ERR_ALIGNMENT", 5: "EX_ERR_WORKSPACE", 6: "EX_ERR_CUDA",
                7: "EX_ERR_INTERNAL"}

# ---------------------------------------------------------------------------------------------
# ctypes mirror of include/ex_engine.h
# ---------------------------------------------------------------------------------------------

KernelFn = CFUNCTYPE(c_int, c_void_p, c_void_p, POINTER(c_void_p), c_int, POINTER(c_int64), c_int, c_void_p)
WorkspaceFn = CFUNCTYPE(c_int64, POINTER(c_int64), c_int)
ErrorFn = CFUNCTYPE(c_char_p)


class ExHardware(Structure):
    _fields_ = [("name", c_char * 256), ("cc_major", c_int32), ("cc_minor", c_int32),
                ("multiprocessor_count", c_int32), ("warp_size", c_int32),
                ("max_threads_per_block", c_int32), ("max_threads_per_multiprocessor", c_int32),
                ("regs_per_block", c_int32), ("regs_per_multiprocessor", c_int32),
                ("shared_mem_per_block", c_int64), ("shared_mem_per_block_optin", c_int64),
                ("shared_mem_per_multiprocessor", c_int64), ("l2_cache_bytes", c_int64),
                ("global_mem_bytes", c_int64)]


class ExTuning(Structure):
    _fields_ = [("threads_per_block", c_int32), ("items_per_thread", c_int32), ("vec_size", c_int32),
                ("shared_mem_bytes", c_int32), ("num_warps", c_int32), ("num_stages", c_int32)]


class ExFactor(Structure):
    _fields_ = [("abi_version", c_uint32), ("factor_id", c_int32), ("name", c_char_p), ("version", c_char_p),
                ("tuning", ExTuning), ("kernel", KernelFn), ("kernel_fallback", KernelFn),
                ("workspace_size", WorkspaceFn), ("last_error", ErrorFn), ("priority", c_int32),
                ("reserved_i32", c_int32), ("description", c_char_p)]


def hardware_from_device(dev=0):
    p = cp.cuda.runtime.getDeviceProperties(dev)
    hw = ExHardware()
    name = p["name"] if isinstance(p["name"], bytes) else str(p["name"]).encode()
    hw.name = name[:255]
    hw.cc_major, hw.cc_minor = p["major"], p["minor"]
    hw.multiprocessor_count = p["multiProcessorCount"]
    hw.warp_size = p["warpSize"]
    hw.max_threads_per_block = p["maxThreadsPerBlock"]
    hw.max_threads_per_multiprocessor = p["maxThreadsPerMultiProcessor"]
    hw.regs_per_block = p["regsPerBlock"]
    hw.regs_per_multiprocessor = p["regsPerMultiprocessor"]
    hw.shared_mem_per_block = p["sharedMemPerBlock"]
    hw.shared_mem_per_block_optin = p["sharedMemPerBlockOptin"]
    hw.shared_mem_per_multiprocessor = p["sharedMemPerMultiprocessor"]
    hw.l2_cache_bytes = p["l2CacheSize"]
    hw.global_mem_bytes = p["totalGlobalMem"]
    return hw


# ---------------------------------------------------------------------------------------------
# bf16 as uint16 (CuPy has no bfloat16): round-to-nearest-even on the fp32 bits
# ---------------------------------------------------------------------------------------------

def f32_to_bf16_bits(x):
    x = cp.asarray(x, dtype=cp.float32)
    u = x.view(cp.uint32)
    r = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return cp.where(cp.isnan(x), np.uint32(0x7FC0), r).astype(cp.uint16)


def bf16_bits_to_f32(b):
    return (b.astype(cp.uint32) << np.uint32(16)).view(cp.float32)


class Dt:
    """One 16-bit dtype: its code, how to store fp32 values, how to read them back."""

    def __init__(self, name):
        self.name = name
        self.code = EX_DTYPE_BFLOAT16 if name == "bf16" else EX_DTYPE_FLOAT16
        self.tol = 1e-2 if name == "bf16" else 5e-3

    def store(self, x32):           # fp32 cupy array -> device array of this dtype
        return f32_to_bf16_bits(x32) if self.name == "bf16" else x32.astype(cp.float16)

    def to_f64(self, d):            # device array of this dtype -> float64
        return (bf16_bits_to_f32(d) if self.name == "bf16" else d.astype(cp.float32)).astype(cp.float64)

    def round(self, x64):           # float64 -> nearest value of this dtype, as float64
        return self.to_f64(self.store(x64.astype(cp.float32)))

    def nan_fill(self, shape):
        if self.name == "bf16":
            return cp.full(shape, 0x7FC0, dtype=cp.uint16)
        return cp.full(shape, cp.nan, dtype=cp.float16)

    def raw(self, d):               # bit view for exact comparisons
        return d.view(cp.uint16)


# ---------------------------------------------------------------------------------------------
# Reference (float64, on the GPU): act rounded to the dtype before the second GEMM
# ---------------------------------------------------------------------------------------------

def reference(dt, x, w13, w2, tw, ids, E, I):
    T, H = x.shape
    K = ids.shape[1]
    x64 = dt.to_f64(x)
    out = cp.zeros((T, H), dtype=cp.float64)
    flat = cp.asnumpy(ids).reshape(-1)
    twf = tw.reshape(-1).astype(cp.float64)
    for e in np.unique(flat):
        if e < 0 or e >= E:
            continue  # invalid id: contributes nothing
        slots = np.nonzero(flat == e)[0]
        toks = cp.asarray(slots // K)
        gu = x64[toks] @ dt.to_f64(w13[int(e)]).T       # (n, 2I)
        g, u = gu[:, :I], gu[:, I:]
        act = dt.round(g / (1.0 + cp.exp(-g)) * u)
        y = act @ dt.to_f64(w2[int(e)]).T               # (n, H)
        cupyx.scatter_add(out, toks, twf[cp.asarray(slots)][:, None] * y)
    return out


# ---------------------------------------------------------------------------------------------
# Calling the factor as the runtime does: kernel, then kernel_fallback on -1
# ---------------------------------------------------------------------------------------------

class Factor:
    def __init__(self, so_path):
        self.lib = ctypes.CDLL(so_path)
        self.lib.ex_get_factor.restype = POINTER(ExFactor)
        self.lib.ex_get_factor.argtypes = [POINTER(ExHardware)]
        self.hw = hardware_from_device(0)
        fp = self.lib.ex_get_factor(ctypes.byref(self.hw))
        if not fp:
            raise RuntimeError("ex_get_factor returned NULL for this device")
        self.f = fp.contents
        self.abi = c_uint32.in_dll(self.lib, "ex_abi_version").value

    def workspace_size(self, dims):
        return int(self.f.workspace_size((c_int64 * len(dims))(*dims), len(dims)))

    def last_error(self):
        if not self.f.last_error:
            return ""
        s = self.f.last_error()
        return s.decode() if s else ""

    @staticmethod
    def _call(fn, out_ptr, x_ptr, aux, dims, stream_ptr, n_aux=None, n_dims=None):
        aux_arr = (c_void_p * len(aux))(*aux)
        dims_arr = (c_int64 * len(dims))(*dims)
        return fn(c_void_p(out_ptr), c_void_p(x_ptr), aux_arr, len(aux) if n_aux is None else n_aux,
                  dims_arr, len(dims) if n_dims is None else n_dims, c_void_p(stream_ptr))

    def call(self, out_ptr, x_ptr, aux, dims, stream_ptr, **kw):
        """Returns (status, path)."""
        rc = self._call(self.f.kernel, out_ptr, x_ptr, aux, dims, stream_ptr, **kw)
        if rc == EX_FALLBACK and self.f.kernel_fallback:
            return self._call(self.f.kernel_fallback, out_ptr, x_ptr, aux, dims, stream_ptr, **kw), "fallback"
        return rc, "kernel"


# ---------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------

# name, T, H, E, I, K, expected path, special
CASES = [
    ("qwen3-30b decode", 1, 2048, 128, 768, 8, "kernel", None),
    ("tiny", 3, 256, 40, 96, 8, "kernel", None),
    ("manifest T=19", 19, 256, 40, 96, 6, "kernel", None),
    ("olmoe T=64", 64, 2048, 64, 1024, 8, "kernel", None),
    ("mid config", 512, 1024, 64, 512, 8, "kernel", None),
    ("granite-ish T=1000", 1000, 512, 40, 256, 6, "kernel", None),
    ("qwen3-30b prefill", 4096, 2048, 128, 768, 8, "kernel", None),
    ("few experts (split)", 2, 1024, 8, 2048, 2, "kernel", None),
    ("odd H, I", 130, 111, 40, 67, 8, "fallback", None),
    ("every token on expert 5", 256, 1024, 64, 512, 8, "kernel", "hot5"),
    ("invalid ids", 16, 256, 40, 96, 4, "kernel", "badids"),
    ("invalid ids, odd", 13, 111, 40, 67, 4, "fallback", "badids"),
    # prefill shapes for the Hopper plugin's CUTLASS path (T*K/E >= 64)
    ("qwen3-30b T=1024", 1024, 2048, 128, 768, 8, "kernel", None),
    ("mixtral prefill", 4096, 4096, 8, 14336, 2, "kernel", None),
    ("skewed, empty experts", 2048, 1024, 64, 512, 8, "kernel", "skew"),
    ("invalid ids, prefill", 512, 256, 16, 128, 4, "kernel", "badids"),
    ("all ids invalid", 256, 256, 8, 128, 2, "kernel", "allbad"),
    ("repeated ids", 64, 1024, 64, 512, 8, "kernel", "dupids"),
    ("repeated ids, prefill", 1024, 512, 16, 256, 4, "kernel", "dupids"),
]
QUICK = {"qwen3-30b decode", "tiny", "odd H, I", "every token on expert 5", "invalid ids", "few experts (split)",
         "granite-ish T=1000", "skewed, empty experts", "invalid ids, prefill", "all ids invalid",
         "repeated ids", "repeated ids, prefill"}
CUTLASS_MIN_ROWS_PER_EXPERT = 64   # kSm90MinRowsPerExpert in factors/moe_fused_gemm_sm90.cu


FORCE_ENV = "EX_MOE_SM90_MIN_ROWS_PER_EXPERT"  # read by the sm90 plugin's ex_get_factor
DECODE_ENV = "EX_MOE_DECODE_CONFIG"             # read by the portable path on every call
COPY_TBS = 4.23                                 # ../shared/PERF.md device-copy ceiling, TB/s

# ../shared/PERF.md's decode shapes (beside the checkout, not in it): name, T, H, E, I, K
DECODE_CASES = [
    ("qwen3-30b T=1", 1, 2048, 128, 768, 8),
    ("olmoe T=1", 1, 2048, 64, 1024, 8),
    ("granite T=1", 1, 1536, 40, 512, 8),
    ("deepseek T=1", 1, 2048, 64, 1408, 6),
    ("mixtral T=64", 64, 4096, 8, 14336, 2),
    ("qwen3-30b T=64", 64, 2048, 128, 768, 8),
]


def sub_path(lib_name, path, T, H, E, I, K, min_rows=CUTLASS_MIN_ROWS_PER_EXPERT):
    """Which code served a call: 'fallback', 'mma.sync' (portable fast path) or 'cutlass'."""
    if path != "kernel":
        return path
    if "sm90" in lib_name and H % 8 == 0 and I % 8 == 0 and (T * K) // E >= min_rows:
        return "cutlass"
    return "mma.sync"


def make_inputs(dt, T, H, E, I, K, special):
    x = dt.store(cp.random.standard_normal((T, H), dtype=cp.float32))
    w13 = dt.store(cp.random.standard_normal((E, 2 * I, H), dtype=cp.float32) * np.float32(1.0 / np.sqrt(H)))
    w2 = dt.store(cp.random.standard_normal((E, H, I), dtype=cp.float32) * np.float32(1.0 / np.sqrt(I)))
    logits = cp.random.standard_normal((T, E), dtype=cp.float32)
    if special == "hot5":
        logits[:, 5] = -cp.inf                         # the others never pick 5
    if special == "skew":                              # experts 0-3 in nearly every row, 4-7 and the
        logits[:, :4] += 3.0                           # upper half never: empty groups at the start,
        logits[:, 4:8] = -cp.inf                       # in the middle and at the end
        logits[:, E // 2:] = -cp.inf
    ids = cp.argsort(-logits, axis=1)[:, :K].astype(cp.int32)   # distinct per row
    sel = cp.take_along_axis(logits, ids.astype(cp.int64), axis=1)
    if special == "hot5":
        ids[:, 0] = 5
        sel[:, 0] = 0.0
    w = cp.exp(sel - sel.max(axis=1, keepdims=True))
    tw = (w / w.sum(axis=1, keepdims=True)).astype(cp.float32)
    if special == "badids":
        ids[min(3, T - 1), 1 % K] = E
        ids[min(7, T - 1), 2 % K] = -1
        ids[T - 1, K - 1] = 1 << 30
    if special == "allbad":
        ids[...] = E
    if special == "dupids":                            # a row's ids repeat (the contract allows it:
        ids[:, 1 % K] = ids[:, 0]                      # each slot counts)
    return x, w13, w2, cp.ascontiguousarray(tw), cp.ascontiguousarray(ids)


def graph_capture(fac, stream, args):
    """Capture one call into a CUDA graph; returns (graph, status) or (None, reason)."""
    try:
        stream.begin_capture()
    except Exception as ex:  # noqa: BLE001 - API missing: report, do not fail the factor
        return None, f"capture unavailable: {ex}"
    rc, _ = fac.call(*args)
    try:
        graph = stream.end_capture()
    except Exception as ex:  # noqa: BLE001
        return None, f"end_capture failed: {ex} (status {rc})"
    if rc != EX_OK:
        return None, f"status {rc} during capture: {fac.last_error()}"
    return graph, "ok"


def time_it(fn, stream, n=20, warmup=3):
    for _ in range(warmup):
        fn()
    stream.synchronize()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    ts = []
    for _ in range(n):
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        ts.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
    return float(np.median(ts))


def run_case(fac, dt, case, stream, timing, rotate=1):
    """rotate > 1: also time graph replay over `rotate` independently drawn input sets (weights
    included), one graph each, replayed round-robin, so that the weights are not served from L2
    (us_rot: median per call)."""
    name, T, H, E, I, K, want_path, special = case
    res = {"name": name, "dtype": dt.name, "shape": f"{T},{H},{E},{I},{K}", "fails": []}
    fails = res["fails"]
    x, w13, w2, tw, ids = make_inputs(dt, T, H, E, I, K, special)
    dims = [T, H, E, I, K, dt.code]
    ws_bytes = fac.workspace_size(dims)
    if ws_bytes < 256:
        fails.append(f"workspace_size {ws_bytes} < 256")
    GUARD = 4096
    ws = cp.zeros(ws_bytes + GUARD, dtype=cp.uint8)
    ws[ws_bytes:] = 0xA5
    # out with one guard row before and after, filled with a sentinel
    out_buf = dt.nan_fill((T + 2, H))
    sentinel = dt.store(cp.full((2, H), 1234.5, dtype=cp.float32))
    out_buf[0] = sentinel[0]
    out_buf[T + 1] = sentinel[1]
    out = out_buf[1:T + 1]
    aux = [None, w13.data.ptr, w2.data.ptr, tw.data.ptr, ids.data.ptr, ws.data.ptr]
    args = (out.data.ptr, x.data.ptr, aux, dims, stream.ptr)
    cp.cuda.Device().synchronize()

    ref = reference(dt, x, w13, w2, tw, ids, E, I)
    ref_norm = float(cp.linalg.norm(ref))

    def one_call():
        out[...] = dt.nan_fill((T, H))
        ws[:4] = 0                                   # the runtime clears the status word
        cp.cuda.Device().synchronize()               # those ran on CuPy's stream, not on `stream`
        rc, path = fac.call(*args)
        stream.synchronize()
        return rc, path

    try:
        rc, path = one_call()
    except cp.cuda.runtime.CUDARuntimeError as ex:
        fails.append(f"CUDA error: {ex}")
        res.update(path="?", rel=float("nan"))
        return res, True  # sticky error: stop
    res["path"] = path
    if rc != EX_OK:
        fails.append(f"status {STATUS_NAMES.get(rc, rc)}: {fac.last_error()}")
        res["rel"] = float("nan")
        return res, False
    if path != want_path:
        fails.append(f"path {path}, expected {want_path}")
    o64 = dt.to_f64(out)
    has_nan = bool(cp.isnan(o64).any())
    if has_nan:
        fails.append("NaN left in out")
    if special == "allbad":                          # nothing contributes: exactly zero
        rel = float(cp.abs(o64).max())
        res["rel"] = rel
        if not rel == 0.0:
            fails.append(f"expected an all-zero output, max |out| = {rel:.3e}")
    else:
        rel = float(cp.linalg.norm(o64 - ref)) / ref_norm if ref_norm > 0 else float("inf")
        res["rel"] = rel
        if not rel < dt.tol:
            fails.append(f"rel err {rel:.3e} >= {dt.tol:g}")
        # one wrong token row of many (a lost slot) moves rel by ~1/sqrt(T) only: the worst row
        # against the rows' RMS norm, as ex_engine.verify.row_error does
        d = (o64 - ref).reshape(T, -1)
        rows = cp.sqrt((d * d).sum(axis=1))
        t = int(rows.argmax())
        row = float(rows[t]) * T ** 0.5 / ref_norm if T > 1 and ref_norm > 0 else 0.0
        if not row <= ROW_SLACK * dt.tol:
            fails.append(f"token row {t} is off by {row:.3e} of the rows' RMS norm, over {ROW_SLACK:g} x "
                         f"the tolerance {dt.tol:g}")
        zero_rel = float(cp.linalg.norm(cp.zeros_like(ref) - ref)) / ref_norm if ref_norm > 0 else 0.0
        if not zero_rel >= dt.tol:                   # an all-zero output must fail this check
            fails.append(f"check cannot tell a zero output from a right one (zero rel {zero_rel:.2e})")
    if not bool(cp.array_equal(dt.raw(out_buf[0]), dt.raw(sentinel[0]))) or \
            not bool(cp.array_equal(dt.raw(out_buf[T + 1]), dt.raw(sentinel[1]))):
        fails.append("wrote outside out")
    if not bool((ws[ws_bytes:] == 0xA5).all()):
        fails.append("wrote past workspace_size")
    status = int(ws[:4].view(cp.int32)[0].get())
    res["status"] = status
    if special in ("badids", "allbad"):
        if not status & 1:
            fails.append("status bit 0 not set for invalid ids")
    elif status != 0:
        fails.append(f"status word {status:#x} for valid ids")

    first = dt.raw(out).copy()
    rc2, _ = one_call()
    res["det"] = rc2 == EX_OK and bool(cp.array_equal(first, dt.raw(out)))
    if not res["det"]:
        fails.append("second call not bit-identical")

    # CUDA graph: capture once, replay, compare bits
    out[...] = dt.nan_fill((T, H))
    ws[:4] = 0
    cp.cuda.Device().synchronize()
    graph, why = graph_capture(fac, stream, args)
    res["graph"] = why
    if graph is not None:
        graph.launch(stream)
        stream.synchronize()
        if not bool(cp.array_equal(first, dt.raw(out))):
            fails.append("graph replay not bit-identical")
    elif not why.startswith("capture unavailable"):
        fails.append(f"graph: {why}")

    if timing:
        res["us"] = time_it(lambda: fac.call(*args), stream)
        if graph is not None:
            res["us_graph"] = time_it(lambda: graph.launch(stream), stream)
        flat = cp.asnumpy(ids).reshape(-1)
        valid = flat[(flat >= 0) & (flat < E)]
        hit = len(np.unique(valid))
        res["bytes"] = hit * 3 * H * I * 2 + 2 * T * H * 2
        res["flops"] = 2 * len(valid) * 3 * H * I
        res["floor_us"] = hit * 3 * H * I * 2 / (COPY_TBS * 1e12) * 1e6
        if rotate > 1 and graph is not None:
            res["us_rot"], res["floor_rot_us"] = time_rotated(fac, dt, case, stream, rotate)
    return res, False


def time_rotated(fac, dt, case, stream, n_sets):
    """Graph replay over n_sets independent input sets (each its own graph), round-robin; returns
    (median us per call, mean floor us over the sets)."""
    name, T, H, E, I, K, _, special = case
    dims = [T, H, E, I, K, dt.code]
    keep, graphs, floors = [], [], []
    for _ in range(n_sets):
        x, w13, w2, tw, ids = make_inputs(dt, T, H, E, I, K, special)
        ws = cp.zeros(max(fac.workspace_size(dims), 256), dtype=cp.uint8)
        out = cp.empty((T, H), dtype=x.dtype)
        aux = [None, w13.data.ptr, w2.data.ptr, tw.data.ptr, ids.data.ptr, ws.data.ptr]
        cp.cuda.Device().synchronize()
        g, why = graph_capture(fac, stream, (out.data.ptr, x.data.ptr, aux, dims, stream.ptr))
        if g is None:
            return None, None
        keep.append((x, w13, w2, tw, ids, ws, out))
        graphs.append(g)
        hit = len(np.unique(cp.asnumpy(ids)))
        floors.append(hit * 3 * H * I * 2 / (COPY_TBS * 1e12) * 1e6)
    for g in graphs:
        g.launch(stream)
    stream.synchronize()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    ts = []
    for _ in range(10):
        start.record(stream)
        for g in graphs:
            g.launch(stream)
        end.record(stream)
        end.synchronize()
        ts.append(cp.cuda.get_elapsed_time(start, end) * 1e3 / n_sets)
    del keep
    return float(np.median(ts)), float(np.mean(floors))


def error_code_checks(fac, stream):
    """Cheap host-side guards: no GPU work is launched for any of these."""
    rows = []
    w = cp.zeros(64, dtype=cp.uint16)
    ws = cp.zeros(1 << 16, dtype=cp.uint8)
    p = w.data.ptr
    good = [None, p, p, p, p, ws.data.ptr]

    def expect(label, want, out, x, aux, dims, **kw):
        rc, _ = fac.call(out, x, aux, dims, stream.ptr, **kw)
        msg = fac.last_error() if rc not in (0, -1) else ""
        rows.append((label, want, rc, msg))

    expect("K > E", 3, p, p, good, [4, 64, 4, 64, 5, 2])
    expect("dtype float32", 2, p, p, good, [4, 64, 4, 64, 2, EX_DTYPE_FLOAT32])
    expect("H = 0", 3, p, p, good, [4, 0, 4, 64, 2, 2])
    expect("T < 0", 3, p, p, good, [-1, 64, 4, 64, 2, 2])
    expect("T = 0, NULL tensors", 0, None, None, [None] * 5 + [ws.data.ptr], [0, 64, 4, 64, 2, 2])
    expect("NULL w13", 1, p, p, [None, None, p, p, p, ws.data.ptr], [4, 64, 4, 64, 2, 2])
    expect("n_aux = 5", 1, p, p, good, [4, 64, 4, 64, 2, 2], n_aux=5)
    expect("n_dims = 5", 1, p, p, good, [4, 64, 4, 64, 2, 2], n_dims=5)
    stream.synchronize()
    return rows


def run_library(so_path, a, explicit, forced=False):
    """Every check and case on one library. Returns (failures, {(case, dtype): result}, sticky),
    (failures, {}) when it could not be loaded, or None when the library declines this device and
    was not named explicitly. forced: the sm90 plugin with EX_MOE_SM90_MIN_ROWS_PER_EXPERT=0 (every
    aligned shape through CUTLASS), on the cases that change path that way (small T: many empty
    groups, M of a few rows)."""
    lib_name = os.path.basename(so_path)
    min_rows = 0 if forced else CUTLASS_MIN_ROWS_PER_EXPERT
    print(f"\n=================== {lib_name}" + (f" with {FORCE_ENV}=0" if forced else ""))
    try:
        if forced:
            os.environ[FORCE_ENV] = "0"
        try:
            fac = Factor(so_path)
        finally:
            os.environ.pop(FORCE_ENV, None)
    except (OSError, RuntimeError) as ex:
        if explicit:
            print(f"FAIL: {so_path}: {ex}")
            return 1, {}
        print(f"skipped: {so_path}: {ex}")
        return None
    f, t = fac.f, fac.f.tuning
    print(f"device: {fac.hw.name.decode()} (cc {fac.hw.cc_major}.{fac.hw.cc_minor}, "
          f"{fac.hw.multiprocessor_count} SMs, smem optin {fac.hw.shared_mem_per_block_optin})")
    print(f"factor: {f.name.decode()} {f.version.decode()} id={f.factor_id} abi={f.abi_version:#x} "
          f"(exported ex_abi_version {fac.abi:#x}) priority={f.priority}")
    print(f"tuning: threads={t.threads_per_block} warps={t.num_warps} items={t.items_per_thread} "
          f"vec={t.vec_size} smem={t.shared_mem_bytes} stages={t.num_stages}")
    print(f"description: {f.description.decode() if f.description else ''}")
    failed = 0
    meta_fail = []
    if f.abi_version != fac.abi or f.factor_id != 2 or f.name != b"moe_fused_gemm":
        meta_fail.append("factor metadata")
    if t.threads_per_block % fac.hw.warp_size or t.num_warps * fac.hw.warp_size != t.threads_per_block \
            or t.shared_mem_bytes > fac.hw.shared_mem_per_block_optin or t.num_stages < 1 or t.vec_size != 8:
        meta_fail.append("tuning vs hardware")
    if not f.kernel or not f.kernel_fallback or not f.workspace_size or not f.last_error:
        meta_fail.append("NULL entry points")
    if meta_fail:
        print("FAIL:", ", ".join(meta_fail))
        failed += len(meta_fail)

    stream = cp.cuda.Stream(non_blocking=True)

    print("\nerror codes (host guards)")
    for label, want, rc, msg in error_code_checks(fac, stream):
        ok = rc == want
        failed += not ok
        print(f"  {'PASS' if ok else 'FAIL'}  {label:22s} want {STATUS_NAMES[want]:26s} got "
              f"{STATUS_NAMES.get(rc, rc)}  {msg}")

    hdr = (f"{'':4s} {'case':22s} {'dt':4s} {'T,H,E,I,K':22s} {'path':8s} {'code':8s} {'rel err':>9s} "
           f"{'det':>3s} {'graph':>5s} {'status':>6s} {'us':>9s} {'us graph':>9s} {'TB/s':>6s} {'TFLOP/s':>7s}  notes")
    print("\n" + hdr)
    results = {}
    sticky = False
    for dtn in ("bf16", "fp16"):
        dt = Dt(dtn)
        for case in CASES:
            if a.quick and case[0] not in QUICK:
                continue
            if forced and sub_path(lib_name, "kernel", *case[1:6]) == "cutlass":
                continue                             # already on the CUTLASS path without forcing
            if forced and sub_path(lib_name, "kernel", *case[1:6], min_rows=0) != "cutlass":
                continue                             # odd H, I: forcing changes nothing
            if sticky:
                break
            cp.random.seed(1234)                     # the same inputs for every library
            try:
                res, sticky = run_case(fac, dt, case, stream, not a.no_timing)
            except Exception as ex:  # noqa: BLE001 - a CUDA fault surfaces here; report and stop
                res = {"name": case[0], "dtype": dtn, "shape": ",".join(map(str, case[1:6])),
                       "fails": [f"{type(ex).__name__}: {ex}"]}
                sticky = True
            ok = not res["fails"]
            failed += not ok
            us, usg = res.get("us"), res.get("us_graph")
            best = usg or us
            tbs = f"{res['bytes'] / (best * 1e-6) / 1e12:6.2f}" if best else "     -"
            tfl = f"{res['flops'] / (best * 1e-6) / 1e12:7.1f}" if best else "      -"
            code = sub_path(lib_name, res.get("path", "?"), *case[1:6], min_rows=min_rows)
            res["code"], res["tflops"] = code, (res["flops"] / (best * 1e-6) / 1e12 if best else None)
            results[(case[0], dtn)] = res
            print(f"{'PASS' if ok else 'FAIL'} {res['name']:22s} {res['dtype']:4s} {res['shape']:22s} "
                  f"{res.get('path', '?'):8s} {code:8s} {res.get('rel', float('nan')):9.2e} "
                  f"{'yes' if res.get('det') else 'no':>3s} {'ok' if res.get('graph') == 'ok' else '-':>5s} "
                  f"{res.get('status', -1):6d} {us if us else 0:9.1f} {usg if usg else 0:9.1f} {tbs} {tfl}  "
                  f"{'; '.join(res['fails'])}", flush=True)
            cp.get_default_memory_pool().free_all_blocks()
    if not sticky and not forced and not a.no_decode:
        n_fail, sticky = decode_pass(fac, a, stream, results)
        failed += n_fail
    if sticky:
        print("FAIL: a CUDA error left the context unusable; remaining cases (and libraries) skipped")
        failed += 1
    return failed, results, sticky


def decode_pass(fac, a, stream, results):
    """../shared/PERF.md's decode shapes under each EX_MOE_DECODE_CONFIG mode: checked like every case, timed
    by graph replay over rotated input sets. Results go into `results` keyed (name [mode], dtype)."""
    modes = [m for m in a.modes.split(",") if m]
    dtypes = ("bf16",) if a.quick else ("bf16", "fp16")
    print(f"\ndecode shapes per {DECODE_ENV} mode ({', '.join(modes)}); us rot = graph replay over "
          f"{a.rotate} rotated input sets; floor = weight bytes of the experts hit / {COPY_TBS} TB/s")
    print(f"{'':4s} {'case':30s} {'dt':4s} {'rel err':>9s} {'det':>3s} {'graph':>5s} {'us graph':>9s} "
          f"{'us rot':>9s} {'floor':>7s} {'x floor':>7s}  notes")
    failed, sticky = 0, False
    saved = os.environ.get(DECODE_ENV)
    try:
        for dtn in dtypes:
            dt = Dt(dtn)
            for (name, T, H, E, I, K) in DECODE_CASES:
                for mode in modes:
                    if sticky:
                        break
                    os.environ[DECODE_ENV] = mode
                    case = (f"{name} [{mode}]", T, H, E, I, K, "kernel", None)
                    cp.random.seed(4321)             # the same inputs for every mode and library
                    try:
                        res, sticky = run_case(fac, dt, case, stream, not a.no_timing,
                                               rotate=a.rotate)
                    except Exception as ex:  # noqa: BLE001
                        res = {"name": case[0], "dtype": dtn, "shape": f"{T},{H},{E},{I},{K}",
                               "fails": [f"{type(ex).__name__}: {ex}"]}
                        sticky = True
                    ok = not res["fails"]
                    failed += not ok
                    usr, fl = res.get("us_rot"), res.get("floor_rot_us")
                    best = usr or res.get("us_graph") or res.get("us")
                    fl = fl or res.get("floor_us")
                    res["code"] = "mma.sync"
                    res["tflops"] = res["flops"] / (best * 1e-6) / 1e12 if best and "flops" in res else None
                    res["x_floor"] = best / fl if best and fl else None
                    results[(case[0], dtn)] = res
                    print(f"{'PASS' if ok else 'FAIL'} {case[0]:30s} {dtn:4s} {res.get('rel', float('nan')):9.2e} "
                          f"{'yes' if res.get('det') else 'no':>3s} {'ok' if res.get('graph') == 'ok' else '-':>5s} "
                          f"{res.get('us_graph') or 0:9.1f} {usr or 0:9.1f} {fl or 0:7.1f} "
                          f"{res['x_floor'] if res.get('x_floor') else 0:7.2f}  {'; '.join(res['fails'])}",
                          flush=True)
                    cp.get_default_memory_pool().free_all_blocks()
    finally:
        if saved is None:
            os.environ.pop(DECODE_ENV, None)
        else:
            os.environ[DECODE_ENV] = saved
    if not a.no_timing and len(modes) >= 2:
        print(f"\ndecode summary (us rot per mode, x floor; last column: {modes[0]} / {modes[-1]})")
        for dtn in dtypes:
            for (name, *_rest) in DECODE_CASES:
                rs = [results.get((f"{name} [{m}]", dtn)) for m in modes]
                cells, ts = "", []
                for m, r in zip(modes, rs):
                    us = (r or {}).get("us_rot") or (r or {}).get("us_graph")
                    xf = (r or {}).get("x_floor")
                    ts.append(us)
                    cells += f" | {m}: {us or 0:8.1f} us {xf or 0:5.2f}x"
                sp = f" | {ts[0] / ts[-1]:5.2f}x" if ts[0] and ts[-1] else ""
                print(f"  {name:18s} {dtn:4s}{cells}{sp}")
    return failed, sticky


def side_by_side(names, all_results):
    """Graph-replay time and TFLOP/s of every case each library ran, in one table."""
    print("\nside by side (graph replay, median of 20; TFLOP/s = 2*T*K*3*H*I / time, valid slots only)")
    head = f"{'case':22s} {'dt':4s} {'T,H,E,I,K':22s}"
    for n in names:
        head += f" | {n[:24]:>24s} {'code':8s} {'us':>9s} {'TFLOP/s':>7s}"
    print(head + (" | speedup 1st/2nd" if len(names) >= 2 else ""))
    keys = []
    for n in names:
        for k in all_results[n]:
            if k not in keys:
                keys.append(k)
    for k in keys:
        row, times = "", []
        shape = next(all_results[n][k]["shape"] for n in names if k in all_results[n])
        for n in names:
            r = all_results[n].get(k)
            if r is None:
                row += f" | {'':24s} {'-':8s} {'-':>9s} {'-':>7s}"
                times.append(None)
                continue
            us = r.get("us_rot") or r.get("us_graph") or r.get("us")
            times.append(us)
            tf = f"{r['tflops']:7.1f}" if r.get("tflops") else "      -"
            xf = f" ({r['x_floor']:.2f}x floor)" if r.get("x_floor") else ""
            row += f" | {xf:>24s} {r.get('code', '?'):8s} {us if us else 0:9.1f} {tf}"
        sp = ""
        if len(names) >= 2 and times[0] and times[1]:
            sp = f" | {times[0] / times[1]:6.2f}x"
        print(f"{k[0]:22s} {k[1]:4s} {shape:22s}{row}{sp}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_scripts["HelpFormatter"])
    ap.add_argument("--lib", "--so", dest="libs", action="append", default=None,
                    help="plugin library to test (repeatable); default: factors/moe_fused_gemm.so and "
                         "factors/moe_fused_gemm_sm90.so")
    ap.add_argument("--no-timing", action="store_true", help="correctness only, no timings")
    ap.add_argument("--quick", action="store_true", help="small cases only")
    ap.add_argument("--no-forced", action="store_true",
                    help=f"skip the extra pass of the sm90 plugin with {FORCE_ENV}=0")
    ap.add_argument("--no-decode", action="store_true",
                    help=f"skip the decode shapes run once per {DECODE_ENV} mode")
    ap.add_argument("--modes", default="old,nopdl,late,new",
                    help=f"{DECODE_ENV} values to compare on the decode shapes (default old,nopdl,late,new)")
    ap.add_argument("--rotate", type=_scripts["integer"], default=4,
                    help="input sets rotated in the decode timings (weights not served from L2)")
    a = ap.parse_args()
    known_modes = ("old", "nopdl", "late", "onewave", "new", "unfused", "gridwait")   # the .cuh's decode_mode()
    bad = [m for m in a.modes.split(",") if m not in known_modes]
    if bad or a.rotate < 1:
        print(f"gpu_moe_selftest: expected --modes from {','.join(known_modes)} and --rotate >= 1, "
              f"got --modes {a.modes} --rotate {a.rotate}", file=sys.stderr)
        return 2
    # the arguments before the machine (a wrong --lib said only "needs CuPy and a CUDA GPU")
    missing = [so for so in a.libs or [] if not os.path.isfile(so)]
    if missing:
        print(f"gpu_moe_selftest: --lib: expected a built library file, got {', '.join(missing)} "
              "(no such file)", file=sys.stderr)
        return 2
    usable, why = cupy_with_gpu()
    if usable is None:   # not 'skipped' library by library, nor a traceback at the first CUDA call
        print(f"gpu_moe_selftest: needs CuPy and a CUDA GPU: {why}", file=sys.stderr)
        return 2

    explicit = a.libs is not None
    libs = a.libs or [os.path.join(ROOT, "factors", "moe_fused_gemm.so"),
                      os.path.join(ROOT, "factors", "moe_fused_gemm_sm90.so")]
    runs = [(so, False) for so in libs]
    if not a.no_forced:
        runs += [(so, True) for so in libs if "sm90" in os.path.basename(so)]
    failed = 0
    names, all_results = [], {}
    for so, forced in runs:
        if not explicit and not os.path.exists(so):
            print(f"\nskipped: {so} (not built)")
            continue
        out = run_library(so, a, explicit, forced)
        if out is None:
            continue
        if len(out) == 2:
            failed += out[0]
            continue
        n_fail, results, sticky = out
        failed += n_fail
        name = os.path.basename(so) + (" (forced)" if forced else "")
        names.append(name)
        all_results[name] = results
        if sticky:
            break
    if len(names) > 1 and not a.no_timing:
        side_by_side(names, all_results)
    if failed == 0 and not names:      # every library skipped: no PASS to claim
        print("\nNOTHING TESTED: no library was built or serves this device (see 'skipped' above)")
        return 1
    print(f"\n{'ALL PASS' if failed == 0 else f'{failed} FAILED'}")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    _scripts["exit_quietly_on_broken_pipe"](main)   # `| head`, Ctrl-C, `> /dev/full`: one line, no traceback
