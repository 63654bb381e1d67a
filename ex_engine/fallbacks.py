"""Python fallbacks of the built-in factors, written once for NumPy and CuPy.

Each takes ``arrays`` (name -> TensorRef, names as in the factor's manifest), ``sizes`` (the
bound shape symbols) and ``params``, computes in float32 and writes the outputs in place,
rounding once to their dtype. They define the semantics the plugins must match (see each
manifest's ``math``) and serve any call that no plugin takes. The ``*_math`` functions are the
same computations on plain float32 arrays, used by tests and references.
"""
from __future__ import annotations

import numpy as np

from .arrays import bf16_bits_to_f32, round_to_dtype


def _f32(xp, raw, dtype):
    """float32 values of a raw NumPy/CuPy array (bfloat16 given as uint16 bits)."""
    return bf16_bits_to_f32(xp, raw) if dtype == "bfloat16" else raw.astype(xp.float32)


def _index_add(xp, out, idx, vals):
    """out[idx] += vals with repeated indices summed."""
    if xp is np:
        np.add.at(out, idx, vals)
    else:
        import cupyx
        cupyx.scatter_add(out, idx, vals)


# ---------------------------------------------------------------------------------------------
# topk_softmax
# ---------------------------------------------------------------------------------------------
def topk_softmax_math(xp, logits, K: int, renormalize: bool):
    """(topk_weights float32 (T,K), topk_ids int32 (T,K)) from float32 logits (T,E).

    Semantics of manifests/topk_softmax.yaml: ranking by logit with NaN as -inf, ties to the
    lowest index; stable fp32 softmax; +inf entries share 1 equally; an all -inf row is uniform
    1/E; a row holding a NaN logit gets NaN for its K weights (its ids as ranked). Source: vLLM
    csrc/moe/topk_softmax_kernels.cu (softmax, then top-k).
    """
    T, E = logits.shape
    key = xp.where(xp.isnan(logits), xp.float32(-np.inf), logits).astype(xp.float32) + xp.float32(0.0)
    if T == 0:
        return xp.zeros((0, K), xp.float32), xp.zeros((0, K), xp.int32)
    if xp is np:
        order = np.argsort(-key, axis=1, kind="stable")
    else:
        order = xp.argsort(-key, axis=1)  # CuPy's sort is a stable radix sort
    ids = order[:, :K].astype(xp.int32)
    m = key.max(axis=1, keepdims=True)
    finite = xp.isfinite(m)
    with np.errstate(over="ignore", invalid="ignore"):
        ex = xp.exp(key - xp.where(finite, m, xp.float32(0.0)))
        p = ex / ex.sum(axis=1, keepdims=True)   # rows with m = +-inf are replaced below
    is_inf = (key == xp.float32(np.inf)).astype(xp.float32)
    p_inf = is_inf / xp.maximum(is_inf.sum(axis=1, keepdims=True), 1)
    p = xp.where(m == xp.float32(np.inf), p_inf, p)
    p = xp.where(m == xp.float32(-np.inf), xp.float32(1.0 / E), p).astype(xp.float32)
    w = xp.take_along_axis(p, ids.astype(xp.int64), axis=1)
    if renormalize:
        w = w / w.sum(axis=1, keepdims=True)
    w = xp.where(xp.isnan(logits).any(axis=1, keepdims=True), xp.float32(np.nan), w)
    return w.astype(xp.float32), ids


def topk_softmax(arrays, sizes, params):
    """Fallback of factor 0: writes topk_weights (T,K) fp32 and topk_ids (T,K) int32."""
    logits = arrays["router_logits"]
    xp = logits.xp()
    w, ids = topk_softmax_math(xp, logits.load_f32(), sizes["K"], params["renormalize"])
    arrays["topk_weights"].raw()[...] = w
    arrays["topk_ids"].raw()[...] = ids


# ---------------------------------------------------------------------------------------------
# fused_add_rmsnorm
# ---------------------------------------------------------------------------------------------
def fused_add_rmsnorm_math(xp, x, residual, weight, eps: float, dtype: str):
    """(new x, new residual) as float32 values already rounded to ``dtype``.

    residual' = round(residual + x); x' = round(residual' * rsqrt(mean(residual'^2) + eps) * w).
    A row whose fp32 sum of squares overflows while its values are finite (|r| past ~1.8e19 /
    sqrt(H)) gets the same rsqrt computed on r / max|r|, as the kernels' rescued_inv_rms does; a
    row holding an inf or NaN keeps the plain formula's IEEE result.
    Source: Zhang & Sennrich 2019 (RMSNorm); vLLM csrc/layernorm_kernels.cu fused_add_rms_norm.
    """
    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        r = round_to_dtype(xp, (x + residual).astype(xp.float32), dtype)
        H = r.shape[-1]
        f32 = xp.float32
        total = (r * r).sum(axis=-1, keepdims=True, dtype=f32)
        inv = (1.0 / xp.sqrt(total / f32(H) + f32(eps))).astype(f32)
        over = ~(total <= f32(np.finfo(np.float32).max))           # inf or NaN sums
        if bool(over.any()):
            amax = xp.where(xp.isnan(r), f32(np.inf), xp.abs(r)).max(axis=-1, keepdims=True)
            fine = over & (amax <= f32(np.finfo(np.float32).max)) & (amax > 0)
            safe = xp.where(fine, amax, f32(1.0))
            q = r * (f32(1.0) / safe)
            s2 = (q * q).sum(axis=-1, keepdims=True, dtype=f32)
            rescued = (1.0 / xp.sqrt(s2 / f32(H) + f32(eps) / safe / safe) / safe).astype(f32)
            inv = xp.where(fine, rescued, inv)
        y = round_to_dtype(xp, (r * inv) * weight, dtype)
    return y, r


