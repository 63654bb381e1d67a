"""Bit-level Python model of topk_softmax_pkey_kernel's fast path (one row), to check the packed-key
logic and the exactness checks against a float64 reference before spending device time.

    python3 benchmarks/topk_variants/model.py [n_rows]
"""
import sys
import numpy as np

from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from gpu_router_norm_selftest import topk_reference, topk_logits, to_storage, to_f32  # noqa: E402

M32 = 0xFFFFFFFF


def hard_rows(rng, T, E):
    """Three (T, E) float32 logit sets that stress the top-k checks, drawn in this order from
    ``rng`` (run_tune.py uses the same draws): N(0, 4) values, a copy with near ties (a few of
    each row's top 10 within an ulp or two of one value) and a mix of +0, -0 and +-|values|."""
    base = (rng.standard_normal((T, E)) * 2).astype(np.float32)
    nt = base.copy()
    for t in range(T):
        top = np.argsort(-nt[t])[:10]
        v = nt[t, top[rng.integers(0, 10)]]
        for j in top[rng.permutation(10)[:rng.integers(2, 6)]]:
            nt[t, j] = np.nextafter(v, np.float32(np.inf) if rng.random() < .5 else np.float32(-np.inf)) \
                if rng.random() < 0.7 else v
            v = nt[t, j] if rng.random() < 0.5 else v
    zs = np.where(rng.random((T, E)) < 0.5, np.float32(0), -np.abs(base))
    zs = np.where(rng.random((T, E)) < 0.5, -zs, zs)
    zs = np.where(zs == 0, np.where(rng.random((T, E)) < .5, np.float32(-0.0), np.float32(0.0)), zs)
    return base, nt, zs.astype(np.float32)


