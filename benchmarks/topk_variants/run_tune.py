#!/usr/bin/env python3
"""topk_softmax variant tuner: checks and times every kernel variant of tune.so (tune.cu: one
launcher per (kernel, G, NV, D, RL, MB)) and the factor builds named by --factors, on a CUDA GPU
with CuPy. The dispatch table of factors/topk_softmax.cu was chosen from its output.

    nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
         -Xcompiler -fPIC -shared -Iinclude -Ifactors -o benchmarks/topk_variants/tune.so \
         benchmarks/topk_variants/tune.cu
    python3 benchmarks/topk_variants/run_tune.py --out DIR [--quick] [--factors factors other/]

Checks: every variant against the float64 reference (ids exact, weights 1e-5 rel + 1e-7 abs) on
self-test rows with specials, near ties, integer ties and +-0 mixes, K in {1, 8, G-1, E}.
Timing: CUDA-graph replay of 20 calls rotating over >= 256 MB of input sets (median of 20
replays, per call), as benchmarks/_timing.graph_us does.
"""
import argparse
import ctypes
import json
import os
import sys
import time

import numpy as np

try:
    import cupy as cp
except ImportError:  # --help works anywhere; a run needs CuPy and a GPU
    cp = None

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import gpu_router_norm_selftest as st  # noqa: E402
from model import hard_rows  # noqa: E402  (this folder: the same draws as the bit-level model)

DT = {"float32": 0, "float16": 1, "bfloat16": 2}

# id: (kind, G, NV, D, RL, MB, E classes) -- mirrors tune.cu
F32 = {0: ("old", 32, 3, 3), 1: ("old", 16, 6, 3), 2: ("pk", 32, 3, 3), 3: ("pk", 32, 3, 2),
       4: ("pk", 16, 6, 3), 5: ("pk", 16, 6, 2), 6: ("pk0", 32, 3, 3), 7: ("pk0mb5", 32, 3, 3),
       8: ("pkmb6", 32, 3, 3), 9: ("pkmb8", 32, 3, 2),
       10: ("old", 8, 4, 4), 11: ("pk", 16, 2, 3), 12: ("pk", 16, 2, 2), 13: ("pk", 32, 1, 2),
       20: ("old", 8, 2, 4), 21: ("pk", 16, 1, 2), 22: ("pk", 16, 1, 3),
       30: ("old", 16, 4, 3), 31: ("pk", 16, 4, 3), 32: ("pk", 32, 2, 3), 33: ("pk", 32, 2, 2),
       40: ("old", 32, 4, 3), 41: ("pk", 32, 4, 3), 42: ("pk", 32, 4, 2)}
H16 = {50: ("old", 16, 3, 3), 51: ("pk", 16, 3, 3), 52: ("pk", 16, 3, 2), 53: ("pk", 32, 2, 2),
       54: ("pk", 32, 2, 3), 55: ("pk0", 16, 3, 3), 56: ("pkmb4", 16, 3, 3),
       60: ("old", 8, 2, 4), 61: ("pk", 16, 1, 2), 62: ("pk", 16, 1, 3),
       70: ("old", 8, 4, 4), 71: ("pk", 16, 2, 3), 72: ("pk", 32, 1, 3), 73: ("pk", 32, 1, 2),
       80: ("old", 32, 2, 3), 81: ("pk", 32, 2, 3), 82: ("pk", 32, 2, 2)}
# timed shape (E) of each variant group
GROUP_E = {0: 384, 10: 128, 20: 64, 30: 256, 40: 512, 50: 384, 60: 128, 70: 256, 80: 512}


def group_of(v):
    return v - v % 10


def capacity(v, dtype):
    kind, G, NV, D = (F32 if dtype == "float32" else H16)[v]
    return G * NV * (4 if dtype == "float32" else 8)


class Tune:
    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        self.lib.tune_launch.restype = ctypes.c_int
        self.lib.tune_launch.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                         ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_int,
                                         ctypes.c_int, ctypes.c_void_p]
        self.lib.tune_regs.restype = ctypes.c_int
        self.lib.tune_exact_warps.restype = ctypes.c_ulonglong

    def launch(self, v, dtype, w, ids, logits, T, E, K, renorm, stream):
        return self.lib.tune_launch(v, DT[dtype], w.data.ptr, ids.data.ptr, logits.data.ptr, T, E, K, renorm,
                                    stream.ptr)


