"""ex-engine verify and load(verify=True): plugins against their Python fallbacks (CPU: the
tests' host plugin; device factors are verified in test_gpu_trust.py)."""
import json
import shutil

import numpy as np
import pytest

from ex_engine import FactorError, FactorRegistry
from ex_engine.arrays import Bits16, TensorRef
from ex_engine.cli import main as cli_main
from ex_engine.manifest import load_all
from ex_engine.verify import VERIFY_RULES, case_dtypes, compare, make_inputs, verify_plugin
from tests.conftest import ROOT, build_plugin, child_env
from tests.test_loader import call

MANIFESTS = load_all(ROOT / "manifests")
BUILTIN = ("topk_softmax", "fused_add_rmsnorm", "moe_fused_gemm")
needs_built = pytest.mark.skipif(not all((ROOT / "factors" / f"{n}.so").exists() for n in BUILTIN)
                                 or shutil.which("nvcc") is None, reason="factors/*.so not built")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Every test gets its own verify cache (EX_ENGINE_CACHE)."""
    monkeypatch.setenv("EX_ENGINE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "verified.json"


# ------------------------------------------------------------------------------ inputs
def test_moe_inputs_follow_the_manifest_values():
    m = MANIFESTS["moe_fused_gemm"]
    arrays, params = make_inputs(m, {"T": 50, "H": 64, "E": 12, "I": 32, "K": 6}, "bfloat16", seed=3)
    assert params == {} and arrays["router_logits"] is None                  # optional: left out
    assert isinstance(arrays["hidden_states"], Bits16) and isinstance(arrays["w13"], Bits16)
    assert TensorRef.of(arrays["w13"]).shape == (12, 64, 64) and TensorRef.of(arrays["w2"]).shape == (12, 64, 32)
    ids = arrays["topk_ids"]
    assert ids.dtype == np.int32 and ids.shape == (50, 6) and ids.min() >= 0 and ids.max() < 12
    assert all(len(set(row)) == 6 for row in ids.tolist())                   # distinct per row
    w = arrays["topk_weights"]
    assert w.dtype == np.float32 and (w >= 0.1).all() and (w <= 1.0).all()
    assert abs(float(TensorRef.of(arrays["w13"]).load_f32().std()) - 1 / 8) < 0.02   # 1/sqrt(H)
    assert np.isnan(TensorRef.of(arrays["out"]).load_f32()).all()            # output poisoned
    again, _ = make_inputs(m, {"T": 50, "H": 64, "E": 12, "I": 32, "K": 6}, "bfloat16", seed=3)
    assert (again["topk_ids"] == ids).all()                                  # seeded


def test_inputs_of_every_builtin_manifest_bind_cleanly():
    """What verify draws is a valid call of each manifest, for each dtype and a small shape."""
    small = {"topk_softmax": {"T": 5, "E": 16, "K": 4, "renormalize": True},
             "fused_add_rmsnorm": {"T": 3, "H": 40},
             "moe_fused_gemm": {"T": 4, "H": 32, "E": 8, "I": 16, "K": 2}}
    for name, case in small.items():
        m = MANIFESTS[name]
        for dt in case_dtypes(m):
            arrays, params = make_inputs(m, case, dt)
            refs = {k: TensorRef.of(v, k) for k, v in arrays.items() if v is not None}
            m.bind(refs, params)
        needed = {sym for t in m.user_tensors for _, sym in t.parsed if sym}
        needed -= {d for d, src in m.dim_sources.items() if "default_dim" in src}  # optional
        for shape in m.test_shapes:                 # every declared test shape names every size
            assert needed <= set(shape), (name, shape)


def test_in_place_output_gets_data_not_poison():
    m = MANIFESTS["fused_add_rmsnorm"]
    arrays, _ = make_inputs(m, {"T": 2, "H": 8}, "float32")
    assert not np.isnan(arrays["x"]).any() and not np.isnan(arrays["residual"]).any()


def test_compare_rules():
    m = MANIFESTS["topk_softmax"]
    w = np.random.default_rng(0).random((3, 2)).astype(np.float32)
    ids = np.array([[0, 1], [2, 3], [4, 5]], np.int32)
    ok, err, _ = compare(m, {"topk_weights": w, "topk_ids": ids}, {"topk_weights": w.copy(), "topk_ids": ids.copy()}, "float32")
    assert ok and err == 0
    ok, _, detail = compare(m, {"topk_weights": w, "topk_ids": ids[:, ::-1].copy()},
                            {"topk_weights": w, "topk_ids": ids}, "float32")
    assert not ok and "topk_ids: 6 of 6 values differ (must be equal)" in detail
    bad = w.copy()
    bad[0, 0] = np.nan
    ok, _, detail = compare(m, {"topk_weights": bad, "topk_ids": ids}, {"topk_weights": w, "topk_ids": ids}, "float32")
    assert not ok and "1 NaN where the fallback has a number" in detail
    ok, _, detail = compare(m, {"topk_weights": w * 1.01, "topk_ids": ids}, {"topk_weights": w, "topk_ids": ids}, "float32")
    assert not ok and "relative error 1.00e-02 > tolerance 1e-05 (float32)" in detail


# ------------------------------------------------------------------------------ CLI
def test_cli_verify_host_plugin_passes_and_prints_stats(tmp_path, capsys):
    build_plugin(tmp_path)
    assert cli_main(["verify", "--dir", str(tmp_path), "--hardware", "h200"]) == 0
    out = capsys.readouterr().out
    assert "no live GPU: device factors cannot be run here" in out
    assert "host_scale  float32  N=7   plugin" in out and "pass" in out
    assert "verify: 1 passed, 0 failed" in out
    stats = json.loads(out.split("stats: ")[1])
    assert stats["host_scale"]["plugin"] == 1


@pytest.mark.parametrize("behaviour,needle", [
    (4, "out: relative error"),                               # wrong result
    (3, "KernelError: host_scale: kernel returned EX_ERR_SHAPE (3): N must be even"),
])
def test_cli_verify_fails_a_wrong_plugin(tmp_path, capsys, behaviour, needle):
    build_plugin(tmp_path, defines={"BEHAVIOUR": behaviour})
    assert cli_main(["verify", "--dir", str(tmp_path), "--hardware", "h200"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and needle in out and "verify: 0 passed, 1 failed" in out


def test_cli_verify_declined_is_not_a_failure(tmp_path, capsys):
    build_plugin(tmp_path, defines={"BEHAVIOUR": 2})
    assert cli_main(["verify", "--dir", str(tmp_path), "--hardware", "h200"]) == 0
    assert "declined" in capsys.readouterr().out


@needs_built
def test_cli_verify_without_gpu_skips_device_factors(capsys):
    code = cli_main(["verify", "--dir", str(ROOT / "factors"), "--hardware", "h200"])
    out = capsys.readouterr().out
    assert code == 0 and out.count("skipped  a device factor and no live GPU") >= 3, out
    # --strict: a verification that ran none of them does not pass
    assert cli_main(["verify", "--dir", str(ROOT / "factors"), "--hardware", "h200", "--strict"]) == 3
    assert "verify --strict: 3 factor(s) skipped" in capsys.readouterr().err


def test_cli_verify_strict_passes_when_everything_ran(tmp_path, capsys):
    build_plugin(tmp_path)                           # a host factor: runs without a GPU
    assert cli_main(["verify", "--dir", str(tmp_path), "--hardware", "h200", "--strict"]) == 0


# ------------------------------------------------------------------------------ load(verify=True)
def test_load_verify_rejects_a_wrong_plugin_and_keeps_the_rest(tmp_path):
    build_plugin(tmp_path, "wrong", defines={"BEHAVIOUR": 4, "NAME": '"host_scale_w"', "FACTOR_ID": 1106})
    build_plugin(tmp_path)
    reg = FactorRegistry.load(tmp_path, hardware="h200", verify=True)
    wrong = next(p for p in reg.plugins if p.path.stem == "wrong")
    assert wrong.status == "rejected"
    assert wrong.reason.startswith("verify: 1 of 1 cases failed against the Python fallback: N=7 float32: "
                                   "out: relative error"), wrong.reason
    assert reg.get("host_scale") is not None and call(reg)[0] == "plugin"
    assert reg.stats()["host_scale"]["plugin"] == 1          # verification calls are not counted


def test_load_verify_remembers_a_pass(tmp_path, cache):
    build_plugin(tmp_path / "lib")
    reg = FactorRegistry.load(tmp_path / "lib", hardware="h200", verify=True)
    check = reg.get("host_scale").checks[-1]
    assert check.name == "verify" and check.ok and check.detail.startswith("1 cases passed")
    data = json.loads(cache.read_text(encoding="utf-8"))
    key = f"{reg.get('host_scale').sha256}|host"
    assert data[key]["factor"] == "host_scale" and data[key]["cases"] == 1
    reg = FactorRegistry.load(tmp_path / "lib", hardware="h200", verify=True)
    assert reg.get("host_scale").checks[-1].detail.startswith("passed before (1 cases on host")
    # another build of the library is verified again (in a folder of its own: a build over the
    # first one's path is refused in this process, which holds the first copy by that path, and
    # its bytes, never run, are not recorded as passed)
    build_plugin(tmp_path / "lib2", defines={"VERSION": '"1.0.1"'})
    reg = FactorRegistry.load(tmp_path / "lib2", hardware="h200", verify=True)
    assert reg.get("host_scale").checks[-1].detail.startswith("1 cases passed")
    build_plugin(tmp_path / "lib", defines={"VERSION": '"1.0.2"'})
    reg = FactorRegistry.load(tmp_path / "lib", hardware="h200", verify=True)
    (p,) = reg.plugins
    assert p.status == "rejected" and p.reason.startswith("loaded copy: "), p.reason
    assert f"{p.sha256}|host" not in json.loads(cache.read_text(encoding="utf-8"))


def test_load_verify_says_when_the_pass_could_not_be_cached(tmp_path, monkeypatch):
    """An unwritable cache (a file where its folder should be) said 'cached in
    <file>/verified.json' although the write had failed."""
    build_plugin(tmp_path / "lib")
    (tmp_path / "afile").write_text("not a folder")
    monkeypatch.setenv("EX_ENGINE_CACHE", str(tmp_path / "afile"))
    for _ in range(2):   # nothing was remembered: verified again
        check = FactorRegistry.load(tmp_path / "lib", hardware="h200", verify=True).get("host_scale").checks[-1]
        assert check.name == "verify" and check.ok
        assert check.detail == (f"1 cases passed against the Python fallback (not cached: {tmp_path / 'afile'} "
                                "is not a folder; it is verified again at the next load)"), check.detail
    assert (tmp_path / "afile").read_text(encoding="utf-8") == "not a folder"


