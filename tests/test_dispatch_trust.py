"""Dispatch under stress, on the CPU: concurrent calls from many threads, one workspace per
thread/stream, empty batches, sizes beyond 2^31 elements, arrays in the wrong place."""
import shutil
import threading

import numpy as np
import pytest

from ex_engine import (DeviceError, DeviceSideError, FactorError, FactorRegistry, KernelError, abi,
                       fused_add_rmsnorm, moe_fused_gemm, topk_softmax)
from tests.conftest import ROOT, build_plugin
from tests.test_validation import FakeDeviceArray


def ws_plugin(folder, **defines):
    """host_scale.c with -DWORKSPACE: the product goes through the runtime's workspace (which it
    requires 256-byte aligned, contract rule 11)."""
    build_plugin(folder, "host_scale_ws", defines={"WORKSPACE": True, "NAME": '"host_scale_ws"',
                                                   "FACTOR_ID": 1107, **defines}, manifest=False)
    shutil.copy(ROOT / "tests" / "plugins" / "host_scale_ws.yaml", folder / "host_scale_ws.yaml")
    return FactorRegistry.load(folder, hardware="h200")


def run_threads(n, fn):
    """Run fn(i) in n threads released together by a barrier; re-raise the first error."""
    barrier, errors, results = threading.Barrier(n, timeout=60), [], [None] * n

    def body(i):
        try:
            barrier.wait()
            results[i] = fn(i)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


# ------------------------------------------------------------------------------ concurrency
def test_threads_get_their_own_workspace_and_the_same_results_as_serial(tmp_path):
    reg = ws_plugin(tmp_path)
    assert reg.get("host_scale_ws") is not None, reg.plugins[0].reason
    rng = np.random.default_rng(0)
    n_threads, calls = 8, 40
    xs = [rng.standard_normal(200_000 + 1000 * i).astype(np.float32) for i in range(n_threads)]
    alphas = [np.array([1.5 + i], np.float32) for i in range(n_threads)]

    def work(i):
        outs = []
        for _ in range(calls):
            out = np.empty_like(xs[i])
            assert reg.dispatch("host_scale_ws", {"x": xs[i], "out": out, "alpha": alphas[i]}) == "plugin"
            outs.append(out)
        return outs

    results = run_threads(n_threads, work)
    for i, outs in enumerate(results):
        want = alphas[i][0] * xs[i]
        for out in outs:
            np.testing.assert_array_equal(out, want)
    keys = [k for k in reg._workspaces if k[0] == "host_scale_ws"]
    assert len(keys) == n_threads and all(k[1] == -1 for k in keys)     # one per thread
    assert reg.stats()["host_scale_ws"]["plugin"] == n_threads * calls


def test_check_device_errors_reads_every_workspace(tmp_path):
    reg = ws_plugin(tmp_path)
    x = np.ones(16, np.float32)

    def work(i):
        reg.dispatch("host_scale_ws", {"x": x, "out": np.empty_like(x),
                                       "alpha": np.array([-1.0 if i < 2 else 1.0], np.float32)})

    run_threads(4, work)
    with pytest.raises(DeviceSideError) as e:
        reg.check_device_errors()
    assert str(e.value).count("host_scale_ws: device status word 0x1 (alpha was negative)") == 2
    reg.check_device_errors()                           # read and cleared: quiet now
    reg.release_workspaces()
    assert not reg._workspaces


def test_numpy_fallbacks_from_threads_match_serial(tmp_path):
    reg = FactorRegistry.load(tmp_path, hardware="h200")   # no plugins: Python fallbacks
    rng = np.random.default_rng(1)
    T, H, E, I, K = 9, 32, 8, 16, 2
    cases = []
    for i in range(6):
        logits = rng.standard_normal((T, E)).astype(np.float32)
        x = rng.standard_normal((T, H)).astype(np.float16)
        res = rng.standard_normal((T, H)).astype(np.float16)
        w13 = (rng.standard_normal((E, 2 * I, H)) / 6).astype(np.float16)
        w2 = (rng.standard_normal((E, H, I)) / 4).astype(np.float16)
        cases.append((logits, x, res, w13, w2))

    def one(c):
        logits, x, res, w13, w2 = (a.copy() for a in c)
        w, ids = topk_softmax(logits, K, True, registry=reg)
        out = moe_fused_gemm(x, w13, w2, w, ids, registry=reg)
        fused_add_rmsnorm(x, res, np.ones(H, np.float16), registry=reg)
        return w, ids, out, x, res

    serial = [one(c) for c in cases]
    for _ in range(3):
        parallel = run_threads(len(cases), lambda i: one(cases[i]))
        for s, p in zip(serial, parallel):
            for a, b in zip(s, p):
                np.testing.assert_array_equal(a, b)


