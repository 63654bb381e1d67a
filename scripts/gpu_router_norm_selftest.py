#!/usr/bin/env python3
"""GPU self-test of factors/topk_softmax.so and factors/fused_add_rmsnorm.so (CuPy + numpy + ctypes).

    make factors/topk_softmax.so factors/fused_add_rmsnorm.so
    python3 scripts/gpu_router_norm_selftest.py            # checks, then timings
    python3 scripts/gpu_router_norm_selftest.py --no-timing

Loads each plugin with ctypes, builds an ex_hardware_t from the device's properties, checks the
ABI fields and the tuning, then checks `kernel` and `kernel_fallback` against float64 numpy
references on awkward shapes, every dtype, special values and strided / misaligned views, with
outputs poisoned before each call.  Prints a PASS/FAIL table (and timings).  Exit status: 0 every
check passed; 1 a check failed, or nothing was tested (neither library loads and serves this
device); 2 no CuPy, or no CUDA device that CuPy can use.

topk_softmax reference (manifests/topk_softmax.yaml): ranking by logit with NaN as -inf, ties to
the lowest index (a stable sort); p = exp(l - m) / sum exp(l - m), the +inf entries sharing 1
when m = +inf, 1/E everywhere when every logit is -inf; NaN weights in a row holding a NaN logit.  ids must match exactly,
weights within 1e-5 relative (+1e-7 absolute, for values that underflow in fp32).

fused_add_rmsnorm reference (manifests/fused_add_rmsnorm.yaml): residual = round(fp32(x + residual))
(checked bit for bit, and norm-wise against float64), x = residual * rsqrt(mean(residual^2) + eps)
* weight in float64, norm-wise relative tolerance fp32 1e-5, fp16 2e-3, bf16 1.6e-2.

bfloat16 data live in uint16 CuPy arrays; the conversions are done in numpy with integer ops.
"""
import argparse
import ctypes
import os
import runpy
import struct
import sys

import numpy as np

# --------------------------------------------------------------------------------------------
# The ABI (include/ex_engine.h), mirrored with ctypes
# --------------------------------------------------------------------------------------------
EX_ABI_VERSION = (1 << 16) | 0
EX_OK, EX_FALLBACK = 0, -1
EX_ERR_INVALID_ARGUMENT, EX_ERR_UNSUPPORTED_DTYPE, EX_ERR_SHAPE = 1, 2, 3
DTYPE_CODE = {"float32": 0, "float16": 1, "bfloat16": 2}


class ExHardware(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char * 256), ("cc_major", ctypes.c_int32), ("cc_minor", ctypes.c_int32),
                ("multiprocessor_count", ctypes.c_int32), ("warp_size", ctypes.c_int32),
                ("max_threads_per_block", ctypes.c_int32), ("max_threads_per_multiprocessor", ctypes.c_int32),
                ("regs_per_block", ctypes.c_int32), ("regs_per_multiprocessor", ctypes.c_int32),
                ("shared_mem_per_block", ctypes.c_int64), ("shared_mem_per_block_optin", ctypes.c_int64),
                ("shared_mem_per_multiprocessor", ctypes.c_int64), ("l2_cache_bytes", ctypes.c_int64),
                ("global_mem_bytes", ctypes.c_int64)]


class ExTuning(ctypes.Structure):
    _fields_ = [(f, ctypes.c_int32) for f in ("threads_per_block", "items_per_thread", "vec_size",
                                              "shared_mem_bytes", "num_warps", "num_stages")]


KERNEL_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                             ctypes.c_int, ctypes.POINTER(ctypes.c_int64), ctypes.c_int, ctypes.c_void_p)
ERROR_FN = ctypes.CFUNCTYPE(ctypes.c_char_p)
# standard library only, loaded by path: this script does not import the package
_scripts = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ex_engine", "_scripts.py"))
cupy_with_gpu = _scripts["cupy_with_gpu"]


class ExFactor(ctypes.Structure):
    _fields_ = [("abi_version", ctypes.c_uint32), ("factor_id", ctypes.c_int32), ("name", ctypes.c_char_p),
                ("version", ctypes.c_char_p), ("tuning", ExTuning), ("kernel", KERNEL_FN),
                ("kernel_fallback", KERNEL_FN), ("workspace_size", ctypes.c_void_p), ("last_error", ERROR_FN),
                ("priority", ctypes.c_int32), ("reserved_i32", ctypes.c_int32), ("description", ctypes.c_char_p)]


