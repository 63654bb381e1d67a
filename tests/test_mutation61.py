"""Session 61's mutation test of ex_engine/ops.py, arrays.py, fallbacks.py and moe_layer.py: each
test fails on one small change of the code (named in its docstring) that the rest of the suite
let pass. CPU only: the Python fallbacks on NumPy, and bare __cuda_array_interface__ objects that
are never dereferenced."""
from __future__ import annotations

import numpy as np
import pytest

from ex_engine import DeviceSideError, FactorRegistry, fused_add_rmsnorm, moe_fused_gemm
from ex_engine.arrays import Bits16, TensorRef, bf16_bits_to_f32, f32_to_bf16_bits
from ex_engine.fallbacks import fused_add_rmsnorm_math
from ex_engine.moe_layer import rel_error

from .reference import random_moe_case, rmsnorm_ref


@pytest.fixture(scope="module")
def reg(tmp_path_factory):
    """A registry without plugins (an empty folder): every call runs the Python fallback."""
    return FactorRegistry.load(tmp_path_factory.mktemp("empty"), hardware="h200")


class _CAI:
    """A bare __cuda_array_interface__ (never dereferenced: only described)."""

    def __init__(self, shape, strides=None, typestr="<f4", ptr=0x7F0000001000):
        self.__cuda_array_interface__ = {"shape": shape, "strides": strides, "typestr": typestr,
                                         "data": (ptr, False), "version": 3}


def _moe_case(T=5, H=16, E=4, I=8, K=2, seed=61):
    """reference.random_moe_case in float32, seeded."""
    return random_moe_case(np.random.default_rng(seed), T, H, E, I, K)


# ------------------------------------------------------------------------------ ops.py
def test_moe_fused_gemm_allocates_a_bits16_out_for_bits16_hidden_states(reg):
    """O06 (ops._empty without its host Bits16 branch): out=None for bfloat16 hidden_states given
    as a Bits16 came back as an ml_dtypes bfloat16 ndarray instead of a Bits16 ("allocated like
    hidden_states"): a caller that tags bf16 as uint16 bits (a library without a bf16 dtype)
    gets another type back than it passed, and `out.bits` fails."""
    x, w13, w2, w, ids = _moe_case()
    bf = lambda a: Bits16(f32_to_bf16_bits(np, a), "bfloat16")   # noqa: E731
    out = moe_fused_gemm(bf(x), bf(w13), bf(w2), w, ids, registry=reg)
    assert isinstance(out, Bits16) and out.dtype == "bfloat16", type(out)
    assert out.bits.dtype == np.uint16 and out.shape == x.shape
    got = bf16_bits_to_f32(np, out.bits).astype(np.float64)
    assert np.isfinite(got).all() and np.linalg.norm(got) > 0.1


