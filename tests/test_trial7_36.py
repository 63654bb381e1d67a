"""Session 36's trials (helpers, no GPU): a numerics adversary found checks that one wrong row of
many passes, a residual compared by a tolerance where it must be exact, in-place writes to torch
inference tensors outside inference mode, and verify.compare's inf and NaN handling. Each has
a test here."""
import math

import numpy as np
import pytest

from ex_engine import FactorRegistry, fused_add_rmsnorm, moe_fused_gemm, topk_softmax
from ex_engine.errors import ArgumentError, ShapeError
from ex_engine.verify import ROW_SLACK, compare, row_error
from tests.conftest import ROOT
from tests.reference import NP_DTYPES, rel_err, rmsnorm_ref, rmsnorm_storage_problems


@pytest.fixture(scope="module")
def reg():
    return FactorRegistry.load(ROOT / "factors")


def _noisy(rng, T, H, rel=2e-3):
    ref = rng.standard_normal((T, H))
    return ref + rel * rng.standard_normal((T, H)), ref


# ------------------------------------------------------------------ one wrong row of many
def test_row_error_sees_one_zeroed_row_that_the_whole_arrays_error_averages_away():
    rng = np.random.default_rng()
    out, ref = _noisy(rng, 20000, 128)
    assert row_error(np, out, ref)[0] < 0.02           # noise: every row like the whole
    out[1234] = 0
    whole = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    err, row = row_error(np, out, ref)
    assert whole < 1e-2 and row == 1234 and err > 0.5, (whole, err, row)
    assert row_error(np, out[:1], ref[:1]) == (0.0, -1)            # one row: nothing to add
    assert row_error(np, np.ones((3, 2)), np.zeros((3, 2)))[0] == math.inf
    assert row_error(np, np.zeros((3, 2)), np.zeros((3, 2))) == (0.0, -1)


def test_verify_compare_fails_one_dropped_slot_among_thousands_of_tokens(reg):
    """A kernel that loses one token's slot at T = 4096, K = 8 moved ||out - ref|| / ||ref|| by
    5e-3, inside bfloat16's 1e-2: verify passed it. The worst row is compared too now."""
    m = reg.manifest("moe_fused_gemm")
    rng = np.random.default_rng()
    T, H, K = 4096, 64, 8
    slots = rng.standard_normal((T, K, H)) / K
    want = slots.sum(1).astype(np.float32)
    ok, err, detail = compare(m, {"out": want.copy()}, {"out": want}, "bfloat16")
    assert ok and err == 0.0, detail
    got = want.copy()
    got[77] -= slots[77, 3].astype(np.float32)         # slot (77, 3) dropped
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2
    ok, err, detail = compare(m, {"out": got}, {"out": want}, "bfloat16")
    assert not ok and "row 77 is off by" in detail and f"over {ROW_SLACK:g} x the tolerance" in detail, detail
    assert err > 1e-2


def test_verify_compare_takes_equal_infinities_and_names_nan_both_ways(reg):
    m = reg.manifest("moe_fused_gemm")
    a = np.array([[1, np.inf], [2, -np.inf]], np.float16)
    assert compare(m, {"out": a}, {"out": a.copy()}, "float16") == (True, 0.0, "")   # was NaN: failed
    got, want = np.array([[1, 2]], np.float16), np.array([[1, np.nan]], np.float16)
    ok, _, detail = compare(m, {"out": got}, {"out": want}, "float16")
    assert not ok and detail == "out: 1 numbers where the fallback has NaN"       # was '0 NaN where ...'
    ok, _, detail = compare(m, {"out": want}, {"out": got}, "float16")
    assert not ok and "1 NaN where the fallback has a number" in detail
    ok, _, detail = compare(m, {"out": -a}, {"out": a}, "float16")
    assert not ok and "2 infinities that differ" in detail


def test_the_tests_relative_error_fails_a_zeroed_row_and_passes_noise():
    """tests/reference.rel_err (every CPU and GPU test's check) is held to what it promises."""
    rng = np.random.default_rng()
    out, ref = _noisy(rng, 20000, 128)
    assert rel_err(out, ref) < 1e-2
    out[-1] = 0
    assert rel_err(out, ref) > 1e-2


