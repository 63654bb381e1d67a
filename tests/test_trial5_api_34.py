"""What an integrator's trial of the Python API found (session thirty-four), each mended with a
test: error classes that did not pickle (a worker process's error became BrokenProcessPool);
torch.Tensor subclasses refused as 'not a torch tensor'; in-place writes that left torch's
version counter alone (autograd computed gradients from overwritten values, silently), and
outputs that are leaves requiring grad written without a word; as_bfloat16 taking a torch
tensor that no op could then serve; a __cuda_array_interface__ array without CuPy failing with
ModuleNotFoundError; NumPy overflow warnings from the moe fallback."""
import copy
import multiprocessing
import pickle
import warnings
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest

import ex_engine
from ex_engine import (ArgumentError, DeviceError, DeviceSideError, FactorError, FactorNotFoundError,
                       KernelError, ShapeError, fused_add_rmsnorm, moe_fused_gemm, topk_softmax)
from ex_engine.arrays import _cupy_importable, as_bfloat16


# ------------------------------------------------- 1. errors pickle and copy as themselves
def _errors():
    return [ShapeError("f", "x", "rank", "2-D", "3-D"), KernelError("f", 3, "EX_ERR_CUDA", "boom"),
            ex_engine.WorkspaceSizeError("f", -1, [1, 2]),
            ex_engine.WorkspaceAllocationError("f", 10, [1], "the GPU", MemoryError("out of memory")),
            DeviceSideError("f: a topk_id outside [0, G)"), FactorNotFoundError("no factor named 'x'"),
            ex_engine.TensorLayoutError("f", "x", "layout", "strided", "sparse"),
            ex_engine.NoDeviceError("no CUDA device"), FactorError("plain")]


@pytest.mark.parametrize("err", _errors(), ids=lambda e: type(e).__name__)
def test_every_error_pickles_and_copies_as_itself(err):
    """pickle.loads(pickle.dumps(e)) and copy.deepcopy(e) raised TypeError (__init__() missing
    arguments) for the classes whose __init__ takes more than a message."""
    for back in (pickle.loads(pickle.dumps(err)), copy.deepcopy(err), copy.copy(err)):
        assert type(back) is type(err)
        assert str(back) == str(err) and back.args == err.args and back.__dict__ == err.__dict__


def _bad_route(_):
    return topk_softmax(np.zeros((2, 4), np.float32), top_k=8)   # K > E: a ShapeError


def test_an_error_in_a_worker_process_reaches_the_caller_as_itself():
    """A ShapeError raised in a ProcessPoolExecutor's worker came back as BrokenProcessPool (the
    pool could not unpickle it); a plain ValueError came through."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
        with pytest.raises(ShapeError, match=r"topk_softmax: argument 'top_k': K <= E") as info:
            pool.submit(_bad_route, None).result()
    assert info.value.argument == "top_k"


# ------------------------------------------------- 2., 3. torch: subclasses, version counters, leaves
def _rms_args(torch, T=3, H=8):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(T, H, generator=g), torch.randn(T, H, generator=g), torch.rand(H, generator=g) + 0.5)


def test_a_torch_tensor_subclass_is_a_torch_tensor():
    """A subclass of torch.Tensor defined outside torch (how engines tag weights, a Parameter
    subclass, or .as_subclass) was refused: 'expected a NumPy/CuPy array or a torch tensor, got
    MyParam'. It is served as the plain tensor is, with the same bits."""
    torch = pytest.importorskip("torch")

    class MyParam(torch.nn.Parameter):
        pass

    class MyTensor(torch.Tensor):
        pass

    x, r, w = _rms_args(torch)
    want = fused_add_rmsnorm(x.clone(), r.clone(), w)
    got = fused_add_rmsnorm(x.clone().as_subclass(MyTensor), r.clone(), MyParam(w, requires_grad=False))
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    g = torch.Generator().manual_seed(1)
    T, H, E, I, K = 2, 16, 4, 8, 2
    hs = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.1).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) * 0.1).to(torch.bfloat16)
    tw, ids = topk_softmax(torch.randn(T, E, generator=g), K)
    plain = moe_fused_gemm(hs, w13, w2, tw, ids)
    sub = moe_fused_gemm(hs, MyParam(w13, requires_grad=False), MyParam(w2, requires_grad=False), tw, ids)
    assert torch.equal(plain, sub)


def test_in_place_writes_bump_torchs_version_counter():
    """fused_add_rmsnorm overwrote x and residual with x._version unchanged, so a backward pass
    that had saved x computed gradients from the new values, silently (a = leaf, x = a * 1,
    y = (x * x).sum(); after the call a.grad was 2 * x_new). Now backward raises as after a
    torch in-place op; the outputs of topk_softmax and moe_fused_gemm given as out are bumped too."""
    torch = pytest.importorskip("torch")
    a = torch.randn(2, 8, requires_grad=True)
    x = a * 1.0
    y = (x * x).sum()
    v = x._version
    with torch.no_grad():   # (under grad mode a non-leaf requiring grad is refused: trial 39f)
        fused_add_rmsnorm(x, torch.zeros(2, 8), torch.ones(8))
    assert x._version > v
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
    logits = torch.randn(3, 6)
    tw, ids = torch.empty(3, 2), torch.empty(3, 2, dtype=torch.int32)
    v = (tw._version, ids._version)
    topk_softmax(logits, 2, topk_weights=tw, topk_ids=ids)
    assert tw._version > v[0] and ids._version > v[1]