def ceil_log2(n):
    return 0 if n <= 1 else 1 + ceil_log2((n + 1) // 2)


def okey(u):  # u ^ ((u >> 31 arith) | 0x80000000)
    s = M32 if (u >> 31) else 0
    return (u ^ (s | 0x80000000)) & M32


def key_to_bits(k):
    return (k ^ 0x80000000) if (k & 0x80000000) else (~k & M32)


def f2u(f):
    return int(np.float32(f).view(np.uint32))


def u2f(u):
    return float(np.uint32(u).view(np.float32))


def lop98(q, l, i):
    return ((l & i) | (~l & ~i & q)) & M32


def ex2(a):
    return float(np.exp2(np.float64(a)))


def pkey_row(x32, G, EPL, D, K, renorm, is16):
    """x32: the row as float32 (NaN allowed), padded to G*EPL with -inf.  Returns
    ('fast', ids, w) or ('exact', reason)."""
    LB, KB = ceil_log2(G), ceil_log2(EPL)
    B = LB + KB
    MASK = (1 << B) - 1
    KMASK = (1 << KB) - 1
    L2E = np.float32(1.4426950408889634)
    x = np.where(np.isnan(x32), np.float32(-np.inf), x32).astype(np.float32)
    lanes = []
    bits_or = [0] * G
    for g in range(G):
        lreg = ((G - 1 - g) << KB) | KMASK
        c = [0] * D
        keys = []
        for k in range(EPL):
            u = f2u(x[g * EPL + k])
            bits_or[g] |= u
            imm = (((1 << LB) - 1) << KB) | (KMASK - k)
            p = lop98(okey(u), lreg, imm)
            keys.append(p)
            t = p
            for i in range(D - 1):
                hi_ = max(c[i], t)
                t = min(c[i], t)
                c[i] = hi_
            c[D - 1] = max(c[D - 1], t)
        lanes.append({"c": c, "keys": keys})
    hi = max(l["c"][0] for l in lanes)
    mval = u2f(key_to_bits(min(hi | MASK, 0xFF800000)))
    if not (abs(mval) <= 65536.0):
        return ("exact", "m")
    mine = [0] * G
    refills = 0
    for r in range(K + 1):
        if r > 0:
            hi = max(l["c"][0] for l in lanes)
        mine[r] = hi
        if r < K:
            for l in lanes:
                c = l["c"]
                pop = c[0] == hi
                if pop:
                    c[:] = c[1:] + [0]
                    if c[0] == 0:
                        refills += 1
                        for p in l["keys"]:
                            t = p if p < hi else 0
                            for i in range(D - 1):
                                hi_ = max(c[i], t)
                                t = min(c[i], t)
                                c[i] = hi_
                            c[D - 1] = max(c[D - 1], t)
    # exact values
    idxs, xv = [], []
    for g in range(K + 1):
        pos = mine[g] & MASK
        idx = (G - 1 - (pos >> KB)) * EPL + (KMASK - (pos & KMASK))
        idxs.append(idx)
        if not is16:
            xv.append(np.float32(x[idx]))
        else:
            m = mine[g]
            qq = (m & ~MASK & M32) if m >= 0x80000000 else (m | MASK)
            xv.append(np.float32(u2f(key_to_bits(qq))))
            assert xv[-1] == x[idx] or (np.isnan(xv[-1]) and False), (xv[-1], x[idx], idx)
    for g in range(K):
        a, b = xv[g], xv[g + 1]
        if not (a > b or (a == b and idxs[g] < idxs[g + 1])):
            return ("exact", "order")
    if abs(xv[K - 1]) < 1e-30:
        return ("exact", "zero")
    if not is16 and ((mine[K - 1] ^ mine[K]) <= MASK):
        dirty = any((b & MASK) != 0 for b in bits_or)
        if dirty:
            return ("exact", "bucket")
    mL = np.float32(np.float32(mval) * L2E)
    u = [ex2(np.float32(np.float32(xv[g]) * L2E) - mL) for g in range(K)]  # fma ~ exact product
    if renorm:
        den = sum(u)
    else:
        den = 0.0
        for g in range(G):
            lane = x[g * EPL:(g + 1) * EPL]
            xm = lane.max()
            if xm == -np.inf:
                continue
            sl = sum(ex2(float(np.float64(v) - np.float64(xm)) * 1.4426950408889634) for v in lane)
            den += sl * ex2(np.float32(xm * L2E) - mL)
    return ("fast", np.array(idxs[:K]), np.array(u) / den, refills)


def check(l32, G, EPL, D, K, renorm, is16, tag, stats):
    T, E = l32.shape
    ref_ids, ref_w = topk_reference(l32.astype(np.float64), K, renorm)
    for t in range(T):
        row = np.full(G * EPL, -np.inf, np.float32)
        row[:E] = l32[t]
        res = pkey_row(row, G, EPL, D, K, renorm, is16)
        if res[0] == "exact":
            stats[res[1]] = stats.get(res[1], 0) + 1
            continue
        stats["fast"] = stats.get("fast", 0) + 1
        stats["refills"] = stats.get("refills", 0) + res[3]
        ids, w = res[1], res[2]
        if not np.array_equal(ids, ref_ids[t]):
            print(f"FAIL ids {tag} row {t}: {ids} want {ref_ids[t]}  row={l32[t][:12]}")
            stats["FAIL"] = stats.get("FAIL", 0) + 1
            continue
        err = np.abs(w - ref_w[t])
        if not (err <= 1e-5 * np.abs(ref_w[t]) + 1e-7).all():
            print(f"FAIL w {tag} row {t}: {w} want {ref_w[t]}")
            stats["FAIL"] = stats.get("FAIL", 0) + 1


def main():
    import argparse
    ap = argparse.ArgumentParser(description="Bit-level model of topk_softmax's packed-key fast path "
                                             "against a float64 reference (CPU only).")
    def positive(v):
        if not v.isdigit() or int(v) < 1:
            raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {v!r}")
        return int(v)
    ap.add_argument("n_rows", type=positive, nargs="?", default=200, help="rows per data set (default 200)")
    n = ap.parse_args().n_rows
    failures = 0
    rng = np.random.default_rng(5)
    configs = [(32, 12, 3, 384, 0), (32, 12, 2, 384, 0), (16, 24, 3, 384, 0), (16, 24, 3, 384, 1),
               (16, 24, 2, 384, 2), (32, 12, 3, 300, 0), (16, 8, 2, 128, 0), (32, 16, 2, 512, 2),
               (16, 8, 3, 100, 1)]
    for G, EPL, D, E, dt in configs:
        dtype = ("float32", "float16", "bfloat16")[dt]
        is16 = dt != 0
        for K in (1, 2, 8, min(G - 1, E - 1)):
            for renorm in (0, 1):
                datasets = {}
                s, _ = topk_logits(rng, n, E, dtype)
                datasets["selftest"] = to_f32(s, dtype)
                base, nt, zs = hard_rows(rng, n, E)
                datasets["neartie"] = to_f32(to_storage(nt, dtype), dtype)
                datasets["ints"] = to_f32(to_storage(np.round(base), dtype), dtype)
                datasets["bf16ish"] = to_f32(to_storage(to_f32(to_storage(base, "bfloat16"), "bfloat16"), dtype), dtype)
                datasets["zeros"] = to_f32(to_storage(zs, dtype), dtype)
                big = (base * 3e4).astype(np.float32)
                datasets["big"] = to_f32(to_storage(big, dtype), dtype)
                for name, l32 in datasets.items():
                    stats = {}
                    check(l32.astype(np.float32), G, EPL, D, K, renorm, is16, f"G{G} EPL{EPL} D{D} E{E} {dtype} K{K} r{renorm} {name}", stats)
                    if K == 8 and renorm == 1 or "FAIL" in stats:
                        print(f"G{G} EPL{EPL} D{D} E{E} {dtype:8s} K{K} r{renorm} {name:9s} {stats}")
                    failures += stats.get("FAIL", 0)
    print(f"model: {failures} failed check(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from ex_engine._scripts import exit_quietly_on_broken_pipe
    exit_quietly_on_broken_pipe(main)   # Ctrl-C, out of memory, `| head`: one line, no traceback