def test_fused_add_rmsnorm_default_eps_is_1e_6(reg):
    """O20 (the default eps 1e-6 -> 1e-5): rows whose mean square is ~1e-6 (small activations)
    are normalised by sqrt(ms + eps), so the default eps changes them by ~2x. The default must
    give what eps=1e-6 gives (the manifest's and vLLM's default), checked against float64."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((3, 64)) * 1e-3).astype(np.float32)
    res = (rng.standard_normal((3, 64)) * 1e-3).astype(np.float32)
    wt = (1 + 0.1 * rng.standard_normal(64)).astype(np.float32)
    X, R = rmsnorm_ref(x, res, wt, 1e-6, "float32")
    y, r = x.copy(), res.copy()
    fused_add_rmsnorm(y, r, wt, registry=reg)
    assert np.linalg.norm(y - X) / np.linalg.norm(X) < 1e-5
    y2, r2 = x.copy(), res.copy()
    fused_add_rmsnorm(y2, r2, wt, 1e-6, registry=reg)
    assert np.array_equal(y, y2) and np.array_equal(r, r2)


# ------------------------------------------------------------------------------ arrays.py
@pytest.mark.parametrize("shape,strides", [((1, 8), (4096, 4)), ((4, 1), (4, 64)), ((1, 1, 8), (12, 0, 4))])
def test_a_size_one_dimension_may_have_any_stride(shape, strides):
    """A20 (TensorRef.is_contiguous without `or sh == 1`): an object known by its
    __cuda_array_interface__ whose size-1 dimension has a stride a packed array would not have
    (one row of a wider buffer, x[i:i+1]) was called non-contiguous, and the ops refused it as a
    LayoutError although its elements are packed (NumPy, CuPy and torch call it contiguous)."""
    ref = TensorRef.of(_CAI(shape, strides))
    assert ref.contiguous is None          # computed by is_contiguous, not a library's flag
    assert ref.is_contiguous()
    assert not TensorRef.of(_CAI((2, 8), (4096, 4))).is_contiguous()   # a real row stride still counts


def test_one_row_of_a_wider_device_buffer_passes_the_layout_check(reg):
    """A20 through an op: router_logits (1, E), one row of a wider buffer known by its
    __cuda_array_interface__, was refused as a LayoutError ('expected C-contiguous strides (8, 1),
    got strides (1024, 1)'); it is packed, so the layout passes and what stops it here is the
    missing CuPy (DeviceError). Only where CuPy does not import: with CuPy the call would run on
    the object's made-up pointer."""
    from ex_engine import topk_softmax
    from ex_engine.arrays import _cupy_importable
    from ex_engine.errors import DeviceError
    if _cupy_importable():
        pytest.skip("CuPy imports here: the call would get past the device check")
    with pytest.raises(DeviceError, match="router_logits.*CuPy"):
        topk_softmax(_CAI((1, 8), (4096, 4)), 2, registry=reg)


# ------------------------------------------------------------------------------ fallbacks.py
def test_rmsnorm_rescue_of_an_overflowing_row_keeps_eps_in_scale():
    """F14 (rescued_inv_rms adding eps instead of eps / amax^2): a finite row whose fp32 sum of
    squares overflows is normalised on q = r / amax, where the eps of the formula becomes
    eps / amax^2 (~0 for |r| ~ 1e20). Adding eps itself to mean(q^2) (O(0.1)) shrank the row by
    tens of percent for eps = 0.1; with the default 1e-6 the error is small but still real."""
    rng = np.random.default_rng(3)
    H = 16
    x = (rng.standard_normal((2, H)) * 1e20).astype(np.float32)
    res = (rng.standard_normal((2, H)) * 1e20).astype(np.float32)
    wt = (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)
    with np.errstate(over="ignore"):
        assert not np.isfinite(((x + res) ** 2).sum(axis=-1, dtype=np.float32)).all()  # the rescue path
    X, _ = rmsnorm_ref(x, res, wt, 0.1, "float32")
    y, _ = fused_add_rmsnorm_math(np, x, res, wt, 0.1, "float32")
    assert np.linalg.norm(y - X) / np.linalg.norm(X) < 1e-5


def test_a_single_bad_expert_map_slot_is_reported(reg):
    """F27 (`if n_bad_map:` -> `if n_bad_map > 1:`): one slot whose expert maps outside [-1, E)
    must still raise DeviceSideError at check_device_errors (test_mutation_gaps_36 has two such
    slots): a single corrupt map entry hit once was silently dropped from the layer's output."""
    x, w13, w2, w, _ = _moe_case(T=4, E=4)
    x, w13, w2 = x.astype(np.float16), w13[:2].astype(np.float16), w2[:2].astype(np.float16)
    ids = np.array([[0, 1], [2, 3], [1, 0], [0, 3]], np.int32)   # global expert 2: one slot
    emap = np.array([0, -1, 7, 1], np.int32)                      # 7: not a local expert (E = 2)
    reg.check_device_errors()
    moe_fused_gemm(x, w13, w2, w, ids, expert_map=emap, registry=reg)
    with pytest.raises(DeviceSideError, match=r"invalid_expert_map in 1 slot") as e:
        reg.check_device_errors()
    assert "invalid_topk_ids" not in str(e.value)


# ------------------------------------------------------------------------------ moe_layer.py
def test_rel_error_of_an_output_with_nan_is_inf():
    """M23 (rel_error without its NaN check): the error of an output holding a NaN was NaN,
    not the documented inf; a caller testing `err > tol` (NaN compares false) then passed a
    corrupted output. Also for a Bits16 output (MoELayer's bfloat16)."""
    rng = np.random.default_rng(5)
    ref = rng.standard_normal((3, 8))
    out = ref.astype(np.float32)
    out[1, 2] = np.nan
    assert rel_error(np, out, ref) == float("inf")
    bits = Bits16(f32_to_bf16_bits(np, out), "bfloat16")
    assert rel_error(np, bits, ref) == float("inf")
    assert 0 < rel_error(np, ref.astype(np.float32), ref) < 1e-6   # a finite output: a finite error
