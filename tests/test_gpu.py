"""The built plugins on a real GPU, through the registry, against float64 references.

Marked `gpu`: skipped where CuPy or a GPU is missing. Outputs are poisoned (NaN) before every
call, inputs drawn fresh, bf16 passed as Bits16 (uint16 bits) so CuPy needs no bf16 dtype.
"""
import math
import os
import re

import numpy as np
import pytest

from ex_engine import DeviceSideError, FactorRegistry, fused_add_rmsnorm, moe_fused_gemm, topk_softmax
from ex_engine.arrays import Bits16, TensorRef, f32_to_bf16_bits
from ex_engine.errors import LayoutError
from ex_engine.fallbacks import moe_fused_gemm_math
from ex_engine.moe_layer import load_models
from tests.conftest import ROOT
from tests.reference import rel_err, rmsnorm_ref, rmsnorm_storage_problems, topk_softmax_ref

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp():
    import cupy
    return cupy


@pytest.fixture(scope="module")
def reg():
    r = FactorRegistry.load(ROOT / "factors")
    assert r.hardware.live
    return r


@pytest.fixture(autouse=True)
def _status_cleared_after(request):
    """A test that fails between flagging the device status word and checking it would fail
    every later test's check: after each test that used the module's registry, any flag left is
    read and dropped, so a failure is reported once, by the test that caused it."""
    yield
    r = request.node.funcargs.get("reg")
    if r is not None:
        try:
            r.check_device_errors()
        except DeviceSideError:
            pass


def make(cp, values_f32, dtype):
    """A CuPy array (or Bits16 for bf16) of ``dtype`` from float32 values."""
    if dtype == "bfloat16":
        return Bits16(f32_to_bf16_bits(cp, values_f32))
    return values_f32.astype(dtype)


def poison(cp, shape, dtype):
    return make(cp, cp.full(shape, cp.nan, cp.float32), dtype)


def f64(a):
    return TensorRef.of(a).load_f32().astype("float64")


def rel(cp, out, ref):
    """reference.rel_err on the device: the whole array's relative error, or the worst row's."""
    o = f64(out) if not hasattr(out, "dtype") or out.dtype != np.float64 else out
    return rel_err(o, ref, cp)


def test_all_builtin_factors_ready_on_this_gpu(reg):
    for name in ("topk_softmax", "fused_add_rmsnorm", "moe_fused_gemm"):
        p = reg.get(name)
        assert p is not None and p.status == "ready", [(q.path.name, q.reason) for q in reg.plugins]


# ------------------------------------------------------------------------------ topk_softmax
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("T,E,K", [(1, 128, 8), (7, 40, 8), (1000, 64, 6), (300, 384, 8), (5, 1, 1), (9, 60, 60)])
def test_topk_softmax_plugin(reg, cp, dtype, T, E, K):
    logits = make(cp, cp.random.standard_normal((T, E), dtype=cp.float32) * 2, dtype)
    w = cp.full((T, K), cp.nan, cp.float32)
    ids = cp.full((T, K), -7, cp.int32)
    topk_softmax(logits, K, True, topk_weights=w, topk_ids=ids, registry=reg)
    assert reg.last_path["topk_softmax"] == "plugin"
    W, I = topk_softmax_ref(f64(logits).get(), K, True)
    np.testing.assert_array_equal(ids.get(), I)
    assert rel(cp, w.astype(cp.float64), cp.asarray(W)) < 1e-5


