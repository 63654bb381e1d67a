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
    class runtime:
        @staticmethod
        def memGetInfo():
            return 3 << 20, 80 << 20
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
    env = {k: v for k, v in os.environ.items() if k not in ("EX_TEST_NO_MEMORY_POOL", "EX_TEST_MEMORY_LOG")}
    memory_log = tmp_path / "memory.txt"
    env["EX_TEST_MEMORY_LOG"] = str(memory_log)
    if on:
        env["EX_TEST_NO_MEMORY_POOL"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "stub"), str(tmp_path), str(ROOT),
                                         env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests)],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    if on:
        assert r.returncode == 0 and "2 passed" in r.stdout, r.stdout + r.stderr
        assert "CuPy memory pool off (EX_TEST_NO_MEMORY_POOL=1)" in r.stdout
        # each test's line: its id and the free memory after it (EX_TEST_MEMORY_LOG)
        assert memory_log.read_text(encoding="utf-8").splitlines() == [
            f"tests/test_probe.py::{t} free 3 of 80 MiB"
            for t in ("test_pool_off_and_registry_noted", "test_workspaces_released_after_the_test_before")]
    else:
        assert "CuPy memory pool off" not in r.stdout, r.stdout
        assert not memory_log.exists()
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


# --- the judge's edges, the options, and one tool's run end to end with a fake compute-sanitizer ---

@pytest.mark.parametrize("rc, text, says", [
    # one error is "1 error" (singular), the status lost: still errors
    (0, CLEAN.replace("0 errors", "1 error"), "sanitizer errors"),
    # racecheck's singular summary ("1 hazard displayed (1 error, ...)") is read, not taken for none
    (0, CLEAN.replace("========= ERROR SUMMARY: 0 errors",
                      "========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)"), "sanitizer errors"),
    (0, CLEAN.replace("========= ERROR SUMMARY: 0 errors",
                      "========= RACECHECK SUMMARY: 1 hazard displayed (0 errors, 1 warning)"),
     "1 racecheck warnings (hazards it deems possibly benign: read the log)"),
    (0, "========= Error: racecheck is not supported on this device\n" + CLEAN,
     "the sanitizer did not check: not supported on this device"),
    (0, "========= Warning: not supported on this platform\n" + CLEAN,
     "the sanitizer did not check: not supported on this platform"),
])
def test_singular_reports_and_unsupported_words_are_not_clean(rc, text, says):
    assert judge(rc, text, 100)[2] == says


def test_pytest_errors_are_counted_and_named():
    text = POOL + ".EFE [100%]\n1 failed, 1 passed, 2 errors in 3.0s\n========= ERROR SUMMARY: 0 errors\n"
    tests, _, verdict = judge(1, text, 100)
    assert tests == "1 passed, 1 failed, 0 skipped, 2 errors" and verdict == "tests failed (status 1)"
    text = POOL + ".E [100%]\n1 passed, 1 error in 3.0s\n========= ERROR SUMMARY: 0 errors\n"
    assert judge(1, text, 100)[0] == "1 passed, 0 failed, 0 skipped, 1 errors"


def test_a_stopped_run_counts_errors_as_failed():
    assert judge(None, POOL + ".E.F [ 50%]\n", 100)[0] == "2 passed, 2 failed, 0 skipped so far"


def test_a_long_run_summary_with_its_clock_is_read():
    text = POOL + "136 passed in 412.34s (0:06:52)\n========= ERROR SUMMARY: 0 errors\n"
    assert judge(0, text, 540) == ("136 passed, 0 failed, 0 skipped", "ERROR SUMMARY: 0 errors", "clean")


def test_timeouts_with_spaces_around_the_pairs():
    assert parse_timeouts("memcheck=300, racecheck = 20") == {"memcheck": 300, "racecheck": 20, "synccheck": 540,
                                                              "initcheck": 540}


HELP_NEW = ("  --padding arg   ...\n  --check-bulk-copy arg\n  --check-warpgroup-mma arg\n"
            "  --racecheck-memcpy-async arg\n  --kernel-name-exclude arg\n")
HELP_OLD = "  --padding arg   ...\n  --kernel-name arg\n"


