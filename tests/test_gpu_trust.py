"""Trust features on a real GPU: the embedded-code check against the live device, verify
against the Python fallbacks, lock and probe on the built factors, concurrent streams (one
workspace each), a CUDA error raised with its string, empty batches, host overhead.

Marked `gpu`: skipped where CuPy or a GPU is missing (written for an H200 with CuPy 14).
"""
import json
import threading

import numpy as np
import pytest

from ex_engine import DeviceError, FactorRegistry, KernelError, abi, fused_add_rmsnorm, verify
from ex_engine.arrays import Bits16, TensorRef
from ex_engine.cli import main as cli_main
from ex_engine.trust import write_lock
from tests.conftest import ROOT

pytestmark = pytest.mark.gpu

FACTORS = ROOT / "factors"
BUILTIN = ("topk_softmax", "fused_add_rmsnorm", "moe_fused_gemm")


@pytest.fixture(scope="module")
def cp():
    import cupy
    return cupy


@pytest.fixture(scope="module")
def reg():
    r = FactorRegistry.load(FACTORS)
    assert r.hardware.live
    for name in BUILTIN:
        assert r.get(name) is not None, [(p.path.name, p.reason) for p in r.plugins]
    return r


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EX_ENGINE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "verified.json"


# ------------------------------------------------------------------------------ loading
def test_embedded_code_matches_the_live_gpu(reg, capsys):
    hw = reg.hardware
    for name in BUILTIN:
        c = next(c for c in reg.get(name).checks if c.name == "cuda code")
        assert c.ok and c.detail.startswith(f"sm_{hw.cc_major}{hw.cc_minor}: ok via"), c.detail
        if (hw.cc_major, hw.cc_minor) == (9, 0):
            assert "ok via sm_90a (SASS)" in c.detail
    assert cli_main(["list-factors", "--why"]) == 0
    assert "[ok] cuda code: sm_" in capsys.readouterr().out


def test_lock_and_probe_on_the_built_factors(tmp_path):
    lock, digests = write_lock(FACTORS, tmp_path / "factors.lock")
    r = FactorRegistry.load(FACTORS, lock=lock, probe="subprocess")
    for name in BUILTIN:
        p = next(q for q in r.plugins if q.path.stem == name)
        assert p.status in ("ready", "shadowed"), p.reason
        names = [c.name for c in p.checks if c.ok]
        assert "sha256 lock" in names and "probe (child process)" in names
        assert digests[p.path.name] == p.sha256


# ------------------------------------------------------------------------------ verify
def test_every_builtin_factor_matches_its_python_fallback(reg):
    for name in BUILTIN:
        results = verify.verify_plugin(reg, reg.get(name), count=False)
        failed = [r for r in results if r.failed]
        assert not failed, "\n" + verify.format_table(failed)
        assert any(r.status == "pass" for r in results), "\n" + verify.format_table(results)


def test_cli_verify_on_the_gpu(capsys):
    assert cli_main(["verify"]) == 0
    out = capsys.readouterr().out
    assert "no live GPU" not in out and " pass" in out and "0 failed" in out
    stats = json.loads(out.split("stats: ")[1])
    assert sum(stats[n]["plugin"] + stats[n]["kernel_fallback"] for n in BUILTIN) > 0


def test_load_verify_runs_once_then_uses_the_cache(cache):
    r = FactorRegistry.load(FACTORS, verify=True)
    for name in BUILTIN:
        c = r.get(name).checks[-1]
        assert c.name == "verify" and c.ok and "cases passed" in c.detail, c.detail
    data = json.loads(cache.read_text(encoding="utf-8"))
    assert any(key.endswith("|" + r.hardware.name) for key in data)
    r = FactorRegistry.load(FACTORS, verify=True)
    for name in BUILTIN:
        assert r.get(name).checks[-1].detail.startswith("passed before"), r.get(name).checks[-1].detail


# ------------------------------------------------------------------------------ dispatch
def _moe_case(reg, cp, seed, T=64, H=1024, E=32, I=512, K=4):
    m = reg.manifest("moe_fused_gemm")
    arrays, _ = verify.make_inputs(m, {"T": T, "H": H, "E": E, "I": I, "K": K}, "bfloat16", cp, seed)
    return arrays


def _bits(a):
    return (a.bits if isinstance(a, Bits16) else a).get()


