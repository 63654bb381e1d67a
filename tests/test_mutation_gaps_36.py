"""Tests that kill mutants which survived the CPU suite (session 36: a helper mutated the
fallbacks, verify, the registry's dispatch, manifest binding, ops and moe_layer by hand, 74
mutants, and wrote a test for each of the 17 real gaps among the 23 survivors). Each test names
the mutant it kills: the mutation is in its docstring."""
import math

import ml_dtypes
import numpy as np
import pytest

from ex_engine import (DeviceSideError, FactorRegistry, LayoutError, fused_add_rmsnorm,
                       moe_fused_gemm, topk_softmax)
from ex_engine.fallbacks import apply_expert_map
from tests.conftest import PLUGIN_SRC, build_plugin
from tests.reference import moe_ref, rmsnorm_ref


@pytest.fixture(scope="module")
def reg(tmp_path_factory):
    return FactorRegistry.load(tmp_path_factory.mktemp("empty"), hardware="h200")


# ------------------------------------------------------------------------ fallbacks: topk_softmax
def test_a_single_plus_inf_logit_takes_all_the_probability(reg):
    """F07: the +inf share is is_inf / max(n_inf, 1); the suite only had a row with two +infs."""
    logits = np.array([[0.0, np.inf, 3.0, -1.0]], np.float32)
    w, ids = topk_softmax(logits, 2, False, registry=reg)
    assert ids.tolist() == [[1, 2]] and w.tolist() == [[1.0, 0.0]]


# ------------------------------------------------------------------------ fallbacks: rmsnorm
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_rmsnorm_normalises_the_residual_as_rounded(reg, dtype):
    """R03: x' uses residual' rounded to its dtype (manifest math). Not rounding it changes ~20%
    of the output's elements by one ulp, which the relative tolerance cannot see: compare
    element by element with the float64 reference rounded to the dtype."""
    npdt = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    rng = np.random.default_rng(1)
    x = rng.standard_normal((16, 512)).astype(npdt)
    res = rng.standard_normal((16, 512)).astype(npdt)
    wt = np.ones(512, npdt)
    X, _ = rmsnorm_ref(x.astype(np.float64), res.astype(np.float64), wt, 1e-6, dtype)
    fused_add_rmsnorm(x, res, wt, 1e-6, registry=reg)
    same = (x == X.astype(np.float32).astype(npdt)).mean()
    assert same > 0.97, same


def test_rmsnorm_eps_counts_for_small_rows(reg):
    """eps inside the rsqrt: a row of tiny values with a large eps is far from unit RMS
    (a mutant dropping eps survived all but the 1e20-rescue test)."""
    x = np.full((1, 4), 1e-3, np.float32)
    res = np.zeros((1, 4), np.float32)
    fused_add_rmsnorm(x, res, np.ones(4, np.float32), 1e-2, registry=reg)
    np.testing.assert_allclose(x, 1e-3 / math.sqrt(1e-6 + 1e-2), rtol=1e-5)


# ------------------------------------------------------------------------ fallbacks: moe
def _one_expert(dtype, x, g_w, u_w, w2):
    """H = 1, I = 1, E = 1, K = 1 layer: g = g_w * x, u = u_w * x, out = w2 * silu(g) * u."""
    npdt = np.dtype(dtype)
    hs = np.array([[x]], npdt)
    w13 = np.array([[[g_w], [u_w]]], npdt)
    w2a = np.array([[[w2]]], npdt)
    return hs, w13, w2a, np.ones((1, 1), np.float32), np.zeros((1, 1), np.int32)


def test_moe_activation_is_rounded_to_float16(reg):
    """M02: silu(g)*u is rounded to the input dtype between the GEMMs: in float16, an activation
    of 65536 is inf (the range the docstring states), not 65536 * w2."""
    hs, w13, w2, w, ids = _one_expert("float16", 256.0, 1.0, 1.0, 1e-3)   # act = 256 * 256
    out = moe_fused_gemm(hs, w13, w2, w, ids, registry=reg)
    assert np.isinf(out).all()


def test_moe_accumulates_in_float32(reg):
    """M07: fp32 accumulation. g = 1000 * 100 is past float16's range in a float16 sum, but
    silu(g) * u = 1e5 * 0.1 fits, and so does out = 1e4 * 1e-3."""
    hs, w13, w2, w, ids = _one_expert("float16", 1000.0, 100.0, 1e-4, 1e-3)
    out = moe_fused_gemm(hs, w13, w2, w, ids, registry=reg)
    ref = moe_ref(hs, w13, w2, w, ids)
    assert np.isfinite(out).all() and abs(float(out[0, 0]) - ref[0, 0]) / abs(ref[0, 0]) < 5e-3


