"""scripts/gpu_sanitize.py on the CPU: its arguments, and how it reads a tool's output.

The tool itself needs compute-sanitizer and a GPU (scripts/gpu_check.sh's sanitize stage); here
its verdicts are checked on outputs shaped as compute-sanitizer and pytest write them, so that a
run with sanitizer errors, failing tests, no tests, a pool left on or a stop at the timeout can
never read as clean.
"""
import runpy
import subprocess
import sys

import pytest

from tests.conftest import ROOT

SCRIPT = ROOT / "scripts" / "gpu_sanitize.py"
san = runpy.run_path(str(SCRIPT), run_name="gpu_sanitize")
judge, parse_timeouts, ERROR_STATUS = san["judge"], san["parse_timeouts"], san["ERROR_STATUS"]

POOL = "ex_engine tests: CuPy memory pool off (EX_TEST_NO_MEMORY_POOL=1)\n"
CLEAN = POOL + "........ [100%]\n8 passed in 12.0s\n========= ERROR SUMMARY: 0 errors\n"


def test_a_clean_run_reads_clean():
    tests, summary, verdict = judge(0, CLEAN, 100)
    assert verdict == "clean" and tests == "8 passed, 0 failed, 0 skipped", tests
    assert summary == "ERROR SUMMARY: 0 errors"


@pytest.mark.parametrize("rc, text, says", [
    (ERROR_STATUS, CLEAN.replace("0 errors", "3 errors"), "sanitizer errors"),
    (0, CLEAN.replace("0 errors", "2 errors"), "sanitizer errors"),        # status lost, summary says
    (ERROR_STATUS, CLEAN, "sanitizer errors"),                             # summary lost, status says
    (1, POOL + "..F [100%]\n1 failed, 2 passed in 3s\n========= ERROR SUMMARY: 0 errors\n", "tests failed (status 1)"),
    (5, POOL + "\n12 deselected in 1s\n========= ERROR SUMMARY: 0 errors\n", "tests failed (status 5)"),
    (0, POOL + "sss [100%]\n3 skipped in 1s\n========= ERROR SUMMARY: 0 errors\n", "no test ran"),
    (0, CLEAN.replace(POOL, ""), "CuPy's pool was not off"),
    (0, CLEAN.replace("========= ERROR SUMMARY: 0 errors\n", ""), "no sanitizer summary"),
    (None, POOL + ".... [ 40%]\n..F. [ 80%]\n", "stopped after 100 s"),
    (0, CLEAN.replace("8 passed", "6 passed, 2 skipped"), "2 tests skipped (not checked)"),
    (0, "========= Internal Sanitizer Error: x\n" + CLEAN, "the sanitizer did not check: Internal Sanitizer Error"),
    (0, "========= Device not supported\n" + CLEAN, "the sanitizer did not check: Device not supported"),
    # words a test printed are not pytest's summary line
    (0, POOL + "log: 3 passed\n\n========= ERROR SUMMARY: 0 errors\n", "no test ran"),
])
def test_every_other_run_is_not_clean(rc, text, says):
    tests, _, verdict = judge(rc, text, 100)
    assert verdict == says, (verdict, tests)


def test_a_stopped_run_counts_the_progress_lines():
    tests, summary, _ = judge(None, POOL + ".... [ 40%]\n..Fs [ 80%]\n", 100)
    assert tests == "6 passed, 1 failed, 1 skipped so far"
    assert summary == "no summary line"


def test_racecheck_summary_is_read():
    text = POOL + ". [100%]\n1 passed in 1s\n========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n"
    assert judge(0, text, 10)[1:] == ("RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)", "clean")
    bad = text.replace("0 hazards displayed (0 errors", "4 hazards displayed (4 errors")
    assert judge(0, bad, 10)[2] == "sanitizer errors"
    # warnings (hazards racecheck deems possibly benign) fail too: the kernels checked are ours
    warned = text.replace("(0 errors, 0 warnings)", "(0 errors, 2 warnings)")
    assert judge(0, warned, 10)[2].startswith("2 racecheck warnings")


