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


@pytest.fixture(scope="module")
def hf_parts():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from ex_engine.integrations import transformers as hf
    from tests import test_integrations as ti
    return hf, ti


def test_patched_experts_do_not_wrap_int64_ids_onto_valid_experts(reg, hf_parts):
    """int64 ids past 2^31 were narrowed by .to(int32): 2^32 + 1 became expert 1, silently.
    They are clamped to -1..E first: out of range stays out of range, flagged."""
    import torch
    from ex_engine.errors import DeviceSideError
    hf, ti = hf_parts
    m = ti.tiny_model("qwen3_moe")
    mlp = m.model.layers[0].mlp
    x = torch.randn(2, ti.H).bfloat16()
    w = torch.ones(2, 1)
    good = torch.tensor([[1], [2]])
    with torch.no_grad(), hf.patch_moe(m, registry=reg):
        reg.check_device_errors()
        a = mlp.experts(x, good, w)
        reg.check_device_errors()                  # valid ids: nothing flagged
        b = mlp.experts(x, good + 2 ** 32, w)
        assert not torch.equal(a, b)
        with pytest.raises(DeviceSideError, match="invalid_topk_ids in 2 slot"):
            reg.check_device_errors()
        mlp.experts(x, good - 2 ** 32, w)         # negative past -2^31: flagged too
        with pytest.raises(DeviceSideError, match="invalid_topk_ids in 2 slot"):
            reg.check_device_errors()


def test_a_model_cast_after_patching_is_named_with_the_remedy(reg, hf_parts):
    """model.float() after patch_moe raised moe_fused_gemm's DTypeError for 'hidden_states', an
    argument the caller never passed. Now the block, the cast and the remedy are named."""
    import torch
    hf, ti = hf_parts
    m = ti.tiny_model("olmoe")
    with hf.patch_moe(m, registry=reg):
        m.float()
        with pytest.raises(hf.UnsupportedModelError, match=r"model\.layers\.0\.mlp: its experts' weights are "
                                                           r"float32 now .* undo\(\) the patch before casting"):
            ti.logits_of(m, ti.prompt())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("H", [111, 4096])
def test_fused_add_rmsnorm_rows_past_the_fp32_sum_of_squares(dtype, H):
    """A row of finite values whose fp32 sum of squares overflows (|r| ~ 1e20) came out as zeros
    (exact answer: r / rms(r) * w, O(1)); it is normalised on r / max|r| now. Rows in range keep
    their values; a row holding an inf keeps IEEE's result (NaN at the inf, zeros elsewhere).
    (The Python fallback here; test_gpu.py runs the kernels on the same rows.)"""
    from ex_engine import fused_add_rmsnorm
    from tests.reference import NP_DTYPES, rmsnorm_ref, rmsnorm_storage_problems
    reg = FactorRegistry(hardware=None)       # no plugins: the Python fallback
    rng = np.random.default_rng()
    npdt = NP_DTYPES[dtype]
    scale = np.array([1e20, 1.0, 3e37, 1e-3])[:, None]
    x = (rng.standard_normal((4, H)) * scale).astype(npdt)
    res = (rng.standard_normal((4, H)) * scale).astype(npdt)
    wt = (1 + 0.1 * rng.standard_normal(H)).astype(npdt)
    X, R = rmsnorm_ref(x.astype(np.float64), res.astype(np.float64), wt, 1e-6, dtype)
    y, r = x.copy(), res.copy()
    fused_add_rmsnorm(y, r, wt, 1e-6, registry=reg)
    tol = reg.manifest("fused_add_rmsnorm").tolerance[dtype]
    for t in range(4):
        got = y[t].astype(np.float64)
        assert np.isfinite(got).all() and np.linalg.norm(got - X[t]) / np.linalg.norm(X[t]) < tol, t
    assert np.linalg.norm(X[0]) > 1.0        # O(1) per element: zeros would fail above
    assert rmsnorm_storage_problems(y.astype(np.float64), r.astype(np.float64), X, R, dtype) == []
    x[2, 5] = np.inf
    fused_add_rmsnorm(x, res, wt, 1e-6, registry=reg)
    assert np.isnan(x[2, 5]) and (x[2, np.arange(H) != 5] == 0).all()