def test_run_moe_fails_a_layer_whose_one_token_row_is_zero(tmp_path, monkeypatch):
    from ex_engine import moe_layer
    from tests.test_cli import _models_file
    _models_file(tmp_path, monkeypatch, "models:\n  tiny: {H: 32, I: 16, E: 8, K: 2}\n")
    real = moe_layer.MoELayer.forward

    def one_row_lost(self, x, registry=None):
        out, w, ids, logits = real(self, x, registry)
        out[5] = 0
        return out, w, ids, logits
    lines = []
    ok = moe_layer.run_moe("tiny", 20000, dtype="float16", repeat=1, echo=lines.append)
    assert ok["ok"] and ok["worst_row_err"] < ROW_SLACK * ok["tolerance"] / 4, ok
    monkeypatch.setattr(moe_layer.MoELayer, "forward", one_row_lost)
    res = moe_layer.run_moe("tiny", 20000, dtype="float16", repeat=1, echo=lines.append)
    assert res["rel_err"] < res["tolerance"] and not res["ok"], res
    assert any("token row 5 is off by" in line for line in lines) and lines[-1].strip() == "FAIL", lines


# ------------------------------------------------------------------ fused_add_rmsnorm's stored values
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_rmsnorm_storage_check_catches_what_the_tolerance_passes(dtype):
    """A truncating bf16 conversion of the residual read 3.4e-3 (bf16 tolerance 8e-3); a mean
    over H + 1 read 1.7e-3. rmsnorm_storage_problems (residual bit for bit, x within an ulp)
    fails both and passes the fallback's own results."""
    rng = np.random.default_rng()
    npdt = NP_DTYPES[dtype]
    T, H = 64, 769
    x = rng.standard_normal((T, H)).astype(npdt)
    res = rng.standard_normal((T, H)).astype(npdt)
    wt = (1 + 0.1 * rng.standard_normal(H)).astype(npdt)
    X, R = rmsnorm_ref(x.astype(np.float64), res.astype(np.float64), wt, 1e-6, dtype)
    y, r = x.copy(), res.copy()
    fused_add_rmsnorm(y, r, wt, 1e-6, registry=FactorRegistry(hardware=None))
    assert rmsnorm_storage_problems(y.astype(np.float64), r.astype(np.float64), X, R, dtype) == []
    # truncation toward zero of the fp32 sum (drop the low mantissa bits)
    s32 = (x.astype(np.float32) + res.astype(np.float32))
    keep = 16 if dtype == "bfloat16" else 13
    trunc = (s32.view(np.uint32) >> keep << keep).view(np.float32).astype(npdt).astype(np.float64)
    assert (trunc != R).any()
    assert any("residual" in p for p in rmsnorm_storage_problems(y.astype(np.float64), trunc, X, R, dtype))
    wrong_mean = (X * math.sqrt(H / (H + 1))).astype(npdt).astype(np.float64)
    assert any(p.startswith("x:") for p in rmsnorm_storage_problems(wrong_mean, R, X, R, dtype))


# ------------------------------------------------------------------ torch inference tensors
def test_in_place_writes_to_inference_tensors_outside_inference_mode_are_refused():
    """torch refuses x.add_(1) on an inference tensor outside torch.inference_mode(); the ops
    wrote it silently through their NumPy / device views. Now ArgumentError naming the
    argument, counted as an error; inside inference mode they run as before."""
    torch = pytest.importorskip("torch")
    reg = FactorRegistry(hardware=None)
    with torch.inference_mode():
        x, r, w = torch.randn(3, 8), torch.randn(3, 8), torch.ones(8)
        wts, ids = torch.empty(3, 2), torch.empty(3, 2, dtype=torch.int32)
        out = torch.empty(3, 8, dtype=torch.float16)
        fused_add_rmsnorm(x, r, w, registry=reg)
        topk_softmax(torch.randn(3, 8), 2, topk_weights=wts, topk_ids=ids, registry=reg)
    calls = [
        ("fused_add_rmsnorm", "x", lambda: fused_add_rmsnorm(x, r.clone(), w, registry=reg)),
        ("fused_add_rmsnorm", "residual", lambda: fused_add_rmsnorm(x.clone(), r, w, registry=reg)),
        ("topk_softmax", "topk_weights", lambda: topk_softmax(torch.randn(3, 8), 2, topk_weights=wts, registry=reg)),
        ("topk_softmax", "topk_ids", lambda: topk_softmax(torch.randn(3, 8), 2, topk_ids=ids, registry=reg)),
        ("moe_fused_gemm", "out", lambda: moe_fused_gemm(
            torch.randn(3, 8, dtype=torch.float16), torch.randn(2, 8, 8, dtype=torch.float16),
            torch.randn(2, 8, 4, dtype=torch.float16), torch.ones(3, 1), torch.zeros(3, 1, dtype=torch.int32),
            out=out, registry=reg)),
    ]
    for fn, name, call in calls:
        before = reg.stats().get(fn, {}).get("errors", 0)
        with pytest.raises(ArgumentError, match=f"{fn}: argument '{name}': inference mode: .*"
                                                "got an inference tensor outside inference mode"):
            call()
        assert reg.stats()[fn]["errors"] == before + 1
    with torch.inference_mode():            # inside: as before
        fused_add_rmsnorm(x, r, w, registry=reg)