def hardware_from_device(cp):
    p = cp.cuda.runtime.getDeviceProperties(0)
    hw = ExHardware()
    name = p.get("name", b"")
    hw.name = (name if isinstance(name, bytes) else str(name).encode())[:255]
    for field, key in [("cc_major", "major"), ("cc_minor", "minor"), ("multiprocessor_count", "multiProcessorCount"),
                       ("warp_size", "warpSize"), ("max_threads_per_block", "maxThreadsPerBlock"),
                       ("max_threads_per_multiprocessor", "maxThreadsPerMultiProcessor"),
                       ("regs_per_block", "regsPerBlock"), ("regs_per_multiprocessor", "regsPerMultiprocessor"),
                       ("shared_mem_per_block", "sharedMemPerBlock"),
                       ("shared_mem_per_block_optin", "sharedMemPerBlockOptin"),
                       ("shared_mem_per_multiprocessor", "sharedMemPerMultiprocessor"),
                       ("l2_cache_bytes", "l2CacheSize"), ("global_mem_bytes", "totalGlobalMem")]:
        setattr(hw, field, int(p.get(key, 0)))
    return hw


class Plugin:
    def __init__(self, path, hw):
        self.path = path
        self.lib = ctypes.CDLL(path)
        self.abi = ctypes.c_uint32.in_dll(self.lib, "ex_abi_version").value
        self.lib.ex_get_factor.restype = ctypes.POINTER(ExFactor)
        self.lib.ex_get_factor.argtypes = [ctypes.POINTER(ExHardware)]
        self.hw = hw
        self.factor = self.get(hw)

    def get(self, hw):
        ptr = self.lib.ex_get_factor(ctypes.byref(hw))
        return ptr.contents if ptr else None

    def call(self, which, out, inp, aux, dims, stream_ptr):
        fn = getattr(self.factor, which)
        aux_arr = (ctypes.c_void_p * max(1, len(aux)))(*aux)
        dims_arr = (ctypes.c_int64 * max(1, len(dims)))(*dims)
        return fn(out, inp, aux_arr, len(aux), dims_arr, len(dims), stream_ptr)

    def error(self):
        return (self.factor.last_error() or b"").decode()