def test_extra_options_are_those_the_sanitizer_lists():
    """An option this compute-sanitizer does not know would stop every run (the planted faults
    unseen); one it knows and is not given checks less."""
    extra, EXCLUDE = san["extra_options"], san["EXCLUDE"]
    assert extra(HELP_NEW, "memcheck") == ["--padding", "65536", "--check-bulk-copy", "yes",
                                           "--check-warpgroup-mma", "yes", *EXCLUDE]
    assert extra(HELP_NEW, "racecheck") == ["--racecheck-memcpy-async", "yes", *EXCLUDE]
    assert extra(HELP_NEW, "synccheck") == extra(HELP_NEW, "initcheck") == EXCLUDE
    # an older one: --padding only, and no --kernel-name-exclude (--kernel-name is another option)
    assert extra(HELP_OLD, "memcheck") == ["--padding", "65536"]
    assert extra(HELP_OLD, "racecheck") == [] and extra("", "memcheck") == []


def test_read_from_gives_what_was_appended(tmp_path):
    log = tmp_path / "log.txt"
    log.write_bytes(b"first run: Invalid __global__ write\n")
    start = log.stat().st_size
    with open(log, "ab") as f:
        f.write(b"$ second run\n\xff done\n")
    assert san["read_from"](log, start) == "$ second run\n\ufffd done\n"


# A fake compute-sanitizer: it notes its arguments and the pool switches, and answers each
# planted fault and the pytest run as $FAKE_SAN says ({"oob": [words, reports an error], ...,
# "pytest": [text, status, seconds]}), with --error-exitcode's status where it reports an error,
# as the real one does.
FAKE_SAN = '''#!{python}
import json, os, sys, time
argv = sys.argv[1:]
plan = json.loads(os.environ["FAKE_SAN"])
with open(os.environ["FAKE_SAN_CALLS"], "a") as f:
    f.write(json.dumps({{"argv": argv, "pool": os.environ.get("EX_TEST_NO_MEMORY_POOL"),
                        "torch": os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING")}}) + "\\n")
status = int(argv[argv.index("--error-exitcode") + 1]) if "--error-exitcode" in argv else 0
if "--plant" in argv:
    words, error = plan[argv[argv.index("--plant") + 1]]
    print("========= COMPUTE-SANITIZER")
    print(words)
    print("========= ERROR SUMMARY: %d error%s" % ((1, "") if error else (0, "s")), flush=True)
    sys.exit(status if error else 0)
text, rc, secs = plan["pytest"]
print(text, flush=True)
time.sleep(secs)
sys.exit(rc)
'''
RUN_CLEAN = POOL + "........ [100%]\n8 passed in 12.0s\n========= ERROR SUMMARY: 0 errors"
SEEN = {"oob": ["========= Invalid __global__ write of size 4 bytes", True],
        "plugin": ["plugin call: status 0, path 1\n========= Invalid __global__ write of size 2 bytes", True]}


def check_memcheck(tmp_path, monkeypatch, plan, help_text=HELP_NEW, timeout=60):
    import argparse
    import json
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(FAKE_SAN.format(python=sys.executable), encoding="utf-8")
    fake.chmod(0o755)
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_SAN", json.dumps(plan))
    monkeypatch.setenv("FAKE_SAN_CALLS", str(calls))
    monkeypatch.delenv("EX_TEST_NO_MEMORY_POOL", raising=False)
    a = argparse.Namespace(out=str(tmp_path), k=None, wide=False, timeouts=dict.fromkeys(san["TOOLS"], timeout))
    row = san["check_tool"]("memcheck", str(fake), help_text, a)
    return row, [json.loads(x) for x in calls.read_text().splitlines()]


