"""dispatch's signature cache: a call that differs from a cached one in dtype, shape, strides,
alignment, device or a parameter's value or type is checked in full again; ops.topk_softmax's
self-described outputs match what TensorRef.of reads from them."""
import numpy as np
import pytest

from ex_engine import FactorRegistry, fallbacks, topk_softmax
from ex_engine.arrays import TensorRef
from ex_engine.errors import ArgumentError, DTypeError, FactorError, LayoutError, ShapeError


@pytest.fixture
def reg(tmp_path):
    return FactorRegistry.load(tmp_path, hardware="h200")   # no plugins: Python fallback


def logits(T=3, E=16, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal((T, E)).astype(dtype)


def misaligned(a):
    """A copy of ``a`` whose data starts 2 bytes past an aligned address."""
    buf = np.zeros(a.nbytes + 16, np.uint8)
    off = (-buf.ctypes.data) % 16 + 2
    out = np.frombuffer(buf.data, dtype=a.dtype, count=a.size, offset=off).reshape(a.shape)
    out[...] = a
    return out


def test_a_cached_signature_still_rejects_what_differs(reg):
    x = logits()
    for _ in range(2):   # the second call takes the cached path
        w, ids = topk_softmax(x, 4, True, registry=reg)
    assert reg.last_path["topk_softmax"] == "python_fallback"
    with pytest.raises(DTypeError, match="router_logits"):
        topk_softmax(x.astype(np.float64), 4, True, registry=reg)
    with pytest.raises(ShapeError, match="K <= E"):   # refused by topk_softmax itself (names top_k),
        topk_softmax(logits(E=3), 4, True, registry=reg)   # before dispatch: counted all the same
    with pytest.raises(LayoutError, match="layout"):
        topk_softmax(np.asfortranarray(logits(T=4, E=16)).T.copy().T, 4, True, registry=reg)
    with pytest.raises(LayoutError, match="alignment"):
        topk_softmax(misaligned(x), 4, True, registry=reg)   # same dtype, shape, strides as x
    with pytest.raises(DTypeError, match="topk_ids"):
        topk_softmax(x, 4, True, topk_weights=np.empty((3, 4), np.float32),
                     topk_ids=np.empty((3, 4), np.int64), registry=reg)
    assert reg.stats()["topk_softmax"]["errors"] == 5


def test_a_parameter_of_another_type_is_checked_again(reg):
    x = logits()
    topk_softmax(x, 4, True, registry=reg)
    topk_softmax(x, 4, True, registry=reg)
    with pytest.raises(ArgumentError, match="renormalize"):
        topk_softmax(x, 4, 1.0, registry=reg)   # == True and hashes alike, but not a bool
    with pytest.raises(ArgumentError, match="renormalize"):
        topk_softmax(x, 4, 2, registry=reg)
    w0, _ = topk_softmax(x, 4, False, registry=reg)
    w1, _ = topk_softmax(x, 4, True, registry=reg)
    assert not np.allclose(w0.sum(1), 1) and np.allclose(w1.sum(1), 1)


@pytest.mark.parametrize("T", [0, 1, 5])
def test_ops_describes_its_outputs_as_tensorref_of_would(reg, T):
    seen = {}

    def spy(arrays, sizes, params):
        seen.update(arrays)
        fallbacks.topk_softmax(arrays, sizes, params)   # a fallback must write its outputs

    reg.set_fallback("topk_softmax", spy)
    w, ids = topk_softmax(logits(T=T), 3, registry=reg)
    for name, arr in (("topk_weights", w), ("topk_ids", ids)):
        got, want = seen[name], TensorRef.of(arr, name)
        assert got.obj is arr
        assert (got.kind, got.ptr, got.shape, got.dtype, got.itemsize, got.device) == \
               (want.kind, want.ptr, want.shape, want.dtype, want.itemsize, want.device)
        assert got.strides == want.strides or T == 0   # NumPy gives empty arrays any strides
        assert got.is_contiguous() and want.is_contiguous()


def test_arguments_the_ops_refuse_before_dispatch_count_as_errors(reg):
    """stats()' errors counts every call that raised, also where the op checks an argument
    itself before it calls dispatch (topk_softmax's top_k, moe_fused_gemm's hidden_states when
    it allocates out)."""
    from ex_engine import moe_fused_gemm
    x = logits(E=8)
    for bad in (9, 0, 2.0, True):
        with pytest.raises(FactorError, match="top_k"):
            topk_softmax(x, bad, registry=reg)
    with pytest.raises(ShapeError, match="topk_ids"):
        topk_softmax(x, 2, topk_ids=np.empty((x.shape[0], 3), np.int32), registry=reg)
    assert reg.stats()["topk_softmax"]["errors"] == 5
    with pytest.raises(FactorError, match="hidden_states"):
        moe_fused_gemm([[1.0]], None, None, None, None, registry=reg)
    assert reg.stats()["moe_fused_gemm"]["errors"] == 1
    topk_softmax(x, 2, registry=reg)   # a good call still counts as served, not as an error
    assert reg.stats()["topk_softmax"]["errors"] == 5
    assert sum(v for k, v in reg.stats()["topk_softmax"].items() if k != "errors") == 1