def test_host_plugin_from_threads_matches_serial(tmp_path):
    build_plugin(tmp_path)
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    xs = [np.random.default_rng(i).standard_normal(50_000).astype(np.float32) for i in range(6)]

    def work(i):
        out = np.empty_like(xs[i])
        for _ in range(20):
            reg.dispatch("host_scale", {"x": xs[i], "out": out, "alpha": np.array([i + 0.5], np.float32)})
        return out

    for i, out in enumerate(run_threads(6, work)):
        np.testing.assert_array_equal(out, np.float32(i + 0.5) * xs[i])


# ------------------------------------------------------------------------------ T = 0
def test_empty_batch_through_the_registry(tmp_path):
    build_plugin(tmp_path)
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    empty = np.zeros(0, np.float32)
    assert reg.dispatch("host_scale", {"x": empty, "out": empty.copy(), "alpha": np.ones(1, np.float32)}) == "plugin"
    w, ids = topk_softmax(np.zeros((0, 8), np.float32), 2, True, registry=reg)
    assert w.shape == (0, 2) and ids.shape == (0, 2) and reg.last_path["topk_softmax"] == "python_fallback"
    x = np.zeros((0, 16), np.float16)
    out = moe_fused_gemm(x, np.zeros((4, 8, 16), np.float16), np.zeros((4, 16, 4), np.float16),
                         np.zeros((0, 2), np.float32), np.zeros((0, 2), np.int32), registry=reg)
    assert out.shape == (0, 16) and reg.last_path["moe_fused_gemm"] == "python_fallback"
    fused_add_rmsnorm(x, x.copy(), np.ones(16, np.float16), registry=reg)
    reg.check_device_errors()


# ------------------------------------------------------------------------------ 64-bit sizes
def test_dims_beyond_2_31_elements_are_exact_int64(tmp_path):
    """T*K*H and T*H beyond 2^31: the CPU side computes in Python ints and passes int64."""
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    T, H, E, I, K = 1 << 20, 4096, 64, 1536, 8        # T*H = 2^32, T*K*H = 2^35 elements
    arrays = {"hidden_states": FakeDeviceArray((T, H), "<f2"), "out": FakeDeviceArray((T, H), "<f2"),
              "w13": FakeDeviceArray((E, 2 * I, H), "<f2"), "w2": FakeDeviceArray((E, H, I), "<f2"),
              "topk_weights": FakeDeviceArray((T, K), "<f4"), "topk_ids": FakeDeviceArray((T, K), "<i4")}
    from ex_engine.arrays import TensorRef
    m = reg.manifest("moe_fused_gemm")
    _, dims, sizes, _, device = m.bind({k: TensorRef.of(v, k) for k, v in arrays.items()})
    assert dims == [T, H, E, I, K, abi.DTYPE_CODES["float16"], E, -1] and device == 0  # G = E, config auto
    assert sizes["T"] * sizes["K"] * sizes["H"] == 1 << 35
    c = abi.ffi.new("int64_t[]", dims + [sizes["T"] * sizes["K"] * sizes["H"]])
    assert list(c) == dims + [1 << 35]
    # a row-strided view whose row stride times T passes 2^31
    rn = reg.manifest("fused_add_rmsnorm")
    big = FakeDeviceArray((T, H), "<f4")
    big.__cuda_array_interface__["strides"] = (3 * H * 4, 4)
    _, dims, _, _, _ = rn.bind({"x": TensorRef.of(big, "x"), "residual": TensorRef.of(FakeDeviceArray((T, H)), "residual"),
                                "weight": TensorRef.of(FakeDeviceArray((H,)), "weight")})
    assert dims[0] == T and dims[4] == 3 * H and dims[4] * T > 1 << 31