def test_a_tool_run_with_its_planted_faults_seen_and_clean_tests_passes(tmp_path, monkeypatch):
    row, calls = check_memcheck(tmp_path, monkeypatch, dict(SEEN, pytest=[RUN_CLEAN, 0, 0]))
    assert row[:4] == ("memcheck", "seen", "8 passed, 0 failed, 0 skipped", "ERROR SUMMARY: 0 errors")
    assert row[5:] == (True, "clean"), row
    # each planted fault in a process of its own, then the tests; every one with the error status and
    # the options --help lists; the tests (only) with CuPy's and PyTorch's pools off
    assert [c["argv"][c["argv"].index("--plant") + 1] for c in calls[:2]] == ["oob", "plugin"]
    for c in calls:
        assert c["argv"][:5] == ["--tool", "memcheck", "--error-exitcode", str(ERROR_STATUS), "--print-limit"]
        assert "--padding" in c["argv"] and "kns=cupy_" in c["argv"]
    assert calls[2]["argv"][calls[2]["argv"].index("pytest"):][:7] == ["pytest", "-q", "-p", "no:cacheprovider",
                                                                        "-m", "gpu", "-rfEs"]
    assert (calls[2]["pool"], calls[2]["torch"]) == ("1", "1") and calls[0]["pool"] is None
    log = (tmp_path / "sanitize_memcheck.txt").read_text()
    assert log.startswith("options beyond --tool memcheck: --padding 65536") and log.count("$ ") == 3


@pytest.mark.parametrize("plugin", [
    ["plugin call: status 0, path 1", False],                                # no report, status 0
    ["plugin call: status 0, path 1\n========= Invalid __global__ read of size 2 bytes", True],  # another error
    ["plugin call: status 0, path 1\n========= Invalid __global__ write of size 2 bytes", False],  # no error status
])
def test_a_planted_fault_not_seen_fails_the_tool_whatever_the_tests_say(tmp_path, monkeypatch, plugin):
    """The plugin's planted write must be reported in its own process's output with the error
    status: another report, or the first plant's words earlier in the log, are not it."""
    row, _ = check_memcheck(tmp_path, monkeypatch, dict(SEEN, plugin=plugin, pytest=[RUN_CLEAN, 0, 0]))
    tool, planted, tests, summary, secs, ok, verdict = row
    assert not ok and planted == "NOT SEEN: plugin", row
    assert verdict == "planted fault not seen; tests clean"


def test_a_tool_run_reads_only_the_tests_output(tmp_path, monkeypatch):
    """The planted faults' reports (ERROR SUMMARY: 1 error) are earlier in the same log: the tests'
    verdict is of the tests' run alone, and a report there fails it."""
    row, _ = check_memcheck(tmp_path, monkeypatch, dict(SEEN, pytest=[RUN_CLEAN, 0, 0]))
    assert row[3] == "ERROR SUMMARY: 0 errors" and row[6] == "clean"
    bad = RUN_CLEAN.replace("0 errors", "2 errors")
    row, _ = check_memcheck(tmp_path, monkeypatch, dict(SEEN, pytest=[bad, ERROR_STATUS, 0]))
    assert row[5:] == (False, "sanitizer errors")


def test_a_tool_run_is_stopped_at_its_timeout(tmp_path, monkeypatch):
    row, _ = check_memcheck(tmp_path, monkeypatch, dict(SEEN, pytest=[POOL + "....", 0, 30]), timeout=2)
    assert row[5:] == (False, "stopped after 2 s") and row[4] < 20, row
    assert row[2] == "4 passed, 0 failed, 0 skipped so far"


@pytest.mark.parametrize("oks, status", [((True, True), 0), ((True, False), 1), ((False, True), 1)])
def test_the_exit_status_is_0_only_where_every_tool_passed(tmp_path, monkeypatch, capsys, oks, status):
    main = san["main"]
    g = main.__globals__
    rows = dict(zip(("memcheck", "initcheck"), oks))
    monkeypatch.setitem(g, "find_sanitizer", lambda given: "/fake/compute-sanitizer")
    monkeypatch.setitem(g, "LIBS", ())
    monkeypatch.setitem(g, "sanitizer_help", lambda s: "")
    monkeypatch.setitem(g["_scripts"], "cupy_with_gpu", lambda: (object(), ""))
    monkeypatch.setitem(g, "check_tool", lambda t, s, h, a: (t, "seen", "1 passed", "ERROR SUMMARY: 0 errors", 1.0,
                                                             rows[t], "clean" if rows[t] else "sanitizer errors"))
    monkeypatch.setattr(sys, "argv", ["gpu_sanitize.py", "--tools", "memcheck,initcheck", "--out", str(tmp_path)])
    assert main() == status
    out = capsys.readouterr().out
    for t, ok in rows.items():
        assert f"| {t} | seen | 1 passed | ERROR SUMMARY: 0 errors | 1 | {'PASS' if ok else 'FAIL: sanitizer errors'} |" in out