def test_a_stopped_run_counts_marks_before_a_report_on_their_line():
    """racecheck's reports follow a test's '.' on its line ('.========= Warning: ...'), as on the
    H100 on 2026-12-07, where such a run was read as one test."""
    text = POOL + "========= Warning: x\n.========= Warning: y\n.========= Warning: z\n..\n"
    assert judge(None, text, 80)[0] == "4 passed, 0 failed, 0 skipped so far"


@pytest.mark.parametrize("text, want", [
    ("90", {"memcheck": 90, "racecheck": 90, "synccheck": 90, "initcheck": 90}),
    ("memcheck=300,racecheck=20", {"memcheck": 300, "racecheck": 20, "synccheck": 540, "initcheck": 540}),
    ("0", None), ("memcheck=0", None), ("foo=3", None), ("memcheck=x", None), ("", None)])
def test_timeouts(text, want):
    assert parse_timeouts(text) == want


def test_the_planted_faults_name_every_tool():
    assert set(san["PLANTED"]) == set(san["TOOLS"]) == set(san["TESTS"])
    # each planted kernel is in the source the --plant run compiles
    for kernel in ("oob", "race", "badsync", "uninit"):
        assert f"__global__ void {kernel}(" in san["KERNELS"]
    assert san["PLANTS"] == ["oob", "plugin", "race", "badsync", "uninit"]
    # the racecheck words need a hazard counted: its summary with 0 hazards is no report
    words = dict((n, w) for plants in san["PLANTED"].values() for n, _, w in plants)
    import re
    assert not re.search(words["race"], "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)")
    assert re.search(words["race"], "RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)")


def test_a_missing_library_is_named(tmp_path):
    """Without the built factors the tests would skip (and the tool say so): it stops first."""
    import shutil
    (tmp_path / "scripts").mkdir()
    (tmp_path / "ex_engine").mkdir()
    (tmp_path / "factors").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts" / "gpu_sanitize.py")
    shutil.copy(ROOT / "ex_engine" / "_scripts.py", tmp_path / "ex_engine" / "_scripts.py")
    fake = tmp_path / "compute-sanitizer"
    fake.write_text("#!/bin/sh\nexit 0\n", encoding="utf-8")
    fake.chmod(0o755)
    r = subprocess.run([sys.executable, str(tmp_path / "scripts" / "gpu_sanitize.py"), "--sanitizer", str(fake)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "missing moe_fused_gemm.so, moe_fused_gemm_sm90.so" in r.stderr, r.stderr


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_help_and_list():
    r = run("--help")
    assert r.returncode == 0 and "compute-sanitizer" in r.stdout and "Exit status" in r.stdout
    r = run("--list", "--tools", "memcheck,initcheck", "--timeout", "memcheck=300")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("memcheck (300 s): pytest -m gpu tests/test_gpu_configs.py") and len(lines) == 2
    assert lines[1].startswith("initcheck (540 s): ")
    r = run("--list", "--tools", "memcheck", "--wide", "-k", "bfloat16")
    assert "test_moe_plugin_awkward" in r.stdout and r.stdout.rstrip().endswith("and (bfloat16)'"), r.stdout


@pytest.mark.parametrize("args, says", [
    (["--tools", "memcheck,foo"], "--tools: expected some of memcheck,racecheck,synccheck,initcheck"),
    (["--tools", ""], "--tools: expected some of"),
    (["--timeout", "-5"], "--timeout: expected seconds >= 1"),
    (["--sanitizer", "/nonexistent/compute-sanitizer"], "--sanitizer: expected a compute-sanitizer executable, "
                                                        "got /nonexistent/compute-sanitizer"),
])
def test_bad_arguments_are_named(args, says):
    r = run(*args)
    assert r.returncode == 2 and says in r.stderr, (r.returncode, r.stderr)


def test_the_selection_collects_the_forced_configurations():
    """Each tool's selection takes the forced cases of test_gpu_configs.py it says: the small set
    20 configurations x 5 kinds, racecheck's 20 x 1, memcheck's wide one all 20 x 10 besides
    test_gpu.py's (pytest's collection, on any machine: the GPU marks skip only at run time)."""
    def collected(tool, wide=False):
        args = san["selection"](tool, wide=wide)
        r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                            "-m", "gpu", *args], capture_output=True, text=True, cwd=ROOT, timeout=120)
        return [ln for ln in r.stdout.splitlines() if "::" in ln]
    wide, small, race = collected("memcheck", True), collected("memcheck"), collected("racecheck")
    forced = lambda ids: [i for i in ids if "test_moe_every_config_on_awkward_shapes" in i]
    assert len(forced(wide)) == 200 and len(forced(small)) == 100 and len(forced(race)) == 20
    assert len(small) == 136 and collected("initcheck") == small == collected("synccheck")
    assert any("test_moe_plugin_awkward" in i for i in wide) and not any("test_moe_plugin_awkward" in i for i in small)
    assert any("test_topk_softmax_plugin" in i for i in race)