def test_moe_duplicate_ids_in_a_row_both_count(reg):
    """M04: out[t] sums every slot; a token routed twice to one expert gets both weights
    (np.add.at, not out[idx] += vals, which keeps one)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 16)).astype(np.float16)
    w13 = (rng.standard_normal((4, 16, 16)) / 4).astype(np.float16)
    w2 = (rng.standard_normal((4, 16, 8)) / 3).astype(np.float16)
    ids = np.array([[2, 2], [1, 3], [0, 0]], np.int32)
    w = np.full((3, 2), 0.5, np.float32)
    out = moe_fused_gemm(x, w13, w2, w, ids, registry=reg)
    ref = moe_ref(x, w13, w2, w, ids)
    assert np.linalg.norm(out.astype(np.float64) - ref) / np.linalg.norm(ref) < 5e-3


def test_apply_expert_map_boundaries():
    """M08 (id == G), M09 (map value == E), M10 (map value < -1): each is a bad slot, counted,
    and contributes nothing (-1)."""
    emap = np.array([0, 1, -1, 2, -2], np.int32)        # E = 2: value 2 (== E) and -2 are bad
    ids = np.array([[5, 0], [3, 1], [4, 2]], np.int32)  # 5 == G
    local, n_ids, n_map = apply_expert_map(np, ids, emap, 2)
    assert local.tolist() == [[-1, 0], [-1, 1], [-1, -1]]
    assert (n_ids, n_map) == (1, 2)


def test_bad_expert_map_values_are_reported_as_such(reg):
    """M11: test_bad_map_values_and_ids_are_skipped_and_reported matches
    'invalid_expert_map.*|invalid_topk_ids.*', so the invalid_topk_ids flag it also triggers
    satisfies it and the expert_map flag is never checked. Only a bad map value here."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 16)).astype(np.float16)
    w13 = (rng.standard_normal((2, 16, 16)) / 4).astype(np.float16)
    w2 = (rng.standard_normal((2, 16, 8)) / 3).astype(np.float16)
    ids = np.array([[0, 1], [2, 3], [1, 2], [0, 3]], np.int32)
    emap = np.array([0, -1, 7, 1], np.int32)             # 7: not a local expert (E = 2)
    reg.check_device_errors()
    moe_fused_gemm(x, w13, w2, np.full((4, 2), 0.5, np.float32), ids, expert_map=emap, registry=reg)
    with pytest.raises(DeviceSideError, match=r"invalid_expert_map in 2 slot") as e:
        reg.check_device_errors()
    assert "invalid_topk_ids" not in str(e.value)


# ------------------------------------------------------------------------ verify.py
def test_compare_fails_a_number_where_the_fallback_has_nan():
    """V01: NaN where the fallback has NaN and the plugin a number (a NaN-logit row of
    topk_softmax written as 0) must fail, not vanish in the zeroed norm."""
    from ex_engine.manifest import load_all
    from ex_engine.verify import compare
    from tests.conftest import ROOT
    m = load_all(ROOT / "manifests")["topk_softmax"]
    want = np.random.default_rng(0).random((4, 2)).astype(np.float32)
    want[1] = np.nan
    got = np.where(np.isnan(want), 0, want).astype(np.float32)
    ids = np.zeros((4, 2), np.int32)
    ok, _, detail = compare(m, {"topk_weights": got, "topk_ids": ids}, {"topk_weights": want, "topk_ids": ids}, "float32")
    assert not ok, detail


def test_compare_fails_just_past_the_tolerance():
    """V03: test_compare_rules only tries an error 1000x the tolerance (1.01 vs 1e-5); an
    inflated tolerance (10x, 100x) passed. 3x the tolerance must fail, 0.3x pass."""
    from ex_engine.manifest import load_all
    from ex_engine.verify import compare
    from tests.conftest import ROOT
    m = load_all(ROOT / "manifests")["topk_softmax"]
    w = np.random.default_rng(0).random((3, 2)).astype(np.float64)
    ids = np.zeros((3, 2), np.int32)
    ok, err, _ = compare(m, {"topk_weights": (w * (1 + 3e-5)).astype(np.float32), "topk_ids": ids},
                         {"topk_weights": w.astype(np.float32), "topk_ids": ids}, "float32")
    assert not ok and 2e-5 < err < 4e-5
    ok, _, _ = compare(m, {"topk_weights": (w * (1 + 3e-6)).astype(np.float32), "topk_ids": ids},
                       {"topk_weights": w.astype(np.float32), "topk_ids": ids}, "float32")
    assert ok