def test_wide_widens_memcheck_only():
    sel = san["selection"]
    assert sel("racecheck", wide=True) == san["TESTS"]["racecheck"] and sel("memcheck", wide=True) == san["WIDE"]
    narrowed = sel("initcheck", "bfloat16")
    assert narrowed[:-1] == san["TESTS"]["initcheck"][:-1] and narrowed[-1] == f"({san['TESTS']['initcheck'][-1]}) and (bfloat16)"


@pytest.mark.parametrize("name, report, other", [
    ("oob", "========= Invalid __global__ write of size 4 bytes", "========= Invalid __global__ read of size 4 bytes"),
    ("plugin", "========= Invalid __global__ write of size 2 bytes", "========= Invalid __shared__ write of size 2 bytes"),
    ("race", "========= Error: Race reported between Write access at race+0x90",
     "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"),
    ("badsync", "========= Barrier error detected. Invalid arguments", "========= ERROR SUMMARY: 0 errors"),
    ("uninit", "========= Uninitialized __global__ memory read of size 4 bytes",
     "========= Invalid __global__ read of size 4 bytes"),
])
def test_each_planted_fault_is_known_by_its_own_report(name, report, other):
    """A planted fault is seen by the report of its kind (compute-sanitizer's words), not by another
    error in the same process (the plugin's planted write, not some read of it)."""
    import re
    words = dict((n, w) for plants in san["PLANTED"].values() for n, _, w in plants)[name]
    assert re.search(words, report) and not re.search(words, other)