def datasets(rng, T, E, dtype):
    out = {}
    s, l64 = st.topk_logits(rng, T, E, dtype)
    out["selftest"] = (s, l64)
    base, nt, zs = hard_rows(rng, T, E)
    for name, a in (("neartie", nt), ("ints", np.round(base)), ("zeros", zs), ("normal", base)):
        s = st.to_storage(a.astype(np.float32), dtype)
        out[name] = (s, st.to_f32(s, dtype).astype(np.float64))
    return out


class Ref:
    """The float64 reference of one data set, sorted once: slices for any K / renormalize."""

    def __init__(self, l64):
        T, E = l64.shape
        key = np.where(np.isnan(l64), -np.inf, l64)
        self.order = np.argsort(-key, axis=1, kind="stable").astype(np.int32)
        m = key.max(axis=1, keepdims=True)
        with np.errstate(invalid="ignore", over="ignore"):
            finite = np.isfinite(m)
            u = np.where(finite, np.exp(key - np.where(finite, m, 0.0)), 0.0)
            u = np.where(m == np.inf, (key == np.inf).astype(np.float64), u)
            u = np.where(m == -np.inf, 1.0, u)
        self.p = u / u.sum(axis=1, keepdims=True)

    def get(self, K, renorm):
        ids = self.order[:, :K]
        w = np.take_along_axis(self.p, ids.astype(np.int64), axis=1)
        if renorm:
            w = w / w.sum(axis=1, keepdims=True)
        return ids, w


def run_checks(tune, stream, dtype, table, Es_of_group, rng, fails, res):
    # one data set family per E, shared by every variant of that E's group
    for grp, Es in Es_of_group.items():
        vs = sorted(v for v in table if group_of(v) == grp)
        if not vs:
            continue
        counts = {v: [0, 0] for v in vs}
        for E in Es:
            cases = []
            for T in (1000, 37):
                data = datasets(rng, T, E, dtype)
                for dname, (s, l64) in data.items():
                    if T == 37 and dname != "selftest":
                        continue
                    cases.append((T, dname, cp.asarray(s), Ref(l64)))
            for v in vs:
                kind, G, NV, D = table[v]
                if capacity(v, dtype) < E:
                    continue
                Ks = sorted({k for k in (1, 2, 8, G - 1, E) if 1 <= k <= E})
                for T, dname, d_logits, ref in cases:
                    for K in Ks:
                        for renorm in (0, 1):
                            if dname != "selftest" and renorm == 0 and K != 8:
                                continue
                            ref_ids, ref_w = ref.get(K, renorm)
                            w = cp.full((T, K), np.nan, dtype=cp.float32)
                            ids = cp.full((T, K), -7, dtype=cp.int32)
                            rc = tune.launch(v, dtype, w, ids, d_logits, T, E, K, renorm, stream)
                            stream.synchronize()
                            counts[v][0] += 1
                            tag = f"v{v} {dtype} E={E} T={T} K={K} renorm={renorm} {dname}"
                            if rc != 0:
                                counts[v][1] += 1
                                fails.append(f"{tag}: rc={rc}")
                                continue
                            gi, gw = cp.asnumpy(ids), cp.asnumpy(w).astype(np.float64)
                            bad = gi != ref_ids
                            if bad.any():
                                counts[v][1] += 1
                                t = int(np.argwhere(bad)[0][0])
                                fails.append(f"{tag}: ids differ in {int(bad.any(1).sum())} rows; row {t} got {gi[t][:10]} want {ref_ids[t][:10]}")
                                continue
                            err = np.abs(gw - ref_w)
                            if not (err <= 1e-5 * np.abs(ref_w) + 1e-7).all() or np.isnan(gw).any():
                                counts[v][1] += 1
                                t, k = np.unravel_index(np.nanargmax(err - 1e-5 * np.abs(ref_w)), err.shape)
                                fails.append(f"{tag}: weight[{t},{k}] {gw[t, k]!r} want {ref_w[t, k]!r}")
        for v in vs:
            res["checks"][f"{dtype}/{v}"] = counts[v]
            print(f"CHECK {dtype:8s} v{v:<3d} {str(table[v]):24s} cases {counts[v][0]:4d} fail {counts[v][1]}", flush=True)