STUB_CUPY = '''
calls = []
class _Cuda:
    @staticmethod
    def set_allocator(a):
        calls.append(("allocator", a))
    @staticmethod
    def set_pinned_memory_allocator(a):
        calls.append(("pinned", a))
cuda = _Cuda()
'''

PROBE = '''
import cupy
from ex_engine.registry import FactorRegistry
from tests import conftest

made = {}

def test_pool_off_and_registry_noted():
    assert cupy.calls == [("allocator", None), ("pinned", None)]
    r = FactorRegistry(hardware="h200")
    assert r in conftest._registries
    made["n"] = 0
    def released():
        made["n"] += 1
    r.release_workspaces = released
    made["r"] = r

def test_workspaces_released_after_the_test_before():
    assert made["n"] == 1
'''


@pytest.mark.parametrize("on", [True, False])
def test_conftest_turns_the_pool_off_under_the_sanitizer(tmp_path, on):
    """EX_TEST_NO_MEMORY_POOL=1 (what gpu_sanitize.py sets): tests/conftest.py turns CuPy's pool
    off, says so on stdout, notes every registry made and releases its workspaces after each
    test. A copy of tests/ (conftest.py and a probe test) runs in a child pytest with a stub
    cupy; unset, nothing of that happens. (The variable is an EX_* one, which conftest drops with
    the plugins' variables: it must be read before that, as it once was not.)"""
    import os
    import shutil
    (tmp_path / "stub" / "cupy").mkdir(parents=True)
    (tmp_path / "stub" / "cupy" / "__init__.py").write_text(STUB_CUPY, encoding="utf-8")
    tests = tmp_path / "tests"
    tests.mkdir()
    shutil.copy(ROOT / "tests" / "conftest.py", tests / "conftest.py")
    (tests / "__init__.py").write_text("", encoding="utf-8")
    (tests / "test_probe.py").write_text(PROBE, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "EX_TEST_NO_MEMORY_POOL"}
    if on:
        env["EX_TEST_NO_MEMORY_POOL"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "stub"), str(tmp_path), str(ROOT),
                                         env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests)],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    if on:
        assert r.returncode == 0 and "2 passed" in r.stdout, r.stdout + r.stderr
        assert "CuPy memory pool off (EX_TEST_NO_MEMORY_POOL=1)" in r.stdout
    else:
        assert "CuPy memory pool off" not in r.stdout, r.stdout
        assert "FAILED tests/test_probe.py::test_pool_off_and_registry_noted" in r.stdout, r.stdout + r.stderr


def test_the_plugin_plant_finds_what_it_uses_in_the_self_test():
    """--plant plugin calls moe_fused_gemm.so through scripts/gpu_moe_selftest.py's ctypes mirror
    (Factor, Dt, make_inputs); a rename there would show only on a GPU, as a planted fault not
    seen. Loaded as the plant loads it (the self-test runs without CuPy up to its GPU calls)."""
    import inspect
    st = runpy.run_path(str(ROOT / "scripts" / "gpu_moe_selftest.py"))
    assert list(inspect.signature(st["make_inputs"]).parameters) == ["dt", "T", "H", "E", "I", "K", "special"]
    assert list(inspect.signature(st["Factor"].call).parameters)[:6] == ["self", "out_ptr", "x_ptr", "aux", "dims",
                                                                         "stream_ptr"]
    assert callable(st["Factor"].workspace_size) and st["Dt"]("bf16").code == st["EX_DTYPE_BFLOAT16"]
    src = SCRIPT.read_text(encoding="utf-8")
    assert 'st["Factor"](str(ROOT / "factors" / "moe_fused_gemm.so"))' in src and 'st["make_inputs"](' in src
