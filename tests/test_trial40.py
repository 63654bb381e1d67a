"""Trial 40 (an LLM inference engine's integrator, NumPy and torch CPU): defects found while
calling the ops through the Python API, each test failing before its fix."""
import re

import numpy as np
import pytest

from ex_engine import DTypeError, FactorRegistry, LayoutError, moe_fused_gemm, topk_softmax
from ex_engine import ops


@pytest.fixture(scope="module")
def reg():
    return FactorRegistry.load(hardware="h200")


HUGE_T = 10 ** 11   # a broadcast view's rows: its outputs could never be allocated


def _moe_weights(H=64, I=32, E=8):
    return np.zeros((E, 2 * I, H), np.float16), np.zeros((E, H, I), np.float16)


def test_broadcast_input_is_refused_before_outputs_are_allocated(reg):
    """np.broadcast_to(row, (10**11, H)) as hidden_states (router_logits) raised NumPy's
    'Unable to allocate 11.6 TiB' (1.46 TiB) from the op's output allocation, a MemoryError from
    deep inside NumPy instead of the LayoutError naming the argument (0 strides: refused)."""
    w13, w2 = _moe_weights()
    hs = np.broadcast_to(np.zeros((1, 64), np.float16), (HUGE_T, 64))
    before = reg.stats().get("moe_fused_gemm", {}).get("errors", 0)
    with pytest.raises(LayoutError, match=r"^moe_fused_gemm: argument 'hidden_states': layout: "
                                          r"expected C-contiguous strides \(64, 1\), got strides \(0, 1\)"):
        moe_fused_gemm(hs, w13, w2, np.zeros((1, 2), np.float32), np.zeros((1, 2), np.int32), registry=reg)
    assert reg.stats()["moe_fused_gemm"]["errors"] == before + 1
    lg = np.broadcast_to(np.zeros((1, 8), np.float32), (HUGE_T, 8))
    with pytest.raises(LayoutError, match=r"^topk_softmax: argument 'router_logits': layout: "
                                          r"expected C-contiguous strides \(8, 1\), got strides \(0, 1\)"):
        topk_softmax(lg, 2, registry=reg)
    with pytest.raises(LayoutError, match="^topk_softmax: argument 'router_logits': layout"):
        topk_softmax(lg, 2, topk_ids=np.zeros((4, 2), np.int32), registry=reg)


def test_non_contiguous_input_allocates_nothing(reg, monkeypatch):
    """A refused input's outputs are not allocated first (a Fortran-order or strided
    hidden_states / router_logits of a real size cost an output of its shape, then the error);
    the error is the one dispatch gives, in its order (a wrong dtype first)."""
    def no_alloc(*args, **kwargs):
        raise AssertionError("an output was allocated for a refused input")
    monkeypatch.setattr(ops, "_empty", no_alloc)
    w13, w2 = _moe_weights()
    hs = np.asfortranarray(np.zeros((4, 64), np.float16))
    with pytest.raises(LayoutError, match="^moe_fused_gemm: argument 'hidden_states': layout"):
        moe_fused_gemm(hs, w13, w2, np.zeros((4, 2), np.float32), np.zeros((4, 2), np.int32), registry=reg)
    with pytest.raises(LayoutError, match="^topk_softmax: argument 'router_logits': layout"):
        topk_softmax(np.zeros((4, 16), np.float32)[:, ::2], 2, registry=reg)
    with pytest.raises(DTypeError, match="^moe_fused_gemm: argument 'hidden_states': dtype"):
        moe_fused_gemm(hs.astype(np.float32), w13, w2, np.zeros((4, 2), np.float32), np.zeros((4, 2), np.int32),
                       registry=reg)


def test_torch_expanded_input_is_refused_before_outputs_are_allocated(reg):
    """torch's expand(10**11, H) as hidden_states / router_logits raised torch's own
    'DefaultCPUAllocator: can't allocate memory' RuntimeError from new_empty."""
    torch = pytest.importorskip("torch")
    w13, w2 = (torch.from_numpy(w) for w in _moe_weights())
    hs = torch.zeros(1, 64, dtype=torch.float16).expand(HUGE_T, 64)
    with pytest.raises(LayoutError, match="^moe_fused_gemm: argument 'hidden_states': layout"):
        moe_fused_gemm(hs, w13, w2, torch.zeros(1, 2), torch.zeros(1, 2, dtype=torch.int32), registry=reg)
    with pytest.raises(LayoutError, match="^topk_softmax: argument 'router_logits': layout"):
        topk_softmax(torch.zeros(1, 8).expand(HUGE_T, 8), 2, registry=reg)


def test_rel_error_takes_the_layers_bfloat16_output():
    """MoELayer's default dtype is bfloat16, whose forward returns out as a Bits16: the
    documented check rel_error(np, out, layer.reference(...)) raised AttributeError ('Bits16'
    object has no attribute 'astype'); a list or None as out failed on 'shape'. The Bits16's
    values are compared now (the same error as of their float32 copy); a non-array is a
    DTypeError naming the argument."""
    from ex_engine.arrays import TensorRef
    from ex_engine.moe_layer import MoELayer, MoEShape, rel_error
    layer = MoELayer(MoEShape("tiny", 32, 16, 8, 3, True), "bfloat16")
    x = layer.hidden_states(3)
    out, w, ids, _ = layer.forward(x, registry=FactorRegistry.load(hardware="h200"))
    ref = layer.reference(x, w, ids)
    err = rel_error(np, out, ref)
    assert err == rel_error(np, TensorRef.of(out).load_f32(), ref)
    assert 0 < err < 1e-2
    with pytest.raises(DTypeError, match="^rel_error: argument 'out': type: expected .*array.*got list"):
        rel_error(np, [1.0], np.ones(1))
    with pytest.raises(DTypeError, match="^rel_error: argument 'ref': type: .*got NoneType"):
        rel_error(np, np.ones(1), None)


@pytest.mark.parametrize("xp, got", [("numpy", "str 'numpy'"), (None, "NoneType None"),
                                     (pytest, "the module pytest")])
def test_moe_layer_refuses_an_xp_that_is_not_numpy_or_cupy(xp, got):
    """MoELayer(shape, xp=torch) (an engine on torch) failed as "module 'torch.random' has no
    attribute 'default_rng'", xp='numpy' as "'str' object has no attribute 'random'"."""
    from ex_engine import ArgumentError
    from ex_engine.moe_layer import MoELayer, MoEShape
    with pytest.raises(ArgumentError, match=r"^MoELayer: argument 'xp': array module: expected the module "
                                            r"numpy or cupy, got " + re.escape(got) + "$"):
        MoELayer(MoEShape("tiny", 32, 16, 8, 3, True), "float16", xp=xp)
