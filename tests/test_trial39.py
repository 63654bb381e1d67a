"""Session 39's static review of the kernels' edge shapes (no GPU): moe_fused_gemm holds T, E and
G in int32, and its plugins refuse a T, E or G past 2^31 - 1 before any CUDA call. But nothing
on the Python side refused an E or G past it (an expert_map of 2^31 int32 is 8 GiB, which an
H100 holds): the call reached the plugin, which returned EX_ERR_SHAPE with "expected T >= 0,
1 <= H, I <= 16777216, E, G >= 1, 1 <= K <= G; got ... G=2147483648", a bound that G keeps, so
the KernelError named neither the argument nor the limit. The manifest now refuses E and G past
2^31 - 1 by name (w13, expert_map), and the plugins' message states every bound it checks."""
import pytest

from ex_engine import FactorRegistry, ShapeError, abi
from ex_engine.arrays import TensorRef
from tests.conftest import ROOT

EX_ERR_SHAPE = 3      # include/ex_engine.h
LIM = (1 << 31) - 1


def _ref(shape, dtype="bfloat16", itemsize=2):
    """A device array description whose memory is never read (bind and the C checks only)."""
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return TensorRef(None, "cupy", 1 << 20, tuple(shape), tuple(reversed(strides)), dtype, itemsize, 0, True)


def _moe_refs(E=4, G=None, T=1, K=1, H=8, I=8):
    refs = {"hidden_states": _ref((T, H)), "out": _ref((T, H)),
            "w13": _ref((E, 2 * I, H)), "w2": _ref((E, H, I)),
            "topk_weights": _ref((T, K), "float32", 4), "topk_ids": _ref((T, K), "int32", 4)}
    if G is not None:
        refs["expert_map"] = _ref((G,), "int32", 4)
    return refs


@pytest.fixture(scope="module")
def reg():
    return FactorRegistry.load(ROOT / "factors", hardware="h200")


def test_the_moe_manifest_refuses_G_past_2_31_naming_expert_map(reg):
    m = reg.manifest("moe_fused_gemm")
    with pytest.raises(ShapeError, match=r"expert_map.*G <= 2147483647") as exc:
        m.bind(_moe_refs(G=LIM + 1), None, reg.tuning.value)
    assert exc.value.argument == "expert_map"
    m.bind(_moe_refs(G=LIM), None, reg.tuning.value)   # the largest G the kernels hold


def test_the_moe_manifest_refuses_E_past_2_31_naming_w13(reg):
    m = reg.manifest("moe_fused_gemm")
    with pytest.raises(ShapeError, match=r"w13.*E <= 2147483647") as exc:
        m.bind(_moe_refs(E=LIM + 1, H=1, I=1), None, reg.tuning.value)
    assert exc.value.argument == "w13"
    m.bind(_moe_refs(E=LIM, H=1, I=1), None, reg.tuning.value)


def _c_call(plugin, dims):
    """The plugin's kernel with fake (never read) pointers: (status, last_error)."""
    ffi = abi.ffi
    fake = ffi.cast("void*", 1 << 20)
    aux = ffi.new("void*[]", [fake] * 7)
    d = ffi.new("int64_t[]", dims)
    st = plugin.factor.kernel(fake, fake, ffi.cast("const void**", aux), 7, d, len(dims), ffi.NULL)
    return st, ffi.string(plugin.factor.last_error()).decode()


@pytest.mark.parametrize("lib", ["moe_fused_gemm.so", "moe_fused_gemm_sm90.so"])
@pytest.mark.parametrize("which", ["T", "E", "G"])
def test_the_moe_plugins_name_the_int32_bound_of_T_E_and_G(lib, which):
    if not (ROOT / "factors" / lib).exists():
        pytest.skip(f"factors/{lib} not built")
    r = FactorRegistry.load(ROOT / "factors", hardware="h200", prefer={"moe_fused_gemm": str(ROOT / "factors" / lib)})
    p = r.get("moe_fused_gemm")
    assert p.path.name == lib
    T, E, G = {"T": (LIM + 1, 4, 4), "E": (1, LIM + 1, LIM + 1), "G": (1, 4, LIM + 1)}[which]
    st, err = _c_call(p, [T, 8, E, 8, 1, 2, G, -1])
    assert st == EX_ERR_SHAPE, (st, err)
    bound = "0 <= T <= 2147483647" if which == "T" else "1 <= E, G <= 2147483647"
    assert bound in err and f"{which}={LIM + 1}" in err, err
    assert "1 <= H, I <= 16777216" in err, err   # (the bound of session 33 still named)
