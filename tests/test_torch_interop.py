"""PyTorch interop of the typed functions: torch tensors in, torch tensors out, zero-copy.

CPU part (runs wherever torch is installed): torch CPU tensors of every dtype go through the
Python fallbacks on the tensors' own memory, come back as torch tensors on the same device and
equal the NumPy results bit for bit. GPU part (marked ``gpu``): CUDA tensors take the plugins,
agree with the CPU results, run on torch's current stream (also a non-default one) and can be
captured in a torch CUDA graph. Skipped entirely where torch is not installed (CI installs
ex_engine[test] only: see README, "PyTorch and transformers").
"""
import ml_dtypes
import numpy as np
import pytest

from ex_engine import FactorRegistry, fused_add_rmsnorm, moe_fused_gemm, topk_softmax
from ex_engine.arrays import TensorRef
from ex_engine.errors import LayoutError
from tests.conftest import ROOT

torch = pytest.importorskip("torch")

TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
NP = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


@pytest.fixture(scope="module")
def reg():
    return FactorRegistry.load(ROOT / "factors")


def to_np(t):
    """A NumPy array with the same values and dtype as torch tensor ``t`` (a copy)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
    return t.numpy().copy()


def bits_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    return a.tobytes() == b.tobytes()


def moe_inputs(T, H, E, I, K, dtype, device="cpu", seed=0, param=False):
    g = torch.Generator().manual_seed(seed)
    dt = TORCH[dtype]
    x = torch.randn(T, H, generator=g).to(dt)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(dt)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dt)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, K, generator=g) * 0.9 + 0.1
    out = [t.to(device) for t in (x, w13, w2, w, ids)]
    if param:   # as a model's weights: Parameters that require grad
        out[1], out[2] = torch.nn.Parameter(out[1]), torch.nn.Parameter(out[2])
    return out


# ------------------------------------------------------------------------------ CPU: fallbacks
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_topk_softmax_torch_cpu_equals_numpy(reg, dtype):
    logits = (torch.randn(19, 40, generator=torch.Generator().manual_seed(1)) * 2).to(TORCH[dtype])
    w, ids = topk_softmax(logits, 8, True, registry=reg)
    assert isinstance(w, torch.Tensor) and isinstance(ids, torch.Tensor)
    assert w.device == logits.device and ids.device == logits.device
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and tuple(w.shape) == (19, 8)
    assert reg.last_path["topk_softmax"] == "python_fallback"
    wn, idn = topk_softmax(to_np(logits), 8, True, registry=reg)
    assert isinstance(wn, np.ndarray)
    assert bits_equal(w.numpy(), wn) and bits_equal(ids.numpy(), idn)


def test_topk_softmax_writes_given_torch_outputs(reg):
    logits = torch.randn(5, 16)
    w, ids = torch.full((5, 3), float("nan")), torch.full((5, 3), -1, dtype=torch.int32)
    w2, ids2 = topk_softmax(logits, 3, False, topk_weights=w, topk_ids=ids, registry=reg)
    assert w2 is w and ids2 is ids
    assert not torch.isnan(w).any() and (ids >= 0).all()
    ref = torch.softmax(logits, -1).topk(3, -1)
    torch.testing.assert_close(w, ref.values)
    assert torch.equal(ids.long(), ref.indices)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_fused_add_rmsnorm_in_place_on_torch_views(reg, dtype):
    T, H = 7, 96
    g = torch.Generator().manual_seed(2)
    dt = TORCH[dtype]
    xbuf = torch.randn(T, 2 * H, generator=g).to(dt)        # x: the left half of each row
    rbuf = torch.randn(T, H + 32, generator=g).to(dt)       # residual: rows wider than H
    weight = (torch.rand(H, generator=g) + 0.5).to(dt)
    x, res = xbuf[:, :H], rbuf[:, 16:16 + H]
    assert not x.is_contiguous() and not res.is_contiguous()
    x_np, res_np, w_np = to_np(x), to_np(res), to_np(weight)
    xbuf0, rbuf0 = xbuf.clone(), rbuf.clone()
    xp, rp = x.data_ptr(), res.data_ptr()
    a, b = fused_add_rmsnorm(x, res, weight, eps=1e-6, registry=reg)
    assert a is x and b is res and x.data_ptr() == xp and res.data_ptr() == rp
    assert reg.last_path["fused_add_rmsnorm"] == "python_fallback"
    fused_add_rmsnorm(x_np, res_np, w_np, eps=1e-6, registry=reg)
    assert bits_equal(to_np(x), x_np) and bits_equal(to_np(res), res_np)
    # in place: the views changed, the rest of both buffers did not
    assert not torch.equal(xbuf[:, :H], xbuf0[:, :H])
    assert torch.equal(xbuf[:, H:], xbuf0[:, H:])
    assert torch.equal(rbuf[:, :16], rbuf0[:, :16]) and torch.equal(rbuf[:, 16 + H:], rbuf0[:, 16 + H:])
    # residual = old x + old residual, rounded to dtype
    torch.testing.assert_close(res.float(), (xbuf0[:, :H].float() + rbuf0[:, 16:16 + H].float()).to(dt).float())


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_moe_fused_gemm_torch_cpu_equals_numpy(reg, dtype):
    x, w13, w2, w, ids = moe_inputs(6, 64, 8, 32, 2, dtype)
    out = moe_fused_gemm(x, w13, w2, w, ids, registry=reg)
    assert isinstance(out, torch.Tensor) and out.dtype == TORCH[dtype] and out.device == x.device
    assert tuple(out.shape) == (6, 64)
    assert reg.last_path["moe_fused_gemm"] == "python_fallback"
    ref = moe_fused_gemm(*(to_np(t) for t in (x, w13, w2, w, ids)), registry=reg)
    assert bits_equal(to_np(out), ref)


def test_moe_fused_gemm_on_parameters_outside_no_grad(reg):
    """Model weights are Parameters that require grad; the fallback reads them (detached) anyway."""
    x, w13, w2, w, ids = moe_inputs(3, 32, 4, 16, 2, "bfloat16", param=True)
    assert torch.is_grad_enabled() and w13.requires_grad
    out = moe_fused_gemm(x, w13, w2, w, ids, registry=reg)
    ref = moe_fused_gemm(x, w13.detach(), w2.detach(), w, ids, registry=reg)
    assert torch.equal(out, ref)


def test_moe_fused_gemm_writes_given_out_and_copies_nothing(reg):
    x, w13, w2, w, ids = moe_inputs(4, 32, 4, 16, 2, "bfloat16")
    out = torch.full((4, 32), float("nan"), dtype=torch.bfloat16)
    ptrs = [t.data_ptr() for t in (x, w13, w2, w, ids)]
    before = [t.clone() for t in (x, w13, w2, w, ids)]
    got = moe_fused_gemm(x, w13, w2, w, ids, out=out, registry=reg)
    assert got is out and not torch.isnan(out.float()).any()
    assert [t.data_ptr() for t in (x, w13, w2, w, ids)] == ptrs
    assert all(torch.equal(a, b) for a, b in zip((x, w13, w2, w, ids), before))


def test_tensor_ref_reads_torch_without_copying():
    t = torch.zeros(4, 6, dtype=torch.bfloat16)[:, 1:5]
    r = TensorRef.of(t)
    assert r.kind == "torch" and r.ptr == t.data_ptr() and r.shape == (4, 4)
    assert r.strides == (6, 1) and r.dtype == "bfloat16" and r.device == -1 and not r.is_contiguous()
    raw = r.raw()                      # the fallbacks' NumPy view: same memory
    raw[...] = 0x3F80                  # bf16 bits of 1.0
    assert torch.equal(t, torch.ones(4, 4, dtype=torch.bfloat16))
    p = torch.nn.Parameter(torch.zeros(3))
    assert TensorRef.of(p).raw().ctypes.data == p.data_ptr()


def test_torch_tensors_take_the_short_path_on_a_host_plugin(tmp_path, monkeypatch):
    """The short path's key read from torch tensors equals the one filed from their checked
    descriptions (torch.Size against a tuple, dtype names): one full check for four calls; an
    overlapping out on the same signature is still refused. CPU tensors and the tests' host
    plugin; the GPU tests run the same on CUDA tensors."""
    from tests.conftest import build_plugin
    build_plugin(tmp_path)
    r = FactorRegistry.load(tmp_path, hardware="h200")
    full, n = r._dispatch_full, []
    monkeypatch.setattr(r, "_dispatch_full", lambda *a, **k: n.append(1) or full(*a, **k))
    for i in range(4):
        x, out, alpha = torch.randn(7), torch.full((7,), float("nan")), torch.tensor([1.5 + i])
        assert r.dispatch("host_scale", {"x": x, "out": out, "alpha": alpha}) == "plugin"
        assert torch.allclose(out, (1.5 + i) * x)
    assert len(n) == 1
    with pytest.raises(LayoutError, match="overlaps 'x'"):
        r.dispatch("host_scale", {"x": x, "out": x, "alpha": alpha})


def test_meta_and_sparse_tensors_are_refused_by_name(tmp_path, reg):
    """A meta tensor has no memory (data_ptr 0) and a sparse one no strided block: refused with
    the argument named, on the typed functions and on a host plugin's short path (a meta tensor
    of a checked CPU signature read as the same key and reached the C kernel with NULL)."""
    from ex_engine.errors import DeviceError, DTypeError
    from tests.conftest import build_plugin
    with pytest.raises(DeviceError, match="'router_logits'.*meta"):
        topk_softmax(torch.empty(4, 8, device="meta"), 2, registry=reg)
    with pytest.raises(DTypeError, match="'router_logits'.*sparse_coo"):
        topk_softmax(torch.randn(4, 8).to_sparse(), 2, registry=reg)
    with pytest.raises(DeviceError, match="'x'.*meta"):
        fused_add_rmsnorm(torch.empty(4, 16, device="meta"), torch.empty(4, 16), torch.ones(16),
                          registry=reg)
    build_plugin(tmp_path)
    r = FactorRegistry.load(tmp_path, hardware="h200")
    x, out, alpha = torch.randn(7), torch.zeros(7), torch.tensor([2.0])
    assert r.dispatch("host_scale", {"x": x, "out": out, "alpha": alpha}) == "plugin"
    with pytest.raises(DeviceError, match="'x'.*meta"):
        r.dispatch("host_scale", {"x": torch.empty(7, device="meta"), "out": out, "alpha": alpha})
    with pytest.raises(DeviceError, match="'out'.*meta"):
        r.dispatch("host_scale", {"x": x, "out": torch.empty(7, device="meta"), "alpha": alpha})


def test_rmsnorm_refuses_a_leaf_that_requires_grad_and_the_ops_record_no_graph(reg):
    """In place into a tensor that requires grad under grad mode (a leaf, as torch refuses it,
    or a non-leaf): refused by name; under no_grad it runs; outputs never require grad."""
    from ex_engine.errors import ArgumentError
    x, r, w = torch.randn(2, 8), torch.randn(2, 8), torch.ones(8)
    with pytest.raises(ArgumentError, match="^fused_add_rmsnorm: argument 'x': autograd"):
        fused_add_rmsnorm(x.clone().requires_grad_(), r.clone(), w, registry=reg)
    with pytest.raises(ArgumentError, match="^fused_add_rmsnorm: argument 'residual': autograd"):
        fused_add_rmsnorm(x.clone(), r.clone().requires_grad_(), w, registry=reg)
    with torch.no_grad():
        fused_add_rmsnorm(x.clone().requires_grad_(), r.clone(), w, registry=reg)
    # a row-strided view of such a leaf (the op takes views into wider buffers): torch refuses
    # x.add_(1) there too; it had gone through and changed the leaf behind autograd
    leaf = torch.randn(2, 16, requires_grad=True)
    before = leaf.detach().clone()
    with pytest.raises(ArgumentError, match="^fused_add_rmsnorm: argument 'x': autograd.*a view of a leaf"):
        fused_add_rmsnorm(leaf[:, :8], r.clone(), w, registry=reg)
    assert torch.equal(leaf.detach(), before)
    # a non-leaf that requires grad (an activation) is refused too under grad mode: it would keep
    # its old grad_fn, and a backward pass would return the gradient of its old values; under
    # no_grad it runs, and nothing it returns requires grad
    act = x.clone().requires_grad_() * 1.0
    rr = r.clone()
    with pytest.raises(ArgumentError, match="^fused_add_rmsnorm: argument 'x': autograd.*non-leaf"):
        fused_add_rmsnorm(act, rr, w, registry=reg)
    with torch.no_grad():
        xo, ro = fused_add_rmsnorm(act, rr, w, registry=reg)
    assert xo is act and ro is rr and not ro.requires_grad     # the arrays given, written in place
    lg = torch.randn(3, 8, requires_grad=True)
    tw, ti = topk_softmax(lg, 2, registry=reg)
    assert not tw.requires_grad and not ti.requires_grad


# ------------------------------------------------------------------------------ GPU: plugins
def _cuda_reg():
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    r = FactorRegistry.load(ROOT / "factors")
    assert r.hardware.live
    return r


@pytest.fixture(scope="module")
def greg():
    return _cuda_reg()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_topk_softmax_cuda_plugin_matches_cpu(greg, dtype):
    logits = (torch.randn(300, 128, generator=torch.Generator().manual_seed(3)) * 2).to(TORCH[dtype])
    w_ref, ids_ref = topk_softmax(logits, 8, True, registry=greg)           # CPU: fallback
    lc = logits.cuda()
    w, ids = topk_softmax(lc, 8, True, registry=greg)
    assert greg.last_path["topk_softmax"] == "plugin"
    assert w.is_cuda and ids.is_cuda and w.dtype == torch.float32 and ids.dtype == torch.int32
    assert w.device == lc.device
    assert torch.equal(ids.cpu(), ids_ref)
    torch.testing.assert_close(w.cpu(), w_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fused_add_rmsnorm_cuda_views_match_cpu(greg, dtype):
    T, H = 33, 2048
    g = torch.Generator().manual_seed(4)
    dt = TORCH[dtype]
    xbuf = torch.randn(T, 2 * H, generator=g).to(dt)
    rbuf = torch.randn(T, H, generator=g).to(dt)
    weight = (torch.rand(H, generator=g) + 0.5).to(dt)
    xg, rg, wg = xbuf.cuda(), rbuf.cuda(), weight.cuda()
    fused_add_rmsnorm(xbuf[:, H:], rbuf, weight, eps=1e-6, registry=greg)     # CPU reference
    fused_add_rmsnorm(xg[:, H:], rg, wg, eps=1e-6, registry=greg)
    assert greg.last_path["fused_add_rmsnorm"] == "plugin"
    assert torch.equal(xg[:, :H].cpu(), xbuf[:, :H])                          # untouched half
    torch.testing.assert_close(rg.cpu().float(), rbuf.float(), rtol=0, atol=0)
    torch.testing.assert_close(xg[:, H:].cpu().float(), xbuf[:, H:].float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("T,H,E,I,K", [(1, 2048, 128, 768, 8), (37, 1024, 64, 256, 8), (5, 512, 8, 1024, 2)])
def test_moe_fused_gemm_cuda_plugin_matches_cpu(greg, dtype, T, H, E, I, K):
    cpu = moe_inputs(T, H, E, I, K, dtype, seed=T)
    ref = moe_fused_gemm(*cpu, registry=greg).float()
    out = moe_fused_gemm(*(t.cuda() for t in cpu), registry=greg)
    assert greg.last_path["moe_fused_gemm"] in ("plugin", "kernel_fallback")
    assert out.is_cuda and out.dtype == TORCH[dtype] and tuple(out.shape) == (T, H)
    err = float((out.cpu().float() - ref).norm() / ref.norm())
    assert err < greg.manifest("moe_fused_gemm").tolerance[dtype], err


@pytest.mark.gpu
def test_the_short_path_reads_new_pointers_and_refuses_an_overlapping_out(greg):
    """Calls after the first with the same signature take dispatch's short path: each reads its
    own tensors (against the CPU fallback of each set), a rerun into a poisoned out is bit-equal,
    out=hidden_states (the signature of an out given before) is still a LayoutError, and an
    address that is not 16-byte aligned still gets a right result."""
    T, H, E, I, K = 3, 512, 8, 256, 2
    cpu_sets = [moe_inputs(T, H, E, I, K, "bfloat16", seed=11 + s) for s in range(3)]
    sets = [[t.cuda() for t in a] for a in cpu_sets]
    outs = [moe_fused_gemm(*a, registry=greg) for a in sets]
    tol = greg.manifest("moe_fused_gemm").tolerance["bfloat16"]
    for a_cpu, a, out in zip(cpu_sets, sets, outs):
        ref = moe_fused_gemm(*a_cpu, registry=greg).float()
        assert float((out.cpu().float() - ref).norm() / ref.norm()) < tol
        again = moe_fused_gemm(*a, out=torch.full_like(out, float("nan")), registry=greg)
        assert greg.last_path["moe_fused_gemm"] == "plugin"
        assert torch.equal(again, out)
    x, w13, w2, w, ids = sets[0]
    with pytest.raises(LayoutError, match="out.*overlaps 'hidden_states'"):
        moe_fused_gemm(x, w13, w2, w, ids, out=x, registry=greg)
    # same signature, hidden_states 2 bytes past a 16-byte boundary: served, and right
    xs = torch.empty(T * H + 1, dtype=x.dtype, device="cuda")[1:].view(T, H).copy_(x)
    odd = moe_fused_gemm(xs, w13, w2, w, ids, registry=greg)
    assert greg.last_path["moe_fused_gemm"] in ("plugin", "kernel_fallback")
    ref = moe_fused_gemm(*cpu_sets[0], registry=greg).float()
    assert float((odd.cpu().float() - ref).norm() / ref.norm()) < tol


@pytest.mark.gpu
def test_factors_run_on_torchs_current_non_default_stream(greg):
    """Inputs are written on a side stream after a long sleep; if a factor ran on any other
    stream it would read them before they are written."""
    T, H, E, I, K = 64, 1024, 32, 256, 4
    x, w13, w2, _, _ = (t.cuda() for t in moe_inputs(T, H, E, I, K, "bfloat16", seed=5))
    logits_src = torch.randn(T, E, device="cuda")
    torch.cuda.synchronize()
    w_ref, ids_ref = topk_softmax(logits_src, K, True, registry=greg)
    out_ref = moe_fused_gemm(x, w13, w2, w_ref, ids_ref, registry=greg)
    torch.cuda.synchronize()
    logits = torch.zeros(T, E, device="cuda")
    xs = torch.zeros_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)          # ~0.1 s of GPU time on this stream
        logits.copy_(logits_src)
        xs.copy_(x)
        w, ids = topk_softmax(logits, K, True, registry=greg)
        out = moe_fused_gemm(xs, w13, w2, w, ids, registry=greg)
    assert greg.last_path["moe_fused_gemm"] == "plugin"
    side.synchronize()
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=0, atol=0)
    torch.testing.assert_close(out.float(), out_ref.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
def test_router_and_experts_capture_in_a_torch_cuda_graph(greg):
    T, H, E, I, K = 4, 2048, 128, 768, 8
    x, w13, w2, _, _ = (t.cuda() for t in moe_inputs(T, H, E, I, K, "bfloat16", seed=6))
    wr = torch.randn(E, H, device="cuda", dtype=torch.bfloat16) * 0.02

    def layer(h):
        w, ids = topk_softmax(h @ wr.t(), K, True, registry=greg)
        return moe_fused_gemm(h, w13, w2, w, ids, registry=greg)

    static_x = x.clone()
    eager = layer(static_x)                     # warm-up: workspace allocated outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = layer(static_x)
    for seed in range(3):
        new = torch.randn(T, H, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)).to(torch.bfloat16)
        static_x.copy_(new)
        g.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(static_out.float(), layer(new).float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(layer(x).float(), eager.float(), rtol=1e-2, atol=1e-2)


def test_fake_tensors_are_refused_by_name_without_a_torch_warning(tmp_path):
    """A new-user trial: under FakeTensorMode (what torch.compile traces with) every op raised
    NumPy's bare ValueError ("data is NULL but array contains data") from the overlap check,
    after torch's warning that reading a FakeTensor's data pointer is a bug. Each op now names
    its first argument, and no data pointer is read."""
    import warnings
    from torch._subclasses.fake_tensor import FakeTensorMode
    from ex_engine.errors import DeviceError
    reg = FactorRegistry.load(tmp_path, hardware="h200")   # no plugin: the Python fallbacks
    calls = {
        "router_logits": lambda: topk_softmax(torch.randn(3, 8), 2, registry=reg),
        "x": lambda: fused_add_rmsnorm(torch.randn(3, 8), torch.randn(3, 8), torch.ones(8), registry=reg),
        "hidden_states": lambda: moe_fused_gemm(
            torch.randn(3, 8), torch.randn(2, 8, 8), torch.randn(2, 8, 4), torch.ones(3, 1),
            torch.zeros(3, 1, dtype=torch.int32), registry=reg),
    }
    for arg, call in calls.items():
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(DeviceError, match=rf"argument '{arg}': memory: .*FakeTensor of shape \(3, 8\)"):
                with FakeTensorMode():
                    call()
    with FakeTensorMode():
        fake = torch.empty(0)
    with pytest.raises(DeviceError, match="FakeTensor of shape \\(0,\\)"):   # no elements: still no memory
        TensorRef.of(fake, "x")
    assert reg.stats()["topk_softmax"]["errors"] == 1


def test_views_and_pointers_a_kernel_cannot_read_as_they_are(tmp_path, monkeypatch):
    """From a review: a negated view (torch applies the sign lazily) gave 2*x where -2*x was
    due, also through the short path of a checked signature; a nested tensor raised torch's
    own error; a FakeTensor (what torch.compile traces with: elements, NULL data pointer)
    reached the C kernel and crashed the process; zero-element calls had lost the short path."""
    from ex_engine.errors import DeviceError, DTypeError
    from tests.conftest import build_plugin
    build_plugin(tmp_path)
    r = FactorRegistry.load(tmp_path, hardware="h200")
    alpha = torch.tensor([2.0])
    x, out = torch.arange(1.0, 8.0), torch.zeros(7)
    assert r.dispatch("host_scale", {"x": x, "out": out, "alpha": alpha}) == "plugin"   # files the key
    neg = torch._neg_view(torch.arange(1.0, 8.0))
    assert neg.is_neg() and neg.is_contiguous()
    with pytest.raises(DTypeError, match="'x'.*resolve_neg.*got a negated view"):
        r.dispatch("host_scale", {"x": neg, "out": out, "alpha": alpha})
    r.dispatch("host_scale", {"x": neg.resolve_neg(), "out": out, "alpha": alpha})
    assert torch.equal(out, -2 * torch.arange(1.0, 8.0))
    with pytest.raises(DTypeError, match="'x'.*nested"):
        TensorRef.of(torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "x")
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        fake = torch.empty(7)
    with pytest.raises(DeviceError, match=r"'x': memory: .*FakeTensor of shape \(7,\)"):
        r.dispatch("host_scale", {"x": fake, "out": out, "alpha": alpha})
    from ex_engine.errors import ArgumentError   # a misspelt name is the problem, not its pointer
    with pytest.raises(ArgumentError, match="argument 'X': unknown argument"):
        r.dispatch("host_scale", {"X": fake, "out": out, "alpha": alpha})
    # a zero-element meta tensor reads like a CPU one (device -1, pointer 0): refused every time,
    # also after a CPU call of that signature filed it for the short path
    meta0 = {"x": torch.empty(0, device="meta"), "out": torch.zeros(0), "alpha": alpha}
    with pytest.raises(DeviceError, match="'x'.*meta"):
        r.dispatch("host_scale", meta0)
    r.dispatch("host_scale", {"x": torch.ones(0), "out": torch.zeros(0), "alpha": alpha})
    with pytest.raises(DeviceError, match="'x'.*meta"):
        r.dispatch("host_scale", meta0)
    full, n = r._dispatch_full, []
    monkeypatch.setattr(r, "_dispatch_full", lambda *a, **k: n.append(1) or full(*a, **k))
    for _ in range(3):
        r.dispatch("host_scale", {"x": torch.ones(0), "out": torch.zeros(0), "alpha": alpha})
    assert len(n) == 0     # filed by the zero-element call above: all three on the short path


def test_as_bfloat16_refuses_torch_float_tensors():
    """torch.dtype has no .kind: a torch float16/bfloat16 tensor passed as_bfloat16's integer
    check and its values would have been read as bit patterns. Refused, saying it needs no tag;
    so is every torch tensor, int16 bit patterns included (torch has both dtypes)."""
    from ex_engine.arrays import as_bfloat16
    from ex_engine.errors import DTypeError
    for dt in (torch.float16, torch.bfloat16):
        with pytest.raises(DTypeError, match="as_bfloat16: argument 'bits'.*needs no tag"):
            as_bfloat16(torch.zeros(4, dtype=dt))
    # an int16 tensor of bit patterns too (a trial: accepted, then every op failed deep inside,
    # AttributeError from new_empty or TypeError from view): torch has the dtype itself
    with pytest.raises(DTypeError, match=r"as_bfloat16: argument 'bits'.*a torch tensor of dtype torch.int16 "
                                         r"\(a torch tensor needs no tag"):
        as_bfloat16(torch.zeros(4, dtype=torch.int16))