def test_a_failure_is_not_cached(tmp_path, cache):
    build_plugin(tmp_path, defines={"BEHAVIOUR": 4})
    for _ in range(2):
        reg = FactorRegistry.load(tmp_path, hardware="h200", verify=True)
        assert reg.plugins[0].status == "rejected" and "relative error" in reg.plugins[0].reason
    assert not cache.exists()


@needs_built
def test_load_verify_keeps_device_factors_without_gpu(tmp_path):
    reg = FactorRegistry.load(ROOT / "factors", hardware="h200", verify=True)
    for name in BUILTIN:
        c = reg.get(name).checks[-1]
        assert c.name == "verify" and c.ok and c.detail.startswith("skipped: a device factor and no live GPU")


def test_verify_plugin_reports_skips(tmp_path):
    build_plugin(tmp_path)
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    p = reg.get("host_scale")
    p.manifest.test_shapes = []
    res = verify_plugin(reg, p)
    assert [r.status for r in res] == ["skipped"] and "no test_shapes" in res[0].detail


def test_cli_verify_reports_a_fallback_of_the_wrong_signature_as_a_failure(tmp_path, capsys):
    build_plugin(tmp_path)
    y = tmp_path / "host_scale.yaml"
    y.write_text(y.read_text(encoding="utf-8").replace("host_scale_fallback:scale", "host_scale_fallback:wrong_signature"), encoding="utf-8")
    # refused at load now (its signature is read there), so verify has nothing to run; it
    # failed every case before, and every call that fell back raised a raw TypeError
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    p = reg.plugins[0]
    assert p.status == "rejected" and p.reason.startswith("python fallback: manifest "), p.reason
    assert ("fallback: 'tests.plugins.host_scale_fallback:wrong_signature': expected a callable "
            "fn(arrays, sizes, params), got one with signature (arrays)") in p.reason, p.reason
    assert cli_main(["verify", "--dir", str(tmp_path), "--hardware", "h200"]) == 1
    assert "no ready plugins" in capsys.readouterr().err


