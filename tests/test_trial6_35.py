"""Session 35's trials (an engine integrator's and a plugin author's, helpers, no GPU): each
defect they found has a test here."""
import numpy as np
import pytest

from ex_engine import FactorRegistry, moe_fused_gemm
from ex_engine.errors import DTypeError
from tests.conftest import ROOT


@pytest.fixture(scope="module")
def reg():
    return FactorRegistry.load(ROOT / "factors")


@pytest.mark.parametrize("dtype", [np.dtype(">f2"), np.dtype([("a", "<f2"), ("b", "<f2")])],
                         ids=["non-native float16", "structured"])
def test_moe_without_out_names_hidden_states_for_a_dtype_no_array_is_made_of(reg, dtype):
    """out=None allocated out with hidden_states' dtype before any check: numpy's TypeError
    ('data type ... not understood'), no FactorError, no argument named, nothing counted."""
    T, H, I, E, K = 2, 8, 4, 2, 1
    x = np.ones((T, H), dtype)
    w13 = np.zeros((E, 2 * I, H), np.float16)
    w2 = np.zeros((E, H, I), np.float16)
    before = reg.stats().get("moe_fused_gemm", {}).get("errors", 0)
    with pytest.raises(DTypeError, match="moe_fused_gemm: argument 'hidden_states': dtype: expected float16 or "
                                         "bfloat16, got"):
        moe_fused_gemm(x, w13, w2, np.ones((T, K), np.float32), np.zeros((T, K), np.int32), registry=reg)
    assert reg.stats()["moe_fused_gemm"]["errors"] == before + 1