def test_topk_softmax_names_router_logits_for_zero_experts():
    with pytest.raises(ShapeError, match=r"topk_softmax: argument 'router_logits': shape\[1\] = E: "
                                         r"expected E >= 1 experts, got 0 \(its shape \(3, 0\)\)"):
        topk_softmax(np.zeros((3, 0), np.float32), 1, registry=FactorRegistry(hardware=None))


# ------------------------------------------------------------------ a new user's trial of the CLI
def test_the_command_with_stderr_closed_still_prints_its_table():
    """`ex-engine hardware --profile h200 2>&-` exited 1 with nothing printed: faulthandler.enable()
    raised on sys.stderr None."""
    import os
    import subprocess
    import sys
    from tests.conftest import child_env
    r = subprocess.run([sys.executable, "-m", "ex_engine", "hardware", "--profile", "h200"], env=child_env(),
                       capture_output=True, text=True, timeout=300, preexec_fn=lambda: os.close(2))
    assert r.returncode == 0 and "NVIDIA H200" in r.stdout, (r.returncode, r.stdout)


def test_list_factors_with_stdout_closed_is_an_error_and_a_reader_that_left_is_141(tmp_path):
    """`list-factors >&-` exited 0 with its table lost; `list-factors | head -1` exited 1, the
    status that means 'no plugin is ready'."""
    import os
    import subprocess
    import sys
    from tests.conftest import child_env
    argv = [sys.executable, "-m", "ex_engine", "list-factors", "--dir", str(ROOT / "factors"), "--no-probe"]
    r = subprocess.run(argv, env=child_env(), capture_output=True, text=True, timeout=300,
                       preexec_fn=lambda: os.close(1))
    assert r.returncode == 2 and "cannot write the output: standard output is closed" in r.stderr, r.stderr
    p = subprocess.Popen(argv, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 141 and "Traceback" not in err, err


@pytest.mark.parametrize("exc,status,line", [
    (KeyboardInterrupt(), 130, "tool.py: interrupted"),
    (MemoryError("Unable to allocate 1.2 TiB"), 2, "tool.py: out of memory: Unable to allocate 1.2 TiB"),
    (RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory: you tried to allocate 8e11 bytes"),
     2, "tool.py: out of memory: [enforce fail] DefaultCPUAllocator: can't allocate memory"),
])
def test_scripts_end_with_one_line_on_ctrl_c_and_on_memory_they_cannot_get(exc, status, line, monkeypatch, capsys):
    """The examples printed a KeyboardInterrupt traceback on Ctrl-C and torch's allocator
    traceback for `--tokens 99999999999`; they end through exit_quietly_on_broken_pipe now."""
    import sys
    from ex_engine._scripts import exit_quietly_on_broken_pipe
    monkeypatch.setattr(sys, "argv", ["/somewhere/tool.py"])

    def main():
        raise exc
    with pytest.raises(SystemExit) as ended:
        exit_quietly_on_broken_pipe(main)
    assert ended.value.code == status and capsys.readouterr().err.startswith(line)
    with pytest.raises(RuntimeError, match="another error"):     # not memory: left as it is
        exit_quietly_on_broken_pipe(lambda: (_ for _ in ()).throw(RuntimeError("another error")))
    for script in ("examples/ep_moe.py", "examples/hf_moe_generate.py", "benchmarks/topk_variants/model.py"):
        assert "exit_quietly_on_broken_pipe(main)" in (ROOT / script).read_text(encoding="utf-8"), script


def test_gpu_check_stops_before_any_stage_when_its_log_folder_cannot_be_written(tmp_path):
    """OUT=/proc/x ran every stage (device time) with tee failing on each: the logs lost."""
    import os
    import subprocess
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    for out in ("/proc/ex_engine_gpu_check", str(ro / "sub"), str(ro)):
        if out != "/proc/ex_engine_gpu_check" and os.access(ro, os.W_OK):   # root writes anywhere
            continue
        r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "list"], capture_output=True,
                           text=True, timeout=60, env={**os.environ, "OUT": out})
        assert r.returncode == 2 and f"cannot write the log folder '{out}'" in r.stderr, (out, r.stderr)
        assert "===" not in r.stdout, r.stdout                     # no stage began