def test_an_output_that_is_a_leaf_requiring_grad_is_refused():
    """fused_add_rmsnorm refused a leaf that requires grad (torch refuses in-place ops on one);
    topk_softmax's topk_weights and moe_fused_gemm's out were written into such a leaf without a
    word. Refused now under grad mode, naming the argument; under torch.no_grad() written."""
    torch = pytest.importorskip("torch")
    logits = torch.randn(3, 6)
    leaf = torch.zeros(3, 2, requires_grad=True)
    with pytest.raises(ArgumentError, match=r"topk_softmax: argument 'topk_weights': autograd: .*a leaf tensor"):
        topk_softmax(logits, 2, topk_weights=leaf)
    with torch.no_grad():
        w, _ = topk_softmax(logits, 2, topk_weights=leaf)
    assert w is leaf and bool((leaf > 0).all())
    T, H, E, I, K = 2, 16, 4, 8, 2
    hs = torch.randn(T, H).to(torch.bfloat16)
    w13, w2 = torch.randn(E, 2 * I, H).to(torch.bfloat16), torch.randn(E, H, I).to(torch.bfloat16)
    tw, ids = topk_softmax(torch.randn(T, E), K)
    out = torch.zeros(T, H, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(ArgumentError, match=r"moe_fused_gemm: argument 'out': autograd: .*a leaf tensor"):
        moe_fused_gemm(hs, w13, w2, tw, ids, out=out)
    with pytest.raises(ArgumentError, match=r"argument 'out': autograd: .*a view of a leaf"):
        moe_fused_gemm(hs, w13, w2, tw, ids, out=torch.zeros(T, 2 * H, dtype=torch.bfloat16,
                                                             requires_grad=True)[:, :H])


def test_as_bfloat16_refuses_a_torch_int16_tensor_with_a_hint():
    """as_bfloat16(int16 torch tensor) was accepted, and then every op failed deep inside
    (AttributeError: 'Bits16' object has no attribute 'new_empty'; TypeError from view)."""
    torch = pytest.importorskip("torch")
    with pytest.raises(ex_engine.DTypeError, match=r"as_bfloat16: argument 'bits': library: .*needs no tag"):
        as_bfloat16(torch.zeros(2, 4, dtype=torch.int16))


# ------------------------------------------------- 5. a device array without CuPy
class _FakeDeviceArray:
    """An object known only by its __cuda_array_interface__ (over host memory here: nothing
    may read it)."""

    def __init__(self, a):
        self._a = a
        self.__cuda_array_interface__ = {"shape": a.shape, "typestr": a.dtype.str, "version": 3,
                                         "data": (a.__array_interface__["data"][0], False), "strides": None}


@pytest.mark.skipif(_cupy_importable(), reason="CuPy imports here: the device path is CuPy's")
def test_a_device_array_without_cupy_is_a_device_error_naming_the_argument():
    """topk_softmax(a __cuda_array_interface__ array) without CuPy raised a bare
    ModuleNotFoundError ('No module named cupy') from deep inside, uncounted; through dispatch a
    FactorError that blamed the Python fallback."""
    reg = ex_engine.FactorRegistry.load(hardware="h200")
    with pytest.raises(DeviceError, match=r"topk_softmax: argument 'router_logits': device: expected CuPy "
                                          r"installed.*got a _FakeDeviceArray in device memory, and CuPy cannot"):
        topk_softmax(_FakeDeviceArray(np.zeros((2, 4), np.float32)), 2, registry=reg)
    assert reg.stats()["topk_softmax"]["errors"] == 1
    dev = lambda shape, dt: _FakeDeviceArray(np.zeros(shape, dt))
    with pytest.raises(DeviceError, match=r"fused_add_rmsnorm: argument 'x': device: expected CuPy installed"):
        reg.dispatch("fused_add_rmsnorm", {"x": dev((2, 8), np.float16), "residual": dev((2, 8), np.float16),
                                           "weight": dev((8,), np.float16)})
    assert reg.stats()["fused_add_rmsnorm"]["errors"] == 1


# ------------------------------------------------- 9. the moe fallback's float16 overflow, quietly
def test_the_moe_fallback_overflows_float16_quietly():
    """Inputs far past float16's range printed NumPy's 'overflow encountered in cast' and
    'invalid value encountered in matmul'; the other fallbacks and the kernel say nothing (the
    docstring states the range). The output is still written (inf/NaN where it overflowed)."""
    T, H, E, I, K = 2, 16, 4, 8, 2
    hs = np.full((T, H), 100, np.float16)
    w13 = np.full((E, 2 * I, H), 100, np.float16)
    w2 = np.full((E, H, I), 100, np.float16)
    tw = np.full((T, K), 0.5, np.float32)
    ids = np.array([[0, 1], [2, 3]], np.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = moe_fused_gemm(hs, w13, w2, tw, ids)
    assert not np.isfinite(out.astype(np.float32)).all()