def fused_add_rmsnorm(arrays, sizes, params):
    """Fallback of factor 1: in place on x (T,H) and residual (T,H); views with row strides ok."""
    x, res, w = arrays["x"], arrays["residual"], arrays["weight"]
    y, r = fused_add_rmsnorm_math(x.xp(), x.load_f32(), res.load_f32(), w.load_f32(),
                                  params["eps"], x.dtype)
    res.store(r)
    x.store(y)


# ---------------------------------------------------------------------------------------------
# moe_fused_gemm
# ---------------------------------------------------------------------------------------------
def moe_fused_gemm_math(xp, hidden_states, w13_of, w2_of, topk_weights, topk_ids, E: int,
                        act_dtype: str | None, accum=np.float32):
    """out (T,H) in ``accum`` precision; w13_of(e)/w2_of(e) return expert e's matrices.

    out[t] = sum_k topk_weights[t,k] * w2[e] @ (silu(g) * u), [g; u] = w13[e] @ x_t, e =
    topk_ids[t,k]; slots with e outside [0, E) contribute nothing. act is rounded to
    ``act_dtype`` (None: not rounded). Source: vLLM fused_moe (fused_experts), Shazeer 2017.
    Returns (out, number of invalid slots).
    """
    T, H = hidden_states.shape
    out = xp.zeros((T, H), accum)
    ids = topk_ids
    valid = (ids >= 0) & (ids < E)
    n_invalid = int((~valid).sum())
    experts = xp.unique(ids[valid])
    x_all = hidden_states.astype(accum)
    for e in (experts.tolist() if hasattr(experts, "tolist") else experts):
        t_idx, k_idx = xp.nonzero(ids == e)
        w13 = w13_of(e).astype(accum)
        I = w13.shape[0] // 2
        gu = x_all[t_idx] @ w13.T
        g, u = gu[:, :I], gu[:, I:]
        with np.errstate(over="ignore"):
            act = (g / (1 + xp.exp(-g))) * u
        if act_dtype is not None:
            act = round_to_dtype(xp, act.astype(xp.float32), act_dtype).astype(accum)
        y = act @ w2_of(e).astype(accum).T
        _index_add(xp, out, t_idx, topk_weights[t_idx, k_idx].astype(accum)[:, None] * y)
    return out, n_invalid


def apply_expert_map(xp, topk_ids, expert_map, E: int):
    """(local ids, n ids outside [0, G), n map values outside [-1, E)) under expert parallelism.

    topk_ids (T, K) int32 hold global ids in [0, G); expert_map (G,) int32 gives each one's
    local expert in [0, E) or -1 (an expert on another rank). Every slot that does not land on
    a local expert gets -1 (contributes nothing). expert_map None: ids are local, G = E.
    Source: vLLM FusedMoE expert_map (global -> local, -1 elsewhere).
    """
    ids = topk_ids.astype(xp.int32)
    if expert_map is None:
        bad = (ids < 0) | (ids >= E)
        return xp.where(bad, -1, ids).astype(xp.int32), int(bad.sum()), 0
    G = expert_map.shape[0]
    in_range = (ids >= 0) & (ids < G)
    local = expert_map[xp.clip(ids, 0, max(G - 1, 0))].astype(xp.int32)
    local = xp.where(in_range, local, -1)
    bad_map = in_range & ((local < -1) | (local >= E))
    local = xp.where(bad_map, -1, local).astype(xp.int32)
    return local, int((~in_range).sum()), int(bad_map.sum())


def moe_fused_gemm(arrays, sizes, params):
    """Fallback of factor 2: writes out (T,H). Returns counts of bad slots when there are any:
    {'invalid_topk_ids': n} (ids outside [0, G)), {'invalid_expert_map': n} (map values outside
    [-1, E)). Slots of experts mapped to -1 (other ranks) contribute nothing."""
    hs = arrays["hidden_states"]
    xp, dt = hs.xp(), hs.dtype
    w13_raw, w2_raw = arrays["w13"].raw(), arrays["w2"].raw()
    ids, emap, n_bad_map = arrays["topk_ids"].raw(), arrays.get("expert_map"), 0
    if emap is not None:      # global ids -> local (-1 elsewhere); counts the bad ones itself
        ids, n_invalid, n_bad_map = apply_expert_map(xp, ids, emap.raw(), sizes["E"])
    # float16's overflow (an activation past 65504 is inf, inf * 0 NaN downstream: the range its
    # docstring states) quietly, as the kernel and the other fallbacks have it
    with np.errstate(over="ignore", invalid="ignore"):
        out, n_outside = moe_fused_gemm_math(
            xp, hs.load_f32(), lambda e: _f32(xp, w13_raw[e], dt), lambda e: _f32(xp, w2_raw[e], dt),
            arrays["topk_weights"].raw(), ids, sizes["E"], dt)
        arrays["out"].store(out)
    if emap is None:
        n_invalid = n_outside     # ids outside [0, E) (with a map, -1 also means "another rank")
    flags = {}
    if n_invalid:
        flags["invalid_topk_ids"] = n_invalid
    if n_bad_map:
        flags["invalid_expert_map"] = n_bad_map
    return flags or None