def test_a_nan_router_logit_makes_its_tokens_weights_and_output_nan(reg):
    """A NaN logit ranked as -inf with p = 0: a corrupted router became a finite routing and a
    finite layer output, silently (the stock torch model gives NaN). Now the row's K weights
    are NaN (its ids stay valid experts), so the token's MoE output is NaN; other rows keep
    their values."""
    from ex_engine import topk_softmax
    rng = np.random.default_rng()
    T, E, K, H, I = 4, 8, 2, 16, 8
    logits = rng.standard_normal((T, E)).astype(np.float32)
    logits[1, 3] = np.nan
    logits[2, :] = np.nan
    for renorm in (False, True):
        w, ids = topk_softmax(logits, K, renorm, registry=reg)
        assert np.isnan(w[1]).all() and np.isnan(w[2]).all() and np.isfinite(w[[0, 3]]).all()
        assert ((ids >= 0) & (ids < E)).all() and ids[2].tolist() == [0, 1]
    x = rng.standard_normal((T, H)).astype(np.float16)
    w13 = (rng.standard_normal((E, 2 * I, H)) * 0.3).astype(np.float16)
    w2 = (rng.standard_normal((E, H, I)) * 0.3).astype(np.float16)
    out = moe_fused_gemm(x, w13, w2, w, ids, registry=reg)
    assert np.isnan(out[1]).all() and np.isnan(out[2]).all() and np.isfinite(out[[0, 3]]).all()
    reg.check_device_errors()                  # valid ids: nothing flagged


def test_a_plugin_writing_its_const_dims_is_an_error_and_the_dims_are_restored(tmp_path):
    """The dims array is cached for the calls that follow (both dispatch paths): a kernel that
    wrote dims[0] = 3 made the next identical call compute 3 of 8 elements, silently (a larger
    value would have written past the output). Now the call raises KernelError, the array is
    restored, and a well-behaved call on the same signature is still right."""
    from ex_engine.errors import KernelError
    from tests.conftest import build_plugin
    build_plugin(tmp_path / "bad", defines={"DIMS_WRITE": 3})
    build_plugin(tmp_path / "good")
    bad = FactorRegistry.load(tmp_path / "bad")
    x = np.arange(8, dtype=np.float32)
    args = lambda: {"x": x, "out": np.full(8, np.nan, np.float32), "alpha": np.array([2.0], np.float32)}
    for _ in range(3):     # the first call (full path), then the short path's cached dims
        with pytest.raises(KernelError, match=r"returned EX_OK \(0\): but its kernel wrote to the const dims "
                                              "array it was passed"):
            bad.dispatch("host_scale", args())
    assert bad.stats()["host_scale"]["errors"] == 3
    # a kernel that writes dims[0] = 12 and declines: its kernel_fallback must not run on 12 (it
    # wrote 4 floats past an 8-float out, a view into a wider buffer)
    build_plugin(tmp_path / "declines", defines={"DIMS_WRITE": 12, "BEHAVIOUR": 1})
    dec = FactorRegistry.load(tmp_path / "declines")
    buf = np.full(16, -1.0, np.float32)
    with pytest.raises(KernelError, match=r"returned EX_FALLBACK \(-1\): but its kernel wrote"):
        dec.dispatch("host_scale", {"x": np.arange(16, dtype=np.float32)[:8], "out": buf[:8],
                                    "alpha": np.array([2.0], np.float32)})
    assert (buf[8:] == -1.0).all()
    good = FactorRegistry.load(tmp_path / "good")
    for _ in range(3):
        a = args()
        assert good.dispatch("host_scale", a) == "plugin"
        np.testing.assert_array_equal(a["out"], 2 * x)


