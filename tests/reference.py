"""float64 references written plainly (loops, no shared code with the fallbacks), and helpers."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from ex_engine.verify import ROW_SLACK   # the worst row may be off by this many tolerances

NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def rel_err(out, ref, xp=np) -> float:
    """The larger of ||out - ref|| / ||ref|| and, for arrays of two rows or more (axis 0), the
    worst row's ||out[t] - ref[t]|| / (ROW_SLACK * ||ref|| / sqrt(T)) (over the rows' RMS norm):
    one zeroed token or one dropped top-k slot among thousands of rows fails a tolerance that
    the whole-array figure alone passes (a zero row of 20000 reads 7e-3 there). inf if out has
    a NaN or ref is all zero. xp: numpy, cupy or torch, whichever holds the arrays. (Written
    apart from ex_engine.verify.row_error, which it checks.)"""
    o = xp.asarray(out, dtype=xp.float64)
    if bool(xp.isnan(o).any()):
        return math.inf
    d = o - ref
    den = float(xp.linalg.norm(ref))
    if not den > 0:
        return math.inf
    err = float(xp.linalg.norm(d)) / den
    if d.ndim >= 2 and d.shape[0] >= 2:
        rows = xp.sqrt((d.reshape(d.shape[0], -1) ** 2).sum(axis=1))
        err = max(err, float(rows.max()) * math.sqrt(d.shape[0]) / (ROW_SLACK * den))
    return err


def topk_softmax_ref(logits, K, renormalize):
    """Per row in float64: ranking (NaN last, ties lowest index), stable softmax, special rows;
    a row holding a NaN logit gets NaN weights."""
    T, E = logits.shape
    W, I = np.zeros((T, K)), np.zeros((T, K), np.int64)
    for t in range(T):
        row = [(-math.inf if math.isnan(v) else float(v)) for v in logits[t]]
        order = sorted(range(E), key=lambda e: (-row[e], e))[:K]
        m = max(row)
        if m == math.inf:
            n = sum(v == math.inf for v in row)
            p = [1.0 / n if v == math.inf else 0.0 for v in row]
        elif m == -math.inf:
            p = [1.0 / E] * E
        else:
            ex = [math.exp(v - m) for v in row]
            s = sum(ex)
            p = [v / s for v in ex]
        w = [p[e] for e in order]
        if renormalize:
            s = sum(w)
            w = [v / s for v in w]
        if any(math.isnan(v) for v in logits[t]):
            w = [math.nan] * K
        W[t], I[t] = w, order
    return W, I


def rmsnorm_ref(x, residual, weight, eps, dtype):
    """(x', residual') in float64, residual rounded to dtype before normalising (as the contract)."""
    r = (x.astype(np.float64) + residual.astype(np.float64)).astype(np.float32)
    r = r.astype(NP_DTYPES[dtype]).astype(np.float64)
    inv = 1.0 / np.sqrt((r * r).mean(axis=-1, keepdims=True) + eps)
    return r * inv * weight.astype(np.float64), r


def _ordered_bits(values64, dtype):
    """float64 values exactly representable in float16/bfloat16 -> integers in the order of the
    values, one apart per unit in the last place (-0 and +0 both 0)."""
    u = np.asarray(values64).astype(NP_DTYPES[dtype]).view(np.uint16).astype(np.int64)
    return np.where(u & 0x8000, -(u & 0x7FFF), u)


def rmsnorm_storage_problems(x_out, res_out, X, R, dtype) -> list:
    """What fused_add_rmsnorm's stored results get wrong beyond rounding (x_out, res_out: float64
    host copies of the results; X, R: rmsnorm_ref's). Returns a list of problems (empty: fine).

    - residual: the fp32 sum of two dtype values rounded once to the dtype is what the contract
      stores (fp32 holds float16 and bfloat16 sums exactly enough: 24 >= 2 * 11 + 2 bits), so it
      must equal R bit for bit, NaN where R has NaN. A truncating conversion or a sum done in
      the dtype reads ~3e-3 by the relative error, inside bfloat16's tolerance of 8e-3.
    - x, float16 and bfloat16: computed in fp32 and rounded once, so within one unit in the last
      place of dtype(X) everywhere and equal to it at 99% of the elements or more (fp32's own
      error moves an element across a rounding boundary at ~0.02% of them in float16, 0.13% at
      most in a NumPy model of the kernels' sums and rsqrtf);
      a mean over H + 1 or a sum of squares in the dtype moves far more. float32's x is left to
      the tolerance (no exact value to compare with)."""
    problems = []
    r_nan, R_nan = np.isnan(res_out), np.isnan(R)
    differ = int(((res_out != R) & ~(r_nan & R_nan)).sum())
    if differ:
        problems.append(f"residual: {differ} of {R.size} elements differ from the fp32 sum rounded once")
    if dtype in ("float16", "bfloat16"):
        ok = np.isfinite(X)
        if np.isnan(x_out[ok]).any():
            problems.append("x: NaN where the reference is finite")
            return problems
        d = np.abs(_ordered_bits(x_out[ok], dtype) - _ordered_bits(X[ok], dtype))
        if d.size and int(d.max()) > 1:
            problems.append(f"x: an element {int(d.max())} ulp off dtype(reference)")
        if int((d > 0).sum()) > max(1, 0.01 * d.size):   # (one element may, in a small array)
            problems.append(f"x: {100 * (d > 0).mean():.1f}% of the elements differ from dtype(reference) "
                            "(at most 1% may, by one unit)")
    return problems


def moe_ref(x, w13, w2, topk_weights, topk_ids):
    """out[t] = sum_k w[t,k] * w2[e] @ (silu(g)*u), float64, slot by slot; invalid ids skipped."""
    T, H = x.shape
    E, I2, _ = w13.shape
    I = I2 // 2
    out = np.zeros((T, H))
    for t in range(T):
        xt = x[t].astype(np.float64)
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            if not 0 <= e < E:
                continue
            gu = w13[e].astype(np.float64) @ xt
            g, u = gu[:I], gu[I:]
            act = g / (1.0 + np.exp(-g)) * u
            out[t] += float(topk_weights[t, k]) * (w2[e].astype(np.float64) @ act)
    return out


def random_routing(rng, T, E, K):
    """Distinct ids per row (argsort of random logits) and positive weights summing to 1."""
    logits = rng.standard_normal((T, E))
    ids = np.argsort(-logits, axis=1)[:, :K].astype(np.int32)
    w = rng.random((T, K)).astype(np.float32) + 0.1
    return (w / w.sum(1, keepdims=True)).astype(np.float32), ids


def random_moe_case(rng, T, H, E, I, K, dtype="float32"):
    """Random inputs of a MoE layer in ``dtype`` (a NP_DTYPES name): hidden_states (T, H), w13
    (E, 2I, H) and w2 (E, H, I) scaled by 1/sqrt of their inner size (outputs O(1)), then
    random_routing's topk_weights and topk_ids (T, K)."""
    npdt = NP_DTYPES[dtype]
    x = rng.standard_normal((T, H)).astype(npdt)
    w13 = (rng.standard_normal((E, 2 * I, H)) / math.sqrt(H)).astype(npdt)
    w2 = (rng.standard_normal((E, H, I)) / math.sqrt(I)).astype(npdt)
    w, ids = random_routing(rng, T, E, K)
    return x, w13, w2, w, ids
