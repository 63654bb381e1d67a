"""float64 references written plainly (loops, no shared code with the fallbacks), and helpers."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref||; inf if out has NaN."""
    o = np.asarray(out, dtype=np.float64)
    if np.isnan(o).any():
        return math.inf
    return float(np.linalg.norm(o - ref) / np.linalg.norm(ref))


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