@pytest.mark.parametrize("sig, code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_build_interrupted_stops_make_and_its_compilers(tmp_path, sig, code):
    """`ex-engine build` killed by pid (SIGTERM, or SIGINT to the command alone) left make's
    children (nvcc, cicc) running, reparented to init, writing factors/*.so: subprocess.call
    SIGKILLed make alone on an interrupt and ignored SIGTERM. make now runs in a group of its
    own that gets the signal; the command waits for it and exits 143 / 130. (A fake make that
    starts a long child stands in for the compilers.)"""
    import os
    import signal
    import subprocess
    import sys
    import time
    fake = tmp_path / "make"
    pidfile = tmp_path / "child.pid"
    # (in the foreground, as make runs nvcc: a non-interactive shell's `cmd &` ignores SIGINT)
    fake.write_text(f"#!/bin/bash\nbash -c 'echo $$ > {pidfile}; exec sleep 300'\n", encoding="utf-8")
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}")
    # SIGINT at its default in the command: a suite started with SIGINT ignored (a background
    # job of a script, nohup) passed SIG_IGN on, Python then installs no KeyboardInterrupt
    # handler and the command rightly ignored the interrupt: a 30 s timeout, not a bug
    proc = subprocess.Popen([sys.executable, "-m", "ex_engine.cli", "build"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for _ in range(200):
            if pidfile.exists() and pidfile.read_text(encoding="utf-8").strip():
                break
            time.sleep(0.05)
        child = int(pidfile.read_text(encoding="utf-8"))
        proc.send_signal(getattr(signal, sig))
        out, err = proc.communicate(timeout=30)
    finally:   # a failure here left the command and `sleep 300` running past the test
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            if pidfile.exists() and pidfile.read_text(encoding="utf-8").strip():
                try:   # make's process group (a session of its own), the stand-in included
                    os.killpg(os.getpgid(int(pidfile.read_text(encoding="utf-8"))), signal.SIGKILL)
                except ProcessLookupError:
                    pass
    assert proc.returncode == code, (out, err)
    for _ in range(100):      # the compiler stand-in is gone (reaped by init once orphaned)
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail(f"make's child {child} outlived the interrupted build")


def test_run_moe_refuses_a_t_that_does_not_fit_before_building_anything(monkeypatch):
    """`ex-engine run moe --tokens 2000000` on the CPU grew past the host's memory while it
    built the weights, and the kernel's OOM killer ended it without a word. The arrays T adds
    are estimated first and compared with what is available: a MemoryError naming both (the
    CLI prints it in one line, exit 2), before any weight is drawn."""
    from ex_engine import moe_layer
    built = []
    monkeypatch.setattr(moe_layer, "MoELayer", lambda *a, **k: built.append(a))
    monkeypatch.setattr(moe_layer, "available_bytes", lambda xp: 8 << 30)
    with pytest.raises(MemoryError, match=r"about .* GB needed at T=2000000 \(weights and arrays\), 8\.6 GB "
                                          r"available on this host"):
        moe_layer.run_moe("qwen3-30b-a3b", 2_000_000, registry=FactorRegistry(hardware=None))
    assert not built
    shape = moe_layer.load_models()["qwen3-30b-a3b"]
    small, big = moe_layer.token_bytes(shape, 64), moe_layer.token_bytes(shape, 2_000_000)
    assert small < 50e6 and big > 100e9     # T's arrays, weights apart (1.2 GB)


def test_benchmark_json_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """The benchmarks rewrote their JSON with Path.write_text after every row, and tune_moe its
    tuning table: an interrupt mid-write left a truncated file (a tuning table then set aside as
    malformed, and not merged into by the next run). _timing.write_json (and tune_moe) write a
    temporary file and rename it: the previous whole file stays if the write fails."""
    import importlib
    import json
    import sys
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        timing = importlib.import_module("_timing")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    out = tmp_path / "b.json"
    timing.write_json(out, {"rows": [1]})
    assert json.loads(out.read_text(encoding="utf-8")) == {"rows": [1]}
    import ex_engine.trust as trust

    def cut(*a, **k):          # the write is cut short where the new text would replace the old
        raise OSError("interrupted")
    monkeypatch.setattr(trust.os, "replace", cut)
    with pytest.raises(OSError, match="b.json"):
        timing.write_json(out, {"rows": [1, 2]})
    assert json.loads(out.read_text(encoding="utf-8")) == {"rows": [1]} and [p.name for p in tmp_path.iterdir()] == ["b.json"]
    src = (ROOT / "benchmarks" / "tune_moe.py").read_text(encoding="utf-8")
    assert "replace_file(out, header" in src and "out.write_text(" not in src
