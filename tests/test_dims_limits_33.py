"""H, I (moe_fused_gemm), E (topk_softmax) and H (fused_add_rmsnorm) are at most 2^24: a static
review (session 33) found int32 loops and ceil-divisions in the kernels that wrap near 2^31
(a fallback's loop over H walking before the row, GEMM2 never running at I = 2^31 - 56 so that
out came back all zero with EX_OK). The manifests refuse such shapes by name, and each plugin's
own check refuses them before any CUDA call (both tested here without a GPU)."""
import numpy as np
import pytest

from ex_engine import FactorRegistry, ShapeError, abi
from ex_engine.arrays import TensorRef
from tests.conftest import ROOT

EX_ERR_SHAPE = 3      # include/ex_engine.h
BIG = (1 << 24) + 8     # past the limit, a multiple of 8 (the fast paths' alignment)


def _ref(name, shape, dtype="bfloat16", itemsize=2):
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return TensorRef(None, "cupy", 1 << 20, tuple(shape), tuple(reversed(strides)), dtype, itemsize, 0, True)


@pytest.fixture(scope="module")
def reg():
    return FactorRegistry.load(ROOT / "factors", hardware="h200")


def _moe_refs(H, I, T=1, E=1, K=1):
    return {"hidden_states": _ref("hidden_states", (T, H)), "out": _ref("out", (T, H)),
            "w13": _ref("w13", (E, 2 * I, H)), "w2": _ref("w2", (E, H, I)),
            "topk_weights": _ref("topk_weights", (T, K), "float32", 4),
            "topk_ids": _ref("topk_ids", (T, K), "int32", 4)}


@pytest.mark.parametrize("H,I,dim", [(BIG, 8, "H"), (8, BIG, "I")])
def test_the_moe_manifest_refuses_H_or_I_past_2_24(reg, H, I, dim):
    m = reg.manifest("moe_fused_gemm")
    with pytest.raises(ShapeError, match=rf"{dim} <= 16777216"):
        m.bind(_moe_refs(H, I), None, reg.tuning.value)
    m.bind(_moe_refs(1 << 24, 8) if dim == "H" else _moe_refs(8, 1 << 24), None, reg.tuning.value)


def test_the_topk_and_rmsnorm_manifests_refuse_past_2_24(reg):
    m = reg.manifest("topk_softmax")
    refs = {"router_logits": _ref("router_logits", (1, BIG), "float32", 4),
            "topk_weights": _ref("topk_weights", (1, 2), "float32", 4),
            "topk_ids": _ref("topk_ids", (1, 2), "int32", 4)}
    with pytest.raises(ShapeError, match=r"E <= 16777216"):
        m.bind(refs, None, reg.tuning.value)
    m = reg.manifest("fused_add_rmsnorm")
    refs = {"x": _ref("x", (1, BIG)), "residual": _ref("residual", (1, BIG)), "weight": _ref("weight", (BIG,))}
    with pytest.raises(ShapeError, match=r"H <= 16777216"):
        m.bind(refs, None, reg.tuning.value)


def _c_call(plugin, dims, n_aux, status_ok=False):
    """The plugin's kernel entry with dims past the limit and fake (never read) pointers:
    (status, last_error). The dims check comes before any CUDA call."""
    ffi = abi.ffi
    fake = ffi.cast("void*", 1 << 20)
    aux = ffi.new("void*[]", [fake] * n_aux)
    d = ffi.new("int64_t[]", dims)
    st = plugin.factor.kernel(fake, fake, ffi.cast("const void**", aux), n_aux, d, len(dims), ffi.NULL)
    return st, ffi.string(plugin.factor.last_error()).decode()


@pytest.mark.parametrize("lib", ["moe_fused_gemm.so", "moe_fused_gemm_sm90.so"])
@pytest.mark.parametrize("H,I", [(BIG, 8), (8, BIG), ((1 << 31) - 56, 8), (8, (1 << 31) - 56)])
def test_the_moe_plugins_refuse_H_or_I_past_2_24_before_any_cuda_call(H, I, lib):
    if not (ROOT / "factors" / lib).exists():
        pytest.skip(f"factors/{lib} not built")
    reg = FactorRegistry.load(ROOT / "factors", hardware="h200", prefer={"moe_fused_gemm": str(ROOT / "factors" / lib)})
    p = reg.get("moe_fused_gemm")
    assert p.path.name == lib
    st, err = _c_call(p, [1, H, 1, I, 1, 2, 1, -1], 7)
    assert st == EX_ERR_SHAPE, (st, err)
    assert "1 <= H, I <= 16777216" in err and f"H={H} " in err and f"I={I} " in err, err


def test_topk_and_rmsnorm_plugins_refuse_past_2_24_before_any_cuda_call():
    reg = FactorRegistry.load(ROOT / "factors", hardware="h200")
    p = reg.get("topk_softmax")
    if p is None:
        pytest.skip("topk_softmax.so not built")
    st, err = _c_call(p, [1, BIG, 2, 1, 0], 1)
    assert st == EX_ERR_SHAPE and "expected 1 <= E <= 16777216" in err, (st, err)
    p = reg.get("fused_add_rmsnorm")
    st, err = _c_call(p, [1, BIG, 0, 0, BIG, BIG], 2)
    assert st == EX_ERR_SHAPE and "expected 1 <= H <= 16777216" in err, (st, err)