def test_no_gpu_is_named_before_any_tool_runs(tmp_path):
    """With compute-sanitizer and the built factors but no GPU (or no CuPy) it stops with status 2,
    running nothing (no planted fault reported as 'not seen')."""
    import shutil
    from tests.conftest import have_gpu
    if have_gpu():
        pytest.skip("a GPU is here")
    for d in ("scripts", "ex_engine", "factors"):
        (tmp_path / d).mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts" / "gpu_sanitize.py")
    shutil.copy(ROOT / "ex_engine" / "_scripts.py", tmp_path / "ex_engine" / "_scripts.py")
    for lib in san["LIBS"]:
        (tmp_path / "factors" / lib).write_bytes(b"")
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(f"#!/bin/sh\necho ran >> {tmp_path / 'ran'}\nexit 0\n", encoding="utf-8")
    fake.chmod(0o755)
    r = subprocess.run([sys.executable, str(tmp_path / "scripts" / "gpu_sanitize.py"), "--sanitizer", str(fake),
                        "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "needs CuPy and a CUDA GPU" in r.stderr, (r.returncode, r.stderr)
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("text", [
    # a second summary (another process of the run) reports errors; the first said none
    CLEAN + "========= ERROR SUMMARY: 2 errors\n",
    POOL + ". [100%]\n1 passed in 1s\n========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n"
           "========= RACECHECK SUMMARY: 3 hazards displayed (0 errors, 3 warnings)\n",
    # pytest or the sanitizer says the tests failed, the status says 0
    POOL + "..F..... [100%]\n1 failed, 7 passed in 12.0s\n========= ERROR SUMMARY: 0 errors\n",
    POOL + "........ [100%]\n8 passed, 1 error in 12.0s\n========= ERROR SUMMARY: 0 errors\n",
    CLEAN.replace("=========", "========= Target application returned an error\n=========", 1),
    CLEAN.replace("=========", "========= Error: process didn't terminate successfully\n=========", 1),
])
def test_a_status_0_run_with_a_report_or_a_failure_anywhere_is_not_clean(text):
    assert judge(0, text, 100)[2] != "clean"


def test_the_least_free_memory_is_named(tmp_path):
    """The memory log's lowest line is said with the tool's result; no log, no words."""
    least_free = san["least_free"]
    log = tmp_path / "m.txt"
    assert least_free(log) == ""
    log.write_text("tests/a.py::t[1] free 70000 of 81000 MiB\ntests/a.py::t[2] free 120 of 81000 MiB\n"
                   "tests/a.py::t[3] free unknown (CUDARuntimeError: out of memory)\n"
                   "tests/a.py::t[4] free 5000 of 81000 MiB\n", encoding="utf-8")
    assert least_free(log) == "; least free device memory after a test: 120 of 81000 MiB (tests/a.py::t[2])"


def test_the_wide_set_is_grouped_a_process_per_function_model_and_decode_shape():
    """memcheck keeps the device memory tests free (group_ids says what was measured), so the
    wide set runs in processes of a test function each, a model each for the model shapes and
    a shape each for the decode tests of several modes."""
    ids = ["tests/test_gpu_configs.py::test_moe_every_config_on_awkward_shapes[moe_fused_gemm-tiny-E_40]",
           "tests/test_gpu_configs.py::test_moe_every_config_on_awkward_shapes[moe_fused_gemm_sm90-narrow-T_1]",
           "tests/test_gpu.py::test_moe_plugin_on_model_shapes[1-mixtral-8x7b-bfloat16]",
           "tests/test_gpu.py::test_moe_plugin_on_model_shapes[1-qwen3-30b-a3b-bfloat16]",
           "tests/test_gpu.py::test_moe_plugin_on_model_shapes[64-mixtral-8x7b-bfloat16]",
           "tests/test_gpu.py::test_moe_empty_batch_on_gpu",
           "tests/test_gpu.py::test_moe_decode_with_no_valid_slot_writes_zeros[1-2048-128-768-8-new]",
           "tests/test_gpu.py::test_moe_decode_with_no_valid_slot_writes_zeros[1-2048-128-768-8-late]",
           "tests/test_gpu.py::test_moe_decode_with_no_valid_slot_writes_zeros[4-4096-8-14336-2-new]"]
    assert san["group_ids"](ids) == [ids[:2], [ids[2], ids[4]], [ids[3]], [ids[5]], ids[6:8], [ids[8]]]


def test_the_groups_runs_make_one_row():
    judge_all = san["judge_all"]
    clean = (0, RUN_CLEAN)
    assert judge_all([clean, clean], 100, 2) == ("16 passed, 0 failed, 0 skipped",
                                                 "ERROR SUMMARY: 0 errors (2 processes)", "clean")
    bad = (ERROR_STATUS, RUN_CLEAN.replace("0 errors", "3 errors"))
    tests, summary, verdict = judge_all([clean, bad, clean], 100, 3)
    assert summary == "ERROR SUMMARY: 3 errors (3 processes)" and verdict == "sanitizer errors (process 2 of 3)"
    # a process stopped at the time limit, or groups never started, is not a pass
    assert judge_all([clean, (None, POOL + "...")], 100, 2)[::2] == (
        "11 passed, 0 failed, 0 skipped so far", "stopped after 100 s (2 of 2 processes started)")
    assert judge_all([clean], 100, 3)[2] == "stopped after 100 s (1 of 3 processes started)"
    assert judge_all([clean, (0, POOL + "no tests ran in 0.1s")], 100, 2)[2] == "no test ran (process 2 of 2)"


def test_memcheck_wide_runs_each_group_in_a_process_of_its_own(tmp_path, monkeypatch):
    import argparse
    import json
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(FAKE_SAN.format(python=sys.executable), encoding="utf-8")
    fake.chmod(0o755)
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_SAN", json.dumps(dict(SEEN, pytest=[RUN_CLEAN, 0, 0])))
    monkeypatch.setenv("FAKE_SAN_CALLS", str(calls))
    ids = ["tests/a.py::t1[x]", "tests/a.py::t1[y]", "tests/a.py::t2"]
    check_tool = san["check_tool"]
    monkeypatch.setitem(check_tool.__globals__, "collect_ids", lambda args, env: ids)
    a = argparse.Namespace(out=str(tmp_path), k=None, wide=True, timeouts=dict.fromkeys(san["TOOLS"], 60))
    row = check_tool("memcheck", str(fake), HELP_NEW, a)
    assert row[2:4] == ("16 passed, 0 failed, 0 skipped", "ERROR SUMMARY: 0 errors (2 processes)")
    assert row[5:] == (True, "clean"), row
    runs = [json.loads(x)["argv"] for x in calls.read_text().splitlines()][2:]
    assert [r[r.index("-rfEs") + 1:] for r in runs] == [ids[:2], ids[2:]]