def test_guard_sees_a_write_before_the_start():
    """V07: a kernel that writes before its output's start (out[-1]) must fail verify; only
    writes past the end were tested (OOB)."""
    from ex_engine import verify
    view, outside = verify._guarded(np, np.zeros(4, np.float32), "out")
    assert outside() == ""
    view.base[verify._GUARD_BYTES - 1] = 0        # the byte just before out[0]
    assert "before its start" in outside()


def test_verify_at_load_refuses_a_failure_of_the_child_itself(tmp_path, monkeypatch):
    """V11: a FAIL row that names no case (the child's report garbled, the library changed
    after it was loaded, a crash before the first case) must refuse the plugin at load."""
    from ex_engine import verify
    monkeypatch.setenv("EX_ENGINE_CACHE", str(tmp_path / "cache"))
    build_plugin(tmp_path / "p")
    reg = FactorRegistry.load(tmp_path / "p", hardware="h200")
    plugin = reg.get("host_scale")
    monkeypatch.setattr(verify, "verify_plugin", lambda *a, **k: [verify.CaseResult(
        "host_scale", "-", "-", "FAIL", detail="the library file changed after it was loaded")])
    ok, detail = verify.verify_at_load(reg, plugin)
    assert not ok and "changed after it was loaded" in detail
    assert not (tmp_path / "cache" / "verified.json").exists()


# ------------------------------------------------------------------------ registry._invoke
def test_an_error_status_is_not_retried_by_the_kernel_fallback(tmp_path):
    """G04: kernel_fallback runs only after EX_FALLBACK; a kernel's error status (here
    EX_ERR_SHAPE, with a kernel_fallback present) is a KernelError, not a silent retry."""
    from ex_engine import KernelError
    src = tmp_path / "host_scale_err_fb.c"
    text = PLUGIN_SRC.read_text(encoding="utf-8")
    line = "s_factor.kernel_fallback = BEHAVIOUR == 1 ? kernel_fallback : NULL;"
    assert line in text
    src.write_text(text.replace(line, "s_factor.kernel_fallback = kernel_fallback;"), encoding="utf-8")
    build_plugin(tmp_path / "p", defines={"BEHAVIOUR": 3}, src=src)
    reg = FactorRegistry.load(tmp_path / "p", hardware="h200")
    x, alpha = np.ones(8, np.float32), np.array([2.0], np.float32)
    with pytest.raises(KernelError, match="EX_ERR_SHAPE"):
        reg.dispatch("host_scale", {"x": x, "out": np.empty_like(x), "alpha": alpha})
    assert reg.stats()["host_scale"] == {"plugin": 0, "kernel_fallback": 0, "python_fallback": 0,
                                         "errors": 1}


# ------------------------------------------------------------------------ manifest bind
def test_overlapping_rows_are_refused(reg):
    """B05: a row stride of H - 1 (rows sharing an element) breaks 'row stride >= H'; x is
    written in place, so its rows would race."""
    from numpy.lib.stride_tricks import as_strided
    H, T = 8, 3
    buf = np.zeros(T * (H - 1) + 1, np.float32)
    x = as_strided(buf, (T, H), ((H - 1) * 4, 4))
    with pytest.raises(LayoutError, match="row stride >= 8"):
        fused_add_rmsnorm(x, np.ones((T, H), np.float32), np.ones(H, np.float32), registry=reg)


# ------------------------------------------------------------------------ moe_layer
def test_run_moe_fails_when_the_experts_are_wrong(tmp_path, monkeypatch):
    """L01: run_moe's PASS/FAIL is never seen failing; a moe_fused_gemm fallback that writes
    half the right answer must give ok False and print FAIL."""
    from ex_engine import fallbacks
    from ex_engine import moe_layer
    from ex_engine.moe_layer import MoEShape, run_moe
    monkeypatch.setattr(moe_layer, "model_shape", lambda name: MoEShape(name, 64, 32, 8, 2, True))
    r = FactorRegistry.load(tmp_path, hardware="h200")

    def half(arrays, sizes, params):
        flags = fallbacks.moe_fused_gemm(arrays, sizes, params)
        out = arrays["out"]
        out.store(out.load_f32() * 0.5)
        return flags
    r.set_fallback("moe_fused_gemm", half)
    lines = []
    res = run_moe("tiny", 5, "bfloat16", repeat=1, registry=r, echo=lines.append)
    assert res["ok"] is False and res["rel_err"] > 0.4 and lines[-1].strip() == "FAIL"


def test_rel_error_of_a_zero_reference_is_inf():
    """L03: its docstring: inf if ref is zero (an output against an all-zero reference
    passed as error 0)."""
    from ex_engine.moe_layer import rel_error
    assert rel_error(np, np.ones((2, 3)), np.zeros((2, 3))) == math.inf