@pytest.mark.parametrize("oob", [1, 64])
def test_cli_verify_fails_a_kernel_that_writes_past_its_output(tmp_path, capsys, oob):
    """Every written array sits between guard bytes: one float too many passed before (and
    corrupted the heap of the process)."""
    build_plugin(tmp_path, defines={"OOB": oob})
    assert cli_main(["verify", "--dir", str(tmp_path), "--hardware", "h200"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and f"out: the kernel wrote {4 * oob} byte(s) past its end" in out, out


# ------------------------------------------------------------------------------ child process
def test_cli_verify_survives_a_kernel_that_crashes_and_checks_the_others(tmp_path, capsys):
    """Each plugin's checks run in a child process: a kernel that writes far out of bounds
    (SIGSEGV) is a FAIL row and the command goes on (it ended the process before)."""
    build_plugin(tmp_path, "crash", defines={"CRASH_IN_KERNEL": 8, "NAME": '"host_scale_c"',
                                             "FACTOR_ID": 1107})
    build_plugin(tmp_path)
    assert cli_main(["verify", "--dir", str(tmp_path), "--hardware", "h200"]) == 1
    out = capsys.readouterr().out
    assert "host_scale_c  float32  N=7   -" in out, out
    assert "FAIL  crashed: SIGSEGV (in this case; verify's child process)" in out, out
    assert "verify: 1 passed, 1 failed" in out
    stats = json.loads(out.split("stats: ")[1])
    assert stats["host_scale"]["plugin"] == 1        # the child's calls are counted here


def test_verify_in_a_child_times_out_a_kernel_that_hangs(tmp_path):
    build_plugin(tmp_path, defines={"HANG_IN_KERNEL": True})
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    res = verify_plugin(reg, reg.get("host_scale"), isolate=True, timeout=8)
    assert [(r.case, r.status, r.detail) for r in res] == [
        ("N=7", "FAIL", "timed out after 8 s (in this case; verify's child process)")]


def test_load_verify_with_probe_rejects_a_crashing_kernel_and_keeps_the_rest(tmp_path, cache):
    build_plugin(tmp_path, "crash", defines={"CRASH_IN_KERNEL": 8, "NAME": '"host_scale_c"',
                                             "FACTOR_ID": 1107})
    build_plugin(tmp_path)
    reg = FactorRegistry.load(tmp_path, hardware="h200", verify=True, probe="subprocess")
    crash = next(p for p in reg.plugins if p.path.stem == "crash")
    assert crash.status == "rejected" and "N=7 float32: crashed: SIGSEGV (in this case" in crash.reason
    assert reg.get("host_scale") is not None and call(reg)[0] == "plugin"
    assert reg.get("host_scale").checks[-1].detail.startswith("1 cases passed")


def test_cli_verify_in_process_still_runs_here(tmp_path, capsys):
    build_plugin(tmp_path)
    assert cli_main(["verify", "--dir", str(tmp_path), "--hardware", "h200", "--in-process"]) == 0
    assert "verify: 1 passed, 0 failed" in capsys.readouterr().out


def test_verify_in_a_child_reports_a_kernel_that_ends_the_process(tmp_path):
    build_plugin(tmp_path, defines={"EXIT_IN_KERNEL": 0})
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    res = verify_plugin(reg, reg.get("host_scale"), isolate=True)
    assert [r.status for r in res] == ["FAIL"]
    assert res[0].case == "N=7" and res[0].detail.startswith("ended with status 0: "), res[0].detail


def test_verify_in_a_child_refuses_a_library_changed_after_loading(tmp_path):
    """The child opens the file again: one replaced after the parent checked it (its lock) is
    not verified in its place."""
    build_plugin(tmp_path)
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    build_plugin(tmp_path, defines={"VERSION": '"1.0.1"'})
    res = verify_plugin(reg, reg.get("host_scale"), isolate=True)
    assert [r.status for r in res] == ["FAIL"] and "library file changed after it was loaded" in res[0].detail


def test_verify_in_a_child_keeps_the_cases_before_a_crash_and_names_the_one_it_hit(tmp_path, capsys):
    build_plugin(tmp_path, defines={"CRASH_IN_KERNEL": 8, "CRASH_IF_N": 9})
    y = tmp_path / "host_scale.yaml"
    y.write_text(y.read_text(encoding="utf-8").replace("  - {N: 7}", "  - {N: 7}\n  - {N: 8}\n  - {N: 9}\n  - {N: 10}"), encoding="utf-8")
    assert cli_main(["verify", "--dir", str(tmp_path), "--hardware", "h200"]) == 1
    out = capsys.readouterr().out
    assert "N=7   plugin" in out and "N=8   plugin" in out and "verify: 2 passed, 1 failed" in out, out
    assert ("N=9   -          -         -      FAIL  crashed: SIGSEGV (in this case; verify's child "
            "process; 1 later case(s) not run)") in out, out


def test_verify_in_a_child_is_not_held_by_a_process_the_kernel_forked(tmp_path):
    """The child's output goes to a file: a forked process that keeps running no longer holds
    the parent until the timeout (a pipe it inherited kept it waiting), and is killed."""
    build_plugin(tmp_path, defines={"FORK_IN_KERNEL": True})
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    import time
    t0 = time.monotonic()
    res = verify_plugin(reg, reg.get("host_scale"), isolate=True, timeout=60)
    assert [r.status for r in res] == ["pass"] and time.monotonic() - t0 < 30


def test_verify_in_a_child_after_a_chdir_and_with_relative_folders(tmp_path, monkeypatch):
    build_plugin(tmp_path / "plugs")
    (tmp_path / "mans").mkdir()
    monkeypatch.chdir(tmp_path)
    reg = FactorRegistry.load("plugs", hardware="h200", manifests_dir="mans")
    monkeypatch.chdir("/")
    res = verify_plugin(reg, reg.get("host_scale"), isolate=True)
    assert [r.status for r in res] == ["pass"], res


def test_cli_verify_timeout_flag(tmp_path, capsys):
    build_plugin(tmp_path, defines={"HANG_IN_KERNEL": True})
    assert cli_main(["verify", "--dir", str(tmp_path), "--hardware", "h200", "--timeout", "8"]) == 1
    assert "FAIL  timed out after 8 s (in this case; verify's child process)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli_main(["verify", "--dir", str(tmp_path), "--timeout", "0"])
    assert "expected a number of seconds > 0, got '0'" in capsys.readouterr().err
    with pytest.raises(FactorError, match="verify_timeout: expected a number of seconds > 0, got -1"):
        FactorRegistry.load(tmp_path, hardware="h200", verify_timeout=-1)


def test_a_fallback_that_calls_sys_exit_fails_its_case_in_process(tmp_path, capsys):
    """A fallback calling sys.exit(4) ended `verify --in-process` with status 4 and no table."""
    build_plugin(tmp_path)
    (tmp_path / "exit_fallback.py").write_text("import sys\ndef scale(arrays, sizes, params):\n    sys.exit(4)\n")
    y = tmp_path / "host_scale.yaml"
    y.write_text(y.read_text(encoding="utf-8").replace("tests.plugins.host_scale_fallback:scale", "exit_fallback:scale"), encoding="utf-8")
    import sys
    sys.path.insert(0, str(tmp_path))
    try:
        assert cli_main(["verify", "--dir", str(tmp_path), "--hardware", "h200", "--in-process"]) == 1
    finally:
        sys.path.remove(str(tmp_path))
    out = capsys.readouterr().out
    assert "FAIL  the Python fallback raised SystemExit: 4" in out, out


def test_what_a_kernel_prints_is_not_taken_for_the_child_report(tmp_path):
    build_plugin(tmp_path, defines={"PRINT_IN_KERNEL": True, "BEHAVIOUR": 4})   # wrong result
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    res = verify_plugin(reg, reg.get("host_scale"), isolate=True)
    assert [(r.case, r.status) for r in res] == [("N=7", "FAIL")], res


def test_verify_in_a_child_reads_stderr_that_is_not_utf8_and_names_it_on_a_crash(tmp_path):
    """A kernel writing a non-UTF-8 line to stderr crashed verify (UnicodeDecodeError) and was
    rejected at load though its results were right; on a crash its last stderr line is shown."""
    build_plugin(tmp_path / "ok", defines={"STDERR_IN_KERNEL": True})
    reg = FactorRegistry.load(tmp_path / "ok", hardware="h200")
    assert [r.status for r in verify_plugin(reg, reg.get("host_scale"), isolate=True)] == ["pass"]
    build_plugin(tmp_path / "crash", defines={"STDERR_IN_KERNEL": True, "CRASH_IN_KERNEL": 8})
    reg = FactorRegistry.load(tmp_path / "crash", hardware="h200")
    res = verify_plugin(reg, reg.get("host_scale"), isolate=True)
    assert res[0].detail.startswith("crashed: SIGSEGV; last stderr line: warnung: Gr\ufffd\ufffde (in this case"), res


def test_a_crash_keeps_the_calls_before_it_in_the_stats_and_the_load_reason_counts_every_case(tmp_path, capsys,
                                                                                                 cache):
    build_plugin(tmp_path, defines={"CRASH_IN_KERNEL": 8, "CRASH_IF_N": 9})
    y = tmp_path / "host_scale.yaml"
    y.write_text(y.read_text(encoding="utf-8").replace("  - {N: 7}", "  - {N: 7}\n  - {N: 8}\n  - {N: 9}\n  - {N: 10}"), encoding="utf-8")
    assert cli_main(["verify", "--dir", str(tmp_path), "--hardware", "h200"]) == 1
    stats = json.loads(capsys.readouterr().out.split("stats: ")[1])
    assert stats["host_scale"]["plugin"] == 2                  # N=7 and N=8 ran before the crash
    reg = FactorRegistry.load(tmp_path, hardware="h200", verify=True, probe="subprocess")
    assert "1 of 4 cases failed" in reg.plugins[0].reason, reg.plugins[0].reason


def test_a_cached_pass_is_not_reused_under_other_rules_or_another_fallback(tmp_path, cache, monkeypatch):
    """The cache key was the library and the manifest: a pass under older checks (before the
    guard zones) or against a fallback since fixed was reused."""
    build_plugin(tmp_path)
    reg = FactorRegistry.load(tmp_path, hardware="h200", verify=True)
    key = f"{reg.get('host_scale').sha256}|host"
    data = json.loads(cache.read_text(encoding="utf-8"))
    assert data[key]["rules"] == VERIFY_RULES and len(data[key]["fallback_sha256"]) == 64
    data[key]["rules"] = VERIFY_RULES - 1
    cache.write_text(json.dumps(data), encoding="utf-8")
    reg = FactorRegistry.load(tmp_path, hardware="h200", verify=True)
    assert reg.get("host_scale").checks[-1].detail.startswith("1 cases passed"), "re-verified"
    data = json.loads(cache.read_text(encoding="utf-8"))
    data[key]["fallback_sha256"] = "0" * 64
    cache.write_text(json.dumps(data), encoding="utf-8")
    reg = FactorRegistry.load(tmp_path, hardware="h200", verify=True)
    assert reg.get("host_scale").checks[-1].detail.startswith("1 cases passed"), "re-verified"
    reg = FactorRegistry.load(tmp_path, hardware="h200", verify=True)
    assert reg.get("host_scale").checks[-1].detail.startswith("passed before")


def test_sigterm_to_verify_leaves_no_process_behind(tmp_path):
    """SIGTERM (timeout(1), kill) ended the command but left a process the kernel forked
    spinning and the report file in the temporary folder."""
    import os
    import signal
    import subprocess
    import sys
    import time
    build_plugin(tmp_path, defines={"FORK_IN_KERNEL": True, "HANG_IN_KERNEL": True})
    env = child_env()
    proc = subprocess.Popen([sys.executable, "-m", "ex_engine", "verify", "--dir", str(tmp_path), "--hardware",
                             "h200"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(4)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    time.sleep(0.5)
    left = subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True).stdout
    assert str(tmp_path) not in left, left


def test_cli_verify_timeout_is_for_child_processes_only(tmp_path, capsys):
    build_plugin(tmp_path)
    assert cli_main(["verify", "--dir", str(tmp_path), "--hardware", "h200", "--in-process", "--timeout", "5"]) == 2
    assert "--timeout: applies to the child processes; not with --in-process" in capsys.readouterr().err


def test_a_fallback_in_main_is_verified_here_not_in_the_child(tmp_path):
    """A manifest fallback '__main__:fn' (a script's own function) cannot be imported by the
    child: the plugin was rejected 'not ready in the child process'; it runs in this process."""
    import __main__
    build_plugin(tmp_path)
    y = tmp_path / "host_scale.yaml"
    y.write_text(y.read_text(encoding="utf-8").replace("tests.plugins.host_scale_fallback:scale", "__main__:ex_engine_test_scale"), encoding="utf-8")
    from tests.plugins.host_scale_fallback import scale
    __main__.ex_engine_test_scale = scale
    try:
        reg = FactorRegistry.load(tmp_path, hardware="h200")
        assert [r.status for r in verify_plugin(reg, reg.get("host_scale"), isolate=True)] == ["pass"]
    finally:
        del __main__.ex_engine_test_scale


def test_sigterm_during_an_in_process_fallback_ends_verify(tmp_path):
    """The SIGTERM handler raised SystemExit, which verify turns into the running case's FAIL
    (a fallback's sys.exit): the command went on and exited 1."""
    import os
    import signal
    import subprocess
    import sys
    import time
    build_plugin(tmp_path)
    (tmp_path / "slow_fallback.py").write_text(
        "import time\nfrom tests.plugins.host_scale_fallback import scale as _s\n"
        "def scale(arrays, sizes, params):\n    time.sleep(20)\n    return _s(arrays, sizes, params)\n")
    y = tmp_path / "host_scale.yaml"
    y.write_text(y.read_text(encoding="utf-8").replace("tests.plugins.host_scale_fallback:scale", "slow_fallback:scale"), encoding="utf-8")
    env = child_env(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "ex_engine", "verify", "--dir", str(tmp_path), "--hardware",
                             "h200", "--in-process"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    time.sleep(4)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM and "terminated (SIGTERM)" in err, (out, err)


def test_the_child_finds_a_fallback_imported_before_a_chdir(tmp_path, monkeypatch):
    """sys.path held '' (the folder the fallback was imported from): after a chdir the child
    could not import it and a correct plugin was rejected."""
    import sys
    build_plugin(tmp_path / "plugs")
    (tmp_path / "mod").mkdir()
    (tmp_path / "mod" / "myfb.py").write_text("from tests.plugins.host_scale_fallback import scale\n")
    y = tmp_path / "plugs" / "host_scale.yaml"
    y.write_text(y.read_text(encoding="utf-8").replace("tests.plugins.host_scale_fallback:scale", "myfb:scale"), encoding="utf-8")
    monkeypatch.chdir(tmp_path / "mod")
    monkeypatch.setattr(sys, "path", ["", *sys.path])
    reg = FactorRegistry.load(tmp_path / "plugs", hardware="h200")
    reg.manifest("host_scale").fallback_fn()            # imported from '' = tmp_path/mod
    monkeypatch.chdir("/")
    try:
        res = verify_plugin(reg, reg.get("host_scale"), isolate=True)
    finally:
        sys.modules.pop("myfb", None)
    assert [r.status for r in res] == ["pass"], res


def test_the_child_refuses_a_manifest_changed_after_loading(tmp_path):
    build_plugin(tmp_path)
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    y = tmp_path / "host_scale.yaml"
    y.write_text(y.read_text(encoding="utf-8").replace("  - {N: 7}", "  - {N: 7}\n  - {N: 8}"), encoding="utf-8")
    res = verify_plugin(reg, reg.get("host_scale"), isolate=True)
    assert [r.status for r in res] == ["FAIL"] and "host_scale.yaml changed after it was loaded" in res[0].detail


def test_in_process_really_runs_here(tmp_path, capsys, monkeypatch):
    import ex_engine.verify as v
    monkeypatch.setattr(v, "_verify_in_child", lambda *a, **k: pytest.fail("a child was started"))
    build_plugin(tmp_path)
    assert cli_main(["verify", "--dir", str(tmp_path), "--hardware", "h200", "--in-process"]) == 0


def test_a_non_path_sys_path_entry_does_not_break_the_child(tmp_path, monkeypatch):
    import sys
    from pathlib import Path as P
    build_plugin(tmp_path)
    monkeypatch.setattr(sys, "path", [*sys.path, P(tmp_path), 42])
    reg = FactorRegistry.load(tmp_path, hardware="h200", probe="subprocess")
    assert [r.status for r in verify_plugin(reg, reg.get("host_scale"), isolate=True)] == ["pass"]


def test_a_kernel_that_floods_stderr_is_capped_at_the_file_limit(tmp_path, monkeypatch):
    """The child's stderr goes to a temporary file: a kernel printing without end filled the
    temporary folder until the timeout. Files the child writes are capped (writes past the
    limit fail; Python ignores SIGXFSZ), and its results still count."""
    import tempfile
    import threading
    import ex_engine.verify as v
    monkeypatch.setattr(v, "CHILD_FILE_LIMIT", 1 << 20, raising=False)
    tmp = tmp_path / "t"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    build_plugin(tmp_path / "p", defines={"STDERR_FLOOD": 64, "HANG_IN_KERNEL": True})   # 4 MB, then hang
    reg = FactorRegistry.load(tmp_path / "p", hardware="h200")
    biggest, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            for f in tmp.iterdir():
                try:
                    biggest[0] = max(biggest[0], f.stat().st_size)
                except OSError:
                    pass
            stop.wait(0.05)
    t = threading.Thread(target=watch)
    t.start()
    try:
        res = verify_plugin(reg, reg.get("host_scale"), isolate=True, timeout=6)
    finally:
        stop.set()
        t.join()
    assert res[0].detail.startswith("timed out after 6 s (in this case"), res
    assert (1 << 19) < biggest[0] <= 1 << 20, biggest[0]     # it wrote, up to the limit


def test_the_fallback_digest_covers_the_helpers_of_its_package(tmp_path, monkeypatch):
    """A pass was keyed on the fallback's own file only: a fixed helper module of its package
    (ex_engine.arrays for ex_engine.fallbacks, say) reused the old pass."""
    import sys
    from ex_engine.verify import _fallback_digest
    pkg = tmp_path / "fbpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "helper.py").write_text("K = 1\n")
    (pkg / "fb.py").write_text("from .helper import K\n\ndef scale(arrays, sizes, params):\n"
                               "    arrays['out'].raw()[...] = K * arrays['alpha'].raw()[0] * arrays['x'].raw()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    build_plugin(tmp_path / "lib")
    y = tmp_path / "lib" / "host_scale.yaml"
    y.write_text(y.read_text(encoding="utf-8").replace("tests.plugins.host_scale_fallback:scale", "fbpkg.fb:scale"), encoding="utf-8")
    reg = FactorRegistry.load(tmp_path / "lib", hardware="h200")
    m = reg.get("host_scale").manifest
    before = _fallback_digest(reg, m)
    assert len(before) == 64 and before == _fallback_digest(reg, m)
    (pkg / "helper.py").write_text("K = 2\n")
    assert _fallback_digest(reg, m) != before
    (pkg / ".#fb.py").symlink_to("user@host.1:2")   # an editor's lock link, dangling
    (pkg / "a.py").symlink_to(pkg / "b.py")
    (pkg / "b.py").symlink_to(pkg / "a.py")          # a loop
    (pkg / "dir.py").mkdir()
    odd = _fallback_digest(reg, m)
    assert len(odd) == 64 and odd == _fallback_digest(reg, m)
    (pkg / "fb.py").write_text((pkg / "fb.py").read_text(encoding="utf-8") + "# changed\n", encoding="utf-8")
    assert _fallback_digest(reg, m) not in ("", odd)
    for mod in [k for k in sys.modules if k == "fbpkg" or k.startswith("fbpkg.")]:
        del sys.modules[mod]           # imported by this test: gone with its folder


def processes_left(tmp_path) -> list:
    """Processes whose command line names ``tmp_path`` (ps -ww: whole command lines; verify's
    child's is longer than ps's default width), killed before returning so that a failing test
    leaves none behind (a chain may still be forking: up to 20 rounds)."""
    import contextlib
    import os
    import subprocess
    import time

    def running():
        out = subprocess.run(["ps", "-eww", "-o", "pid=,args="], capture_output=True, text=True).stdout
        return [ln[:200] for ln in out.splitlines() if str(tmp_path) in ln]
    left = running()
    found = left
    for _ in range(20):
        if not found:
            break
        for ln in found:
            with contextlib.suppress(OSError):
                os.kill(int(ln.split()[0]), 9)
        time.sleep(0.1)
        found = running()
    return left


def test_cli_verify_kills_what_a_kernel_started_in_a_new_session(tmp_path):
    """A process that left the child's session (setsid), and one it started, kept running after
    `ex-engine verify` (the session kill misses them); the command adopts orphans while it
    runs and kills them with the child. A chain of 120 processes under one setsid goes too."""
    import os
    import subprocess
    import sys
    import time
    build_plugin(tmp_path / "one", defines={"SETSID_IN_KERNEL": True})
    build_plugin(tmp_path / "chain", defines={"SETSID_IN_KERNEL": True, "SETSID_CHAIN": 120})
    env = child_env()
    for d in ("one", "chain"):
        r = subprocess.run([sys.executable, "-m", "ex_engine", "verify", "--dir", str(tmp_path / d), "--hardware",
                            "h200"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "1 passed" in r.stdout, (r.stdout, r.stderr)
    time.sleep(0.3)
    left = processes_left(tmp_path)
    assert not left, left


def test_verify_called_from_a_program_leaves_its_children_and_setting_alone(tmp_path, capsys):
    """cli.main([...]) from a program does not adopt orphans: a child of that program started
    before the call, and the subreaper setting, are as they were."""
    import ctypes
    import subprocess
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        build_plugin(tmp_path)
        assert cli_main(["verify", "--dir", str(tmp_path), "--hardware", "h200"]) == 0
        assert sleeper.poll() is None
        state = ctypes.c_int(-1)
        assert ctypes.CDLL(None).prctl(37, ctypes.byref(state), 0, 0, 0) == 0 and state.value == 0
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_pass_is_not_reused_when_the_fallback_cannot_be_read(tmp_path, cache, monkeypatch):
    """An unknown fallback digest ('') matched a cached '' and reused the pass."""
    from ex_engine import verify
    build_plugin(tmp_path)
    monkeypatch.setattr(verify, "_fallback_digest", lambda registry, m: "")
    reg = FactorRegistry.load(tmp_path, hardware="h200", verify=True)
    assert reg.get("host_scale").checks[-1].detail.startswith("1 cases passed")
    reg = FactorRegistry.load(tmp_path, hardware="h200", verify=True)
    assert reg.get("host_scale").checks[-1].detail.startswith("1 cases passed"), "run again"


def test_two_sigterms_in_a_row_still_leave_nothing_behind(tmp_path):
    """A second SIGTERM a millisecond after the first cut the cleanup short: the signal reaches
    another thread of the process (NumPy's), so blocking it in the main thread did not hold
    Python's handler; processes that left the child's session kept running."""
    import os
    import signal
    import subprocess
    import sys
    import time
    build_plugin(tmp_path, defines={"SETSID_IN_KERNEL": True, "SETSID_CHAIN": 20, "HANG_IN_KERNEL": True})
    env = child_env()
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, "-m", "ex_engine", "verify", "--dir", str(tmp_path), "--hardware",
                                 "h200"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(3)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.001)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
        time.sleep(0.3)
        left = processes_left(tmp_path)
        assert not left and rc == 128 + signal.SIGTERM, (rc, left)


def test_a_sigterm_during_the_childs_start_or_twice_in_the_cleanup_leaves_nothing(tmp_path, monkeypatch):
    """Two windows where SIGTERM ended verify without its cleanup (a CI run left a child once):
    a signal handled right after Popen returned, before verify named the process (simulated
    here: the signal is sent from inside Popen); and a second SIGTERM raised again on the way
    into the cleanup. The first waits until the child is named, the second is ignored once the
    command is ending."""
    import os
    import signal
    import subprocess
    from ex_engine import cli
    from ex_engine import verify as verify_mod
    build_plugin(tmp_path, defines={"HANG_IN_KERNEL": True})
    import types

    class TermAfterStart(subprocess.Popen):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            os.kill(os.getpid(), signal.SIGTERM)   # handled at the next bytecode boundary

    only_verify = types.ModuleType("subprocess")      # verify's subprocess, not everyone's
    only_verify.__dict__.update(subprocess.__dict__)
    only_verify.Popen = TermAfterStart
    monkeypatch.setattr(verify_mod, "subprocess", only_verify)
    assert cli.main(["verify", "--dir", str(tmp_path), "--hardware", "h200"]) == 128 + signal.SIGTERM
    assert not processes_left(tmp_path)
    old = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with pytest.raises(cli.Terminated):
            cli._exit_on_sigterm(signal.SIGTERM, None)
        assert signal.getsignal(signal.SIGTERM) is cli._ignore_signal   # a second one waits
    finally:
        signal.signal(signal.SIGTERM, old)


# ------------------------------------------------------------------------------ audit: arguments
def test_make_inputs_refuses_a_case_that_is_not_sizes():
    from ex_engine.errors import ArgumentError
    m = MANIFESTS["moe_fused_gemm"]
    with pytest.raises(ArgumentError, match=r"make_inputs: argument 'case': type: expected a mapping.*list \[1\]"):
        make_inputs(m, [1], "float16")
    with pytest.raises(ArgumentError, match=r"make_inputs: argument 'case\['T'\]': a size: expected an int >= 0, got -1"):
        make_inputs(m, {"T": -1, "H": 8, "E": 2, "I": 4, "K": 1}, "float16")
    with pytest.raises(ArgumentError, match=r"argument 'case\['H'\]'.*got 8.5"):
        make_inputs(m, {"T": 1, "H": 8.5, "E": 2, "I": 4, "K": 1}, "float16")
    arrays, params = make_inputs(MANIFESTS["topk_softmax"], {"T": 0, "E": 4, "K": 2, "renormalize": True},
                                 "float32")
    assert params == {"renormalize": True} and arrays["router_logits"].shape == (0, 4)


def test_verify_plugin_and_run_case_name_a_wrong_plugin_argument():
    from ex_engine.errors import ArgumentError
    from ex_engine.registry import Plugin
    from ex_engine.verify import run_case
    reg = FactorRegistry.load(ROOT / "factors", hardware="h200")
    for fn in (lambda: verify_plugin(reg, "moe_fused_gemm"),
               lambda: run_case(reg, "moe_fused_gemm", {"T": 1}, "float16")):
        with pytest.raises(ArgumentError, match=r"argument 'plugin': type: expected a loaded Plugin.*str 'moe_fused_gemm'"):
            fn()
    # a device factor with no live GPU: a clear error, not ModuleNotFoundError: cupy
    p = Plugin(ROOT / "factors" / "fused_add_rmsnorm.so", "ready", name="fused_add_rmsnorm",
               manifest=MANIFESTS["fused_add_rmsnorm"])
    with pytest.raises(FactorError, match=r"run_case: plugin 'fused_add_rmsnorm': a device factor .*needs a live GPU; the registry has profile h200"):
        run_case(reg, p, {"T": 1, "H": 8}, "float16")
    assert verify_plugin(reg, p)[0].status == "skipped"