def test_concurrent_streams_give_the_serial_results(reg, cp):
    """One thread per CuPy stream, each calling moe_fused_gemm and topk_softmax repeatedly: the
    outputs equal those of serial calls bit for bit (each stream has its own workspace).
    T = 64 and 512 (T*K/E = 8 and 64: the portable path and, on Hopper, the sm90 plugin's)."""
    n_threads, calls = 4, 8
    cases = [_moe_case(reg, cp, seed, T=64 if seed % 2 == 0 else 512) for seed in range(n_threads)]
    logits = [cp.random.standard_normal((64, 128), dtype=cp.float32) for _ in range(n_threads)]

    def run(i):
        a = dict(cases[i])
        a["out"] = Bits16(cp.full_like(a["out"].bits, 0xFFFF))    # poisoned: NaN, -1
        reg.dispatch("moe_fused_gemm", a)
        w = cp.full((logits[i].shape[0], 8), cp.nan, cp.float32)
        ids = cp.full((logits[i].shape[0], 8), -1, cp.int32)
        reg.dispatch("topk_softmax", {"router_logits": logits[i], "topk_weights": w, "topk_ids": ids},
                     {"renormalize": True})
        return a["out"], w, ids

    serial = [run(i) for i in range(n_threads)]
    cp.cuda.Device().synchronize()
    serial = [tuple(_bits(x) for x in outs) for outs in serial]
    # every element written (the outputs were poisoned; cp.empty could hold an earlier answer)
    assert all(not ((o & 0x7FFF) > 0x7F80).any() and not np.isnan(w).any() and (i >= 0).all()
               for o, w, i in serial)
    assert reg.last_path["moe_fused_gemm"] in ("plugin", "kernel_fallback")

    barrier, results, errors = threading.Barrier(n_threads, timeout=120), [None] * n_threads, []

    def body(i):
        try:
            with cp.cuda.Device(reg.hardware.device_id):
                stream = cp.cuda.Stream(non_blocking=True)
                with stream:
                    barrier.wait()
                    outs = [run(i) for _ in range(calls)]
                    stream.synchronize()
                results[i] = [tuple(_bits(x) for x in o) for o in outs]
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(n_threads):
        for outs in results[i]:
            for got, want in zip(outs, serial[i]):
                np.testing.assert_array_equal(got, want)
    if reg.get("moe_fused_gemm").factor.workspace_size != abi.ffi.NULL:
        streams = {k[2] for k in reg._workspaces if k[0] == "moe_fused_gemm" and k[1] >= 0}
        assert len(streams) >= n_threads + 1, streams      # the serial stream and one per thread
    reg.check_device_errors()                              # valid ids: nothing flagged


def test_cuda_error_after_launch_is_raised_with_its_string(reg, cp):
    """A launch on the legacy stream while another (blocking) stream captures a graph fails with
    cudaErrorStreamCaptureImplicit: the kernel returns EX_ERR_CUDA and last_error's string."""
    if cp.cuda.get_current_stream().ptr != 0:
        pytest.skip("the current CuPy stream is not the legacy default stream")
    x = cp.random.standard_normal((8, 256), dtype=cp.float32)
    r = cp.random.standard_normal((8, 256), dtype=cp.float32)
    w = cp.ones(256, cp.float32)
    cp.cuda.Device().synchronize()
    capture = cp.cuda.Stream()                     # blocking: the legacy stream syncs with it
    capture.begin_capture(getattr(cp.cuda.runtime, "streamCaptureModeGlobal", 0))
    try:
        with pytest.raises(KernelError) as e:
            fused_add_rmsnorm(x, r, w, registry=reg)
    finally:
        try:
            capture.end_capture()                  # invalidated by the failed launch
        except Exception:  # noqa: BLE001
            pass
    assert e.value.status_name == "EX_ERR_CUDA" and "EX_ERR_CUDA (6)" in str(e.value)
    assert e.value.detail.startswith("cuda"), e.value.detail      # e.g. cudaErrorStreamCaptureImplicit: ...
    fused_add_rmsnorm(x, r, w, registry=reg)     # the device is fine afterwards
    cp.cuda.Device().synchronize()
    assert reg.last_path["fused_add_rmsnorm"] in ("plugin", "kernel_fallback")


@pytest.mark.parametrize("name,case", [
    ("topk_softmax", {"T": 0, "E": 64, "K": 8, "renormalize": True}),
    ("fused_add_rmsnorm", {"T": 0, "H": 1024}),
    ("moe_fused_gemm", {"T": 0, "H": 256, "E": 8, "I": 128, "K": 2}),
])
def test_empty_batch_is_served_by_the_plugin(reg, cp, name, case):
    m = reg.manifest(name)
    arrays, params = verify.make_inputs(m, case, verify.case_dtypes(m)[-1], cp)
    assert reg.dispatch(name, arrays, params) in ("plugin", "kernel_fallback")
    cp.cuda.Device().synchronize()


def test_arrays_on_another_gpu_are_refused(reg, cp):
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    other = 1 if reg.hardware.device_id == 0 else 0
    with cp.cuda.Device(other):
        logits = cp.zeros((4, 16), cp.float32)
        w, ids = cp.empty((4, 2), cp.float32), cp.empty((4, 2), cp.int32)
    with pytest.raises(DeviceError, match=f"expected cuda:{reg.hardware.device_id} .*got cuda:{other}"):
        reg.dispatch("topk_softmax", {"router_logits": logits, "topk_weights": w, "topk_ids": ids})


def test_host_arrays_on_a_gpu_registry_take_the_python_fallback(reg):
    logits = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    w, ids = np.empty((4, 2), np.float32), np.empty((4, 2), np.int32)
    assert reg.dispatch("topk_softmax", {"router_logits": logits, "topk_weights": w, "topk_ids": ids}) \
        == "python_fallback"


def test_dispatch_host_overhead(reg, cp):
    """Host time per dispatch of a tiny call (kernels queue asynchronously): target < 50 µs."""
    import time
    logits = cp.random.standard_normal((1, 128), dtype=cp.float32)
    w, ids = cp.empty((1, 8), cp.float32), cp.empty((1, 8), cp.int32)
    a, params = {"router_logits": logits, "topk_weights": w, "topk_ids": ids}, {"renormalize": True}
    for _ in range(200):
        reg.dispatch("topk_softmax", a, params)
    cp.cuda.Device().synchronize()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(1000):
            reg.dispatch("topk_softmax", a, params)
        best = min(best, (time.perf_counter() - t0) / 1000 * 1e6)
        cp.cuda.Device().synchronize()
    print(f"host overhead: {best:.1f} us per dispatch")
    assert best < 50, f"{best:.1f} us per dispatch"
    assert TensorRef.of(ids).shape == (1, 8)