def make_sets(T, E, dtype, K, sigma=1.0):
    esz = 4 if dtype == "float32" else 2
    nbytes = T * E * esz + T * K * 8
    nsets = min(64, max(1, -(-256 * 2**20 // nbytes)))
    sets = []
    for _ in range(nsets):
        a = cp.random.standard_normal((T, E), dtype=cp.float32) * sigma
        if dtype == "float32":
            sets.append(a)
        elif dtype == "float16":
            sets.append(a.astype(cp.float16))
        else:
            u = a.view(cp.uint32)
            sets.append(((u + cp.uint32(0x7FFF) + ((u >> 16) & cp.uint32(1))) >> 16).astype(cp.uint16))
    return sets


def graph_time(stream, fns, calls=20, replays=20):
    calls = max(calls, len(fns))
    for f in fns:
        f()
    stream.synchronize()
    stream.begin_capture()
    try:
        for i in range(calls):
            fns[i % len(fns)]()
    finally:
        g = stream.end_capture()
    g.launch(stream)
    stream.synchronize()
    ts = []
    for _ in range(replays):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(stream)
        g.launch(stream)
        e1.record(stream)
        e1.synchronize()
        ts.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3 / calls)
    ts.sort()
    return ts[len(ts) // 2], ts[0]


def main():
    ap = argparse.ArgumentParser(description="Check and time topk_softmax's kernel variants and factor builds.")
    ap.add_argument("--out", default=".", help="folder for tune.json")
    ap.add_argument("--quick", action="store_true", help="fewer timing repetitions")
    ap.add_argument("--no-check", action="store_true", help="time only, skip the float64 checks")
    ap.add_argument("--tune", default=os.path.join(HERE, "tune.so"), help="the built tune.cu")
    ap.add_argument("--factors", nargs="*", default=["factors"],
                    help="plugin folders (relative to the repository) whose topk_softmax.so to time")
    args = ap.parse_args()
    if cp is None:
        print("run_tune: needs CuPy and a CUDA GPU", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    res = {"timing": [], "checks": {}, "regs": {}, "exact_frac": {}, "factor_timing": []}
    stream = cp.cuda.Stream(non_blocking=True)
    tune = Tune(args.tune)
    t0 = time.time()

    def dump():
        with open(os.path.join(args.out, "tune.json"), "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)

    with stream:
        # ---- timing first (the point of the call), then checks -------------------------------
        T, K = 16384, 8
        for dtype, table in (("float32", F32), ("bfloat16", H16), ("float16", H16)):
            for grp in sorted({group_of(v) for v in table}):
                E = GROUP_E[grp]
                if dtype == "float16" and E != 384:
                    continue
                sets = make_sets(T, E, dtype, K)
                w = cp.empty((T, K), cp.float32)
                ids = cp.empty((T, K), cp.int32)
                for v in sorted(x for x in table if group_of(x) == grp):
                    regs = tune.lib.tune_regs(v, DT[dtype])
                    res["regs"][f"{dtype}/{v}"] = regs
                    for renorm in ((1, 0) if E == 384 else (1,)):
                        tune.lib.tune_exact_warps(1)
                        fns = [(lambda lg=lg: tune.launch(v, dtype, w, ids, lg, T, E, K, renorm, stream)) for lg in sets]
                        rc = fns[0]()
                        stream.synchronize()
                        n_exact = tune.lib.tune_exact_warps(1)
                        med, best = graph_time(stream, fns)
                        row = {"dtype": dtype, "E": E, "T": T, "K": K, "renorm": renorm, "v": v,
                               "variant": (table[v]), "us": med, "best_us": best, "regs": regs, "rc": rc,
                               "exact_warps_one_call": int(n_exact)}
                        res["timing"].append(row)
                        print(f"TIME {dtype:8s} E={E:4d} renorm={renorm} v{v:<3d} {str(table[v]):24s} regs {regs:3d} "
                              f"{med:7.2f} us (best {best:6.2f})  exact warps/call {n_exact}", flush=True)
                    dump()
                del sets
                cp.get_default_memory_pool().free_all_blocks()
        # T = 4096 for the small-E groups
        for dtype, vs, E in (("float32", (10, 11, 12, 13), 128), ("float32", (20, 21, 22), 64),
                             ("bfloat16", (60, 61, 62), 128)):
            T = 4096
            sets = make_sets(T, E, dtype, K)
            w = cp.empty((T, K), cp.float32)
            ids = cp.empty((T, K), cp.int32)
            for v in vs:
                fns = [(lambda lg=lg: tune.launch(v, dtype, w, ids, lg, T, E, K, 1, stream)) for lg in sets]
                med, best = graph_time(stream, fns)
                res["timing"].append({"dtype": dtype, "E": E, "T": T, "K": K, "renorm": 1, "v": v, "us": med, "best_us": best})
                print(f"TIME {dtype:8s} T={T} E={E:4d} v{v:<3d} {med:7.2f} us (best {best:6.2f})", flush=True)
            del sets
        dump()
        print(f"[timing done in {time.time() - t0:.0f} s]", flush=True)

        # ---- the factor builds through the ABI, same timer ------------------------------------
        hw = st.hardware_from_device(cp)
        for fdir in args.factors:
            path = os.path.join(ROOT, fdir, "topk_softmax.so")
            if not os.path.exists(path):
                print(f"no {path}")
                continue
            plug = st.Plugin(path, hw)
            for dtype, E, T in (("float32", 384, 16384), ("float32", 128, 16384), ("float32", 64, 4096),
                                ("float32", 128, 4096), ("float32", 256, 16384), ("float32", 512, 16384),
                                ("bfloat16", 384, 16384), ("float16", 384, 16384), ("bfloat16", 128, 16384),
                                ("bfloat16", 256, 16384), ("bfloat16", 512, 16384)):
                sets = make_sets(T, E, dtype, K)
                w = cp.empty((T, K), cp.float32)
                ids = cp.empty((T, K), cp.int32)
                dims = [T, E, K, 1, DT[dtype]]
                fns = [(lambda lg=lg: plug.call("kernel", w.data.ptr, lg.data.ptr, [ids.data.ptr], dims, stream.ptr))
                       for lg in sets]
                med, best = graph_time(stream, fns)
                res["factor_timing"].append({"factor": fdir, "dtype": dtype, "E": E, "T": T, "us": med, "best_us": best})
                print(f"FACTOR {fdir:20s} {dtype:8s} T={T:5d} E={E:4d} {med:7.2f} us (best {best:6.2f})", flush=True)
                del sets
            cp.get_default_memory_pool().free_all_blocks()
        dump()

        # ---- checks ------------------------------------------------------------------------------
        if not args.no_check:
            rng = np.random.default_rng(11)
            fails = []
            es = {0: (384, 381, 257), 10: (128, 125, 65), 20: (64, 61, 33), 30: (256, 253, 129),
                  40: (512, 509, 385), 50: (384, 381, 257), 60: (128, 125, 65), 70: (256, 253, 129),
                  80: (512, 509, 385)}
            for dtype, table in (("float32", F32), ("bfloat16", H16), ("float16", H16)):
                groups = {g: es[g] for g in es if any(group_of(v) == g for v in table)}
                if dtype == "float16":
                    groups = {g: e for g, e in groups.items() if g in (50, 60)}
                run_checks(tune, stream, dtype, table, groups, rng, fails, res)
                dump()
            res["fails"] = fails[:200]
            for line in fails[:40]:
                print("  FAIL", line)
            print(f"CHECKS: {len(fails)} failing case(s)  [{time.time() - t0:.0f} s]", flush=True)
    dump()


if __name__ == "__main__":
    st._scripts["exit_quietly_on_broken_pipe"](main)   # `| head`, Ctrl-C, `> /dev/full`: one line, no traceback
