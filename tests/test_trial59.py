"""A new integrator's trial (session fifty-nine): a malformed __cuda_array_interface__ and a CuPy
that cannot use the device raised NumPy's, Python's or CuPy's own errors from inside ex_engine;
now each is a FactorError naming the factor and the argument."""
import sys
import types

import numpy as np
import pytest

from ex_engine import FactorRegistry, moe_fused_gemm, topk_softmax
from ex_engine.errors import DeviceError, DTypeError


class _CAI:
    def __init__(self, d):
        self.__cuda_array_interface__ = d


_GOOD = {"shape": (2, 8), "typestr": "<f4", "data": (0xDEAD000, False), "version": 3}


@pytest.mark.parametrize("change", [
    {"typestr": None},            # missing
    {"typestr": "zz"},            # np.dtype: TypeError
    {"shape": "ab"},              # np.prod: UFuncTypeError
    {"shape": (2.5, 8)},          # not ints
    {"data": None},               # None[0]
    {"data": (0xDEAD000,)},       # no read-only flag
    {"strides": ("a", 4)},
    {"strides": (32,)},           # one stride for two dims (a review: taken as contiguous)
    {"shape": (-4, 8)},           # a negative size (likewise)
])
def test_a_malformed_cuda_array_interface_is_refused_by_name(change):
    d = {**_GOOD, **change}
    d = {k: v for k, v in d.items() if v is not None or k == "data"}
    with pytest.raises(DTypeError) as exc:
        topk_softmax(_CAI(d), 2, registry=FactorRegistry.load())
    msg = str(exc.value)
    assert "topk_softmax" in msg and "router_logits" in msg and "__cuda_array_interface__" in msg
    assert exc.value.argument == "router_logits"


def test_an_interface_that_is_no_dict_is_refused_by_name():
    with pytest.raises(DTypeError, match="router_logits"):
        topk_softmax(_CAI(["not", "a", "dict"]), 2, registry=FactorRegistry.load())


def _cupy_without_a_driver(monkeypatch):
    """A stand-in CuPy that imports but whose every device use raises CUDARuntimeError from a
    cupy_backends module, as a CuPy for CUDA 13 does on a CUDA 12 driver."""
    from ex_engine import arrays

    err_mod = types.ModuleType("cupy_backends.cuda.api.runtime")
    CUDARuntimeError = type("CUDARuntimeError", (RuntimeError,), {"__module__": err_mod.__name__})

    class Device:
        def __init__(self, i):
            raise CUDARuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient "
                                   "for CUDA runtime version")

    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(Device=Device)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(arrays, "_CUPY_IMPORT", [True])
    monkeypatch.setattr(arrays, "_CUPY_RUNTIME", [None])


def test_a_cupy_that_cannot_use_the_device_is_a_device_error_naming_the_argument(monkeypatch):
    _cupy_without_a_driver(monkeypatch)
    reg = FactorRegistry.load()
    with pytest.raises(DeviceError) as exc:
        topk_softmax(_CAI(dict(_GOOD)), 2, registry=reg)
    msg = str(exc.value)
    assert exc.value.argument == "router_logits" and "topk_softmax" in msg
    assert "CUDARuntimeError: cudaErrorInsufficientDriver" in msg and "cupy-cuda12x" in msg
    assert reg.stats()["topk_softmax"]["errors"] == 1
    T, H, I, E, K = 2, 128, 64, 4, 2
    dev = lambda shape, t="<u2": _CAI({"shape": shape, "typestr": t, "data": (0xDEAD000, False), "version": 3})
    with pytest.raises(DeviceError) as exc:
        moe_fused_gemm(dev((T, H)), dev((E, 2 * I, H)), dev((E, H, I)), dev((T, K), "<f4"), dev((T, K), "<i4"),
                       registry=reg)
    assert exc.value.argument == "hidden_states"


def test_an_error_of_another_library_is_not_taken_for_cupys(monkeypatch):
    """Only CuPy's own errors become the DeviceError: anything else (a bug) is not hidden."""
    _cupy_without_a_driver(monkeypatch)
    cupy = sys.modules["cupy"]

    class Device:
        def __init__(self, i):
            raise ZeroDivisionError("not CuPy's")

    cupy.cuda = types.SimpleNamespace(Device=Device)
    with pytest.raises(ZeroDivisionError):
        topk_softmax(_CAI(dict(_GOOD)), 2, registry=FactorRegistry.load())


def test_a_wellformed_interface_still_reads_as_before():
    from ex_engine.arrays import TensorRef

    ref = TensorRef.of(_CAI({**_GOOD, "strides": (32, 4)}), "x", "f")
    assert ref.shape == (2, 8) and ref.strides == (8, 1) and ref.dtype == "float32" and ref.ptr == 0xDEAD000
    ref = TensorRef.of(_CAI({**_GOOD, "shape": (np.int64(2), 8), "strides": None}), "x", "f")
    assert ref.shape == (2, 8) and ref.strides == (8, 1)


def test_the_fallback_note_names_every_rejected_library_of_a_factor(tmp_path):
    """Two libraries of one factor, both rejected (their manifest's fallback does not import):
    the note named one of them; it names both, each with its reason."""
    import shutil

    from ex_engine import _paths
    from tests.conftest import ROOT, build_plugin

    m = tmp_path / "m"
    shutil.copytree(_paths.manifests_dir(), m)
    yaml_text = (ROOT / "tests" / "plugins" / "host_scale.yaml").read_text(encoding="utf-8")
    (m / "host_scale.yaml").write_text(yaml_text.replace("tests.plugins.host_scale_fallback:scale",
                                                         "nosuch_mod:scale"), encoding="utf-8")
    build_plugin(tmp_path / "lib", manifest=False)
    build_plugin(tmp_path / "lib", "host_scale_b", manifest=False)
    reg = FactorRegistry.load(tmp_path / "lib", hardware="h200", manifests_dir=m)
    a, b = reg.plugins
    assert a.status == b.status == "rejected" and a.name == b.name == "host_scale"
    (note,) = [n for n in reg.notes if n.startswith("fallback:")]
    assert note.startswith(f"fallback: host_scale: no ready plugin: 2 libraries were rejected "
                           f"({a.path.name}: {a.reason}; {b.path.name}: {b.reason}); its Python fallback "
                           "nosuch_mod:scale cannot be loaded"), note