# ------------------------------------------------------------------------------ wrong place
def test_device_arrays_to_a_host_factor_are_refused(tmp_path):
    build_plugin(tmp_path)
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    a = {"x": FakeDeviceArray((4,), ptr=0x7F0000000000), "out": FakeDeviceArray((4,), ptr=0x7F0000001000),
         "alpha": FakeDeviceArray((1,), ptr=0x7F0000002000)}
    with pytest.raises(DeviceError, match="host_scale: argument 'out': device: expected host memory "
                                          r"\(a host factor\), got cuda:0"):
        reg.dispatch("host_scale", a)


def test_host_workspace_is_256_byte_aligned_and_a_bad_size_is_a_named_error(tmp_path):
    """Rule 11 promises a 256-byte aligned workspace (NumPy's buffers were 16/64-aligned: the
    kernel refused with EX_ERR_ALIGNMENT most of the time); a workspace_size below 0 or absurdly
    large is the plugin's bug, reported as EX_ERR_WORKSPACE (not a 256-byte buffer, not NumPy's
    MemoryError) and counted."""
    reg = ws_plugin(tmp_path / "ok")
    x, alpha = np.ones(7, np.float32), np.array([2.0], np.float32)
    for n in range(40):                                   # fresh buffers of many sizes: all aligned
        xs = np.ones(7 + n, np.float32)
        out = np.empty_like(xs)
        reg._workspaces.clear()
        assert reg.dispatch("host_scale_ws", {"x": xs, "out": out, "alpha": alpha}) == "plugin"
        assert (out == 2).all()
    for size in ("-5", "(1LL << 50)"):
        bad = ws_plugin(tmp_path / f"ws{len(size)}", WS_BYTES=size)
        with pytest.raises(KernelError, match=r"^host_scale_ws: workspace_size returned .* bytes for dims "
                                              r"\[7\]: expected 0\.\.1099511627776 \(2\*\*40\); (a bug of the plugin's "
                                              r"workspace_size|more scratch memory than a device holds: dims too "
                                              r"large for this factor \(or a bug of the plugin's workspace_size\)), "
                                              r"so its kernel was not called$"):
            bad.dispatch("host_scale_ws", {"x": x, "out": np.empty_like(x), "alpha": alpha})
        assert bad.stats()["host_scale_ws"]["errors"] == 1


def test_a_null_error_text_and_a_host_decline_are_reported_plainly(tmp_path):
    build_plugin(tmp_path / "a", defines={"BEHAVIOUR": 3, "NULL_ERROR_TEXT": True})
    reg = FactorRegistry.load(tmp_path / "a", hardware="h200")
    x, alpha = np.ones(8, np.float32), np.array([2.0], np.float32)
    with pytest.raises(KernelError, match="EX_ERR_SHAPE"):      # was: RuntimeError from cffi on NULL
        reg.dispatch("host_scale", {"x": x, "out": np.empty_like(x), "alpha": alpha})
    assert reg.stats()["host_scale"]["errors"] == 1
    build_plugin(tmp_path / "b", defines={"BEHAVIOUR": 2}, manifest=False)
    text = (ROOT / "tests" / "plugins" / "host_scale.yaml").read_text(encoding="utf-8")
    (tmp_path / "b" / "host_scale.yaml").write_text(text.replace(
        "fallback: tests.plugins.host_scale_fallback:scale", "fallback: null"), encoding="utf-8")
    reg = FactorRegistry.load(tmp_path / "b", hardware="h200")
    with pytest.raises(FactorError, match=r"its plugin declined the call \(EX_FALLBACK\) and it has no kernel_fallback"):
        reg.dispatch("host_scale", {"x": x, "out": np.empty_like(x), "alpha": alpha})


def test_release_workspaces_releases_them_even_when_a_flag_is_pending(tmp_path):
    """release_workspaces read the status words first and raised DeviceSideError for a pending
    flag before releasing anything: the workspaces were never dropped. They are dropped, then
    the error is raised (once: the flags are read and cleared)."""
    reg = ws_plugin(tmp_path)
    x = np.ones(16, np.float32)
    reg.dispatch("host_scale_ws", {"x": x, "out": np.empty_like(x), "alpha": np.array([-1.0], np.float32)})
    assert reg._workspaces
    with pytest.raises(DeviceSideError, match="host_scale_ws: device status word 0x1 \\(alpha was negative\\)"):
        reg.release_workspaces()
    assert not reg._workspaces
    reg.check_device_errors()          # reported once
    reg.release_workspaces()