def test_small_cli_messages_of_the_new_users_trial(tmp_path, monkeypatch, capsys):
    """--prefer with a misspelt factor said 'none is ready'; lock --dir of nothing said 'is not a
    directory' where the other commands say 'does not exist'; a lock note for an over-size
    regular file said 'a lock lists regular files only'; a missing folder on a search path of
    several was not named when the profiles could not be found."""
    import os
    from ex_engine import cli
    from ex_engine.errors import FactorError
    from ex_engine.hardware import profiles_problem
    reg = FactorRegistry.load(ROOT / "factors", hardware="h200", probe=None,
                              prefer={"nosuch": "topk_softmax.so"})
    assert any("prefer: nosuch -> topk_softmax.so: no factor named 'nosuch' (known: fused_add_rmsnorm, "
               "moe_fused_gemm, topk_softmax)" in n for n in reg.notes), reg.notes
    assert cli.main(["lock", "--dir", str(tmp_path / "nothing")]) == 2
    assert "lock: factor folder '" + str(tmp_path / "nothing") + "': does not exist" in capsys.readouterr().err
    big = tmp_path / "lib"
    big.mkdir()
    with open(big / "huge.so", "wb") as f:            # sparse: no disk used
        f.truncate(3 * 2**30)
    assert cli.main(["lock", "--dir", str(big)]) == 0
    out = capsys.readouterr().out
    assert ("note: huge.so left out: 3.00 GiB, over the limit of 2.00 GiB for a library; a lock lists "
            "libraries up to that size only") in out, out
    mine = tmp_path / "mine"
    mine.mkdir()
    monkeypatch.setenv("EX_ENGINE_MANIFESTS", f"{mine}{os.pathsep}{tmp_path / 'gone'}")
    assert f"of its folders, {tmp_path / 'gone'} does not exist" in profiles_problem()
    with pytest.raises(FactorError):
        FactorRegistry.load(ROOT / "factors", hardware="h200", probe=None)


def test_dram_rows_probe_checks_its_json_path_before_asking_for_a_gpu():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "dram_rows_probe.py"), "--json", "/nonexist/x"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == "dram_rows_probe.py: --json: folder /nonexist does not exist"


# ------------------------------------------------------------------ a review of the session's change
def test_review_items_of_the_row_check_and_the_ulp_rule(reg):
    """An all-zero reference: the absolute rule decides (row_error's inf failed 1e-30); the tests'
    rel_err is inf there (it raised ZeroDivisionError); one element an ulp off in an array of
    fewer than 100 is not '1%'; moe_fused_gemm's test shapes hold one of more than 64 rows,
    where the row check can add something."""
    m = reg.manifest("fused_add_rmsnorm")
    got = np.zeros((4, 3), np.float32)
    got[2, 1] = 1e-30
    ok, _, detail = compare(m, {"x": got, "residual": got.copy()},
                            {"x": np.zeros((4, 3), np.float32), "residual": got.copy()}, "float32")
    assert ok, detail
    assert rel_err(np.zeros((4, 3)), np.zeros((4, 3))) == math.inf
    X = np.linspace(0.5, 1.5, 8).reshape(1, 8)
    R = X.astype(np.float16).astype(np.float64)
    x_out = R.copy()
    x_out[0, 3] = np.nextafter(np.float16(x_out[0, 3]), np.float16(2)).astype(np.float64)
    assert rmsnorm_storage_problems(x_out, R, X, R, "float16") == []
    x_out[0, 5] = np.nextafter(np.float16(x_out[0, 5]), np.float16(2)).astype(np.float64)
    assert rmsnorm_storage_problems(x_out, R, X, R, "float16") != []     # two of 8: too many
    assert max(s["T"] for s in reg.manifest("moe_fused_gemm").test_shapes) > 64


def test_inference_tensors_inside_inference_mode_take_no_refusal_path(monkeypatch):
    """Every call of an engine serving under torch.inference_mode() went through the refusal
    path (2.6 µs against 0.1 before) for tensors that pass: the cheap test now asks the mode."""
    torch = pytest.importorskip("torch")
    from ex_engine import ops
    reg = FactorRegistry(hardware=None)
    monkeypatch.setattr(ops, "_refuse_torch_writes", lambda *a: pytest.fail("refusal path taken"))
    with torch.inference_mode():
        x, r, w = torch.randn(3, 8), torch.randn(3, 8), torch.ones(8)
        fused_add_rmsnorm(x, r, w, registry=reg)
        topk_softmax(torch.randn(3, 8), 2, topk_weights=torch.empty(3, 2), registry=reg)
        assert not ops._torch_write_suspect(x)
    assert ops._torch_write_suspect(x)