def test_topk_softmax_special_rows_match_fallback(reg, cp):
    nan, inf = math.nan, math.inf
    rows = np.array([[1, 3, 3, 0, 3, 2], [nan, 2, nan, 1, .5, 0], [inf, 0, inf, 5, -inf, 1],
                     [-inf, -inf, nan, -inf, -inf, -inf], [6e4, 5.9e4, -6e4, 0, 1, 2]], np.float32)
    logits = cp.asarray(rows)
    # poisoned with -7, not NaN: rows 1 and 3 expect NaN weights
    w, ids = cp.full((5, 3), -7.0, cp.float32), cp.full((5, 3), -7, cp.int32)
    topk_softmax(logits, 3, False, topk_weights=w, topk_ids=ids, registry=reg)
    assert reg.last_path["topk_softmax"] == "plugin"
    W, I = topk_softmax_ref(rows.astype(np.float64), 3, False)
    np.testing.assert_array_equal(ids.get(), I)
    np.testing.assert_allclose(w.get(), W, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("E,K,renorm", [(128, 8, False), (384, 8, True), (64, 6, True), (2000, 8, False)])
def test_topk_softmax_nan_rows_get_nan_weights(reg, cp, dtype, E, K, renorm):
    """A row holding a NaN logit gets NaN for its K weights and valid ids (ranked with NaN as
    -inf), on every kernel: the fast one (E = 64, 128), the packed-key one (E = 384 with
    renormalize) and the generic one (E = 2000, kernel_fallback); other rows as the reference."""
    T = 64
    lv = cp.random.standard_normal((T, E), dtype=cp.float32) * 2
    lv[3, 7] = cp.nan
    lv[10, :] = cp.nan
    lv[20, ::3] = cp.nan
    lv[33, :] = -cp.inf
    logits = make(cp, lv, dtype)
    w = cp.full((T, K), -7.0, cp.float32)
    ids = cp.full((T, K), -7, cp.int32)
    topk_softmax(logits, K, renorm, topk_weights=w, topk_ids=ids, registry=reg)
    # the fast and packed-key kernels serve E <= 1024; the generic one (kernel_fallback) E = 2000
    assert reg.last_path["topk_softmax"] == ("kernel_fallback" if E > 1024 else "plugin")
    W, I = topk_softmax_ref(f64(logits).get(), K, renorm)
    np.testing.assert_array_equal(ids.get(), I)
    got = w.get()
    nan_rows = np.isnan(f64(logits).get()).any(axis=1)
    assert nan_rows.sum() == 3 and np.isnan(got[nan_rows]).all() and not np.isnan(got[~nan_rows]).any()
    np.testing.assert_allclose(got[~nan_rows], W[~nan_rows], rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------------ fused_add_rmsnorm
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("T,H", [(1, 4096), (7, 111), (1000, 769), (64, 2048)])
def test_fused_add_rmsnorm_plugin(reg, cp, dtype, T, H):
    xv = cp.random.standard_normal((T, H), dtype=cp.float32)
    rv = cp.random.standard_normal((T, H), dtype=cp.float32)
    wv = 1 + 0.1 * cp.random.standard_normal(H, dtype=cp.float32)
    x, r, w = make(cp, xv, dtype), make(cp, rv, dtype), make(cp, wv, dtype)
    X, R = rmsnorm_ref(f64(x).get(), f64(r).get(), f64(w).get(), 1e-6, dtype)
    fused_add_rmsnorm(x, r, w, 1e-6, registry=reg)
    assert reg.last_path["fused_add_rmsnorm"] == "plugin"
    tol = reg.manifest("fused_add_rmsnorm").tolerance[dtype]
    assert rel(cp, x, cp.asarray(X)) < tol and rel(cp, r, cp.asarray(R)) < tol
    assert rmsnorm_storage_problems(f64(x).get(), f64(r).get(), X, R, dtype) == []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("H", [111, 4096, 20000])
def test_fused_add_rmsnorm_plugin_rows_past_the_fp32_sum_of_squares(reg, cp, dtype, H):
    """Rows of finite values whose fp32 sum of squares overflows (|r| ~ 1e20, 3e37) were zeros:
    rescued_inv_rms normalises them on r / max|r| (H = 111: the scalar fast kernel; 4096: the
    vector one; 20000: the generic kernel). A row holding an inf keeps IEEE's result."""
    scale = cp.asarray([1e20, 1.0, 3e37, 1e-3], dtype=cp.float32)[:, None]
    xv = cp.random.standard_normal((4, H), dtype=cp.float32) * scale
    rv = cp.random.standard_normal((4, H), dtype=cp.float32) * scale
    wv = 1 + 0.1 * cp.random.standard_normal(H, dtype=cp.float32)
    x, r, w = make(cp, xv, dtype), make(cp, rv, dtype), make(cp, wv, dtype)
    X, R = rmsnorm_ref(f64(x).get(), f64(r).get(), f64(w).get(), 1e-6, dtype)
    fused_add_rmsnorm(x, r, w, 1e-6, registry=reg)
    # the fast kernels hold H <= 4096 here (scalar) or more (vector); H = 20000 is past both
    assert reg.last_path["fused_add_rmsnorm"] == ("plugin" if H <= 4096 else "kernel_fallback")
    tol = reg.manifest("fused_add_rmsnorm").tolerance[dtype]
    got = f64(x)
    for t in range(4):
        assert rel(cp, got[t], cp.asarray(X[t])) < tol, t
    assert rmsnorm_storage_problems(got.get(), f64(r).get(), X, R, dtype) == []
    assert float(np.linalg.norm(X[0])) > 1.0   # O(1) per element: zeros fail above
    xi = make(cp, xv, dtype)
    ri = make(cp, rv, dtype)
    ri_f = f64(ri)
    ri_f[2, 5] = cp.inf
    ri = make(cp, ri_f.astype(cp.float32), dtype)
    fused_add_rmsnorm(xi, ri, w, 1e-6, registry=reg)
    row = f64(xi)[2]
    assert bool(cp.isnan(row[5])) and bool((row[cp.arange(H) != 5] == 0).all())


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_fused_add_rmsnorm_views_and_misaligned_base(reg, cp, dtype):
    T, H = 33, 769
    bx = cp.full((T, H + 40), 7, dtype)
    br = cp.full((T, H + 9), -3, dtype)
    x, r = bx[:, 1:1 + H], br[:, 3:3 + H]              # row strides 809, 778; base +1/+3 elements
    x[...] = cp.random.standard_normal((T, H))
    r[...] = cp.random.standard_normal((T, H))
    w = (1 + 0.1 * cp.random.standard_normal(H)).astype(dtype)
    X, R = rmsnorm_ref(x.get().astype(np.float64), r.get().astype(np.float64), w.get(), 1e-5, dtype)
    fused_add_rmsnorm(x, r, w, 1e-5, registry=reg)
    assert reg.last_path["fused_add_rmsnorm"] == "plugin"
    tol = reg.manifest("fused_add_rmsnorm").tolerance[dtype]
    assert rel(cp, x.astype(cp.float64), cp.asarray(X)) < tol
    assert rel(cp, r.astype(cp.float64), cp.asarray(R)) < tol
    assert rmsnorm_storage_problems(f64(x).get(), f64(r).get(), X, R, dtype) == []
    assert bool((bx[:, :1] == 7).all()) and bool((bx[:, 1 + H:] == 7).all())
    assert bool((br[:, :3] == -3).all()) and bool((br[:, 3 + H:] == -3).all())


def test_short_path_on_cupy_arrays_checks_every_call(reg, cp):
    """After a checked call, calls with the same signature take dispatch's short path: fresh
    arrays give their own results, x passed as residual (same signature) is a LayoutError."""
    T, H = 5, 1024
    w = (1 + 0.1 * cp.random.standard_normal(H)).astype(cp.float16)
    for _ in range(3):
        x = cp.random.standard_normal((T, H)).astype(cp.float16)
        r = cp.random.standard_normal((T, H)).astype(cp.float16)
        X, R = rmsnorm_ref(x.get().astype(np.float64), r.get().astype(np.float64), w.get(), 1e-5, "float16")
        fused_add_rmsnorm(x, r, w, 1e-5, registry=reg)
        assert reg.last_path["fused_add_rmsnorm"] == "plugin"
        tol = reg.manifest("fused_add_rmsnorm").tolerance["float16"]
        assert rel(cp, x.astype(cp.float64), cp.asarray(X)) < tol
        assert rel(cp, r.astype(cp.float64), cp.asarray(R)) < tol
        assert rmsnorm_storage_problems(f64(x).get(), f64(r).get(), X, R, "float16") == []
    errors = reg.stats()["fused_add_rmsnorm"]["errors"]
    with pytest.raises(LayoutError, match="overlaps"):
        fused_add_rmsnorm(x, x, w, 1e-5, registry=reg)
    assert reg.stats()["fused_add_rmsnorm"]["errors"] == errors + 1


# ------------------------------------------------------------------------------ moe_fused_gemm
def moe_case(cp, T, H, E, I, K, dtype, skew=False):
    x = make(cp, cp.random.standard_normal((T, H), dtype=cp.float32), dtype)
    w13 = make(cp, cp.random.standard_normal((E, 2 * I, H), dtype=cp.float32) / math.sqrt(H), dtype)
    w2 = make(cp, cp.random.standard_normal((E, H, I), dtype=cp.float32) / math.sqrt(I), dtype)
    logits = cp.random.standard_normal((T, E), dtype=cp.float32)
    if skew:
        logits[:, :2] += 4.0
    ids = cp.argsort(-logits, axis=1)[:, :K].astype(cp.int32)
    w = cp.random.random((T, K), dtype=cp.float32) + 0.1
    return x, w13, w2, (w / w.sum(1, keepdims=True)).astype(cp.float32), ids


def empty_experts_ids(cp, T, E=64, K=4):
    """(T, K) int32 top-k ids over E experts, experts 0-3 hot, 4-7 and 32.. never chosen."""
    logits = cp.random.standard_normal((T, E), dtype=cp.float32)
    logits[:, :4] += 3.0
    logits[:, 4:8] = -cp.inf
    logits[:, 32:] = -cp.inf
    return cp.argsort(-logits, axis=1)[:, :K].astype(cp.int32)


def moe_reference(cp, x, w13, w2, w, ids):
    E = TensorRef.of(w13).shape[0]
    w13r, w2r = TensorRef.of(w13), TensorRef.of(w2)
    conv = lambda ref, e: TensorRef.of(Bits16(ref.raw()[e]) if ref.dtype == "bfloat16" else ref.raw()[e]).load_f32()
    out, _ = moe_fused_gemm_math(cp, f64(x), lambda e: conv(w13r, e), lambda e: conv(w2r, e),
                                 w.astype(cp.float64), ids, E, None, accum=cp.float64)
    return out


def run_moe_check(reg, cp, case, dtype, want_path=("plugin",)):
    x, w13, w2, w, ids = case
    T, H = TensorRef.of(x).shape
    out = poison(cp, (T, H), dtype)
    moe_fused_gemm(x, w13, w2, w, ids, out=out, registry=reg)
    assert reg.last_path["moe_fused_gemm"] in want_path
    ref = moe_reference(cp, x, w13, w2, w, ids)
    tol = reg.manifest("moe_fused_gemm").tolerance[dtype]
    if dtype == "float16":
        # fp16's own error is <= ~9e-4 at these shapes (a NumPy model of the kernels' roundings);
        # the manifest's 5e-3 would pass an fp16 path that rounds its intermediates to bf16 (3.5e-3)
        tol = min(tol, 2e-3)
    err = rel(cp, out, ref)
    assert err < tol, err
    return out


MODELS = load_models()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("T", [1, 64])
def test_moe_plugin_on_model_shapes(reg, cp, model, T, dtype):
    s = MODELS[model]
    run_moe_check(reg, cp, moe_case(cp, T, s.H, s.E, s.I, s.K, dtype), dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("T,H,E,I,K", [(3, 256, 40, 96, 8), (1000, 512, 40, 256, 6), (4096, 2048, 128, 768, 8),
                                       (19, 2048, 60, 1408, 4), (1, 64, 1, 32, 1),
                                       # prefill rows per expert with I > H (mixtral's ratio):
                                       # the Hopper path's buffers hold xs, gu, act and ys in turn
                                       (1024, 256, 8, 1024, 2), (2048, 512, 16, 1408, 6),
                                       # Hopper path with I % 128 != 0: the ungated GEMM1 and
                                       # the separate silu launch
                                       (1024, 512, 8, 200, 2),
                                       # 16 rows per expert: the kernel's own choice is mid32
                                       (130, 1024, 16, 200, 2)])
@pytest.mark.parametrize("library", [None, "moe_fused_gemm.so"])
def test_moe_plugin_awkward(reg, cp, T, H, E, I, K, dtype, library):
    """The registry's choice (the Hopper plugin on an H200) and the portable plugin, whose
    BM = 64 / 128 kernels no other test runs in float16."""
    r = reg if library is None else registry_preferring(library)
    run_moe_check(r, cp, moe_case(cp, T, H, E, I, K, dtype), dtype)


# (T, H, E, I, K) of the Hopper tiling tests (kind_case: "one expert", "empty experts" routing)
SM90_AWKWARD_SHAPES = {"T=1": (1, 2048, 128, 768, 8), "T=3 E=40": (3, 256, 40, 128, 8),
                       "E=40": (1000, 512, 40, 256, 6), "ungated I=200": (1024, 512, 8, 200, 2),
                       "I > H": (700, 256, 8, 1024, 2), "one expert": (3000, 512, 16, 384, 1),
                       "empty experts": (2048, 256, 64, 128, 4), "H=200": (1000, 200, 16, 256, 4),
                       "I=1408": (700, 256, 8, 1408, 2), "repeated ids": (1000, 512, 40, 256, 8)}


def registry_preferring(library):
    """A registry of factors/ whose moe_fused_gemm is ``library`` (a file name there), loaded with
    the environment as it is now (a plugin reads its switches when it loads); skips where the
    library is not built or not ready on this GPU."""
    if not (ROOT / "factors" / library).exists():
        pytest.skip(f"{library} not built")
    r = FactorRegistry.load(ROOT / "factors", prefer={"moe_fused_gemm": library})
    p = r.get("moe_fused_gemm")
    if p is None or p.path.name != library:
        pytest.skip(f"{library} not ready on this GPU")
    return r


def sm90_registry():
    """A registry whose moe_fused_gemm is the Hopper plugin (skips where it is not built or not
    ready on this GPU)."""
    return registry_preferring("moe_fused_gemm_sm90.so")


# Tile128 (cooperative; GEMM2 on 128 x 128 ping-pong tiles where I <= 1024), Tile64 (ping-pong),
# narrow (both GEMMs on 128 x 128 ping-pong tiles, two MMAs along M per warpgroup), chunked
# (both GEMMs on chunks of up to 256 of an expert's rows; on the gated shapes with H % 128 == 0,
# else the 128 x 256 tiling), chunked_nomc (the same without the multicast of A), chunked_tail
# (256-row chunks whose last takes up to 32 rows more, with the multicast of A)
@pytest.mark.parametrize("config", [4, 7, 8, 10])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("kind", ["T=1", "T=3 E=40", "E=40", "ungated I=200", "I > H", "one expert",
                                  "empty experts", "H=200", "I=1408", "repeated ids"])
def test_moe_sm90_tilings_on_awkward_shapes(cp, config, dtype, kind):
    """The three tilings of the Hopper plugin's grouped GEMMs, forced through dims[7] (what the tuner
    times): tiny and awkward shapes, one expert with every slot, idle experts, the gated GEMM1
    (I % 128 == 0) and the ungated one with the separate silu launch; H = 200 leaves a last
    k-tile of 8 of the 64 columns for the TMA to zero-fill; I = 1408 keeps GEMM2 on the 128-row
    tiling's cooperative tile (the other shapes have I <= 1024: ping-pong)."""
    r = sm90_registry()
    r.set_tuning("moe_fused_gemm", lambda sizes: config)
    case, _ = kind_case(cp, SM90_AWKWARD_SHAPES, kind, dtype)
    run_moe_check(r, cp, case, dtype)
    r.check_device_errors()


def profiled_kernels(cp, call):
    """(call()'s result, the names of the CUDA kernels it launched), from PyTorch's profiler (a
    CUPTI kernel trace; skips where PyTorch is missing); the device is synchronized on both sides."""
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile
    cp.cuda.Device().synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        result = call()
        cp.cuda.Device().synchronize()
    return result, [ev.name for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.parametrize("kind,chunked", [("I > H", True), ("one expert", True), ("H=200", False),
                                          ("ungated I=200", False)])
def test_moe_chunked_kernels_run_where_they_take_the_shape(cp, kind, chunked):
    """dims[7] = 10 (chunked) and 11 (chunked_nomc) run the chunked kernels (moe_chunked_sm90.cuh)
    on the shapes they take (gated GEMM1, H % 128 == 0) and the 128-row CUTLASS tiling elsewhere;
    dims[7] = 4 never runs them. The outputs agree whichever ran, so the kernels' names in
    PyTorch's profiler (a CUPTI kernel trace) say which did."""
    r = sm90_registry()
    case, _ = kind_case(cp, SM90_AWKWARD_SHAPES, kind)
    ran = {}
    for config in (10, 11, 4):
        r.set_tuning("moe_fused_gemm", lambda sizes, c=config: c)
        run_moe_check(r, cp, case, "bfloat16")           # compiled, warm
        _, names = profiled_kernels(cp, lambda: run_moe_check(r, cp, case, "bfloat16"))
        assert any("combine" in n for n in names), names   # the trace saw the call
        ran[config] = any("chunked_gemm_kernel" in n for n in names)
    assert ran == {10: chunked, 11: chunked, 4: False}, ran
    r.check_device_errors()


@pytest.mark.parametrize("T,H,E,I,K", [(1, 4096, 128, 1536, 8), (2, 4096, 16, 6400, 2), (4, 2048, 128, 768, 8),
                                       (8, 1536, 40, 512, 8), (64, 2048, 64, 1408, 6), (40, 2056, 16, 1000, 2)])
def test_moe_decode4_equals_decode(reg, cp, T, H, E, I, K):
    """decode4 (dims[7] = 9) is decode's tile at 4 blocks per SM: forced, its output equals
    decode's (dims[7] = 1) bit for bit, with the routing inside the GEMMs (T*K <= 32) and with a
    routing launch, a last N-tile that is partly past I (I = 1000: 31.25 tiles of 32) and an H that
    is no multiple of its 64-column k-step (2056); and so does the kernel's own choice (decode4
    where H >= 2048 on the H200, whose SMs hold four of its blocks; decode at H = 1536; tiny's grid
    does not fit in one wave on any of these shapes)."""
    case = moe_case(cp, T, H, E, I, K, "bfloat16")
    outs = []
    try:
        for config in (1, 9, -1):
            reg.set_tuning("moe_fused_gemm", lambda sizes, c=config: c)
            outs.append(run_moe_check(reg, cp, case, "bfloat16"))
    finally:
        reg.set_tuning("moe_fused_gemm", None)
    reg.check_device_errors()
    for o in outs[1:]:
        assert bool((outs[0].bits == o.bits).all())


@pytest.mark.parametrize("T,H,E,I,K", [(130, 111, 40, 67, 8), (3, 100, 5, 20, 2)])
def test_moe_unaligned_sizes_go_to_kernel_fallback(reg, cp, T, H, E, I, K):
    run_moe_check(reg, cp, moe_case(cp, T, H, E, I, K, "bfloat16"), "bfloat16",
                  want_path=("kernel_fallback",))


def test_moe_skewed_and_single_expert(reg, cp):
    run_moe_check(reg, cp, moe_case(cp, 512, 1024, 64, 512, 8, "bfloat16", skew=True), "bfloat16")
    x, w13, w2, w, ids = moe_case(cp, 256, 512, 16, 128, 4, "bfloat16")
    ids[:, 0] = 5
    ids[:, 1:] = cp.asarray(np.array([[6, 7, 8]] * 256, np.int32))  # 12 experts idle
    run_moe_check(reg, cp, (x, w13, w2, w, ids), "bfloat16")


def test_moe_is_deterministic(reg, cp):
    case = moe_case(cp, 777, 1024, 40, 384, 8, "bfloat16")
    a = run_moe_check(reg, cp, case, "bfloat16")
    b = run_moe_check(reg, cp, case, "bfloat16")
    assert bool((a.bits == b.bits).all())


def test_moe_out_of_range_ids_are_skipped_and_reported(reg, cp):
    x, w13, w2, w, ids = moe_case(cp, 64, 512, 16, 128, 4, "bfloat16")
    ids[3, 1], ids[10, 0] = 16, -5
    reg.check_device_errors()
    run_moe_check(reg, cp, (x, w13, w2, w, ids), "bfloat16")
    with pytest.raises(DeviceSideError, match="topk_id outside"):
        reg.check_device_errors()


def test_moe_call_is_capturable_in_a_cuda_graph(reg, cp):
    x, w13, w2, w, ids = moe_case(cp, 64, 2048, 128, 768, 8, "bfloat16")
    out = poison(cp, (64, 2048), "bfloat16")
    moe_fused_gemm(x, w13, w2, w, ids, out=out, registry=reg)   # warm-up: workspace allocated
    # the warm-up ran on CuPy's legacy stream, which a non-blocking stream does not wait for: its
    # right answer could land after the poison below, and a replay that wrote nothing would pass
    cp.cuda.Device().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        out.bits.fill(0xFFFF)
        stream.begin_capture()
        moe_fused_gemm(x, w13, w2, w, ids, out=out, registry=reg)
        graph = stream.end_capture()
        graph.launch(stream)
    stream.synchronize()
    assert rel(cp, out, moe_reference(cp, x, w13, w2, w, ids)) < 1e-2


def test_moe_empty_batch_on_gpu(reg, cp):
    x, w13, w2, w, ids = moe_case(cp, 0, 256, 8, 64, 2, "bfloat16")
    out = moe_fused_gemm(x, w13, w2, w, ids, registry=reg)
    assert TensorRef.of(out).shape == (0, 256)


def test_torch_tensors_zero_copy(reg):
    torch = pytest.importorskip("torch")
    T, H, E, I, K = 16, 256, 8, 128, 2
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) / H ** 0.5
    w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) / I ** 0.5
    logits = torch.randn(T, E, device="cuda")
    w, ids = topk_softmax(logits, K, True, registry=reg)
    assert isinstance(w, torch.Tensor) and w.dtype == torch.float32 and ids.dtype == torch.int32
    out = moe_fused_gemm(x, w13, w2, w, ids, registry=reg)
    assert isinstance(out, torch.Tensor) and reg.last_path["moe_fused_gemm"] == "plugin"
    ref = torch.zeros(T, H, dtype=torch.float64, device="cuda")
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            gu = w13[e].double() @ x[t].double()
            act = torch.nn.functional.silu(gu[:I]) * gu[I:]
            ref[t] += float(w[t, k]) * (w2[e].double() @ act)
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("library", ["moe_fused_gemm.so", "moe_fused_gemm_sm90.so"])
def test_moe_index_arithmetic_beyond_2_pow_31(cp, library):
    """T*K*H > 2^31 elements: offsets into the T*K x H intermediates must be 64-bit."""
    reg = registry_preferring(library)
    T, H, E, I, K = 32768, 8200, 8, 64, 8      # T*K*H = 2.15e9 > 2^31
    assert T * K * H > 2**31
    x, w13, w2, w, ids = moe_case(cp, T, H, E, I, K, "bfloat16")
    out = poison(cp, (T, H), "bfloat16")
    moe_fused_gemm(x, w13, w2, w, ids, out=out, registry=reg)
    assert reg.last_path["moe_fused_gemm"] == "plugin"
    rows = cp.asarray(np.array([0, 1, T // 2, T - 2, T - 1]))     # check the last rows too
    sub = (Bits16(x.bits[rows]), w13, w2, w[rows], ids[rows])
    ref = moe_reference(cp, *sub)
    assert rel(cp, Bits16(out.bits[rows]), ref) < 1e-2
    assert not bool(cp.isnan(TensorRef.of(out).load_f32()).any())


def test_moe_out_of_range_ids_under_graph_capture(reg, cp):
    """The in-kernel guard works inside a CUDA graph: no out-of-bounds write, flag raised."""
    x, w13, w2, w, ids = moe_case(cp, 64, 2048, 128, 768, 8, "bfloat16")
    out = poison(cp, (64, 2048), "bfloat16")
    moe_fused_gemm(x, w13, w2, w, ids, out=out, registry=reg)      # warm-up outside capture
    reg.check_device_errors()
    ids[5, 3], ids[40, 0] = 128, -2                                 # set before capture: the graph reads them
    guard = cp.full(4096, 0x7F7F, cp.uint16)                        # a neighbour allocation to watch
    cp.cuda.Device().synchronize()                                  # (legacy stream's writes done)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        moe_fused_gemm(x, w13, w2, w, ids, out=out, registry=reg)
        graph = stream.end_capture()
        out.bits.fill(0xFFFF)
        graph.launch(stream)
    stream.synchronize()
    assert rel(cp, out, moe_reference(cp, x, w13, w2, w, ids)) < 1e-2
    assert bool((guard == 0x7F7F).all())
    with pytest.raises(DeviceSideError, match="topk_id outside"):
        reg.check_device_errors()


@pytest.mark.parametrize("T,H,E,I,K", [(1, 2048, 128, 768, 8), (3, 2048, 64, 1024, 8), (4, 4096, 8, 14336, 2),
                                       (1, 1536, 40, 512, 8), (32, 512, 16, 256, 1)])
def test_moe_fused_routing_equals_the_routing_launch(reg, cp, monkeypatch, T, H, E, I, K):
    """T*K <= 32: GEMM1 routes in-block (new: GEMM2 too, prefetching w2 before it waits for
    GEMM1); the outputs equal the separate routing launch's, bit for bit (rows are independent,
    the combine's order is fixed), and invalid ids are flagged."""
    x, w13, w2, w, ids = moe_case(cp, T, H, E, I, K, "bfloat16")
    ids[0, 0] = E + 3                                   # an invalid slot in the first token
    if K > 1:
        ids[T - 1, K - 1] = ids[T - 1, K - 2]           # the last token: one expert in two slots
    outs = []
    for mode in ("new", "onewave", "late", "nopdl", "unfused"):
        monkeypatch.setenv("EX_MOE_DECODE_CONFIG", mode)
        reg.check_device_errors()
        outs.append(run_moe_check(reg, cp, (x, w13, w2, w, ids), "bfloat16"))
        with pytest.raises(DeviceSideError, match="topk_id outside"):
            reg.check_device_errors()
    for o in outs[1:]:
        assert bool((outs[0].bits == o.bits).all())


def moe_graph(reg, cp, case, out):
    """(stream, graph): one moe_fused_gemm call of ``case`` into ``out``, captured on a new
    non-blocking stream (the device synchronised first: out's poison, filled on the legacy
    stream, lands before any replay); replay it inside ``with stream:``."""
    cp.cuda.Device().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        moe_fused_gemm(*case, out=out, registry=reg)
        graph = stream.end_capture()
    return stream, graph


@pytest.mark.parametrize("T,H,E,I,K", [(1, 2048, 128, 768, 8), (3, 1544, 40, 512, 8), (16, 1024, 64, 256, 2),
                                       (8, 2048, 128, 768, 8), (64, 1024, 64, 256, 8)])
def test_moe_decode_survives_garbage_workspace_and_graph_replay(reg, cp, monkeypatch, T, H, E, I, K):
    """Decode (new mode: routing inside both GEMMs for T*K <= 32, else GEMM2 reading the routing
    launch's tile list before it waits for GEMM1; early launches whatever the wave count): a
    workspace full of garbage (nothing of an earlier call may be relied on), repeated eager
    calls and graph replays all give the unfused mode's output (separate routing launch, no
    early launches), bit for bit."""
    case = moe_case(cp, T, H, E, I, K, "bfloat16")
    monkeypatch.setenv("EX_MOE_DECODE_CONFIG", "unfused")
    want = run_moe_check(reg, cp, case, "bfloat16")
    monkeypatch.setenv("EX_MOE_DECODE_CONFIG", "new")
    outs = [run_moe_check(reg, cp, case, "bfloat16")]
    for buf in reg._workspaces.values():               # counters and scratch: garbage
        buf[256:] = 0x55
    outs.append(run_moe_check(reg, cp, case, "bfloat16"))
    out = poison(cp, (T, H), "bfloat16")
    stream, graph = moe_graph(reg, cp, case, out)
    with stream:
        for _ in range(3):
            out.bits.fill(0xFFFF)
            graph.launch(stream)
            stream.synchronize()
            outs.append(Bits16(out.bits.copy()))
    reg.check_device_errors()
    for o in outs:
        assert bool((o.bits == want.bits).all())


@pytest.mark.parametrize("T,H,E,I,K,layout", [(5, 2048, 128, 768, 8, "uniform"), (8, 1544, 40, 512, 8, "uniform"),
                                              (64, 1536, 40, 512, 8, "uniform"), (24, 4096, 8, 1024, 2, "uniform"),
                                              (40, 1024, 64, 256, 8, "one expert"), (48, 1024, 64, 256, 4, "empty experts"),
                                              (128, 2048, 128, 768, 8, "skew"), (100, 1024, 8, 512, 2, "one expert")])
def test_moe_decode_tile_waits_equal_the_grid_wait(reg, cp, monkeypatch, T, H, E, I, K, layout):
    """Decode after a routing launch (T*K > 32): under new, GEMM2's blocks wait for their own
    tile's counter (GEMM1's blocks add to it once their act columns are stored) instead of for
    GEMM1's whole grid, both GEMMs expert by expert (an expert's M-tiles of one N-tile side by
    side). Its outputs equal gridwait's (the whole-grid wait) bit for bit, with an expert holding
    every token (many tiles of one expert, 7 with a part-filled last at T = 100, K = 2),
    experts without tokens, H off the tile (1544), and over 20 graph replays back to back (a
    counter read too early would let GEMM2 multiply act rows from the replay before: every
    replay's act is poisoned first by a garbage-filled workspace)."""
    x, w13, w2, w, ids = moe_case(cp, T, H, E, I, K, "bfloat16", skew=layout == "skew")
    if layout == "one expert":
        ids[:, 0] = 3
        ids[:, 1:] = cp.arange(4, 4 + K - 1, dtype=cp.int32)[None, :] % E
    elif layout == "empty experts":
        ids[:] = cp.asarray(empty_experts_ids(cp, T, E, K))
    case = (x, w13, w2, w, ids)
    monkeypatch.setenv("EX_MOE_DECODE_CONFIG", "gridwait")
    want = run_moe_check(reg, cp, case, "bfloat16")
    monkeypatch.setenv("EX_MOE_DECODE_CONFIG", "new")
    assert bool((run_moe_check(reg, cp, case, "bfloat16").bits == want.bits).all())
    out = poison(cp, (T, H), "bfloat16")
    stream, graph = moe_graph(reg, cp, case, out)
    with stream:
        for _ in range(20):
            for buf in reg._workspaces.values():     # counters and act: garbage before each replay
                buf[256:] = 0x55
            out.bits.fill(0xFFFF)
            graph.launch(stream)
        stream.synchronize()
    reg.check_device_errors()
    assert bool((out.bits == want.bits).all())


@pytest.mark.parametrize("mode", ["new", "onewave", "late", "unfused", "gridwait"])
@pytest.mark.parametrize("T,H,E,I,K", [(1, 2048, 128, 768, 8), (4, 4096, 8, 14336, 2), (3, 1544, 40, 512, 8),
                                       (8, 1024, 64, 256, 8)])
def test_moe_decode_with_no_valid_slot_writes_zeros(reg, cp, monkeypatch, mode, T, H, E, I, K):
    """Every id invalid (no GEMM tile at all, every GEMM block a surplus one): out is still
    written, all zeros (by the combine, H = 1544 included), and the ids are flagged."""
    x, w13, w2, w, ids = moe_case(cp, T, H, E, I, K, "bfloat16")
    ids[:] = E + 1
    monkeypatch.setenv("EX_MOE_DECODE_CONFIG", mode)
    reg.check_device_errors()
    out = poison(cp, (T, H), "bfloat16")
    moe_fused_gemm(x, w13, w2, w, ids, out=out, registry=reg)
    assert reg.last_path["moe_fused_gemm"] == "plugin"
    with pytest.raises(DeviceSideError, match="topk_id outside"):
        reg.check_device_errors()
    assert bool((f64(out) == 0).all())


@pytest.fixture(scope="module")
def cluster_regs(tmp_path_factory):
    """(off, on): registries of copies of each moe plugin (a library is one copy per process and
    reads EX_MOE_CLUSTER_COMBINE when it loads), loaded with the cluster combine off and on."""
    import shutil
    regs = {}
    for lib in ("moe_fused_gemm.so", "moe_fused_gemm_sm90.so"):
        if not (ROOT / "factors" / lib).exists():
            continue
        pair = []
        for value in ("0", "1"):
            d = tmp_path_factory.mktemp(f"cc{value}")
            shutil.copy(ROOT / "factors" / lib, d / lib)
            old = os.environ.get("EX_MOE_CLUSTER_COMBINE")
            os.environ["EX_MOE_CLUSTER_COMBINE"] = value
            try:
                r = FactorRegistry.load(d)
            finally:
                if old is None:
                    os.environ.pop("EX_MOE_CLUSTER_COMBINE", None)
                else:
                    os.environ["EX_MOE_CLUSTER_COMBINE"] = old
            if r.get("moe_fused_gemm") is None:
                break
            pair.append(r)
        if len(pair) == 2:
            regs[lib] = pair
    if not regs:
        pytest.skip("no moe_fused_gemm plugin ready on this GPU")
    return regs


@pytest.mark.parametrize("lib", ["moe_fused_gemm.so", "moe_fused_gemm_sm90.so"])
@pytest.mark.parametrize("kind", ["granite", "K=6", "K=2 H=4352", "K=1 H=8448", "invalid id", "all invalid",
                                  "repeated expert", "expert_map", "fp16", "H=1544 I=1000", "K=8 512 blocks",
                                  "K=2 split"])
def test_moe_cluster_combine_equals_the_combine_launch(cp, cluster_regs, lib, kind):
    """T = 1 on sm_90+: where GEMM2 has at most 3 blocks per SM, it runs in clusters of the token's
    K blocks whose rank 0 sums the rows (no combine launch); its output equals the combine
    launch's bit for bit (both within tolerance of the float64 reference), also in a CUDA graph,
    and with ids that give some of a cluster's blocks no tile. The profiler's kernel names say
    which path ran: the combine launch at 512 blocks (qwen3-30b's shape) and where GEMM2 is split
    over I (S = 2: few blocks, mixtral's T = 1 and K = 2 at H = 4096 here)."""
    if lib not in cluster_regs:
        pytest.skip(f"{lib} not built or not ready")
    off, on = cluster_regs[lib]
    shapes = {"granite": (1536, 40, 512, 8), "K=6": (2048, 64, 1408, 6), "K=2 H=4352": (4352, 8, 3584, 2),
              "K=1 H=8448": (8448, 16, 512, 1), "invalid id": (1536, 40, 512, 8), "all invalid": (1536, 40, 512, 8),
              "repeated expert": (1536, 40, 512, 8), "expert_map": (1536, 40, 512, 8), "fp16": (1536, 40, 512, 8),
              "H=1544 I=1000": (1544, 40, 1000, 8), "K=8 512 blocks": (2048, 128, 768, 8),
              "K=2 split": (4096, 8, 3584, 2)}
    H, E, I, K = shapes[kind]
    dtype = "float16" if kind == "fp16" else "bfloat16"
    x, w13, w2, w, ids = moe_case(cp, 1, H, E, I, K, dtype)
    kw = {}
    if kind == "invalid id":
        ids[0, 1] = E + 5
    elif kind == "all invalid":
        ids[:] = E + 1
    elif kind == "repeated expert":
        ids[0, 1] = ids[0, 0]
    elif kind == "expert_map":   # G = 2E global ids, the odd ones on another rank
        emap = cp.asarray(np.array([g // 2 if g % 2 == 0 else -1 for g in range(2 * E)], np.int32))
        ids = cp.asarray(np.array([[2 * j + (j % 2) for j in range(K)]], np.int32))
        kw = {"expert_map": emap}
    outs, names = [], []
    for r in (off, on):
        out = poison(cp, (1, H), dtype)
        _, n = profiled_kernels(cp, lambda: moe_fused_gemm(x, w13, w2, w, ids, out=out, registry=r, **kw))
        assert r.last_path["moe_fused_gemm"] == "plugin"
        names.append(n)
        outs.append(out)
    flagged = kind in ("invalid id", "all invalid")
    for r in (off, on):
        if flagged:
            with pytest.raises(DeviceSideError, match="topk_id outside"):
                r.check_device_errors()
        else:
            r.check_device_errors()
    bits = lambda o: o.bits if isinstance(o, Bits16) else o.view(cp.uint16)
    assert bool((bits(outs[0]) == bits(outs[1])).all()), kind
    if kind == "all invalid":
        assert bool((f64(outs[1]) == 0).all())
    else:   # (expert_map: the reference of the mapped ids; it compared the two paths only)
        ref = route_reference(cp, x, w13, w2, w, ids, kw.get("expert_map"))
        assert rel(cp, outs[1], ref) < off.manifest("moe_fused_gemm").tolerance[dtype]
    combine = [any("combine" in k for k in n) for n in names]
    assert combine == [True, kind in ("K=8 512 blocks", "K=2 split")], (combine, names)
    # graph replay of the cluster path
    out = poison(cp, (1, H), dtype)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        moe_fused_gemm(x, w13, w2, w, ids, out=out, registry=on, **kw)   # warm: the workspace
        stream.begin_capture()
        moe_fused_gemm(x, w13, w2, w, ids, out=out, registry=on, **kw)
        graph = stream.end_capture()
        for _ in range(2):
            bits(out).fill(0xFFFF)
            graph.launch(stream)
            stream.synchronize()
            assert bool((bits(out) == bits(outs[0])).all()), kind
    if flagged:
        with pytest.raises(DeviceSideError, match="topk_id outside"):
            on.check_device_errors()
    else:
        on.check_device_errors()


# ------------------------------------------------------------------------------ multi-block routing
ROUTE_ENV = "EX_MOE_ROUTE_MULTIBLOCK_SLOTS"      # read by ex_get_factor (moe_portable_init)
SM90_ENV = "EX_MOE_SM90_MIN_ROWS_PER_EXPERT"     # read by the sm90 plugin's ex_get_factor
GATHER_ENV = "EX_MOE_SM90_GATHER_BY_TOKEN"       # read by the sm90 plugin's ex_get_factor
ROUTE_LIBS = [("moe_fused_gemm.so", None), ("moe_fused_gemm_sm90.so", 0)]   # (library, sm90 min rows)


@pytest.fixture
def route_reg():
    """load(library, route_slots, sm90_min_rows): a registry whose moe_fused_gemm is `library`,
    its ex_get_factor called with those variables set. A plugin's settings are process-wide (one
    dlopen handle per library): load a registry right before the calls it is meant for. At the
    end the caller's environment is restored and every library's ex_get_factor called again, so
    the module's `reg` gets its settings back."""
    saved = {k: os.environ.get(k) for k in (ROUTE_ENV, SM90_ENV, GATHER_ENV)}

    def load(library, route_slots, sm90_min_rows=None, gather_by_token=None):
        os.environ[ROUTE_ENV] = str(route_slots)
        for var, value in ((SM90_ENV, sm90_min_rows), (GATHER_ENV, gather_by_token)):
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = str(value)
        return registry_preferring(library)

    try:
        yield load
    finally:
        restore_env(saved)
        FactorRegistry.load(ROOT / "factors")


def route_case(cp, kind):
    """(x, w13, w2, w, ids, expert_map, flags): awkward routing inputs, bf16; flags = the device
    flags (DeviceSideError texts) the call must raise."""
    if kind == "awkward":                  # E=40, T*K = 8000: 4 blocks of 2048 slots, the last short
        return (*moe_case(cp, 1000, 512, 40, 256, 8, "bfloat16"), None, ())
    if kind == "one expert":               # every slot on expert 3 (5 blocks), 15 experts empty
        x, w13, w2, w, ids = moe_case(cp, 10000, 256, 16, 128, 1, "bfloat16")
        ids[:] = 3
        return x, w13, w2, w, ids, None, ()
    if kind == "empty experts":
        x, w13, w2, w, ids = moe_case(cp, 2048, 256, 64, 128, 4, "bfloat16")
        ids[:] = empty_experts_ids(cp, 2048)
        return x, w13, w2, w, ids, None, ()
    if kind == "repeated ids":             # a row's ids repeat (the contract allows it: each slot
        x, w13, w2, w, ids = moe_case(cp, 1000, 512, 40, 256, 8, "bfloat16")   # counts)
        repeat_ids(ids)
        return x, w13, w2, w, ids, None, ()
    if kind == "small tiles":              # 9 rows per expert: BM = 16 tiles (portable plugin;
        return (*moe_case(cp, 1200, 256, 256, 256, 2, "bfloat16"), None, ())  # 12..28: BM = 32)
    if kind == "qwen3-ish":                # T*K = 32768: 16 blocks
        return (*moe_case(cp, 4096, 256, 128, 128, 8, "bfloat16"), None, ())
    if kind == "many passes":              # T*K = 160000 > 64 * 2048: 64 blocks of 2500 slots
        return (*moe_case(cp, 20000, 128, 24, 64, 8, "bfloat16"), None, ())
    if kind == "top_k 40":                 # K > 32 (the gather by token takes 32 slots at a
        x, w13, w2, w, ids = moe_case(cp, 300, 264, 48, 128, 40, "bfloat16")  # time); H/8 = 33
        ids[7, 33] = 48                    # vectors (a part span); one invalid id
        return x, w13, w2, w, ids, None, ("topk_id outside",)
    if kind == "expert map":               # G=64 global ids, E=24 local experts, the rest -1;
        G, E, T, K = 64, 24, 1500, 6       # invalid ids and one invalid map value
        x, w13, w2, w, _ = moe_case(cp, T, 256, E, 128, K, "bfloat16")
        ids = cp.argsort(cp.random.standard_normal((T, G), dtype=cp.float32), axis=1)[:, :K].astype(cp.int32)
        emap = np.full(G, -1, np.int32)
        emap[5:5 + E] = np.arange(E, dtype=np.int32)[::-1]   # local order differs from global
        emap[40] = E + 7                                     # outside [-1, E): flag bit 1
        ids[3, 1], ids[700, 0], ids[T - 1, K - 1] = G, -1, 1 << 30
        return x, w13, w2, w, ids, cp.asarray(emap), ("topk_id outside", "expert_map value outside")
    raise ValueError(kind)


def repeat_ids(ids):
    """Make a (T, K >= 6) ids array's rows repeat experts, in place: slot 1 takes slot 0's
    expert, and every third row gives slots 2-4 slot 5's (one expert in 4 of its slots)."""
    ids[:, 1] = ids[:, 0]
    ids[::3, 2:5] = ids[::3, 5:6]


def route_reference(cp, x, w13, w2, w, ids, emap):
    if emap is not None:
        G, E = emap.shape[0], TensorRef.of(w13).shape[0]
        inside = (ids >= 0) & (ids < G)
        local = cp.where(inside, emap[cp.clip(ids, 0, G - 1)], -1)
        ids = cp.where((local >= 0) & (local < E), local, -1).astype(cp.int32)
    return moe_reference(cp, x, w13, w2, w, ids)


def route_run(r, cp, case):
    x, w13, w2, w, ids, emap, flags = case
    T, H = TensorRef.of(x).shape
    r.check_device_errors()
    out = poison(cp, (T, H), "bfloat16")
    moe_fused_gemm(x, w13, w2, w, ids, expert_map=emap, out=out, registry=r)
    assert r.last_path["moe_fused_gemm"] == "plugin"
    if flags:
        with pytest.raises(DeviceSideError) as exc:
            r.check_device_errors()
        for f in flags:
            assert f in str(exc.value), (f, str(exc.value))
    else:
        r.check_device_errors()
    return out


@pytest.mark.parametrize("library,sm90_min_rows", ROUTE_LIBS)
@pytest.mark.parametrize("kind", ["awkward", "one expert", "empty experts", "small tiles", "qwen3-ish",
                                  "many passes", "expert map", "repeated ids"])
def test_moe_multiblock_routing_equals_single_block(route_reg, cp, library, sm90_min_rows, kind):
    """EX_MOE_ROUTE_MULTIBLOCK_SLOTS=0 forces the multi-block routing (histogram launch, then
    placement launch), a huge value the single-block one: both match the float64 reference, flag
    the same invalid ids, and give bit-identical outputs (only the order of the slots inside an
    expert differs, on which no output depends). sm90: every aligned shape on the CUTLASS path."""
    case = route_case(cp, kind)
    ref = route_reference(cp, *case[:6])
    outs = []
    for slots in (0, 1 << 40):
        r = route_reg(library, slots, sm90_min_rows)
        out = route_run(r, cp, case)
        tol = r.manifest("moe_fused_gemm").tolerance["bfloat16"]
        assert rel(cp, out, ref) < tol, (slots, rel(cp, out, ref))
        outs.append(out)
    assert bool((outs[0].bits == outs[1].bits).all())


@pytest.mark.parametrize("slots", [0, 1 << 40])
@pytest.mark.parametrize("kind", ["awkward", "one expert", "empty experts", "many passes", "expert map",
                                  "top_k 40", "repeated ids"])
def test_sm90_gather_by_token_equals_gather_by_row(route_reg, cp, kind, slots):
    """The CUTLASS path's gather of hidden_states into expert order, a warp per token (default:
    each row read once, written to the sorted rows the routing recorded for its slots) against a
    warp per sorted row (EX_MOE_SM90_GATHER_BY_TOKEN=0): both match the float64 reference and
    each other bit for bit, with slots that go nowhere (invalid ids, experts of another rank),
    under either routing launch (multi-block: slots = 0; single block: a huge threshold)."""
    case = route_case(cp, kind)
    ref = route_reference(cp, *case[:6])
    outs = []
    for by_token in (1, 0):
        r = route_reg("moe_fused_gemm_sm90.so", slots, 0, by_token)
        out = route_run(r, cp, case)
        tol = r.manifest("moe_fused_gemm").tolerance["bfloat16"]
        assert rel(cp, out, ref) < tol, (by_token, rel(cp, out, ref))
        outs.append(out)
    assert bool((outs[0].bits == outs[1].bits).all())


@pytest.mark.parametrize("library,sm90_min_rows", ROUTE_LIBS)
def test_moe_multiblock_routing_under_graph_capture(route_reg, cp, library, sm90_min_rows):
    """The multi-block routing (programmatic dependent launch of its placement) inside a CUDA
    graph: the replay equals the eager call, bit for bit, and still flags invalid ids."""
    r = route_reg(library, 0, sm90_min_rows)
    x, w13, w2, w, ids = moe_case(cp, 1000, 512, 40, 256, 8, "bfloat16")
    ids[10, 2] = 40
    eager = poison(cp, (1000, 512), "bfloat16")
    moe_fused_gemm(x, w13, w2, w, ids, out=eager, registry=r)     # warm-up: workspace allocated
    with pytest.raises(DeviceSideError, match="topk_id outside"):
        r.check_device_errors()
    out = poison(cp, (1000, 512), "bfloat16")
    cp.cuda.Device().synchronize()                     # the poison (legacy stream) before the replay
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        moe_fused_gemm(x, w13, w2, w, ids, out=out, registry=r)
        graph = stream.end_capture()
        graph.launch(stream)
    stream.synchronize()
    assert bool((out.bits == eager.bits).all())
    with pytest.raises(DeviceSideError, match="topk_id outside"):
        r.check_device_errors()


SKIP_A_ENV = "EX_MOE_SM90_SKIP_EMPTY_A"   # read by the sm90 plugin's ex_get_factor


def restore_env(saved):
    """Set each environment variable of saved (name -> value, None: unset) back as it was."""
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def kind_case(cp, shapes, kind, dtype=None):
    """(moe_case, dtype) of shapes[kind] = (T, H, E, I, K): dtype, else float16 where the kind
    names fp16 and bfloat16 otherwise; "one expert": every slot on expert 3; "empty experts":
    empty_experts_ids (T = 2048)."""
    T, H, E, I, K = shapes[kind]
    dtype = dtype or ("float16" if "fp16" in kind else "bfloat16")
    case = moe_case(cp, T, H, E, I, K, dtype)
    if kind == "one expert":
        case[4][:] = 3
    if kind == "empty experts":
        case[4][:] = empty_experts_ids(cp, 2048)
    if kind == "repeated ids":
        repeat_ids(case[4])
    return case, dtype


def same_bits(cp, a, b, dtype):
    """Whether two moe_fused_gemm outputs of dtype are equal bit for bit."""
    if dtype == "bfloat16":
        return bool((a.bits == b.bits).all())
    return bool((a.view(cp.uint16) == b.view(cp.uint16)).all())


@pytest.fixture
def skip_a_reg():
    """load(on): a registry whose moe_fused_gemm is the Hopper plugin, loaded with the GEMMs'
    skipping of all-padding A slices on or off; the environment and the module's registry
    settings are restored at the end."""
    saved = {SKIP_A_ENV: os.environ.get(SKIP_A_ENV)}

    def load(on):
        os.environ[SKIP_A_ENV] = "1" if on else "0"
        return sm90_registry()

    try:
        yield load
    finally:
        restore_env(saved)
        FactorRegistry.load(ROOT / "factors")


@pytest.mark.parametrize("config", [7, 4, 8])
@pytest.mark.parametrize("kind", ["qwen3-30b T=512", "few rows", "one expert", "empty experts", "E=40 fp16",
                                  "ungated few rows"])
def test_sm90_skip_empty_a_slices_bit_identical(skip_a_reg, cp, config, kind):
    """Both GEMMs leaving out the multicast slices of A that hold only padding rows (the default,
    in experts of one M-tile; the MMA then reads stale rows there, for output rows past the
    expert's M that are never stored) give the same bits as loading them
    (EX_MOE_SM90_SKIP_EMPTY_A=0), under each tiling (forced): experts of 1-58 rows (qwen3-30b's
    T = 512 shape, "few rows", float16, the ungated GEMM1 with I % 128 != 0: slices skipped under
    every tiling, where an expert has <= 32 rows under the 64-row tiling (config 7), <= 64 under
    the 128-row ones), every slot on one expert (never skipped), hot experts beside cold ones of
    30-60 rows (skipped under the 128-row tilings only); both within tolerance of the float64
    reference. A skipped slice that held valid rows would feed the MMA stale rows (of other
    tiles, or of the NaN rows a first call loads, where shared memory keeps them) and change the
    bits. This checks equality only, not that a slice was skipped (benchmarks/RESULTS.md has the
    timing that shows it). Each registry is loaded right before its calls: the plugin's cached
    launch parameters are keyed by its loads, so the second load's setting is the one that runs."""
    shapes = {"qwen3-30b T=512": (512, 2048, 128, 768, 8), "few rows": (40, 512, 64, 256, 6),
              "one expert": (300, 512, 16, 384, 1), "empty experts": (2048, 256, 64, 128, 4),
              "E=40 fp16": (100, 512, 40, 256, 6), "ungated few rows": (40, 512, 16, 200, 2)}
    (x, w13, w2, w, ids), dtype = kind_case(cp, shapes, kind)
    T, H, E, _, K = shapes[kind]
    outs = []
    for on in (True, False):
        r = skip_a_reg(on)
        r.set_tuning("moe_fused_gemm", lambda sizes: config)
        # a first call on NaN rows, every expert given slots (slot t -> t % E): its A stages hold
        # NaN rows afterwards where shared memory keeps them
        nan_x = make(cp, cp.full((T, H), cp.nan, cp.float32), dtype)
        all_ids = (cp.arange(T * K, dtype=cp.int32) % E).reshape(T, K)
        moe_fused_gemm(nan_x, w13, w2, w, all_ids, out=poison(cp, (T, H), dtype), registry=r)
        outs.append(run_moe_check(r, cp, (x, w13, w2, w, ids), dtype))
        r.check_device_errors()
    assert same_bits(cp, outs[0], outs[1], dtype)


def outputs_under_env(skip_a_reg, cp, case, dtype, config, env, values):
    """[out for each of values]: moe_fused_gemm's output on case, each from a fresh Hopper registry
    loaded with the variable env set to that value (a load-time setting) and the tile configuration
    forced to config (dims[7]), each checked against the float64 reference (run_moe_check) and for
    device errors; env is restored at the end."""
    saved = {env: os.environ.get(env)}
    outs = []
    try:
        for v in values:
            os.environ[env] = v
            r = skip_a_reg(True)
            r.set_tuning("moe_fused_gemm", lambda sizes: config)
            outs.append(run_moe_check(r, cp, case, dtype))
            r.check_device_errors()
    finally:
        restore_env(saved)
    return outs


EXPERT_ORDER_ENV = "EX_MOE_SM90_EXPERT_ORDER"   # read by the sm90 plugin's ex_get_factor


@pytest.mark.parametrize("config", [4, 7, 8, 10])
@pytest.mark.parametrize("kind", ["qwen3-30b T=512", "hot neighbours", "one expert", "empty experts",
                                  "E=40 fp16"])
def test_sm90_expert_spread_order_bit_identical(skip_a_reg, cp, config, kind):
    """The Hopper path's CUTLASS GEMMs with the experts in their spread order (the default: group g
    holds expert g * s mod E) give the same bits as in id order (EX_MOE_SM90_EXPERT_ORDER=id),
    under each CUTLASS tiling (forced) and the chunked one (10, which keeps the id order either
    way), both within tolerance of the float64 reference (run_moe_check): a group given one
    expert's rows and another's weights or output rows would fail that check. "hot neighbours": every token's first slot on
    experts 0..3 (the benchmark's skew puts its hot experts next to each other too), E = 32."""
    shapes = {"qwen3-30b T=512": (512, 2048, 128, 768, 8), "hot neighbours": (512, 512, 32, 256, 4),
              "one expert": (300, 512, 16, 384, 1), "empty experts": (2048, 256, 64, 128, 4),
              "E=40 fp16": (100, 512, 40, 256, 6)}
    case, dtype = kind_case(cp, shapes, kind)
    if kind == "hot neighbours":
        T = shapes[kind][0]
        case[4][:, 0] = cp.arange(T, dtype=cp.int32) % 4
    outs = outputs_under_env(skip_a_reg, cp, case, dtype, config, EXPERT_ORDER_ENV, ("spread", "id"))
    assert same_bits(cp, outs[0], outs[1], dtype)


INTERLEAVE_ENV = "EX_MOE_SM90_CHUNKED_INTERLEAVE"   # read by the sm90 plugin's ex_get_factor


@pytest.mark.parametrize("config", [10, 11, 12])
@pytest.mark.parametrize("kind", ["two hot", "four hot, odd N-tiles", "128-row chunks", "many rounds",
                                  "qwen3-30b T=512"])
def test_sm90_chunked_hot_items_interleaved_bit_identical(skip_a_reg, cp, config, kind):
    """The chunked kernels (forced: 10 chunked, 11 chunked_nomc, 12 chunked_tail) with the hot
    experts' items dealt alternately with the others' (the default; a hot expert has more than
    twice the mean rows and two chunks or more) give the same bits as in expert order
    (EX_MOE_SM90_CHUNKED_INTERLEAVE=0), both within tolerance of the float64 reference: an item
    dealt twice or never would leave rows of act or ys unwritten or wrong. The interleaved run
    comes first, on a fresh registry. "two hot": every token's first slot on expert 0 or 1
    (about 1000 rows each against a mean of 256: 5 chunks; the cold stream outlasts the hot one);
    "four hot, odd N-tiles": on experts 0..3 (E = 16, 4 chunks each, more hot items than cold;
    H = 384: GEMM2's 3 N-tiles, no multicast, an odd grid); "128-row chunks": a mean of 64 rows
    (chunked and chunked_nomc take 128-row chunks: 3 for a hot expert); "many rounds": two hot of
    16 experts at T = 8192 (about 4600 rows each against a mean of 1024), some 600 items a GEMM:
    several full rounds of the persistent grid and a partial last one (the other kinds' items fill
    one or two); "qwen3-30b T=512": uniform routing, no hot expert (the expert order either way)."""
    shapes = {"two hot": (2048, 512, 32, 256, 4), "four hot, odd N-tiles": (3000, 384, 16, 256, 2),
              "128-row chunks": (512, 512, 32, 256, 4), "many rounds": (8192, 2048, 16, 1024, 2),
              "qwen3-30b T=512": (512, 2048, 128, 768, 8)}
    case, dtype = kind_case(cp, shapes, kind)
    T = shapes[kind][0]
    hot = {"two hot": 2, "four hot, odd N-tiles": 4, "128-row chunks": 2, "many rounds": 2}.get(kind)
    if hot:
        case[4][:, 0] = cp.arange(T, dtype=cp.int32) % hot
    outs = outputs_under_env(skip_a_reg, cp, case, dtype, config, INTERLEAVE_ENV, ("1", "0"))
    assert same_bits(cp, outs[0], outs[1], dtype)


CLUSTER_M2_ENV = "EX_MOE_SM90_CLUSTER_M2_ROWS"   # read by the sm90 plugin's ex_get_factor


def cutlass_clusters(names):
    """{(GEMM, (cluster M, cluster N))} of every CUTLASS grouped GEMM launch among the profiled
    kernel names: GEMM "gated" (GatedMainloop) or "plain", the ClusterShape that CUTLASS's
    MainloopSm90ArrayTmaGmmaWarpSpecialized<Stages, ClusterShape, ...> carries."""
    found = set()
    for name in names:
        if "MainloopSm90ArrayTmaGmmaWarpSpecialized" not in name:
            continue
        m = re.search(r"MainloopSm90ArrayTmaGmmaWarpSpecialized<\s*\d+\s*,\s*(?:cute::)?tuple<\s*"
                      r"(?:cute::)?C<(\d+)>\s*,\s*(?:cute::)?C<(\d+)>", name)
        if m is None:   # a name the profiler left mangled (seen on an H100): cute::C<m>, then the
            # template C again with <n> (N SF_ I Li n E E E), or a back-reference where n == m
            m = re.search(r"MainloopSm90ArrayTmaGmmaWarpSpecializedILi\d+E\w*?1CILi(\d+)EEE"
                          r"(?:N[A-Z0-9]*_ILi(\d+)EEE|S[A-Z0-9]*_)", name)
        assert m, name[:400]
        cm = int(m.group(1))
        cn = int(m.group(2)) if m.group(2) is not None else cm
        found.add(("gated" if "GatedMainloop" in name else "plain", (cm, cn)))
    return found


@pytest.mark.parametrize("kind", ["I=1408", "one expert", "E=40 fp16", "empty experts", "ungated I=200",
                                  "few rows"])
def test_sm90_gated_gemm1_in_clusters_along_m_bit_identical(skip_a_reg, cp, kind):
    """Under the 128 x 256 tiling (forced: dims[7] = 4), the gated GEMM1 of a shape with an odd
    I / 128 runs in clusters of 2 x 1 CTAs (the weights multicast to a pair of M-tiles, the gate
    and up boxes each copied by one CTA of the pair) from EX_MOE_SM90_CLUSTER_M2_ROWS rows per
    expert on (set to 1 here: every call), and gives the same bits as in 1 x 2 pairs (=0), both
    within tolerance of the float64 reference: I = 1408 (11 N-tiles), 384 with every slot on one
    expert (24 M-tiles), 128 with idle experts (experts of one M-tile rounded up to a pair, the
    second all zero fill, its A copy left out); an even I / 128 (256), the ungated GEMM1 (I = 200)
    and GEMM2 keep their 1 x 2 pairs either way. The profiler's kernel names say which cluster
    shapes ran. A box multicast to the wrong CTA, or a stage released before the peer read it,
    changes the bits or hangs."""
    shapes = {"I=1408": (700, 256, 8, 1408, 2), "one expert": (3000, 512, 16, 384, 1),
              "E=40 fp16": (1000, 512, 40, 256, 6), "empty experts": (2048, 256, 64, 128, 4),
              "ungated I=200": (700, 256, 8, 200, 2), "few rows": (40, 512, 64, 256, 6)}
    case, dtype = kind_case(cp, shapes, kind)
    I = shapes[kind][3]
    saved = {CLUSTER_M2_ENV: os.environ.get(CLUSTER_M2_ENV)}
    outs, clusters = [], {}
    try:
        for m2 in (True, False):
            os.environ[CLUSTER_M2_ENV] = "1" if m2 else "0"
            r = skip_a_reg(True)
            r.set_tuning("moe_fused_gemm", lambda sizes: 4)
            out, names = profiled_kernels(cp, lambda: run_moe_check(r, cp, case, dtype))
            outs.append(out)
            clusters[m2] = cutlass_clusters(names)
            r.check_device_errors()
    finally:
        restore_env(saved)
    assert same_bits(cp, outs[0], outs[1], dtype)
    gemm1 = "gated" if I % 128 == 0 else "plain"
    pairs = {(gemm1, (1, 2)), ("plain", (1, 2))}   # GEMM1, then GEMM2 (cooperative or ping-pong)
    m2 = I % 128 == 0 and (I // 128) % 2 == 1
    assert clusters[True] == ({("gated", (2, 1)), ("plain", (1, 2))} if m2 else pairs), clusters
    assert clusters[False] == pairs, clusters


CHUNKED_MC_ENV = "EX_MOE_SM90_CHUNKED_MULTICAST"   # read by the sm90 plugin's ex_get_factor
CHUNK_ROWS_ENV = "EX_MOE_SM90_CHUNK_ROWS"   # likewise


@pytest.mark.parametrize("kind", ["150 rows per expert", "one expert", "empty experts", "E=40 fp16", "T=1"])
def test_chunked_multicast_bit_identical(skip_a_reg, cp, kind):
    """The chunked tiling (dims[7] = 10) in clusters of two CTAs that multicast A (the default)
    gives the same bits as one CTA per item (EX_MOE_SM90_CHUNKED_MULTICAST=0): chunks of 3 sub-tiles
    (a little over 128 rows per expert, mixtral T = 512's case), of 1 (T = 1, E = 40), twelve chunks
    of one expert, idle experts; both within tolerance of the float64 reference. A sub-tile copied
    by the wrong CTA of a pair, or a stage refilled before the peer released it, changes the bits
    or hangs. chunked_nomc (dims[7] = 11) gives the same bits with the switch on, and the
    profiler shows its kernels without the multicast where config 10's use it. On 256-row chunks
    throughout (EX_MOE_SM90_CHUNK_ROWS=256: the 128-row chunks run without the multicast). Each
    registry is loaded right before its calls (the setting is the plugin's, read at its latest
    load)."""
    shapes = {"150 rows per expert": (600, 512, 8, 1024, 2), "one expert": (3000, 512, 16, 384, 1),
              "empty experts": (2048, 256, 64, 128, 4), "E=40 fp16": (1000, 512, 40, 256, 6),
              "T=1": (1, 2048, 128, 768, 8)}
    (x, w13, w2, w, ids), dtype = kind_case(cp, shapes, kind)
    saved = {k: os.environ.get(k) for k in (CHUNKED_MC_ENV, CHUNK_ROWS_ENV)}
    outs = []
    try:
        os.environ[CHUNK_ROWS_ENV] = "256"
        for on in (True, False):
            os.environ[CHUNKED_MC_ENV] = "1" if on else "0"
            r = skip_a_reg(True)
            r.set_tuning("moe_fused_gemm", lambda sizes: 10)
            outs.append(run_moe_check(r, cp, (x, w13, w2, w, ids), dtype))
            r.check_device_errors()
        # chunked_nomc (dims[7] = 11) with the switch on: the same bits, and no multicast kernel
        # (chunked_gemm_kernel<T, kGated, kMc, kBand, kSubs>: kMc false) where 10 runs one
        os.environ[CHUNKED_MC_ENV] = "1"
        r = skip_a_reg(True)
        kmc = {}
        for config in (10, 11):
            r.set_tuning("moe_fused_gemm", lambda sizes, c=config: c)
            run_moe_check(r, cp, (x, w13, w2, w, ids), dtype)
            out, names = profiled_kernels(cp, lambda: run_moe_check(r, cp, (x, w13, w2, w, ids), dtype))
            kmc[config] = chunked_kernel_multicast(names)
            if config == 11:
                outs.append(out)
        r.check_device_errors()
    finally:
        restore_env(saved)
    assert same_bits(cp, outs[0], outs[1], dtype) and same_bits(cp, outs[0], outs[2], dtype)
    assert kmc[11] == {False} and True in kmc[10], kmc


SM90_PDL_ENV = "EX_MOE_SM90_PDL"   # read by the sm90 plugin's ex_get_factor


def fill_nan(cp, out, dtype):
    """Sets every element of a moe_fused_gemm output (Bits16, or a float16 array) to NaN bits, on
    the current stream."""
    (out.bits if dtype == "bfloat16" else out.view(cp.uint16)).fill(0xFFFF)


@pytest.mark.parametrize("config", [10, 7])
@pytest.mark.parametrize("kind", ["qwen3-30b T=512", "150 rows per expert", "E=40 fp16", "H=128", "H=128 150 rows",
                                  "T=1"])
def test_sm90_pdl_bit_identical(skip_a_reg, cp, config, kind):
    """The Hopper path with programmatic dependent launch (the default: the gather loads its first
    hidden_states rows before it waits for the routing, the chunked GEMMs copy their first weight
    stages before they wait for the previous kernel, the combine's blocks get resident before
    GEMM2 ends) gives the same bits as plain launches (EX_MOE_SM90_PDL=0), under the chunked
    tiling (config 10) and a CUTLASS one (7, grouped64: the gather and the combine), eagerly and
    in CUDA-graph replays. Every checked call follows, on the same stream, a call on NaN
    hidden_states routed otherwise (slot s to expert s % E, so that its expert_off, slot_pos and
    every row of xs, act and ys differ): a kernel that read the routing, A (xs, act) or ys before
    the kernel that writes them in the checked call had done so would read the first call's
    values; that call's output must be NaN everywhere (a checked call that overwrote the
    workspace while it still ran would change it). "H=128": GEMM1's reduction of 2 stages, fewer
    than the ring's 7 (75 rows per expert: 128-row chunks) or, "H=128 150 rows", its 4 (256-row
    chunks): every stage of a chunked CTA's first item copied before the wait. Each registry is
    loaded right before its calls (the setting is read at load)."""
    shapes = {"qwen3-30b T=512": (512, 2048, 128, 768, 8), "150 rows per expert": (600, 512, 8, 1024, 2),
              "E=40 fp16": (1000, 512, 40, 256, 6), "H=128": (300, 128, 8, 256, 2),
              "H=128 150 rows": (600, 128, 8, 256, 2), "T=1": (1, 2048, 128, 768, 8)}
    case, dtype = kind_case(cp, shapes, kind)
    x, w13, w2, w, ids = case
    T, H, E, _, K = shapes[kind]
    nan_x = make(cp, cp.full((T, H), cp.nan, cp.float32), dtype)
    nan_ids = (cp.arange(T * K, dtype=cp.int32) % E).reshape(T, K)

    def all_nan(out):
        return bool(cp.isnan(f64(out)).all())

    saved = {SM90_PDL_ENV: os.environ.get(SM90_PDL_ENV)}
    eager, replays = [], []
    try:
        for on in ("1", "0"):
            os.environ[SM90_PDL_ENV] = on
            r = skip_a_reg(True)
            r.set_tuning("moe_fused_gemm", lambda sizes: config)
            for _ in range(3):
                nan_out = moe_fused_gemm(nan_x, w13, w2, w, nan_ids, out=poison(cp, (T, H), dtype), registry=r)
                out = run_moe_check(r, cp, case, dtype)
                assert all_nan(nan_out)
            eager.append(out)
            nan_out, g_out = poison(cp, (T, H), dtype), poison(cp, (T, H), dtype)
            cp.cuda.Device().synchronize()             # the poison (legacy stream) before the replay
            stream = cp.cuda.Stream(non_blocking=True)
            with stream:
                stream.begin_capture()
                moe_fused_gemm(nan_x, w13, w2, w, nan_ids, out=nan_out, registry=r)
                moe_fused_gemm(x, w13, w2, w, ids, out=g_out, registry=r)
                graph = stream.end_capture()
                for _ in range(3):
                    fill_nan(cp, g_out, dtype)
                    graph.launch(stream)
                    stream.synchronize()
                    replays.append((same_bits(cp, g_out, out, dtype), all_nan(nan_out)))
            r.check_device_errors()
    finally:
        restore_env(saved)
    assert same_bits(cp, eager[0], eager[1], dtype)
    assert replays == [(True, True)] * 6, replays


CHUNKED_SWAP_ENV = "EX_MOE_SM90_CHUNKED_SWAP_AB"   # read by the sm90 plugin's ex_get_factor


def swap_band(rows_per_expert, subs=4):
    """The swap-AB band the sm90 plugin picks for T*K/G rows per expert on chunks of subs 64-row
    sub-tiles (chunked::swap_band): the band j + 1 of chunks of 64j + 1 .. 64j + 32 rows centred
    nearest the rows past full chunks (past 64 * subs - 16: band 1, the next chunk's)."""
    return ((rows_per_expert % (64 * subs) + 15) // 64) % subs + 1


def chunks_in_band(ids, E, band):
    """How many chunks (256 rows each, an expert's last one shorter) of the routing ``ids`` have
    a size that band's kernels run on swap AB (64(band-1) + 1 .. 64(band-1) + 32 rows)."""
    lo, hi = 64 * (band - 1) + 1, 64 * (band - 1) + 32
    n = 0
    for m in np.bincount(np.asarray(ids).ravel(), minlength=E):
        while m > 0:
            n += lo <= min(m, 256) <= hi
            m -= 256
    return n


def swap_ab_counts(band):
    """Rows per expert (top_k = 1, 16 experts) for a call whose swap-AB band is ``band``: chunks in
    the band (64(band-1) + 1, 5, 12, 16, 17, 20, 24, 28, 31, 32 rows, and an expert of 256 + base + 7
    rows whose second chunk is in it), chunks past it on the sub-tiles (+33, +48, +63, +64), an idle
    expert."""
    base = 64 * (band - 1)
    counts = [base + d for d in (1, 5, 16, 17, 31, 32, 33, 48, 63, 64, 24, 20, 12, 28)] + [0, 256 + base + 7]
    assert swap_band(sum(counts) // len(counts)) == band
    return counts


def swap_ab_case(cp, dtype, band, H=256, I=256):
    """(moe_case, dtype): T = sum(swap_ab_counts(band)) tokens, top_k = 1, expert e given
    swap_ab_counts(band)[e] of them (in a random order)."""
    counts = swap_ab_counts(band)
    T, E = sum(counts), len(counts)
    x, w13, w2, w, _ = moe_case(cp, T, H, E, I, 1, dtype)
    ids = cp.asarray(np.random.default_rng().permutation(np.repeat(np.arange(E), counts)).astype(np.int32))
    return (x, w13, w2, w, ids.reshape(T, 1)), dtype


def chunked_kernel_args(names):
    """Of the profiled kernel names, the template arguments of every chunked_gemm_kernel<T, kGated,
    kMc, kBand, kSubs, kX> launch, each a list of 6 stripped strings."""
    return [[a.strip() for a in n.split("chunked_gemm_kernel<", 1)[1].split(">", 1)[0].split(",")]
            for n in names if "chunked_gemm_kernel<" in n]


def chunked_kernel_multicast(names):
    """The kMc (A multicast across clusters of two) of every chunked_gemm_kernel launch among the
    profiled kernel names: a set of bools (a demangler writes a bool as true/false or as 1/0)."""
    mcs = [args[2] for args in chunked_kernel_args(names)]
    assert all(a in ("true", "false", "1", "0") for a in mcs), mcs
    return {a in ("true", "1") for a in mcs}


def chunked_kernel_swaps(names):
    """The kBand (swap-AB band, 0: none) of every chunked_gemm_kernel launch among the profiled
    kernel names: a set of ints."""
    return {int(args[3]) for args in chunked_kernel_args(names)}


def chunked_kernel_subs(names):
    """The kSubs (64-row sub-tiles per chunk: 4 or 2) of every chunked_gemm_kernel launch among
    the profiled kernel names: a set of ints."""
    return {int(args[4]) for args in chunked_kernel_args(names)}


@pytest.mark.parametrize("multicast", [True, False])
@pytest.mark.parametrize("kind", ["band 1", "band 2", "band 3", "band 4", "band 3 fp16", "150 rows per expert",
                                  "E=40 fp16", "T=1", "I=1408"])
def test_chunked_swap_ab_bit_identical(skip_a_reg, cp, kind, multicast):
    """The chunked tiling (dims[7] = 10) with swap AB on the chunks of the call's band (the
    default: chunks of 64j + 1 .. 64j + 32 rows, the band nearest the rows per expert, as the
    GMMA's N = 64j + 32, the weights' 64-row halves as M, GEMM1's weight tile loaded as interleaved
    groups of 8 gate and 8 up rows) gives the same bits as every chunk on 64-row sub-tiles
    (EX_MOE_SM90_CHUNKED_SWAP_AB=0), with and without the multicast, both within tolerance of the
    float64 reference. "band b": experts of fixed row counts whose call takes band b (N = 32, 96,
    160, 224), with chunks in the band (one of them an expert's second chunk) and chunks past it
    on the sub-tiles, one idle expert (band 3 also in fp16); then random routing: ~150 rows per
    expert, E = 40, one row per expert (T = 1: band 1), GEMM1 N-tiles of 64 act columns past 1024
    (I = 1408; ~144 rows per expert), each case checked to hold chunks of its band. A gate row paired with the wrong up row, a chunk row stored to the wrong token, or
    an N that leaves out rows changes the bits; rows past a chunk's end are multiplied but never
    stored (the output is poisoned first). PyTorch's profiler shows that the kernels of the
    expected band ran with the default and band 0 with =0 (else both runs could take one path and
    agree trivially). On 256-row chunks throughout (EX_MOE_SM90_CHUNK_ROWS=256: the 128-row chunks
    run without the multicast; test_chunked_chunk_rows_bit_identical gives them the same bits).
    Each registry is loaded right before its calls (the setting is the plugin's, read at its
    latest load)."""
    shapes = {"150 rows per expert": (600, 512, 8, 1024, 2), "E=40 fp16": (1000, 512, 40, 256, 6),
              "T=1": (1, 2048, 128, 768, 8), "I=1408": (576, 256, 8, 1408, 2)}
    if kind.startswith("band"):
        band = int(kind.split()[1])
        case, dtype = swap_ab_case(cp, "float16" if "fp16" in kind else "bfloat16", band)
    else:
        case, dtype = kind_case(cp, shapes, kind)
        T, _, E, _, K = shapes[kind]
        band = swap_band(T * K // E)
    # the case has chunks the band swaps (else both runs would take the sub-tiles and agree trivially)
    assert chunks_in_band(case[4].get(), case[1].shape[0], band) > 0, (kind, band)
    saved = {k: os.environ.get(k) for k in (CHUNKED_SWAP_ENV, CHUNKED_MC_ENV, CHUNK_ROWS_ENV)}
    outs, swaps = [], []
    try:
        os.environ[CHUNK_ROWS_ENV] = "256"
        os.environ[CHUNKED_MC_ENV] = "1" if multicast else "0"
        for swap in ("1", "0"):
            os.environ[CHUNKED_SWAP_ENV] = swap
            r = skip_a_reg(True)
            r.set_tuning("moe_fused_gemm", lambda sizes: 10)
            out, names = profiled_kernels(cp, lambda: run_moe_check(r, cp, case, dtype))
            outs.append(out)
            swaps.append(chunked_kernel_swaps(names))
            r.check_device_errors()
    finally:
        restore_env(saved)
    assert swaps == [{band}, {0}], (swaps, sorted({n for n in names if "chunked" in n}))
    assert same_bits(cp, outs[0], outs[1], dtype)


def chunk_subs(rows_per_expert):
    """The 64-row sub-tiles per chunk the sm90 plugin picks for T*K/G rows per expert
    (chunked::chunk_subs): 2 (128-row chunks) up to 104 rows per expert, else 4 (256)."""
    return 2 if rows_per_expert <= 104 else 4


def chunk_subs_run(setting, rows_per_expert, E):
    """The sub-tiles per chunk the sm90 plugin runs with EX_MOE_SM90_CHUNK_ROWS = setting ("256",
    "128", or None: auto): 128-row chunks only where their shared memory (7 stages of 32 KB,
    barriers, and (E + 1) int32) fits the H200's 232,448 bytes, E <= 739."""
    want = {"256": 4, "128": 2}.get(setting) or chunk_subs(rows_per_expert)
    return want if want == 4 or E <= 739 else 4


def chunked_kernel_extra(names):
    """The kX (rows a chunk may hold past its 256: 0, or 32 under chunked_tail) of every
    chunked_gemm_kernel launch among the profiled kernel names: a set of ints."""
    return {int(args[5]) for args in chunked_kernel_args(names)}


@pytest.mark.parametrize("kind", ["270 rows per expert", "270 fp16", "qwen3-30b T=4096", "one expert 2840",
                                  "I=1408", "E=40 fp16", "empty experts", "T=1", "E=768"])
def test_chunked_extra_rows_bit_identical(skip_a_reg, cp, kind):
    """chunked_tail (dims[7] = 12: 256-row chunks whose last takes up to 32 rows more as a swap-AB
    piece, so an expert of 257..288 rows is one item; GEMM1's weight tile loaded as interleaved
    groups of 8 gate and 8 up rows; in clusters of two CTAs multicasting A, the extra box too)
    gives the same bits as chunked_nomc on plain 256-row chunks (EX_MOE_SM90_CHUNK_ROWS=256), and
    as itself with one CTA per item (EX_MOE_SM90_CHUNKED_MULTICAST=0), all within tolerance of the
    float64 reference: each row's sum runs over the same k-steps of 16 whichever MMA holds it, so a
    row stored to the wrong place, a gate paired with the wrong up, the extra box copied to the
    wrong rows or by the wrong CTA of a pair, or a chunk left out changes the bits. The profiler
    shows kX = 32 ran under chunked_tail and 0 under chunked_nomc, and the multicast kernels under
    chunked_tail only where the switch leaves them on. Shapes: ~270 rows per expert
    (experts under 256, of 257..288 and past 288 rows) in bfloat16 and float16, qwen3-30b's
    T = 4096 (256 +- 16), one expert of 2840 rows (11 chunks, the last of 280), I = 1408, and
    shapes without extra rows (E = 40, idle experts, T = 1); E = 768, past the 751 experts whose
    prefix fits beside its stages: plain 256-row chunks (kX = 0) under chunked_tail too."""
    shapes = {"270 rows per expert": (1080, 512, 8, 256, 2), "270 fp16": (1080, 512, 8, 256, 2),
              "qwen3-30b T=4096": (4096, 2048, 128, 768, 8), "one expert 2840": (2840, 512, 16, 384, 1),
              "I=1408": (1440, 512, 16, 1408, 3), "E=40 fp16": (1000, 512, 40, 256, 6),
              "empty experts": (2048, 256, 64, 128, 4), "T=1": (1, 2048, 128, 768, 8),
              "E=768": (400, 256, 768, 128, 2)}
    case, dtype = kind_case(cp, shapes, kind)
    if kind == "one expert 2840":
        case[4][:] = 3  # every slot on expert 3
    saved = {k: os.environ.get(k) for k in (CHUNK_ROWS_ENV, CHUNKED_MC_ENV)}
    outs, kxs, kmcs = [], [], []
    try:
        for config, mc in ((11, "1"), (12, "1"), (12, "0")):
            os.environ[CHUNK_ROWS_ENV] = "256"  # chunked_tail's chunks whatever the setting
            os.environ[CHUNKED_MC_ENV] = mc
            r = skip_a_reg(True)
            r.set_tuning("moe_fused_gemm", lambda sizes, c=config: c)
            out, names = profiled_kernels(cp, lambda: run_moe_check(r, cp, case, dtype))
            outs.append(out)
            kxs.append(chunked_kernel_extra(names))
            kmcs.append(chunked_kernel_multicast(names))
            r.check_device_errors()
    finally:
        restore_env(saved)
    kx = 0 if shapes[kind][2] > 751 else 32
    assert kxs == [{0}, {kx}, {kx}], kxs
    # every shape here has an even count of N-tiles in both GEMMs (I / 64 and H / 128): chunked_tail
    # multicasts A in pairs by default, one CTA per item under the switch; chunked_nomc never
    assert kmcs == [{False}, {True}, {False}], kmcs
    assert same_bits(cp, outs[0], outs[1], dtype) and same_bits(cp, outs[0], outs[2], dtype)


@pytest.mark.parametrize("config", [11, 10])
@pytest.mark.parametrize("kind", ["qwen3-30b T=512", "granite T=512", "112 rows per expert", "150 rows per expert",
                                  "one expert", "empty experts", "E=40 fp16", "E=768", "T=1"])
def test_chunked_chunk_rows_bit_identical(skip_a_reg, cp, kind, config):
    """The chunked kernels on chunks of 128 rows (7 stages, one CTA per item) give the same bits
    as on chunks of 256 rows (EX_MOE_SM90_CHUNK_ROWS=128 / 256), each within tolerance of the
    float64 reference, and the default (auto) runs the chunk size chunked::chunk_subs gives the
    call: ~32 rows per expert (qwen3-30b's T = 512 shape: one chunk of either size), ~100
    (granite's T = 512 shape: a few experts past 128 rows run two), 112 (auto: 256-row chunks,
    past the 104 of chunk_subs), ~150 (two 128-row chunks), one expert of 3000 rows (12 or 24
    chunks), idle experts, E = 40 in float16, E = 768 (past the 739 experts whose prefix fits
    beside 7 stages: 256-row chunks whatever the setting), T = 1. Each row's sum runs over the
    same k-steps whichever chunk holds it, so a row stored to the wrong place, a chunk left out
    or a stage of the deeper ring refilled too soon changes the bits. PyTorch's profiler shows
    the kernels of the expected chunk size ran (kSubs 4 or 2), with the swap-AB band the plugin
    picks for that chunk size, and, under config 10 (multicast asked for), that the 128-row
    chunks run without it. Each registry is loaded right before its calls (the setting is read
    at load)."""
    shapes = {"qwen3-30b T=512": (512, 2048, 128, 768, 8), "granite T=512": (512, 1536, 40, 512, 8),
              "112 rows per expert": (560, 512, 40, 256, 8), "150 rows per expert": (600, 512, 8, 1024, 2),
              "one expert": (3000, 512, 16, 384, 1), "empty experts": (2048, 256, 64, 128, 4),
              "E=40 fp16": (1000, 512, 40, 256, 6), "E=768": (400, 256, 768, 128, 2),
              "T=1": (1, 2048, 128, 768, 8)}
    case, dtype = kind_case(cp, shapes, kind)
    T, _, E, _, K = shapes[kind]
    saved = {CHUNK_ROWS_ENV: os.environ.get(CHUNK_ROWS_ENV)}
    settings = ("256", "128", None)
    outs, subs, mcs, swaps = [], [], [], []
    try:
        for rows in settings:
            if rows is None:
                os.environ.pop(CHUNK_ROWS_ENV, None)
            else:
                os.environ[CHUNK_ROWS_ENV] = rows
            r = skip_a_reg(True)
            r.set_tuning("moe_fused_gemm", lambda sizes: config)
            out, names = profiled_kernels(cp, lambda: run_moe_check(r, cp, case, dtype))
            outs.append(out)
            subs.append(chunked_kernel_subs(names))
            mcs.append(chunked_kernel_multicast(names))
            swaps.append(chunked_kernel_swaps(names))
            r.check_device_errors()
    finally:
        restore_env(saved)
    want = [chunk_subs_run(s, T * K // E, E) for s in settings]
    assert subs == [{n} for n in want], (subs, want)
    assert swaps == [{swap_band(T * K // E, n)} for n in want], (swaps, want)
    assert all(m == {False} for m, n in zip(mcs, want) if n == 2), (mcs, want)
    assert same_bits(cp, outs[0], outs[1], dtype) and same_bits(cp, outs[0], outs[2], dtype)
