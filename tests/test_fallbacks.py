"""The Python fallbacks against float64 references on awkward sizes, and their semantics."""
import math

import numpy as np
import pytest

from ex_engine import (DeviceSideError, FactorRegistry, ShapeError, fused_add_rmsnorm,
                       moe_fused_gemm, topk_softmax)
from tests.reference import (NP_DTYPES, moe_ref, random_moe_case, rel_err, rmsnorm_ref,
                             rmsnorm_storage_problems, topk_softmax_ref)


@pytest.fixture(scope="module")
def reg(tmp_path_factory):
    """A registry with no plugins: every call takes the Python fallback."""
    return FactorRegistry.load(tmp_path_factory.mktemp("empty"), hardware="h200")


# ------------------------------------------------------------------------------ topk_softmax
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("T,E,K", [(1, 128, 8), (3, 40, 8), (19, 60, 6), (5, 384, 8), (4, 1, 1), (6, 8, 8)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_softmax_matches_float64(reg, dtype, T, E, K, renormalize):
    rng = np.random.default_rng()
    logits = (rng.standard_normal((T, E)) * 3).astype(NP_DTYPES[dtype])
    w, ids = topk_softmax(logits, K, renormalize, registry=reg)
    W, I = topk_softmax_ref(logits.astype(np.float64), K, renormalize)
    assert ids.dtype == np.int32 and w.dtype == np.float32
    np.testing.assert_array_equal(ids, I)
    assert rel_err(w, W) < 1e-5


def test_topk_softmax_special_rows(reg):
    nan, inf = math.nan, math.inf
    logits = np.array([
        [1.0, 3.0, 3.0, 0.0, 3.0],        # ties: lowest index first
        [nan, 2.0, nan, 1.0, 0.5],        # NaN ranks last; the row's weights NaN
        [inf, 0.0, inf, 5.0, -inf],       # +inf entries share 1
        [-inf, -inf, nan, -inf, -inf],    # nothing finite, a NaN: NaN weights
        [65000.0, 64000.0, -65000.0, 0.0, 1.0],  # large fp32 values: stable
    ], np.float32)
    w, ids = topk_softmax(logits, 3, False, registry=reg)
    W, I = topk_softmax_ref(logits.astype(np.float64), 3, False)
    np.testing.assert_array_equal(ids, I)
    np.testing.assert_allclose(w, W, rtol=1e-6, atol=1e-7)
    assert ids[0].tolist() == [1, 2, 4] and ids[1].tolist() == [1, 3, 4]
    assert w[2].tolist() == [0.5, 0.5, 0.0] and ids[3].tolist() == [0, 1, 2]  # NaN ties with -inf
    assert np.isnan(w[1]).all() and np.isnan(w[3]).all() and not np.isnan(w[[0, 2, 4]]).any()
    for row in ids:
        assert len(set(row.tolist())) == 3 and all(0 <= i < 5 for i in row)
    w, ids = topk_softmax(np.full((1, 5), -inf, np.float32), 2, False, registry=reg)
    assert np.allclose(w, 0.2) and ids.tolist() == [[0, 1]]                  # all -inf: uniform


def test_topk_softmax_large_fp16_logits_do_not_overflow(reg):
    logits = np.array([[60000, 59968, -60000, 100]], np.float16)   # 59968 = 60000 - 32, exact
    w, ids = topk_softmax(logits, 2, False, registry=reg)
    assert ids.tolist() == [[0, 1]] and np.isfinite(w).all()
    assert abs(w[0, 1] - math.exp(-32)) < 1e-18 and w[0, 0] == 1.0


def test_topk_softmax_empty_and_k_greater_than_e(reg):
    w, ids = topk_softmax(np.zeros((0, 16), np.float32), 4, registry=reg)
    assert w.shape == (0, 4) and ids.shape == (0, 4)
    with pytest.raises(ShapeError, match=r"argument 'top_k': K <= E: expected at most E = 8 \(router_logits' width\), got 9"):
        topk_softmax(np.ones((2, 8), np.float32), 9, registry=reg)


# ------------------------------------------------------------------------------ fused_add_rmsnorm
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("T,H", [(1, 4096), (3, 111), (19, 769)])
def test_fused_add_rmsnorm_matches_float64(reg, dtype, T, H):
    rng = np.random.default_rng()
    npdt = NP_DTYPES[dtype]
    x = rng.standard_normal((T, H)).astype(npdt)
    res = rng.standard_normal((T, H)).astype(npdt)
    wt = (1 + 0.1 * rng.standard_normal(H)).astype(npdt)
    X, R = rmsnorm_ref(x.astype(np.float64), res.astype(np.float64), wt, 1e-6, dtype)
    fused_add_rmsnorm(x, res, wt, 1e-6, registry=reg)
    tol = reg.manifest("fused_add_rmsnorm").tolerance[dtype]
    assert rel_err(x.astype(np.float64), X) < tol
    assert rel_err(res.astype(np.float64), R) < tol
    assert rel_err(np.zeros_like(X), X) > tol  # the tolerance can fail
    assert rmsnorm_storage_problems(x.astype(np.float64), res.astype(np.float64), X, R, dtype) == []


def test_fused_add_rmsnorm_on_row_views_leaves_padding(reg):
    rng = np.random.default_rng()
    buf_x = np.full((7, 130), 7.0, np.float32)
    buf_r = np.full((7, 150), -3.0, np.float32)
    x, res = buf_x[:, 5:116], buf_r[:, 20:131]           # H = 111, row strides 130 and 150
    x[...] = rng.standard_normal(x.shape)
    res[...] = rng.standard_normal(res.shape)
    wt = rng.standard_normal(111).astype(np.float32)
    X, R = rmsnorm_ref(x.copy(), res.copy(), wt, 1e-5, "float32")
    fused_add_rmsnorm(x, res, wt, 1e-5, registry=reg)
    assert rel_err(x, X) < 1e-5 and rel_err(res, R) < 1e-5
    assert (buf_x[:, :5] == 7).all() and (buf_x[:, 116:] == 7).all()
    assert (buf_r[:, :20] == -3).all() and (buf_r[:, 131:] == -3).all()


# ------------------------------------------------------------------------------ moe_fused_gemm
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("T,H,E,I,K", [(1, 111, 40, 67, 8), (3, 64, 40, 32, 8), (19, 111, 40, 67, 6), (5, 48, 7, 24, 7)])
def test_moe_matches_float64(reg, dtype, T, H, E, I, K):
    rng = np.random.default_rng()
    x, w13, w2, w, ids = random_moe_case(rng, T, H, E, I, K, dtype)
    out = np.full((T, H), np.nan, NP_DTYPES[dtype])   # poisoned: every element must be written
    moe_fused_gemm(x, w13, w2, w, ids, out=out, registry=reg)
    ref = moe_ref(x, w13, w2, w, ids)
    tol = reg.manifest("moe_fused_gemm").tolerance[dtype]
    assert rel_err(out, ref) < tol
    assert rel_err(np.zeros_like(ref), ref) > tol and rel_err(np.roll(out.astype(np.float64), 1, axis=1), ref) > tol


def test_moe_all_tokens_on_one_expert_and_idle_experts(reg):
    rng = np.random.default_rng()
    x, w13, w2, w, ids = random_moe_case(rng, 16, 64, 10, 32, 3, "bfloat16")
    ids[:, 0] = 4
    ids[:, 1] = np.where(ids[:, 1] == 4, 5, ids[:, 1])
    ids[:, 2] = 9
    ids[:, 1] = np.where(ids[:, 1] == 9, 6, ids[:, 1])
    out = moe_fused_gemm(x, w13, w2, w, ids, registry=reg)
    assert rel_err(out, moe_ref(x, w13, w2, w, ids)) < 1e-2


def test_moe_out_of_range_ids_contribute_nothing_and_are_reported(reg):
    rng = np.random.default_rng()
    x, w13, w2, w, ids = random_moe_case(rng, 4, 32, 6, 16, 2, "float16")
    ids[1, 0], ids[2, 1] = 6, -1
    out = moe_fused_gemm(x, w13, w2, w, ids, registry=reg)
    assert rel_err(out, moe_ref(x, w13, w2, w, ids)) < 5e-3
    with pytest.raises(DeviceSideError, match=r"invalid_topk_ids in 2 slot"):
        reg.check_device_errors()
    reg.check_device_errors()  # cleared


def test_moe_empty_batch(reg):
    x, w13, w2, w, ids = random_moe_case(np.random.default_rng(), 0, 32, 6, 16, 2, "float16")
    assert moe_fused_gemm(x, w13, w2, w, ids, registry=reg).shape == (0, 32)