# --------------------------------------------------------------------------------------------
# dtypes: numpy storage <-> float32 (bfloat16 as uint16 bits, round to nearest even)
# --------------------------------------------------------------------------------------------
def f32_to_bf16_bits(a):
    a = np.ascontiguousarray(a, dtype=np.float32)
    u = a.view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    quiet_nan = ((u >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return np.where(np.isnan(a), quiet_nan, rounded)


def bf16_bits_to_f32(b):
    return (np.ascontiguousarray(b, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


def to_storage(a32, dtype):
    """float32 values stored as ``dtype`` (bf16 as its bits); values past float16's range become
    inf, as a cast does (callers draw such rows on purpose: no overflow warning)."""
    if dtype == "bfloat16":
        return f32_to_bf16_bits(a32)
    with np.errstate(over="ignore"):
        return np.asarray(a32, dtype=np.float32).astype(STORAGE[dtype])


def to_f32(s, dtype):
    return bf16_bits_to_f32(s) if dtype == "bfloat16" else np.asarray(s).astype(np.float32)


# --------------------------------------------------------------------------------------------
# Results table
# --------------------------------------------------------------------------------------------
class Table:
    def __init__(self):
        self.rows = {}  # group -> [cases, failures, worst, first failure]

    def add(self, group, ok, worst=0.0, detail=""):
        r = self.rows.setdefault(group, [0, 0, 0.0, ""])
        r[0] += 1
        r[2] = max(r[2], worst)
        if not ok:
            r[1] += 1
            if not r[3]:
                r[3] = detail
            print(f"  FAIL {group}: {detail}", flush=True)

    def failures(self):
        return sum(r[1] for r in self.rows.values())

    def show(self):
        print("\n'worst': topk = largest relative weight error; rmsnorm = largest norm-wise error / tolerance")
        print(f"{'group':46s} {'cases':>6s} {'fail':>5s} {'worst':>10s}  result")
        for g, (n, f, w, d) in self.rows.items():
            print(f"{g:46s} {n:6d} {f:5d} {w:10.3g}  {'PASS' if f == 0 else 'FAIL: ' + d[:120]}")


# --------------------------------------------------------------------------------------------
# ABI and tuning
# --------------------------------------------------------------------------------------------
def check_abi(tab, plug, stem, factor_id, hw):
    g = f"{stem}: ABI and tuning"
    f = plug.factor
    tab.add(g, plug.abi == EX_ABI_VERSION, detail=f"ex_abi_version {plug.abi:#x}")
    tab.add(g, f is not None, detail="ex_get_factor returned NULL on this device")
    if f is None:
        return False
    t = f.tuning
    checks = [
        (f.abi_version == EX_ABI_VERSION, f"abi_version {f.abi_version:#x}"),
        (f.factor_id == factor_id, f"factor_id {f.factor_id}"),
        (f.name == stem.encode(), f"name {f.name!r}"),
        (f.version == b"0.1.0", f"version {f.version!r}"),
        (bool(f.kernel), "kernel is NULL"),
        (bool(f.last_error), "last_error is NULL"),
        (f.priority == 0 and f.reserved_i32 == 0, "priority / reserved not 0"),
        (t.threads_per_block > 0 and t.threads_per_block % hw.warp_size == 0
         and t.threads_per_block <= hw.max_threads_per_block, f"threads_per_block {t.threads_per_block}"),
        (t.num_warps * hw.warp_size == t.threads_per_block, f"num_warps {t.num_warps}"),
        (t.vec_size == 8, f"vec_size {t.vec_size}"),
        (t.items_per_thread >= 1 and t.num_stages == 1, "items_per_thread / num_stages"),
        (0 <= t.shared_mem_bytes <= hw.shared_mem_per_block_optin, f"shared_mem_bytes {t.shared_mem_bytes}"),
        (plug.error() == "", f"last_error before any call: {plug.error()!r}"),
    ]
    for ok, d in checks:
        tab.add(g, ok, detail=d)
    # other hardware: a 64-lane warp is declined; a smaller block limit is respected
    hw64 = ExHardware.from_buffer_copy(hw)
    hw64.warp_size = 64
    tab.add(g, plug.get(hw64) is None, detail="warp_size 64 not declined")
    hw128 = ExHardware.from_buffer_copy(hw)
    hw128.max_threads_per_block = 128
    f128 = plug.get(hw128)
    tab.add(g, f128 is not None and f128.tuning.threads_per_block <= 128
            and f128.tuning.num_warps * 32 == f128.tuning.threads_per_block,
            detail="max_threads_per_block 128 not respected")
    plug.factor = plug.get(hw)  # back to the real device's tuning
    return True


# --------------------------------------------------------------------------------------------
# topk_softmax
# --------------------------------------------------------------------------------------------
def topk_reference(l64, K, renormalize):
    """l64: (T, E) float64 logits.  Returns ids (T, K) int32 and weights (T, K) float64."""
    T, E = l64.shape
    key = np.where(np.isnan(l64), -np.inf, l64)
    ids = np.argsort(-key, axis=1, kind="stable")[:, :K].astype(np.int32)  # ties: lowest index
    m = key.max(axis=1, keepdims=True) if E else np.zeros((T, 1))
    with np.errstate(invalid="ignore", over="ignore"):
        finite = np.isfinite(m)
        u = np.where(finite, np.exp(key - np.where(finite, m, 0.0)), 0.0)
        u = np.where(m == np.inf, (key == np.inf).astype(np.float64), u)
        u = np.where(m == -np.inf, 1.0, u)
    p = u / u.sum(axis=1, keepdims=True)
    w = np.take_along_axis(p, ids.astype(np.int64), axis=1)
    if renormalize:
        w = w / w.sum(axis=1, keepdims=True)
    w = np.where(np.isnan(l64).any(axis=1, keepdims=True), np.nan, w)   # a NaN logit: NaN weights
    return ids, w


def topk_logits(rng, T, E, dtype):
    """Normal logits (scale 2) with special rows: ties, NaN, +-inf, all -inf, all NaN, +-0, huge."""
    l = (rng.standard_normal((T, E)) * 2.0).astype(np.float32)
    big = 30000.0 if dtype == "float16" else 1e30
    specials = []
    if E >= 1:
        specials = [
            lambda r: np.full(E, 0.5, np.float32),                                   # all tied
            lambda r: np.round(r),                                                   # many ties
            lambda r: np.where(rng.random(E) < 0.25, np.nan, r),                     # NaN scattered
            lambda r: np.where(np.arange(E) == E // 2, np.inf, np.where(np.arange(E) == 0, np.nan, r)),
            lambda r: np.where(np.arange(E) % 3 == 1, np.inf,                        # several +inf, -inf, NaN
                               np.where(np.arange(E) % 3 == 2, -np.inf, np.nan)),
            lambda r: np.full(E, -np.inf, np.float32),                               # all -inf
            lambda r: np.where(np.arange(E) % 2 == 0, -np.inf, np.nan),              # -inf and NaN only
            lambda r: np.full(E, np.nan, np.float32),                                # all NaN
            lambda r: np.where(np.arange(E) % 3 == 0, -0.0,                          # +0 / -0 ties
                               np.where(np.arange(E) % 3 == 1, 0.0, -1.0)),
            lambda r: np.where(np.arange(E) % 2 == 0, big, -big) * np.sign(r + 0.1), # huge magnitudes
            lambda r: np.where(rng.random(E) < 0.5, -np.inf, r),                     # -inf scattered
            lambda r: np.where(np.arange(E) == E - 1, r.max() + 1, r),               # winner in the last slot
        ]
    if T >= 7:
        n = min(len(specials), T // 2)
        for i in range(n):
            row = (i * 37 + 1) % T
            l[row] = np.asarray(specials[i](l[row]), dtype=np.float32)
    s = to_storage(l, dtype)
    return s, to_f32(s, dtype).astype(np.float64)


def run_topk(cp, tab, plug, stream, quick):
    rng = np.random.default_rng(1234)
    Ts = (0, 1, 7, 1000) if quick else (0, 1, 7, 1000, 16384)
    Es = (1, 8, 40, 128, 384, 512)
    extra = [(37, 3), (37, 7), (37, 33), (37, 100), (37, 257), (37, 1000), (37, 1024), (19, 1500), (5, 2048)]
    cases = [(T, E) for T in Ts for E in Es] + extra
    have_fb = bool(plug.factor.kernel_fallback)
    for T, E in cases:
        for dtype in ("float32", "float16", "bfloat16"):
            logits, l64 = topk_logits(rng, T, E, dtype)
            d_full = cp.asarray(logits)
            views = [("aligned", d_full)]
            if T > 0 and (T, E) in extra[:3] + [(1000, 40), (7, 128)]:
                buf = cp.asarray(np.concatenate([logits.reshape(-1)[:1], logits.reshape(-1)]))
                views.append(("misaligned", buf[1:].reshape(T, E)))  # base 1 element off
            Ks = sorted({k for k in (1, 8, E) if 1 <= k <= E})
            for K in Ks:
                for renorm in (0, 1):
                    ref_ids, ref_w = topk_reference(l64, K, renorm)
                    for vname, d_logits in views:
                        for which in ("kernel", "kernel_fallback") if have_fb else ("kernel",):
                            group = f"topk_softmax {which} {'E<=1024' if E <= 1024 else 'E>1024'}"
                            if vname != "aligned":
                                group += " misaligned"
                            w = cp.full((T, K), -7.0, dtype=cp.float32)   # no weight is negative
                            ids = cp.full((T, K), -7, dtype=cp.int32)
                            dims = [T, E, K, renorm, DTYPE_CODE[dtype]]
                            rc = plug.call(which, w.data.ptr, d_logits.data.ptr, [ids.data.ptr], dims, stream.ptr)
                            stream.synchronize()
                            tag = f"T={T} E={E} K={K} renorm={renorm} {dtype} {vname}"
                            if which == "kernel" and E > 1024:
                                tab.add(group + " (declines)", rc == EX_FALLBACK,
                                        detail=f"{tag}: rc={rc}, expected -1 for E > 1024")
                                continue
                            if rc != EX_OK:
                                tab.add(group, False, detail=f"{tag}: rc={rc} ({plug.error()})")
                                continue
                            got_ids, got_w = cp.asnumpy(ids), cp.asnumpy(w).astype(np.float64)
                            if (got_ids == -7).any() or (got_w == -7.0).any():
                                tab.add(group, False, detail=f"{tag}: outputs left unwritten")
                                continue
                            bad_ids = got_ids != ref_ids
                            if bad_ids.any():
                                t = int(np.argwhere(bad_ids)[0][0])
                                tab.add(group, False, detail=f"{tag}: ids differ in {int(bad_ids.any(1).sum())} rows, "
                                        f"row {t}: got {got_ids[t][:8]} want {ref_ids[t][:8]} "
                                        f"(logits {l64[t][:6]})")
                                continue
                            nan_differs = np.isnan(got_w) != np.isnan(ref_w)
                            if nan_differs.any():
                                t = int(np.argwhere(nan_differs)[0][0])
                                tab.add(group, False, detail=f"{tag}: row {t}: NaN weights {np.isnan(got_w[t]).astype(int)} "
                                        f"where the reference's are {np.isnan(ref_w[t]).astype(int)} (logits {l64[t][:6]})")
                                continue
                            # (NaN rows matched above; compared as 0 here, in copies: ref_w serves
                            # every view and kernel of this K)
                            gw, rw = np.nan_to_num(got_w, nan=0.0), np.nan_to_num(ref_w, nan=0.0)
                            err = np.abs(gw - rw)
                            ok = bool((err <= 1e-5 * np.abs(rw) + 1e-7).all())
                            rel = float((err / np.maximum(np.abs(rw), 1e-7)).max()) if T else 0.0
                            detail = ""
                            if not ok:
                                t, k = np.unravel_index(np.argmax(err - 1e-5 * np.abs(rw)), err.shape)
                                detail = f"{tag}: weight[{t},{k}] {gw[t, k]!r} want {rw[t, k]!r}"
                            tab.add(group, ok, rel, detail)


def check_topk_errors(cp, tab, plug, stream):
    g = "topk_softmax argument checks"
    w = cp.zeros((4, 2), dtype=cp.float32)
    ids = cp.zeros((4, 2), dtype=cp.int32)
    x = cp.zeros((4, 8), dtype=cp.float32)
    s = stream.ptr
    for dims, aux, out, want, what in [
        ([4, 8, 2, 1, 0], [ids.data.ptr], w.data.ptr, EX_OK, "valid call"),
        ([4, 8, 9, 1, 0], [ids.data.ptr], w.data.ptr, EX_ERR_SHAPE, "K > E"),
        ([4, 8, 0, 1, 0], [ids.data.ptr], w.data.ptr, EX_ERR_SHAPE, "K = 0"),
        ([4, 0, 1, 1, 0], [ids.data.ptr], w.data.ptr, EX_ERR_SHAPE, "E = 0"),
        ([-1, 8, 2, 1, 0], [ids.data.ptr], w.data.ptr, EX_ERR_INVALID_ARGUMENT, "T < 0"),
        ([4, 8, 2, 1, 7], [ids.data.ptr], w.data.ptr, EX_ERR_UNSUPPORTED_DTYPE, "dtype 7"),
        ([4, 8, 2, 1, 3], [ids.data.ptr], w.data.ptr, EX_ERR_UNSUPPORTED_DTYPE, "dtype int32"),
        ([4, 8, 2, 1], [ids.data.ptr], w.data.ptr, EX_ERR_INVALID_ARGUMENT, "n_dims 4"),
        ([4, 8, 2, 1, 0], [], w.data.ptr, EX_ERR_INVALID_ARGUMENT, "n_aux 0"),
        ([4, 8, 2, 1, 0], [0], w.data.ptr, EX_ERR_INVALID_ARGUMENT, "topk_ids NULL"),
        ([4, 8, 2, 1, 0], [ids.data.ptr], 0, EX_ERR_INVALID_ARGUMENT, "topk_weights NULL"),
        ([0, 8, 2, 1, 0], [0], 0, EX_OK, "T = 0 with NULL pointers"),
    ]:
        rc = plug.call("kernel", out, x.data.ptr, aux, dims, s)
        msg = plug.error()
        ok = rc == want and ((rc in (EX_OK, EX_FALLBACK)) or msg != "")
        tab.add(g, ok, detail=f"{what}: rc={rc} want {want}, last_error={msg!r}")
    stream.synchronize()


# --------------------------------------------------------------------------------------------
# fused_add_rmsnorm
# --------------------------------------------------------------------------------------------
NORM_TOL = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 8e-3}   # manifests/fused_add_rmsnorm.yaml
# (a correct kernel's error is at most half an ulp an element: 4.9e-4 in float16, 3.9e-3 in
# bfloat16; the doubled values this table had could not fail where the manifest's pass)
EPS = 1e-6


def eps_bits(eps):
    return struct.unpack("<q", struct.pack("<d", eps))[0]


def norm_reference(x_s, r_s, w_s, dtype):
    """Returns (residual_out storage, residual_out float64 exact sum, x_out float64)."""
    r32 = to_f32(x_s, dtype) + to_f32(r_s, dtype)          # fp32 add, as the contract says
    res_s = to_storage(r32, dtype)
    rr = to_f32(res_s, dtype).astype(np.float64)
    exact = to_f32(x_s, dtype).astype(np.float64) + to_f32(r_s, dtype).astype(np.float64)
    x_ref = rr / np.sqrt((rr * rr).mean(axis=1, keepdims=True) + EPS) * to_f32(w_s, dtype).astype(np.float64)
    return res_s, exact, x_ref


def ulp_problem(x_s, x_ref64, dtype):
    """'' or what is wrong with a 16-bit x (storage) against the float64 reference: the kernel
    computes in fp32 and rounds once, so every element is within one ulp of dtype(reference)
    and at least 99% equal to it (tests/reference.py's rmsnorm_storage_problems; fp32's own
    error moves an element across a rounding boundary at well under 1%)."""
    if dtype == "float32":
        return ""
    def ordered(s):   # bits -> integers in the order of the values, one apart per ulp
        u = np.ascontiguousarray(s).view(np.uint16).astype(np.int64)
        return np.where(u & 0x8000, -(u & 0x7FFF), u)
    finite = np.isfinite(x_ref64)
    d = np.abs(ordered(x_s) - ordered(to_storage(x_ref64.astype(np.float32), dtype)))[finite]
    if d.size and int(d.max()) > 1:
        return f"x: an element {int(d.max())} ulp off dtype(reference)"
    if int((d > 0).sum()) > max(1, 0.01 * d.size):   # (one element may, in a small array)
        return f"x: {100 * (d > 0).mean():.2f}% of the elements differ from dtype(reference) (at most 1% may, by one unit)"
    return ""


def rel_norm(got, ref):
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(got - ref) / den) if den > 0 else float(np.linalg.norm(got))


def run_norm(cp, tab, plug, stream, quick):
    rng = np.random.default_rng(99)
    Ts = (1, 7, 1000)
    Hs = (111, 769, 2048, 4096)
    extra = [(3, 4099), (3, 20000), (5, 1), (5, 8), (2, 8192)]  # past the register range; tiny rows
    have_fb = bool(plug.factor.kernel_fallback)
    for T, H in [(t, h) for t in Ts for h in Hs] + extra:
        for dtype in ("float32", "float16", "bfloat16"):
            st = STORAGE[dtype]
            x32 = rng.standard_normal((T, H)).astype(np.float32)
            r32 = rng.standard_normal((T, H)).astype(np.float32)
            w32 = (1.0 + 0.1 * rng.standard_normal(H)).astype(np.float32)
            if T >= 7:
                x32[3] = 0.0
                r32[3] = 0.0  # a zero row: rsqrt(eps)
            x_s, r_s, w_s = to_storage(x32, dtype), to_storage(r32, dtype), to_storage(w32, dtype)
            res_ref_s, res_exact, x_ref = norm_reference(x_s, r_s, w_s, dtype)
            esz = np.dtype(st).itemsize
            pad_v = 16 // esz  # keeps 16-byte row alignment
            for layout, (xpad, xoff, rpad, roff, woff) in {
                "contiguous": (0, 0, 0, 0, 0),
                "strided": (pad_v, 0, 3 * pad_v, 0, 0),
                "misaligned": (3, 1, 5, 1, 1),
            }.items():
                for which in ("kernel", "kernel_fallback") if have_fb else ("kernel",):
                    group = f"fused_add_rmsnorm {which} {layout}"
                    tag = f"T={T} H={H} {dtype} {layout}"
                    # wide buffers filled with a sentinel; the tensors are views into them
                    poison = to_storage(np.full(1, -7.25, np.float32), dtype)[0]
                    xb_h = np.full((T, H + xpad + xoff), poison, dtype=st)
                    rb_h = np.full((T, H + rpad + roff), poison, dtype=st)
                    wb_h = np.full(H + woff, poison, dtype=st)
                    xb_h[:, xoff:xoff + H] = x_s
                    rb_h[:, roff:roff + H] = r_s
                    wb_h[woff:] = w_s
                    xb, rb, wb = cp.asarray(xb_h), cp.asarray(rb_h), cp.asarray(wb_h)
                    xv, rv, wv = xb[:, xoff:xoff + H], rb[:, roff:roff + H], wb[woff:]
                    dims = [T, H, DTYPE_CODE[dtype], eps_bits(EPS), xb_h.shape[1], rb_h.shape[1]]
                    rc = plug.call(which, xv.data.ptr, xv.data.ptr, [rv.data.ptr, wv.data.ptr], dims, stream.ptr)
                    stream.synchronize()
                    if which == "kernel" and rc == EX_FALLBACK:
                        # the fast path holds 2048 16-byte packs (aligned) or 4096 elements (scalar)
                        scalar = layout == "misaligned" or (H * esz) % 16 != 0
                        expected = H > 4096 if scalar else H * esz > 2048 * 16
                        tab.add("fused_add_rmsnorm kernel declines past its register range (-1)", expected,
                                detail=f"{tag}: returned -1 ({plug.error()})")
                        continue
                    if rc != EX_OK:
                        tab.add(group, False, detail=f"{tag}: rc={rc} ({plug.error()})")
                        continue
                    xo, ro, wo = cp.asnumpy(xb), cp.asnumpy(rb), cp.asnumpy(wb)
                    # padding and weight untouched
                    xm = np.ones(xo.shape, bool)
                    xm[:, xoff:xoff + H] = False
                    rm = np.ones(ro.shape, bool)
                    rm[:, roff:roff + H] = False
                    untouched = (np.array_equal(xo[xm], xb_h[xm]) and np.array_equal(ro[rm], rb_h[rm])
                                 and np.array_equal(wo, wb_h))
                    res_got = ro[:, roff:roff + H]
                    x_got = to_f32(xo[:, xoff:xoff + H], dtype).astype(np.float64)
                    bits_ok = np.array_equal(np.ascontiguousarray(res_got).view(np.uint8),
                                             np.ascontiguousarray(res_ref_s).view(np.uint8))
                    e_res = rel_norm(to_f32(res_got, dtype).astype(np.float64), res_exact)
                    e_x = rel_norm(x_got, x_ref)
                    tol = NORM_TOL[dtype]
                    up = ulp_problem(xo[:, xoff:xoff + H], x_ref, dtype)
                    ok = (untouched and bits_ok and e_res <= tol and e_x <= tol and np.isfinite(x_got).all()
                          and not up)
                    detail = ""
                    if not ok:
                        detail = (f"{tag}: padding untouched={untouched} residual bit-exact={bits_ok} "
                                  f"residual err={e_res:.3g} x err={e_x:.3g} (tol {tol})" + (f"; {up}" if up else ""))
                    tab.add(group, ok, max(e_x, e_res) / tol, detail)


def check_norm_errors(cp, tab, plug, stream):
    g = "fused_add_rmsnorm argument checks"
    x = cp.zeros((4, 8), dtype=cp.float32)
    r = cp.zeros((4, 8), dtype=cp.float32)
    w = cp.ones(8, dtype=cp.float32)
    e = eps_bits(EPS)
    s = stream.ptr
    for dims, aux, want, what in [
        ([4, 8, 0, e, 8, 8], [r.data.ptr, w.data.ptr], EX_OK, "valid call"),
        ([4, 8, 0, e, 7, 8], [r.data.ptr, w.data.ptr], EX_ERR_SHAPE, "x stride < H"),
        ([4, 8, 0, e, 8, 4], [r.data.ptr, w.data.ptr], EX_ERR_SHAPE, "residual stride < H"),
        ([4, 0, 0, e, 8, 8], [r.data.ptr, w.data.ptr], EX_ERR_SHAPE, "H = 0"),
        ([-4, 8, 0, e, 8, 8], [r.data.ptr, w.data.ptr], EX_ERR_INVALID_ARGUMENT, "T < 0"),
        ([4, 8, 4, e, 8, 8], [r.data.ptr, w.data.ptr], EX_ERR_UNSUPPORTED_DTYPE, "dtype int64"),
        ([4, 8, 0, e, 8], [r.data.ptr, w.data.ptr], EX_ERR_INVALID_ARGUMENT, "n_dims 5"),
        ([4, 8, 0, e, 8, 8], [r.data.ptr], EX_ERR_INVALID_ARGUMENT, "n_aux 1"),
        ([4, 8, 0, e, 8, 8], [0, w.data.ptr], EX_ERR_INVALID_ARGUMENT, "residual NULL"),
        ([4, 8, 0, e, 8, 8], [r.data.ptr, 0], EX_ERR_INVALID_ARGUMENT, "weight NULL"),
        ([0, 8, 0, e, 8, 8], [0, w.data.ptr], EX_OK, "T = 0 with NULL x / residual"),
    ]:
        xp = 0 if what.startswith("T = 0") else x.data.ptr
        rc = plug.call("kernel", xp, xp, aux, dims, s)
        msg = plug.error()
        ok = rc == want and ((rc in (EX_OK, EX_FALLBACK)) or msg != "")
        tab.add(g, ok, detail=f"{what}: rc={rc} want {want}, last_error={msg!r}")
    stream.synchronize()


# --------------------------------------------------------------------------------------------
# Timing (CuPy events; median of 50 after warm-up; CUDA-graph replay where CuPy can capture)
# --------------------------------------------------------------------------------------------
def time_us(cp, stream, fn, iters=50, warmup=10):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(stream)
        fn()
        e1.record(stream)
        e1.synchronize()
        times.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
    return float(np.median(times))


def graph_us(cp, stream, fn, per_graph=20, iters=50):
    """Per-call time of `fn` replayed from a CUDA graph of `per_graph` calls, or None."""
    try:
        stream.begin_capture()
        try:
            for _ in range(per_graph):
                fn()
        finally:
            graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        return time_us(cp, stream, lambda: graph.launch(stream), iters=iters, warmup=3) / per_graph
    except Exception as exc:  # CuPy without stream capture, or capture refused
        print(f"  (graph replay unavailable: {exc})")
        return None


def copy_ceiling_gbs(cp, stream, nbytes):
    """Device-to-device copy of nbytes/2 (read + write = nbytes), GB/s counted on nbytes."""
    half = nbytes // 2
    src = cp.zeros(half, dtype=cp.uint8)
    dst = cp.empty(half, dtype=cp.uint8)
    rt = cp.cuda.runtime
    us = time_us(cp, stream, lambda: rt.memcpyAsync(dst.data.ptr, src.data.ptr, half,
                                                     rt.memcpyDeviceToDevice, stream.ptr))
    return nbytes / us / 1e3


def run_timing(cp, norm, topk, stream):
    print("\nTimings (bf16; median of 50 after warm-up; 'graph' = per call replayed from a CUDA graph of 20)")
    rng = np.random.default_rng(7)
    print(f"{'fused_add_rmsnorm':28s} {'eager us':>9s} {'graph us':>9s} {'GB/s':>7s} {'% 4.2TB/s':>9s} "
          f"{'copy GB/s':>9s} {'% copy':>7s}")
    for T, H in [(4096, 2048), (4096, 7168), (16384, 4096), (16384, 7168)]:
        x = cp.asarray(to_storage(rng.standard_normal((T, H)).astype(np.float32), "bfloat16"))
        r = cp.asarray(to_storage(rng.standard_normal((T, H)).astype(np.float32), "bfloat16"))
        w = cp.asarray(to_storage(np.ones(H, np.float32), "bfloat16"))
        dims = [T, H, 2, eps_bits(EPS), H, H]
        fn = lambda: norm.call("kernel", x.data.ptr, x.data.ptr, [r.data.ptr, w.data.ptr], dims, stream.ptr)
        rc = fn()
        if rc != EX_OK:
            print(f"  T={T} H={H}: rc={rc} ({norm.error()})")
            continue
        eager = time_us(cp, stream, fn)
        graph = graph_us(cp, stream, fn)
        nbytes = 4 * T * H * 2
        best = graph if graph else eager
        gbs = nbytes / best / 1e3
        copy = copy_ceiling_gbs(cp, stream, nbytes)
        gs = f"{graph:9.1f}" if graph else f"{'n/a':>9s}"
        print(f"  T={T:5d} H={H:5d}{'':12s} {eager:9.1f} {gs} {gbs:7.0f} {100 * gbs / 4200:8.1f}% "
              f"{copy:9.0f} {100 * gbs / copy:6.1f}%")
        del x, r, w
    print(f"{'topk_softmax (renormalize)':28s} {'eager us':>9s} {'graph us':>9s} {'GB/s':>7s}  target us")
    for T, E, K in [(4096, 128, 8), (16384, 128, 8), (16384, 384, 8)]:
        logits = cp.asarray(to_storage(rng.standard_normal((T, E)).astype(np.float32), "bfloat16"))
        wts = cp.empty((T, K), dtype=cp.float32)
        ids = cp.empty((T, K), dtype=cp.int32)
        dims = [T, E, K, 1, 2]
        fn = lambda: topk.call("kernel", wts.data.ptr, logits.data.ptr, [ids.data.ptr], dims, stream.ptr)
        rc = fn()
        if rc != EX_OK:
            print(f"  T={T} E={E}: rc={rc} ({topk.error()})")
            continue
        eager = time_us(cp, stream, fn)
        graph = graph_us(cp, stream, fn)
        nbytes = T * E * 2 + T * K * 8
        best = graph if graph else eager
        target = max(2 * nbytes / 4.2e12 * 1e6, 8.0)
        gs = f"{graph:9.1f}" if graph else f"{'n/a':>9s}"
        print(f"  T={T:5d} E={E:4d} K={K}{'':9s} {eager:9.1f} {gs} {nbytes / best / 1e3:7.0f}  {target:6.1f}"
              f"  {'(met)' if best <= target else '(missed)'}")


# --------------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_scripts["HelpFormatter"])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--factors", default=os.path.join(here, "..", "factors"), help="folder of the .so files")
    ap.add_argument("--suffix", default=".so", help="library file suffix")
    ap.add_argument("--no-timing", action="store_true", help="checks only")
    ap.add_argument("--quick", action="store_true", help="skip T=16384 in the topk sweep")
    args = ap.parse_args()
    # the arguments before the machine (a wrong --factors said only "needs CuPy and a CUDA GPU")
    if not os.path.isdir(args.factors):
        print(f"gpu_router_norm_selftest: --factors: expected a folder of built libraries, got "
              f"{args.factors} (no such folder)", file=sys.stderr)
        return 2

    cp, why = cupy_with_gpu()
    if cp is None:       # not a CUDARuntimeError traceback at the first CUDA call
        print(f"gpu_router_norm_selftest: needs CuPy and a CUDA GPU: {why}", file=sys.stderr)
        return 2

    hw = hardware_from_device(cp)
    print(f"device: {hw.name.decode(errors='replace')}  cc {hw.cc_major}.{hw.cc_minor}  "
          f"{hw.multiprocessor_count} SMs  warp {hw.warp_size}")
    stream = cp.cuda.Stream(non_blocking=True)
    tab = Table()
    plugins = {}
    for stem, fid in (("topk_softmax", 0), ("fused_add_rmsnorm", 1)):
        path = os.path.join(args.factors, stem + args.suffix)
        try:
            plugins[stem] = Plugin(path, hw)
        except OSError as exc:
            tab.add(f"{stem}: load", False, detail=str(exc))
            continue
        if not check_abi(tab, plugins[stem], stem, fid, hw):
            del plugins[stem]

    with stream:  # CuPy's own work (poisoning, copies) on the same stream as the plugins'
        if "topk_softmax" in plugins:
            print("topk_softmax ...", flush=True)
            check_topk_errors(cp, tab, plugins["topk_softmax"], stream)
            run_topk(cp, tab, plugins["topk_softmax"], stream, args.quick)
        if "fused_add_rmsnorm" in plugins:
            print("fused_add_rmsnorm ...", flush=True)
            check_norm_errors(cp, tab, plugins["fused_add_rmsnorm"], stream)
            run_norm(cp, tab, plugins["fused_add_rmsnorm"], stream, args.quick)
        tab.show()
        if not args.no_timing and len(plugins) == 2:
            run_timing(cp, plugins["fused_add_rmsnorm"], plugins["topk_softmax"], stream)

    n = tab.failures()
    if not plugins:      # neither library loaded and served this device: no PASS to claim
        print(f"\nFAIL: NOTHING TESTED (neither library of {args.factors} loads and serves this device); "
              f"{n} failing case(s)")
        return 1
    print(f"\n{'PASS' if n == 0 else 'FAIL'}: {n} failing case(s)")
    return 1 if n else 0


if __name__ == "__main__":
    _scripts["exit_quietly_on_broken_pipe"](main)   # `| head`, Ctrl-C, `> /dev/full`: one line, no traceback
