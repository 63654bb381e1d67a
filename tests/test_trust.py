"""What the registry refuses to load, and why: missing dependencies, GPU code for other
hardware, lock files, crashing plugins, competing plugins of one factor (CPU tests; the GPU
ones are in test_gpu_trust.py)."""
import json
import warnings
import os
import shutil
import struct
from pathlib import Path

import pytest
import yaml

from ex_engine import FactorError, FactorRegistry, abi, fatbin
from ex_engine.cli import main as cli_main
from tests.conftest import OTHER_PROFILE_LOAD, ROOT, build_helper, build_plugin
from tests.test_loader import call

FACTORS = ROOT / "factors"
BUILTIN = ("topk_softmax", "fused_add_rmsnorm", "moe_fused_gemm")   # built by make: sm_90a + sm_80 + PTX
needs_built = pytest.mark.skipif(not all((FACTORS / f"{n}.so").exists() for n in BUILTIN)
                                 or shutil.which("nvcc") is None,
                                 reason="factors/*.so not built or nvcc missing")


def by_stem(reg, stem):
    return next(p for p in reg.plugins if p.path.stem == stem)


def profile(tmp_path, base="h200", **changes) -> Path:
    """A hardware profile YAML in tmp_path: ``base`` with some fields changed."""
    data = yaml.safe_load((ROOT / "manifests" / "hardware" / f"{base}.yaml").read_text(encoding="utf-8"))
    data.update(changes)
    path = tmp_path / f"fake_{base}.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


# ------------------------------------------------------------------------------ dependencies
def test_missing_dependency_is_named(tmp_path):
    libdir = tmp_path / "lib"
    helper = build_helper(libdir)
    plugins = tmp_path / "plugins"
    build_plugin(plugins, "needs_helper", defines={"HELPER": True, "NAME": '"host_scale_h"', "FACTOR_ID": 1102},
                 link=[f"-L{libdir}", "-lexhelper", f"-Wl,-rpath,{libdir}"])
    build_plugin(plugins)
    helper.unlink()      # (not loaded before: the dynamic loader would keep it mapped)
    reg = FactorRegistry.load(plugins, hardware="h200")
    p = by_stem(reg, "needs_helper")
    assert p.status == "rejected" and p.reason.startswith("dlopen: missing dependency libexhelper.so"), p.reason
    assert call(reg)[0] == "plugin"                              # the rest keep working


# ------------------------------------------------------------------------------ ABI and struct
def test_other_abi_names_both_versions(tmp_path):
    build_plugin(tmp_path, defines={"ABI_OVERRIDE": (7 << 16) | 3})
    p = FactorRegistry.load(tmp_path, hardware="h200").plugins[0]
    assert p.status == "rejected"
    assert f"runtime ABI {abi.version_str(abi.ABI_VERSION)}" in p.reason and "built against 7.3" in p.reason


@pytest.mark.parametrize("defines,check", [
    ({"NO_GET_FACTOR": True}, "symbol ex_get_factor"),
    ({"RETURN_NULL": True}, "ex_get_factor(hw)"),
    ({"STRUCT_ABI": (1 << 16) | 9}, "struct abi_version"),
    ({"NULL_NAME": True}, "name"),
    ({"NULL_KERNEL": True}, "kernel"),
    ({"VERSION": "NULL"}, "version"),
    ({"VERSION": '"x.y"'}, "version is MAJOR.MINOR.PATCH"),
    ({"VERSION": '"1.2.3.4.5-rc1"'}, "version is MAJOR.MINOR.PATCH"),
    ({"NAME": '"../good/host_scale"'}, "name is an identifier"),
    ({"NAME": '"/tmp/host_scale"'}, "name is an identifier"),
    ({"FACTOR_ID": -5}, "factor id"),
    ({"FACTOR_ID": 500}, "factor id"),
    ({"NAME": '"evil"', "FACTOR_ID": 0}, "factor id"),
])
def test_each_struct_problem_fails_its_own_check(tmp_path, defines, check):
    build_plugin(tmp_path, defines=defines, manifest="/" not in defines.get("NAME", ""))
    p = FactorRegistry.load(tmp_path, hardware="h200").plugins[0]
    assert p.status == "rejected" and p.checks[-1].name == check and not p.checks[-1].ok
    assert p.reason.startswith(check + ":")


def test_id_other_than_the_manifest_is_refused(tmp_path):
    build_plugin(tmp_path, defines={"FACTOR_ID": 1108}, manifest=False)
    (tmp_path / "host_scale.yaml").write_text((ROOT / "tests" / "plugins" / "host_scale.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    p = FactorRegistry.load(tmp_path, hardware="h200").plugins[0]
    assert p.status == "rejected" and p.reason.startswith("manifest id: expected id 1100") and "library says 1108" in p.reason


# ------------------------------------------------------------------------------ tuning
def test_block_larger_than_an_sm_is_refused(tmp_path):
    build_plugin(tmp_path, defines={"TPB": 256})
    reg = FactorRegistry.load(tmp_path, hardware=profile(tmp_path, max_threads_per_multiprocessor=128))
    p = reg.plugins[0]
    assert p.status == "rejected"
    assert "threads_per_block <= max_threads_per_multiprocessor: expected <= 128 (one block must fit an SM), got 256" in p.reason


def test_every_tuning_check_says_expected_and_got(tmp_path):
    build_plugin(tmp_path)
    p = FactorRegistry.load(tmp_path, hardware="h200").plugins[0]
    tuning = [c for c in p.checks if c.name.split()[0] in abi.TUNING_FIELDS]
    assert len(tuning) == 8 and all("expected" in c.detail and "got" in c.detail for c in tuning)


# ------------------------------------------------------------------------------ GPU code (fatbin)
def test_host_library_skips_the_cuda_code_check_with_a_note(tmp_path):
    build_plugin(tmp_path)
    p = FactorRegistry.load(tmp_path, hardware="h200").plugins[0]
    c = next(c for c in p.checks if c.name == "cuda code")
    assert c.ok and "no .nv_fatbin section" in c.detail and p.cuda_code is None


def _entry(kind, arch, flags=0x11, payload=b"\0" * 8):
    head = struct.pack("<HHIQIIHHIIIQ", kind, 0x101, 64, len(payload), 0, 0, 0, 0, arch, 0, 0, flags)
    return head + b"\0" * (64 - len(head)) + payload


def test_fatbin_walk_and_compatibility_rules():
    entries = _entry(2, 90, 0x100011) + _entry(2, 80) + _entry(1, 80, 0x8011)
    blob = struct.pack("<IHHQ", fatbin.FATBIN_MAGIC, 1, 16, len(entries)) + entries
    found = fatbin.fatbin_entries(b"\0" * 8 + blob + b"\0" * 8 + blob)   # padding, two containers
    assert [e.name for e in found] == ["sm_90a", "sm_80", "compute_80"] * 2
    ok = lambda names, cc: fatbin.check_code([fatbin.CodeEntry(k, a, s) for k, a, s in names], *cc)[0]
    assert ok([("sass", 90, "a")], (9, 0)) and not ok([("sass", 90, "a")], (9, 1))
    assert ok([("sass", 80, "")], (8, 6)) and not ok([("sass", 86, "")], (8, 0))
    assert not ok([("sass", 80, "")], (9, 0))                        # SASS stays in its major
    assert ok([("ptx", 80, "")], (9, 0)) and not ok([("ptx", 90, "")], (8, 9))
    assert not ok([("ptx", 90, "a")], (10, 0))                       # arch-specific PTX: exact cc
    assert ok([("sass", 100, "f")], (10, 3)) and not ok([("sass", 100, "f")], (12, 0))
    with pytest.raises(fatbin.FatbinError):
        fatbin.fatbin_entries(blob[:40])                             # truncated container


@needs_built
@OTHER_PROFILE_LOAD
@pytest.mark.parametrize("hw,via", [("h200", "ok via sm_90a (SASS)"), ("a100", "ok via sm_80 (SASS)")])
def test_built_factors_carry_code_for_the_profile(hw, via):
    reg = FactorRegistry.load(FACTORS, hardware=hw)
    for p in (by_stem(reg, n) for n in BUILTIN):
        c = next(c for c in p.checks if c.name == "cuda code")
        assert c.ok and via in c.detail, (p.path.name, c.detail)
        assert p.cuda_code == {"sass": ["sm_90a", "sm_80"], "ptx": ["compute_80"]}


@needs_built
def test_built_factors_refused_on_a_gpu_they_have_no_code_for(tmp_path):
    reg = FactorRegistry.load(FACTORS, hardware=profile(tmp_path, "a100", name="Fake T4", cc_major=7, cc_minor=5))
    for p in (by_stem(reg, n) for n in BUILTIN):
        assert p.status == "rejected" and p.lib is None, p.path.name     # never opened
        assert p.reason == ("cuda code: no SASS or PTX for sm_75: library has sm_90a, sm_80 SASS and "
                            "compute_80 PTX (Fake T4, cc 7.5)"), p.reason


@needs_built
def test_cuda_code_in_list_factors_why_and_json(capsys):
    assert cli_main(["list-factors", "--dir", str(FACTORS), "--hardware", "a100", "--why"]) == 0
    assert "[ok] cuda code: sm_80: ok via sm_80 (SASS)" in capsys.readouterr().out
    assert cli_main(["list-factors", "--dir", str(FACTORS), "--hardware", "a100", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert all(p["cuda_code"]["sass"] == ["sm_90a", "sm_80"] for p in data["plugins"]
               if Path(p["path"]).stem in BUILTIN)


# ------------------------------------------------------------------------------ probe
def test_probe_reports_a_crash_and_never_opens_it_here(tmp_path):
    build_plugin(tmp_path, "crashy", defines={"CRASH": True, "NAME": '"host_scale_crash"', "FACTOR_ID": 1103})
    build_plugin(tmp_path)
    reg = FactorRegistry.load(tmp_path, hardware="h200", probe="subprocess")
    p = by_stem(reg, "crashy")
    assert p.status == "rejected" and p.lib is None
    assert p.reason == "probe (child process): crashed in ex_get_factor: signal SIGSEGV", p.reason
    assert reg.get("host_scale").status == "ready" and call(reg)[0] == "plugin"


def test_probe_reports_a_hang(tmp_path):
    build_plugin(tmp_path, defines={"HANG": True})
    p = FactorRegistry.load(tmp_path, hardware="h200", probe="subprocess", probe_timeout=2).plugins[0]
    assert p.status == "rejected" and p.lib is None
    assert p.reason == "probe (child process): timed out after 2 s in ex_get_factor", p.reason


def test_cli_probe_timeout_option(tmp_path, capsys):
    """With probing the default of list-factors and verify, the child's time limit is theirs to
    set too (--probe-timeout; it was fixed at 10 s): a hanging library is refused after it."""
    import time
    build_plugin(tmp_path, defines={"HANG": True})
    t0 = time.monotonic()
    assert cli_main(["list-factors", "--dir", str(tmp_path), "--hardware", "h200", "--probe-timeout", "1",
                     "--why"]) == 1   # no plugin is ready
    assert time.monotonic() - t0 < 8
    assert "timed out after 1 s in ex_get_factor" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli_main(["list-factors", "--probe-timeout", "0"])
    assert e.value.code == 2 and "expected a number of seconds > 0, got '0'" in capsys.readouterr().err


@pytest.mark.parametrize("argv,got", [
    (["list-factors", "--no-probe"], "--no-probe"),
    (["verify", "--no-probe"], "--no-probe"),
    (["run", "moe", "--tokens", "1"], "no --probe"),   # run moe probes only with --probe
])
def test_cli_probe_timeout_without_a_probe_is_a_usage_error(tmp_path, capsys, argv, got):
    """--probe-timeout where no probe runs was ignored without a word (exit 0)."""
    assert cli_main(argv + ["--dir", str(tmp_path), "--hardware", "h200", "--probe-timeout", "5"]) == 2
    assert capsys.readouterr().err == ("ex-engine: error: --probe-timeout: expected together with --probe "
                                       f"(it limits the probe's child process), got {got}\n")


@pytest.mark.parametrize("defines,reason", [
    ({"EXIT_IN_GET": 0}, "exited with status 0 in ex_get_factor (the library ended the child process)"),
    ({"EXIT_IN_GET": 3}, "exited with status 3 in ex_get_factor"),
    # (the crash is in reading what ex_get_factor returned, not in its code: the reason says so)
    ({"BAD_DESCRIPTION": True}, "crashed in reading the factor it returned: signal SIGSEGV"),
])
def test_probe_refuses_a_library_that_ends_or_would_crash_the_process(tmp_path, defines, reason):
    """exit() in ex_get_factor ended the caller's process silently (status 0) after the probe had
    passed it; a wild description pointer passed the probe (which did not read it) and then
    crashed the caller. The rest of the folder still loads."""
    build_plugin(tmp_path, "bad", defines={**defines, "NAME": '"host_scale_bad"', "FACTOR_ID": 1109})
    build_plugin(tmp_path)
    reg = FactorRegistry.load(tmp_path, hardware="h200", probe="subprocess")
    bad = by_stem(reg, "bad")
    assert bad.status == "rejected" and bad.lib is None and reason in bad.reason, bad.reason
    assert reg.get("host_scale").status == "ready" and call(reg)[0] == "plugin"


def test_probe_passes_good_and_other_abi_plugins_on(tmp_path):
    build_plugin(tmp_path)
    build_plugin(tmp_path, "abi9", defines={"ABI_OVERRIDE": 9 << 16, "CRASH": True,
                                            "NAME": '"x"', "FACTOR_ID": 1104})
    reg = FactorRegistry.load(tmp_path, hardware="h200", probe="subprocess")
    assert reg.get("host_scale").checks[0].name == "cuda code"
    assert any(c.name == "probe (child process)" and c.ok for c in reg.get("host_scale").checks)
    assert "library built against 9.0" in by_stem(reg, "abi9").reason   # ex_get_factor never called


def test_probe_says_how_far_its_child_got(tmp_path):
    """The probe's ok detail said 'opened and called ex_get_factor' for a file the child could
    not open and for a library without ex_get_factor: it says where the child stopped."""
    (tmp_path / "text.so").write_text("hello\n")
    build_plugin(tmp_path, "noget", defines={"NO_GET_FACTOR": True})
    build_plugin(tmp_path, "good", manifest=False)
    reg = FactorRegistry.load(tmp_path, hardware="h200", probe="subprocess")
    probe = {p.path.stem: next(c for c in p.checks if c.name == "probe (child process)") for p in reg.plugins}
    assert all(c.ok for c in probe.values())
    assert probe["text"].detail == ("child process: did not crash; it stopped at dlopen with a Python "
                                    "error (OSError): it could not open the library (the checks below "
                                    "say why)"), probe["text"].detail
    assert by_stem(reg, "text").reason.startswith("dlopen: ")
    assert probe["noget"].detail == ("child process: did not crash; it opened the library, found no "
                                     "ex_get_factor and called nothing (the checks below say why)")
    assert by_stem(reg, "noget").reason.startswith("symbol ex_get_factor: not exported")
    assert probe["good"].detail == "child process: opened the library and called ex_get_factor without crashing"


def test_probe_fails_when_its_child_stops_before_the_library(tmp_path, monkeypatch):
    """A Python error in the child before it opened the library (here: importing ex_engine)
    passed the probe, which then let the library be opened unprobed."""
    from ex_engine import trust
    monkeypatch.setattr(trust, "_CHILD", trust._CHILD.replace("    from ex_engine import abi\n",
                                                              "    raise ImportError('no ex_engine')\n"))
    build_plugin(tmp_path)
    p = FactorRegistry.load(tmp_path, hardware="h200", probe="subprocess").plugins[0]
    assert p.status == "rejected" and p.lib is None
    assert p.reason == ("probe (child process): the probe's child process stopped before opening the "
                        "library with a Python error (ImportError); not opened unprobed"), p.reason


def test_probe_fails_when_its_child_stops_between_opening_and_calling(tmp_path, monkeypatch):
    """A Python error after the child opened the library but before it called ex_get_factor
    (here: reading the hardware) read as 'could not open the library' and passed the probe: the
    in-process load would have been the first to run the library's code."""
    from ex_engine import trust
    child = trust._CHILD.replace("    hw = Hardware(", "    raise KeyError('hw')\n    hw = Hardware(")
    assert child != trust._CHILD
    monkeypatch.setattr(trust, "_CHILD", child)
    build_plugin(tmp_path)
    p = FactorRegistry.load(tmp_path, hardware="h200", probe="subprocess").plugins[0]
    assert p.status == "rejected" and p.lib is None
    assert p.reason == ("probe (child process): the probe's child process stopped between opening the "
                        "library and calling ex_get_factor with a Python error (KeyError); not "
                        "opened unprobed"), p.reason


# ------------------------------------------------------------------------------ lock
def test_lock_accepts_listed_files_and_refuses_changed_or_unlisted_ones_before_dlopen(tmp_path, capsys):
    build_plugin(tmp_path)
    assert cli_main(["lock", "--dir", str(tmp_path)]) == 0
    lock = json.loads((tmp_path / "ex_engine.lock").read_text(encoding="utf-8"))
    assert list(lock) == ["host_scale.so"] and len(lock["host_scale.so"]) == 64
    reg = FactorRegistry.load(tmp_path, hardware="h200", lock=True)
    assert reg.get("host_scale") is not None
    assert reg.plugins[0].checks[0].name == "sha256 lock" and reg.plugins[0].checks[0].ok
    # the file changes (a crashing build: it must never be opened) and another appears
    build_plugin(tmp_path, defines={"CRASH": True})
    build_plugin(tmp_path, "extra", defines={"CRASH": True, "NAME": '"host_scale_x"', "FACTOR_ID": 1105})
    reg = FactorRegistry.load(tmp_path, hardware="h200", lock=tmp_path / "ex_engine.lock")
    changed, extra = by_stem(reg, "host_scale"), by_stem(reg, "extra")
    assert changed.status == "rejected" and changed.lib is None and len(changed.checks) == 1
    assert changed.reason.startswith(f"sha256 lock: sha256 mismatch: lock has {lock['host_scale.so']}, "
                                     f"file has {changed.sha256}")
    assert extra.status == "rejected" and extra.lib is None
    assert extra.reason.startswith("sha256 lock: not listed in the lock (no entry for 'extra.so'), file has "
                                   f"{extra.sha256}"), extra.reason   # not a "mismatch": no entry at all


def test_lock_warn_mode_loads_with_a_warning(tmp_path, capsys):
    build_plugin(tmp_path)
    lock = tmp_path / "my.lock"
    lock.write_text(json.dumps({"host_scale.so": "0" * 64}), encoding="utf-8")
    with pytest.warns(UserWarning, match="sha256 mismatch.*loaded anyway") as caught:
        reg = FactorRegistry.load(tmp_path, hardware="h200", lock=lock, lock_mode="warn")
    # said at the user's call, not inside ex_engine (stacklevel=3 named registry.py)
    assert [w.filename for w in caught if "loaded anyway" in str(w.message)] == [__file__]
    p = reg.get("host_scale")
    assert p is not None and p.checks[0].warn and "sha256 mismatch: lock has 000" in p.checks[0].detail
    assert any(n.startswith("lock: host_scale.so: sha256 mismatch") for n in reg.notes), reg.notes
    assert call(reg)[0] == "plugin"
    # the CLI prints the mismatch as its note once, not also as a Python warning (it did both)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli_main(["list-factors", "--dir", str(tmp_path), "--hardware", "h200", "--lock", str(lock),
                         "--lock-warn", "--why", "--no-probe"]) == 0
    assert not [w for w in caught if "loaded anyway" in str(w.message)], [str(w.message) for w in caught]
    out = capsys.readouterr()
    assert "[WARN] sha256 lock: warning: sha256 mismatch" in out.out
    assert (out.out + out.err).count("loaded anyway (lock_mode=warn)") == 2   # the check row and the note
    assert cli_main(["list-factors", "--dir", str(tmp_path), "--hardware", "h200", "--lock", str(lock)]) == 1
    assert "rejected" in capsys.readouterr().out   # (exit status 1: no plugin is ready)


def test_a_folder_given_as_dot_opens_its_own_files(tmp_path, monkeypatch):
    """dlopen reads 'host_scale.so' (no '/') as a name to search the library path for, not as
    the file in the current folder whose bytes the lock checked: the registry opens the file
    by its absolute path."""
    build_plugin(tmp_path)
    assert cli_main(["lock", "--dir", str(tmp_path)]) == 0
    monkeypatch.chdir(tmp_path)
    for reg in (FactorRegistry.load(".", hardware="h200", lock=True),
                FactorRegistry.load(".", hardware="h200", probe="subprocess")):
        p = reg.get("host_scale")
        assert p is not None and p.status == "ready", reg.plugins[0].reason
        assert call(reg)[0] == "plugin"
    reg = FactorRegistry.load(tmp_path / "..", hardware="h200")   # nothing there: no error
    assert reg.load_library("host_scale.so").status == "ready"


def test_a_path_through_a_symlinked_folder_opens_the_file_the_lock_checked(tmp_path):
    """'link/../x.so' is resolved by the kernel through the link; folding '..' away in the
    text (os.path.abspath) opened another file than the one whose bytes the lock had checked."""
    build_plugin(tmp_path / "deep" / "dir")
    build_plugin(tmp_path / "deep")                                   # the locked library
    assert cli_main(["lock", "--dir", str(tmp_path / "deep")]) == 0
    build_plugin(tmp_path, defines={"NAME": '"not_the_locked_one"', "FACTOR_ID": 1108})
    (tmp_path / "link").symlink_to(tmp_path / "deep" / "dir")
    reg = FactorRegistry.load(tmp_path / "link" / "..", hardware="h200", lock=True)
    p = reg.plugins[0]
    assert p.status == "ready" and p.name == "host_scale", (p.name, p.reason)


def test_a_locked_library_that_is_gone_is_noted(tmp_path, capsys):
    build_plugin(tmp_path)
    build_plugin(tmp_path, "second", defines={"NAME": '"host_scale_2"', "FACTOR_ID": 1107})
    assert cli_main(["lock", "--dir", str(tmp_path)]) == 0
    reg = FactorRegistry.load(tmp_path, hardware="h200", lock=True)
    assert not [n for n in reg.notes if n.startswith("lock:")], reg.notes
    (tmp_path / "second.so").unlink()
    reg = FactorRegistry.load(tmp_path, hardware="h200", lock=True)
    reg.load_folder(tmp_path)                        # loaded again: still one note
    reg.load_folder(tmp_path / ".." / tmp_path.name)   # under another spelling too
    notes = [n for n in reg.notes if n.startswith("lock:")]
    where = tmp_path.resolve()
    assert notes == [f"lock: {where / 'ex_engine.lock'} lists second.so, which {where} does not "
                     "have (deleted or renamed since the lock was written)"], reg.notes
    assert reg.get("host_scale") is not None         # the rest loads as before
    capsys.readouterr()
    assert cli_main(["list-factors", "--dir", str(tmp_path), "--hardware", "h200",
                     "--lock", str(tmp_path / "ex_engine.lock")]) == 0
    assert "lists second.so" in capsys.readouterr().out


@pytest.mark.parametrize("content,msg", [
    ('{"host_scale.so": 123}', "entry 'host_scale.so': expected a SHA-256 digest .* got 123"),
    ('{"host_scale.so": "abc def"}', "entry 'host_scale.so': expected a SHA-256 digest"),
    ('["host_scale.so"]', "expected a JSON object .* got list"),
])
def test_a_malformed_lock_file_is_an_error_naming_the_entry(tmp_path, content, msg):
    build_plugin(tmp_path)
    (tmp_path / "ex_engine.lock").write_text(content, encoding="utf-8")
    with pytest.raises(FactorError, match=msg):
        FactorRegistry.load(tmp_path, hardware="h200", lock=True)


def test_missing_lock_file_is_an_error(tmp_path, capsys):
    build_plugin(tmp_path)
    with pytest.raises(FactorError, match="lock file .*nope.lock: not found; write one with `ex-engine lock`"):
        FactorRegistry.load(tmp_path, hardware="h200", lock=tmp_path / "nope.lock")
    assert cli_main(["list-factors", "--dir", str(tmp_path), "--lock", str(tmp_path / "nope.lock")]) == 2
    # also for a folder without libraries, where no library's check reads the lock (a new-user
    # trial: a mistyped --lock passed silently there, and list-factors said only "no plugins")
    empty = tmp_path / "empty"
    empty.mkdir()
    for lock in (tmp_path / "nope.lock", True):
        with pytest.raises(FactorError, match="lock file .*(nope|ex_engine).lock: not found"):
            FactorRegistry.load(empty, hardware="h200", lock=lock)
    assert cli_main(["list-factors", "--dir", str(empty), "--lock", str(tmp_path / "nope.lock")]) == 2
    assert "lock file" in capsys.readouterr().err


def test_cli_lock_output_path(tmp_path, capsys):
    build_plugin(tmp_path)
    out = tmp_path / "sub.lock"
    assert cli_main(["lock", "--dir", str(tmp_path), "--output", str(out)]) == 0
    assert "host_scale.so" in json.loads(out.read_text(encoding="utf-8"))
    assert f"wrote {out}" in capsys.readouterr().out


# ------------------------------------------------------------------------------ which plugin wins
def test_prefer_overrides_version_and_priority(tmp_path):
    build_plugin(tmp_path, "a_old", defines={"VERSION": '"1.0.0"', "BEHAVIOUR": 1})
    build_plugin(tmp_path, "b_new", defines={"VERSION": '"2.0.0"', "PRIORITY": 9})
    reg = FactorRegistry.load(tmp_path, hardware="h200", prefer={"host_scale": "a_old.so"})
    assert reg.get("host_scale").path.stem == "a_old" and call(reg)[0] == "kernel_fallback"
    loser = by_stem(reg, "b_new")
    assert loser.status == "shadowed"
    assert "wins: a_old.so" in loser.reason and "the user's choice (prefer={'host_scale': 'a_old.so'})" in loser.reason
    # a full path works too; a path elsewhere does not match
    reg = FactorRegistry.load(tmp_path, hardware="h200", prefer={"host_scale": str(tmp_path / "a_old.so")})
    assert reg.get("host_scale").path.stem == "a_old"
    reg = FactorRegistry.load(tmp_path, hardware="h200", prefer={"host_scale": "/elsewhere/a_old.so"})
    assert reg.get("host_scale").path.stem == "b_new"
    assert any("prefer: host_scale -> /elsewhere/a_old.so: no ready plugin" in n for n in reg.notes)


@pytest.mark.parametrize("a,b,winner,rule", [
    ({"VERSION": '"1.2.0"'}, {"VERSION": '"1.10.0"'}, "b", "higher version wins: 1.10.0 over 1.2.0"),
    ({"PRIORITY": 5}, {"PRIORITY": 1}, "a", "same version 1.0.0, higher priority wins: 5 over 1"),
    ({}, {}, "b", "the file name that sorts last wins (b.so after a.so)"),
])
def test_shadowed_plugin_names_winner_and_rule(tmp_path, a, b, winner, rule):
    build_plugin(tmp_path, "a", defines=a)
    build_plugin(tmp_path, "b", defines=b)
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    assert reg.get("host_scale").path.stem == winner
    loser = by_stem(reg, "a" if winner == "b" else "b")
    assert loser.status == "shadowed" and f"wins: {winner}.so" in loser.reason and rule in loser.reason


def test_duplicate_id_names_winner_and_prefer_decides(tmp_path):
    build_plugin(tmp_path)
    build_plugin(tmp_path, "other", defines={"NAME": '"host_scale_other"'})   # same id 1100
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    lost = by_stem(reg, "host_scale")
    assert "factor id 1100 already taken by 'host_scale_other' (other.so)" in lost.reason
    assert "the file name that sorts last wins" in lost.reason
    reg = FactorRegistry.load(tmp_path, hardware="h200", prefer={"host_scale": "host_scale.so"})
    assert reg.get("host_scale") is not None and reg.get("host_scale_other") is None
    assert "the user's choice" in by_stem(reg, "other").reason


def test_bad_options_are_refused(tmp_path):
    with pytest.raises(FactorError, match="lock_mode: expected 'refuse' or 'warn', got 'maybe'"):
        FactorRegistry.load(tmp_path, hardware="h200", lock_mode="maybe")
    with pytest.raises(FactorError, match="probe: expected None or 'subprocess', got 'fork'"):
        FactorRegistry.load(tmp_path, hardware="h200", probe="fork")


def test_cli_why_prints_every_check_of_every_plugin(tmp_path, capsys):
    build_plugin(tmp_path)
    (tmp_path / "junk.so").write_text("junk")
    assert cli_main(["list-factors", "--dir", str(tmp_path), "--hardware", "h200", "--why", "--probe"]) == 0
    out = capsys.readouterr().out
    for needle in ("[ok] cuda code: no .nv_fatbin section", "[ok] probe (child process)",
                   "[ok] dlopen", "[ok] abi version", "[ok] num_stages >= 1",
                   "[ok] cuda code: not checked: not an ELF file", "[FAIL] dlopen: not a loadable shared library"):
        assert needle in out, needle


def test_files_named_so_that_are_not_regular_files_are_refused_without_reading(tmp_path, capsys):
    """A FIFO named x.so blocked the load (and `ex-engine lock`) for ever; a link to /dev/zero
    read without end. Refused with a reason; the rest loads; lock skips them."""
    build_plugin(tmp_path)
    os.mkfifo(tmp_path / "fifo.so")
    (tmp_path / "zero.so").symlink_to("/dev/zero")
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    for stem in ("fifo", "zero"):
        p = by_stem(reg, stem)
        assert p.status == "rejected" and p.reason.startswith("read: not a regular file"), p.reason
    assert reg.get("host_scale").status == "ready"
    assert cli_main(["lock", "--dir", str(tmp_path)]) == 0
    assert list(json.loads((tmp_path / "ex_engine.lock").read_text(encoding="utf-8"))) == ["host_scale.so"]


def test_a_manifest_must_name_its_factor_as_the_library_does(tmp_path):
    """foo.so (factor foo) with a foo.yaml that says name: bar loaded, and its errors spoke of
    'bar'; two manifests of one name in the folder: the second was taken silently."""
    build_plugin(tmp_path, manifest=False)
    text = (ROOT / "tests" / "plugins" / "host_scale.yaml").read_text(encoding="utf-8")
    (tmp_path / "host_scale.yaml").write_text(text.replace("name: host_scale", "name: other_name"), encoding="utf-8")
    p = FactorRegistry.load(tmp_path, hardware="h200").plugins[0]
    assert p.status == "rejected" and p.reason.startswith("manifest name:") and "names 'other_name'" in p.reason
    mdir = tmp_path / "m"
    mdir.mkdir()
    (mdir / "a.yaml").write_text(text, encoding="utf-8")
    (mdir / "b.yaml").write_text(text, encoding="utf-8")
    (tmp_path / "empty").mkdir()
    reg = FactorRegistry.load(tmp_path / "empty", hardware="h200", manifests_dir=mdir)
    # neither is host_scale.yaml: which one describes the library cannot be told, none is used
    assert any("a.yaml and " in n and "b.yaml all name 'host_scale' and none is host_scale.yaml" in n
               for n in reg.notes), reg.notes
    assert "host_scale" not in reg.manifests
    (mdir / "host_scale.yaml").write_text(text, encoding="utf-8")   # the file of that name is the manifest
    reg = FactorRegistry.load(tmp_path / "empty", hardware="h200", manifests_dir=mdir)
    assert str(reg.manifests["host_scale"].path).endswith("host_scale.yaml")
    assert any("b.yaml: names 'host_scale', as" in n and "is not used" in n for n in reg.notes), reg.notes
