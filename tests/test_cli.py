"""The ex-engine command line on a machine without a GPU."""
import json
import os
import re
import subprocess
import sys

import pytest
from pathlib import Path

from ex_engine.cli import build_parser, main
from tests.conftest import ROOT, child_env


@pytest.mark.parametrize("argv", [[], ["list-factors"], ["hardware"], ["run"], ["run", "moe"], ["build"],
                                  ["verify"], ["lock"]])
def test_every_command_has_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv + ["--help"])
    assert e.value.code == 0
    assert "usage: ex-engine" in capsys.readouterr().out


@pytest.mark.parametrize("argv,usage", [
    (["list-factors", "--unknown"], "usage: ex-engine list-factors "),
    (["run", "moe", "--no-probe"], "usage: ex-engine run moe "),
    (["run", "--x"], "usage: ex-engine run "),
    (["hardware", "--zz"], "usage: ex-engine hardware "),
    (["verify", "extra"], "usage: ex-engine verify "),
    (["--bogus"], "usage: ex-engine [-h] COMMAND"),
])
def test_an_unknown_argument_is_reported_with_its_commands_usage(argv, usage, capsys):
    """A new-user trial: an unknown option of a subcommand printed the top-level usage, where
    every other usage error of that subcommand prints its own."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(usage), err
    assert f"error: unrecognized arguments: {argv[-1]}" in err


def test_seed_must_be_non_negative(capsys):
    with pytest.raises(SystemExit) as e:
        main(["verify", "--seed", "-1"])
    assert e.value.code == 2 and "--seed: expected an integer >= 0, got '-1'" in capsys.readouterr().err


def test_hardware_json_is_json_alone(capsys):
    """`hardware --json` prints only JSON on stdout: the live GPU's fields, or null without a
    GPU (the remark then goes to stderr)."""
    assert main(["hardware", "--json"]) == 0
    out = capsys.readouterr().out
    d = json.loads(out)
    assert d is None or "cc_major" in d, out


def test_hardware_profile_json(capsys):
    assert main(["hardware", "--profile", "h200", "--json"]) == 0
    hw = json.loads(capsys.readouterr().out)
    assert hw["name"] == "NVIDIA H200" and hw["multiprocessor_count"] == 132 and hw["cc_major"] == 9


def test_unknown_profile_is_a_clear_error(capsys):
    assert main(["hardware", "--profile", "tpu9"]) == 2
    err = capsys.readouterr().err
    assert "hardware profile 'tpu9': no such profile; expected one of ['a100', 'bi-v100', 'h100', 'h200']" in err


PROFILES = Path(__file__).resolve().parents[1] / "manifests" / "hardware"


def _profile_with(tmp_path, field, text, name="bad.yaml"):
    """The h200 profile with ``field``'s line replaced by ``field: text`` (YAML as written)."""
    lines = [f"{field}: {text}" if line.startswith(f"{field}:") else line
             for line in (PROFILES / "h200.yaml").read_text(encoding="utf-8").splitlines()]
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("field, text, least, got", [
    ("cc_major", '"nine"', 1, "'nine'"),                       # ValueError from int()
    ("cc_minor", "null", 0, "None"),                           # TypeError from int()
    ("global_mem_bytes", "99999999999999999999999", 1, "99999999999999999999999"),  # OverflowError in to_c
    ("multiprocessor_count", "99999999999", 1, "99999999999"),  # does not fit 'int32_t'
    ("global_mem_bytes", "1e400", 1, "inf"),                 # a float (inf) to ex_engine's YAML 1.2 floats
    ("global_mem_bytes", "1.0e+400", 1, "inf"),
    ("cc_major", "9.5", 1, "9.5"),                             # was shown as 9
    ("cc_major", "true", 1, "True"),                           # was shown as 1
    ("multiprocessor_count", "-5", 1, "-5"),                   # was accepted
    ("warp_size", "0", "32 or 64", "0"),                       # every plugin then declined the hardware
    ("warp_size", "7", "32 or 64", "7"),
    ("max_threads_per_block", "0", 32, "0"),
    ("max_threads_per_block", "1", 32, "1"),
    ("max_threads_per_block", "8192", 32, "8192"),
    ("max_threads_per_block", "1000", "a multiple of warp_size 32", "1000"),
    ("cc_minor", "99", 0, "99"),                               # was shown as sm_999
    ("cc_major", "99", 1, "99"),                               # was shown as sm_990
    ("cc_major", "0", 1, "0"),
    ("l2_cache_bytes", "-1", 0, "-1"),
    ("name", "null", None, "None"),
])
def test_a_bad_profile_value_is_one_clear_error(tmp_path, capsys, field, text, least, got):
    """A profile's value that is no integer, or does not fit its ex_hardware_t field, or is a
    count of 0, was a raw traceback (int() and to_c) or silently coerced (9.5 -> 9, true -> 1,
    warp_size 0 made every plugin 'decline this hardware'): now each command that takes a
    profile says which file, which field, what was expected and what came."""
    from ex_engine import FactorRegistry
    from ex_engine.errors import FactorError
    from ex_engine.hardware import Hardware
    path = _profile_with(tmp_path, field, text)
    want = f"hardware profile {path}: {field}: expected " + (
        "a non-empty string" if least is None else least if isinstance(least, str)
        else f"an integer >= {least}, at most ")
    with pytest.raises(FactorError) as e:
        Hardware.from_profile(str(path))
    assert str(e.value).startswith(want) and str(e.value).endswith(f"got {got}"), str(e.value)
    with pytest.raises(FactorError, match=f"{field}: expected"):
        FactorRegistry.load(tmp_path, hardware=str(path))
    for argv in (["hardware", "--profile", str(path)], ["list-factors", "--dir", str(tmp_path), "--hardware", str(path)]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err == f"ex-engine: error: {e.value}\n", err


def test_profile_values_at_the_edges_of_their_fields(tmp_path):
    """The largest values ex_hardware_t holds load and reach the C struct; one more does not."""
    from ex_engine import abi
    from ex_engine.errors import FactorError
    from ex_engine.hardware import Hardware
    hw = Hardware.from_profile(str(_profile_with(tmp_path, "multiprocessor_count", 2 ** 31 - 1)))
    assert hw.to_c(abi.ffi).multiprocessor_count == 2 ** 31 - 1
    hw = Hardware.from_profile(str(_profile_with(tmp_path, "global_mem_bytes", 2 ** 63 - 1)))
    assert hw.to_c(abi.ffi).global_mem_bytes == 2 ** 63 - 1
    assert Hardware.from_profile(str(_profile_with(tmp_path, "cc_minor", 0))).cc_minor == 0
    with pytest.raises(FactorError, match=r"multiprocessor_count: expected an integer >= 1, at most 2147483647 \(int32_t\), got 2147483648"):
        Hardware.from_profile(str(_profile_with(tmp_path, "multiprocessor_count", 2 ** 31)))
    # plausible ranges at their edges: cc 1.0 .. 20.9, warps of 32 or 64, 32 .. 4096 threads
    for field, v in (("cc_major", 1), ("cc_major", 20), ("cc_minor", 9), ("warp_size", 64),
                     ("max_threads_per_block", 4096), ("max_threads_per_block", 64)):
        assert getattr(Hardware.from_profile(str(_profile_with(tmp_path, field, v))), field) == v
    # a Hardware built by hand (or rebuilt with Hardware(**d)) keeps to the same rules
    d = Hardware.from_profile("h200").as_dict()
    assert Hardware(**d) == Hardware.from_profile("h200")
    with pytest.raises(FactorError, match=r"Hardware \(profile h200\): warp_size: expected 32 or 64"):
        Hardware(**{**d, "warp_size": 0})
    # live and device_id were taken as they came ('yes', 'x'): a device index is an int
    for field, v, words in (("live", "yes", "live: expected True or False, got 'yes'"),
                            ("device_id", "x", "device_id: expected an int >= 0 (a CUDA device) or -1"),
                            ("device_id", -2, "device_id: expected an int >= 0"),
                            ("device_id", True, "device_id: expected an int"),
                            ("source", 3, "source: expected a string")):
        with pytest.raises(FactorError, match=re.escape(words)):
            Hardware(**{**d, field: v})
    with pytest.raises(FactorError, match=r"device_id: expected an int >= 0 for a live device"):
        Hardware(**{**d, "live": True})
    assert Hardware(**{**d, "live": True, "device_id": 0}).device_id == 0


def test_a_numeric_profile_name_is_a_name(tmp_path):
    """name: 4090 is a number to YAML: it loaded as the name '4090' before profiles were
    checked and does again (a bool is still refused)."""
    from ex_engine import abi
    from ex_engine.errors import FactorError
    from ex_engine.hardware import Hardware
    hw = Hardware.from_profile(str(_profile_with(tmp_path, "name", 4090)))
    assert hw.name == "4090" and abi.ffi.string(hw.to_c(abi.ffi).name) == b"4090"
    assert Hardware(**{**hw.as_dict(), "name": 5090}).name == "5090"
    with pytest.raises(FactorError, match="name: expected a non-empty string"):
        Hardware.from_profile(str(_profile_with(tmp_path, "name", True)))


def test_detect_raises_for_a_device_that_breaks_the_profile_rules(monkeypatch):
    """Hardware.detect() is None only when no device is visible; a device whose properties a
    profile could not hold (an empty name, a count of 0) raised FactorError inside it, which
    detect took for 'no GPU' (every call then ran on the Python fallbacks, silently)."""
    import types
    from ex_engine.errors import FactorError
    from ex_engine.hardware import Hardware
    props = {"name": b"", "major": 9, "minor": 0, "multiProcessorCount": 132, "warpSize": 32,
             "maxThreadsPerBlock": 1024, "maxThreadsPerMultiProcessor": 2048, "regsPerBlock": 65536,
             "regsPerMultiprocessor": 65536, "sharedMemPerBlock": 49152, "sharedMemPerBlockOptin": 232448,
             "sharedMemPerMultiprocessor": 233472, "l2CacheSize": 52428800, "totalGlobalMem": 150 << 30}
    runtime = types.SimpleNamespace(getDeviceProperties=lambda i: props,
                                    getDeviceCount=lambda: 1)
    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime,
                                                            Device=lambda: types.SimpleNamespace(id=0)))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cupy.cuda)
    with pytest.raises(FactorError, match=r"Hardware \(device 0\): name: expected a non-empty string"):
        Hardware.detect()
    props["name"] = b"NVIDIA H200"
    assert Hardware.detect().name == "NVIDIA H200"
    runtime.getDeviceProperties = lambda i: (_ for _ in ()).throw(RuntimeError("no driver"))
    assert Hardware.detect() is None


def test_a_profile_is_found_by_name_with_its_suffix_or_by_any_existing_file(tmp_path, monkeypatch, capsys):
    """'a100.yaml', a file with no suffix and /dev/null all said 'no such profile' although the
    file exists: an existing file is read, a name with .yaml/.yml is the shipped profile, and
    a miss says what was looked for."""
    from ex_engine.errors import FactorError
    from ex_engine.hardware import Hardware
    a100 = Hardware.from_profile("a100")
    for name in ("a100.yaml", "A100.YML", "a100.yml"):
        assert Hardware.from_profile(name) == a100, name
    assert main(["hardware", "--profile", "a100.yaml", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["name"] == a100.name
    no_suffix = tmp_path / "myprof"
    no_suffix.write_text((PROFILES / "bi-v100.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    assert Hardware.from_profile(str(no_suffix)).name == "Iluvatar BI-V100"
    assert Hardware.from_profile(no_suffix).name == "Iluvatar BI-V100"     # a Path too
    monkeypatch.chdir(tmp_path)
    assert Hardware.from_profile("myprof").name == "Iluvatar BI-V100"      # a bare file name
    (tmp_path / "h200").write_text("not a profile")   # a bare name is the shipped profile first
    assert Hardware.from_profile("h200").name == "NVIDIA H200"
    if Path("/dev/null").exists():
        # found (it exists), then refused unread as every device is (/dev/zero never ended)
        with pytest.raises(FactorError, match=r"hardware profile /dev/null: not a regular file \(a character device\)"):
            Hardware.from_profile("/dev/null")
    (tmp_path / "empty.yaml").write_text("# nothing here\n")
    with pytest.raises(FactorError, match="empty.yaml: empty profile"):
        Hardware.from_profile("empty.yaml")
    with pytest.raises(FactorError, match=f"hardware profile {tmp_path}: a directory; expected a YAML file"):
        Hardware.from_profile(str(tmp_path))
    with pytest.raises(FactorError, match=r"'tpu9.yml': no such profile; .*\(looked for the file tpu9.yml "
                                          r"and .*hardware/tpu9.yaml\)"):
        Hardware.from_profile("tpu9.yml")
    assert main(["hardware", "--profile", str(tmp_path / "nope.yaml")]) == 2
    assert f"(looked for the file {tmp_path / 'nope.yaml'})" in capsys.readouterr().err


def test_hardware_of_another_type_names_the_types_expected():
    """from_profile(5) was a raw TypeError; load(hardware=123 or a dict) said "no such profile '123'"."""
    from ex_engine import FactorRegistry
    from ex_engine.errors import FactorError
    from ex_engine.hardware import Hardware, resolve
    with pytest.raises(FactorError, match=r"hardware profile: expected a profile name or a path \(str or "
                                          r"os.PathLike\), got int 5"):
        Hardware.from_profile(5)
    for bad, shown in ((123, "int 123"), ({"cc_major": 9}, "dict {'cc_major': 9}"), (9.0, "float 9.0")):
        with pytest.raises(FactorError, match=r"hardware: expected a Hardware, a profile name or path "
                                              rf"\(str or os.PathLike\), 'auto' or None, got {shown}"):
            FactorRegistry.load(hardware=bad)
    with pytest.raises(FactorError, match="hardware profile: expected a profile name .* got ''"):
        resolve("")
    assert resolve(PROFILES / "a100.yaml").name == Hardware.from_profile("a100").name


def test_empty_path_variables_are_unset(monkeypatch, capsys):
    """EX_ENGINE_FACTORS= made the factor folder '.' and EX_ENGINE_MANIFESTS= the profiles
    folder 'hardware': an empty value now counts as unset (the defaults, as README says)."""
    from ex_engine import _paths
    from ex_engine.hardware import Hardware
    monkeypatch.setenv("EX_ENGINE_FACTORS", "")
    monkeypatch.setenv("EX_ENGINE_MANIFESTS", "")
    assert _paths.factors_dir() == _paths.ROOT / "factors"
    assert _paths.manifests_dir() == _paths.ROOT / "manifests"
    assert build_parser().parse_args(["list-factors"]).dir == str(_paths.ROOT / "factors")
    assert Hardware.from_profile("h200").name == "NVIDIA H200"
    built = (_paths.ROOT / "factors" / "topk_softmax.so").exists()   # else nothing is ready: 1
    assert main(["list-factors", "--hardware", "h200"]) == (0 if built else 1)
    assert "no plugins (*.so) in ." not in capsys.readouterr().out


def test_a_missing_manifests_folder_is_named(tmp_path, monkeypatch, capsys):
    """With EX_ENGINE_MANIFESTS=/nonexist, --help listed 'hardware profile ()' and `hardware`
    said 'the manifests folder has no hardware/*.yaml' without naming it."""
    from ex_engine.errors import FactorError
    from ex_engine.hardware import Hardware
    gone = tmp_path / "nonexist"
    monkeypatch.setenv("EX_ENGINE_MANIFESTS", str(gone))
    why = f"the profiles folder {gone / 'hardware'} does not exist (EX_ENGINE_MANIFESTS={gone})"
    with pytest.raises(SystemExit):
        main(["list-factors", "--help"])
    assert "profile ()" not in " ".join(capsys.readouterr().out.split())
    commands = build_parser()._subparsers._group_actions[0].choices
    for command, dest in (("list-factors", "hardware"), ("hardware", "profile")):
        action = next(a for a in commands[command]._actions if a.dest == dest)
        assert f"(none: {why})" in action.help, action.help   # (argparse wraps it at '-')
    with pytest.raises(FactorError, match="no profiles to choose from: " + why.replace("(", r"\(").replace(")", r"\)")):
        Hardware.from_profile("h200")
    assert main(["hardware"]) == 0
    out = capsys.readouterr().out
    if Hardware.detect() is None:      # with a GPU it describes the GPU instead
        assert f"no hardware profiles: {why}" in out
    (gone / "hardware").mkdir(parents=True)
    assert main(["hardware"]) == 0
    out = capsys.readouterr().out
    if Hardware.detect() is None:
        assert f"the profiles folder {gone / 'hardware'} has no *.yaml" in out


def test_run_moe_on_the_cpu_fallback(tmp_path, capsys):
    code = main(["run", "moe", "--model", "granite-3.0-3b-a800m", "--tokens", "1", "5", "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "python_fallback" in out and "PASS" in out and "ids equal" in out


def test_run_moe_unknown_model(capsys):
    assert main(["run", "moe", "--model", "gpt-5", "--tokens", "1"]) == 2
    assert "model 'gpt-5': unknown; expected one of" in capsys.readouterr().err


def test_console_entry_point_runs():
    r = subprocess.run([sys.executable, "-m", "ex_engine", "hardware", "--profile", "a100"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "NVIDIA A100" in r.stdout


def test_parser_lists_all_commands():
    text = build_parser().format_help()
    for cmd in ("list-factors", "hardware", "run", "build", "verify", "lock"):
        assert cmd in text


def test_prefer_option_needs_name_equals_file(tmp_path, capsys):
    assert main(["list-factors", "--dir", str(tmp_path), "--prefer", "moe_fused_gemm"]) == 2
    assert "--prefer: expected NAME=FILE" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["list-factors"], ["verify"], ["run", "moe", "--tokens", "1"]])
def test_prefer_refuses_a_factor_preferred_twice(tmp_path, capsys, command):
    """--prefer moe_fused_gemm=A --prefer moe_fused_gemm=B: the last one won, silently."""
    argv = command + ["--dir", str(tmp_path), "--prefer", "moe_fused_gemm=a.so",
                      "--prefer", "topk_softmax=t.so", "--prefer", "moe_fused_gemm=b.so"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err == ("ex-engine: error: --prefer: factor 'moe_fused_gemm': expected one FILE per "
                            "factor, got two (moe_fused_gemm=a.so and moe_fused_gemm=b.so)\n")
    assert captured.out == ""


def test_run_without_a_job_is_a_usage_error(capsys):
    """`ex-engine run` alone: run's usage (not the last subcommand's) and argparse's error line
    on stderr, exit status 2 (SystemExit, as every usage error; it printed run's whole help on
    stdout with no 'error:' line)."""
    with pytest.raises(SystemExit) as e:
        main(["run"])
    captured = capsys.readouterr()
    assert e.value.code == 2 and captured.out == ""
    assert captured.err.startswith("usage: ex-engine run") and "ex-engine build" not in captured.err
    assert captured.err.endswith("ex-engine run: error: the following arguments are required: JOB\n"), captured.err


def test_lock_to_a_missing_folder_is_a_clear_error(tmp_path, capsys):
    assert main(["lock", "--dir", str(tmp_path), "--output", str(tmp_path / "no" / "x.lock")]) == 2
    assert "ex-engine: error: lock: cannot write the lock file" in capsys.readouterr().err


def test_lock_escapes_a_file_name_with_a_newline_as_list_factors_does(tmp_path, capsys):
    """lock printed a library named 'new\\nline.so' with a raw line break (a second line that
    looks like another entry); list-factors writes it '\\n' (registry._printable)."""
    (tmp_path / "new\nline.so").write_bytes(b"not an ELF file")
    (tmp_path / "b\x1b[31m.so").write_bytes(b"neither")
    assert main(["lock", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) == 3 and "\x1b" not in out, out
    assert lines[0].endswith("  b\\x1b[31m.so") and lines[1].endswith("  new\\nline.so"), out
    assert main(["list-factors", "--dir", str(tmp_path)]) in (0, 1)
    assert "new\\nline.so" in capsys.readouterr().out


@pytest.mark.parametrize("argv,says", [
    (["run", "moe", "--model", "granite-3.0-3b-a800m", "--tokens", "1", "--repeat", "0"],
     "argument --repeat: expected an integer >= 1, got '0'"),
    (["build", "--jobs", "0"], "argument -j/--jobs: expected an integer >= 1, got '0'"),
    (["build", "-j", "two"], "argument -j/--jobs: expected an integer >= 1, got 'two'"),
    # a fresh user's trial (session fifty-five): -j 70000 reached make, which hung for ever
    (["build", "-j", "70000"], "argument -j/--jobs: expected at most 256 parallel jobs, got '70000'"),
    (["build", "-j", "257", "topk_softmax"], "argument -j/--jobs: expected at most 256 parallel jobs, got '257'"),
])
def test_bad_counts_are_refused_before_any_work(argv, says, capsys):
    """As every argument error: argparse's usage line and 'error:', exit status 2 (these two
    were bare messages printed after parsing)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "usage: ex-engine" in err and "error:" in err, err


def test_list_factors_why_escapes_a_file_name_in_its_checks(tmp_path, capsys):
    """The name check's line printed a library's file name raw (a newline in it split the line);
    it is escaped as in the table."""
    from tests.conftest import ROOT
    src = ROOT / "factors" / "topk_softmax.so"
    if not src.exists():
        pytest.skip("factors not built")
    (tmp_path / "we ird\nname.so").write_bytes(src.read_bytes())
    main(["list-factors", "--why", "--dir", str(tmp_path), "--hardware", "h200"])
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "name matches file stem" in ln)
    assert "differs from file 'we ird\\nname.so'" in line, out


def test_not_a_checkout_hint_on_run_moe_and_lock(tmp_path, monkeypatch, capsys):
    """Installed without the checkout (no manifests/ or factors/ beside the package), run moe
    and lock named the missing file or folder without the hint that list-factors, verify,
    hardware and build give: install with pip install -e, or set the two folder variables."""
    from ex_engine import _paths
    monkeypatch.setattr(_paths, "ROOT", tmp_path)
    monkeypatch.delenv("EX_ENGINE_MANIFESTS", raising=False)
    monkeypatch.delenv("EX_ENGINE_FACTORS", raising=False)
    assert main(["run", "moe", "--tokens", "1"]) == 2
    assert "pip install -e <checkout>" in capsys.readouterr().err
    assert main(["lock"]) == 2
    assert "pip install -e <checkout>" in capsys.readouterr().err


def test_verify_with_no_ready_plugin_fails(tmp_path, capsys):
    assert main(["verify", "--dir", str(tmp_path)]) == 1
    assert "nothing verified" in capsys.readouterr().err


def test_list_factors_why_shows_no_failure_text_on_passed_checks(capsys):
    from tests.conftest import ROOT
    if not (ROOT / "factors" / "topk_softmax.so").exists():
        pytest.skip("factors not built")
    assert main(["list-factors", "--why", "--hardware", "h200"]) == 0
    out = capsys.readouterr().out
    for line in out.splitlines():
        if line.strip().startswith("[ok]"):
            assert "returned NULL" not in line and "got NULL" not in line and "found none" not in line, line


def test_list_factors_columns_line_up_for_wide_and_combining_characters(tmp_path, capsys):
    """The table was padded by len(): a file named with a combining mark ('u' + U+0308, one
    column, two characters) or East Asian wide characters (two columns each) pushed the columns
    after it out of line (fresh user's finding)."""
    from ex_engine.cli import _width
    from tests.conftest import build_plugin
    names = ["plain", "u\u0308n\u0131", "\u6f22\u5b57"]
    try:
        [os.fsencode(n) for n in names]
    except UnicodeEncodeError:
        pytest.skip(f"file names with non-ASCII characters cannot be made under the file system "
                    f"encoding {sys.getfilesystemencoding()!r} (an ASCII locale, UTF-8 mode off)")
    for i, stem in enumerate(names):
        build_plugin(tmp_path, stem, defines={"NAME": f'"host_scale_{i}"', "FACTOR_ID": 1110 + i})
    assert (_width("u\u0308"), _width("\u6f22\u5b57"), _width("abc")) == (1, 4, 3)
    main(["list-factors", "--dir", str(tmp_path), "--hardware", "h200", "--no-probe"])
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("id  "))
    starts = {_width(header[:header.index("file")])}
    for stem in names:
        line = next(line for line in lines if f"{stem}.so" in line)
        starts.add(_width(line[:line.index(f"{stem}.so")]))
    assert len(starts) == 1, (starts, lines)


def test_list_factors_names_the_tuning_file_in_use(tmp_path, capsys):
    from ex_engine.tuning import tuning_dir
    # (exit status 1: an empty folder, no plugin is ready)
    assert main(["list-factors", "--dir", str(tmp_path), "--hardware", "h200"]) == 1
    assert f"tuning: {tuning_dir() / 'h200.yaml'}" in capsys.readouterr().out
    assert main(["list-factors", "--dir", str(tmp_path), "--hardware", "a100"]) == 1
    assert "tuning: no file for NVIDIA A100-SXM4-80GB (108 SMs) in" in capsys.readouterr().out
    assert main(["list-factors", "--dir", str(tmp_path), "--hardware", "h200", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["tuning_file"] == str(tuning_dir() / "h200.yaml")


def test_run_moe_refuses_token_counts_it_cannot_hold(capsys, monkeypatch):
    """A huge --tokens was a NumPy traceback ('Maximum allowed dimension exceeded', or an
    _ArrayMemoryError of hundreds of GiB); now an argparse error, or a one-line message."""
    with pytest.raises(SystemExit) as e:
        main(["run", "moe", "--tokens", "99999999999999999999"])
    assert e.value.code == 2 and "--tokens: expected at most 16777216 tokens" in capsys.readouterr().err
    import ex_engine.moe_layer as ml

    def no_memory(*a, **k):
        raise MemoryError("Unable to allocate 381. GiB for an array")
    monkeypatch.setattr(ml, "run_moe", no_memory)
    assert main(["run", "moe", "--model", "qwen3-30b-a3b", "--tokens", "10000000"]) == 2
    err = capsys.readouterr().err
    assert "--tokens 10000000: the qwen3-30b-a3b layer's arrays do not fit in memory" in err
    assert "381. GiB" in err and "Traceback" not in err


def test_an_install_without_the_checkout_says_how_to_fix_it(tmp_path, monkeypatch, capsys):
    """`pip install .` (not -e) copies the package alone: the profiles, manifests and Makefile
    are missing. The first error a user meets says so and how to fix it (it said 'expected one
    of []' and 'check EX_ENGINE_MANIFESTS'; build ran make in site-packages)."""
    from ex_engine import _paths
    from ex_engine.errors import FactorError
    from ex_engine.hardware import Hardware
    monkeypatch.setattr(_paths, "ROOT", tmp_path / "site-packages")
    monkeypatch.delenv("EX_ENGINE_MANIFESTS", raising=False)
    monkeypatch.delenv("EX_ENGINE_FACTORS", raising=False)
    with pytest.raises(FactorError, match="not in a checkout.*pip install -e <checkout>.*EX_ENGINE_MANIFESTS"):
        Hardware.from_profile("h200")
    assert main(["build"]) == 2
    assert "no Makefile in" in capsys.readouterr().err
    from ex_engine import FactorRegistry     # with a GPU (or a profile path) the folder comes next
    real_profile = Path(__file__).resolve().parents[1] / "manifests" / "hardware" / "h200.yaml"
    with pytest.raises(FactorError, match="factor folder .*(not a directory|does not exist).*pip install -e <checkout>"):
        FactorRegistry.load(hardware=str(real_profile))
    assert main(["hardware"]) == 0
    out = capsys.readouterr().out
    if Hardware.detect() is None:      # with a GPU it describes the GPU instead
        assert "no hardware profiles: ex_engine at" in out and "--profile h200" not in out
    monkeypatch.setenv("EX_ENGINE_MANIFESTS", str(tmp_path / "elsewhere"))
    assert _paths.not_a_checkout() == ""     # pointed somewhere on purpose: the plain message
    # build needs the checkout's Makefile whatever the folder variables say (it suggested them)
    monkeypatch.setenv("EX_ENGINE_FACTORS", str(tmp_path / "elsewhere"))
    assert main(["build"]) == 2
    err = capsys.readouterr().err
    assert "no Makefile in" in err and "make -C <checkout>" in err and "EX_ENGINE_" not in err, err


def test_small_argument_faults_from_a_fresh_users_review(tmp_path, capsys):
    """lock --output '' wrote the default lock file; verify=\"no\" switched verification on;
    eps = 1e-60 passed 'gt: 0' and was 0 in float32 (NaN rows); verify without a GPU said
    'verifying' for factors it then skipped."""
    import numpy as np
    from ex_engine import FactorRegistry, fused_add_rmsnorm
    from ex_engine.errors import ArgumentError, FactorError
    with pytest.raises(SystemExit) as exc:   # argparse's usage error, as for every empty option
        main(["lock", "--dir", str(tmp_path), "--output", ""])
    assert exc.value.code == 2
    assert "argument --output: expected a non-empty value, got ''" in capsys.readouterr().err
    assert not (tmp_path / "ex_engine.lock").exists()
    for bad in ("no", "yes", 2, None, np.array([1])):
        with pytest.raises(FactorError, match="verify: expected True or False"):
            FactorRegistry.load(tmp_path, hardware="h200", verify=bad)
    for good in (0, 1, np.True_, False):     # as a manifest's bool parameter takes them
        FactorRegistry.load(tmp_path, hardware="h200", verify=good)
    x, r, w = np.zeros((2, 8), np.float32), np.zeros((2, 8), np.float32), np.ones(8, np.float32)
    for eps in (1e-60, 1e-40, 1e39):     # 0 in float32, a subnormal, inf
        with pytest.raises(ArgumentError, match="'eps'.*rounds to a normal float32"):
            fused_add_rmsnorm(x, r, w, eps=eps)
    fused_add_rmsnorm(x, r, w, eps=1.17549435e-38)   # how NumPy prints float32's smallest normal
    fused_add_rmsnorm(x, r, w, eps=3.4028235e38)     # and its largest
    assert np.isfinite(x).all()
    from ex_engine.hardware import Hardware
    if Hardware.detect() is None and (ROOT / "factors" / "moe_fused_gemm.so").exists():
        main(["verify"])
        out = capsys.readouterr().out
        assert "skipping moe_fused_gemm" in out and "verifying moe_fused_gemm" not in out


def _models_file(tmp_path, monkeypatch, text):
    """A copy of manifests/ whose moe_models.yaml is ``text``, in use through EX_ENGINE_MANIFESTS."""
    import shutil
    mdir = tmp_path / "manifests"
    shutil.copytree(Path(__file__).resolve().parents[1] / "manifests", mdir)
    (mdir / "moe_models.yaml").write_text(text, encoding="utf-8")
    monkeypatch.setenv("EX_ENGINE_MANIFESTS", str(mdir))
    return mdir / "moe_models.yaml"


@pytest.mark.parametrize("entry,message", [
    ("{H: -8, I: 768, E: 128, K: 8, renormalize: true}", "H: expected an integer >= 1, got -8"),
    ("{H: 2048.7, I: 768, E: 128, K: 8, renormalize: true}", "H: expected an integer >= 1, got 2048.7"),
    ("{H: 2048, I: 0, E: 128, K: 8}", "I: expected an integer >= 1, got 0"),
    ("{H: 2048, I: 768, E: true, K: 1}", "E: expected an integer >= 1, got True"),
    ("{H: 2048, I: 768, E: 128}", "K: missing; expected an integer >= 1"),
    ("{H: 2048, I: 768, E: 4, K: 8}", "K: expected at most E = 4"),
    ('{H: 2048, I: 768, E: 128, K: 8, renormalize: "no"}', "renormalize: expected true or false, got 'no'"),
    ("{H: 2048, I: 768, E: 128, K: 8, renormalise: true}", "unknown field(s) ['renormalise']"),
    ("[2048, 768, 128, 8]", "expected a mapping {H, I, E, K, renormalize}"),
])
def test_run_moe_refuses_a_bad_model_entry_naming_file_model_and_field(tmp_path, monkeypatch, capsys,
                                                                       entry, message):
    """moe_models.yaml was read with int() and bool(): H: -8 was NumPy's traceback, H: 2048.7
    ran as 2048 and renormalize: "no" as true, both a PASS."""
    path = _models_file(tmp_path, monkeypatch, f"models:\n  qwen3-30b-a3b: {entry}\n")
    assert main(["run", "moe", "--tokens", "2"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith(f"ex-engine: error: model list {path}: model 'qwen3-30b-a3b': ") and message in err, err
    assert "\n" not in err and "Traceback" not in err and "PASS" not in captured.out


def test_run_moe_names_an_unknown_model_before_loading_any_plugin(capsys):
    """An unknown --model was found only after the registry loaded: its notes (e.g. 'no ready
    plugin ...' where no .so is built) came first, and the error line last."""
    assert main(["run", "moe", "--model", "foo", "--tokens", "1"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("ex-engine: error: model 'foo': unknown; expected one of ['deepseek-v2-lite'"), err
    assert "\n" not in err and captured.out == ""


@pytest.mark.parametrize("text,message", [
    ("models: {}\n", "models: expected at least one model"),
    ("models:\n", "models: expected at least one model"),
    ("", "expected a mapping with a 'models' key, got an empty file"),
    ("token_counts: [1, 8]\n", "models: missing"),
    ("models:\n  m: {H: 8, I: 8, E: 2, K: 1}\ntoken_counts: [0, 8]\n",
     "token_counts: expected a non-empty list of integers >= 1, got [0, 8]"),
    ("models:\n  m: {H: 8, I: 8, E: 2, K: 1}\nmodel: {}\n", "unknown key(s) ['model']"),
])
def test_run_moe_all_refuses_an_empty_or_malformed_model_list(tmp_path, monkeypatch, capsys, text, message):
    """`models: {}` with --model all printed only 'stats: {}' and exit status 0: nothing ran."""
    path = _models_file(tmp_path, monkeypatch, text)
    assert main(["run", "moe", "--model", "all", "--tokens", "2"]) == 2
    captured = capsys.readouterr()
    assert f"ex-engine: error: model list {path}: " in captured.err and message in captured.err, captured.err
    assert "stats:" not in captured.out


def test_load_models_keeps_the_shipped_models_and_their_types(tmp_path, monkeypatch):
    """The benchmarks and GPU tests read the shipped file through load_models: every model comes
    back with int dims and a bool renormalize; a small valid file loads as written."""
    from ex_engine.moe_layer import load_models
    models = load_models()
    assert {"qwen3-30b-a3b", "mixtral-8x7b", "granite-3.0-3b-a800m"} <= set(models)
    for s in models.values():
        assert all(type(v) is int and v >= 1 for v in (s.H, s.I, s.E, s.K)) and s.K <= s.E
        assert type(s.renormalize) is bool
    assert models["mixtral-8x7b"].renormalize is True and models["olmoe-1b-7b"].renormalize is False
    path = _models_file(tmp_path, monkeypatch, "models:\n  tiny: {H: 16, I: 8, E: 4, K: 4}\n")
    (s,) = load_models(path).values()
    assert (s.model, s.H, s.I, s.E, s.K, s.renormalize) == ("tiny", 16, 8, 4, 4, False)


def test_run_moe_says_what_it_is_doing_before_the_long_steps(tmp_path):
    """qwen3-235b-a22b on a CPU spent ~45 s building 5 GB of weights with nothing printed
    between the header and the table. Now a line on stderr comes before each long step (seen
    here through one merged stream, in order: header, steps, table)."""
    r = subprocess.run([sys.executable, "-m", "ex_engine", "run", "moe", "--model", "granite-3.0-3b-a800m",
                        "--tokens", "1", "--dir", str(tmp_path)],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert r.returncode == 0, r.stdout
    lines = r.stdout.splitlines()
    at = {key: next((i for i, line in enumerate(lines) if key in line), None)
          for key in ("MoE layer granite", "building the layer's weights (0.19 GB", "running the layer",
                      "computing the float64 reference", "timing each factor (", "served by", "PASS")}
    assert None not in at.values(), r.stdout
    assert list(at.values()) == sorted(at.values()), r.stdout
    from ex_engine.moe_layer import run_moe        # a library caller gets the steps only if it asks
    seen = []
    res = run_moe("granite-3.0-3b-a800m", 1, echo=lambda *a: None, progress=seen.append)
    # (on the CPU a first line says how much memory and time to expect)
    assert res["ok"] and [s.split()[0] for s in seen] == ["on", "building", "running", "computing", "timing"]
    assert seen[0].startswith("  on the CPU: about 0.2 GB, and about ")


def test_from_device_names_a_missing_index(monkeypatch):
    """A wrong GPU index said 'no CUDA device visible to CuPy' (as if there were no GPU at all):
    the message names the index and how many devices CuPy sees; a non-int index is refused."""
    import types
    from ex_engine.errors import FactorError
    from ex_engine.hardware import Hardware, NoDeviceError
    runtime = types.SimpleNamespace(getDeviceCount=lambda: 2,
                                    getDeviceProperties=lambda i: (_ for _ in ()).throw(RuntimeError("bad")))
    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime,
                                                            Device=lambda: types.SimpleNamespace(id=0)))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cupy.cuda)
    with pytest.raises(NoDeviceError, match=r"CUDA device 5: no such device; CuPy sees 2 \(indices 0 \.\. 1\)"):
        Hardware.from_device(5)
    with pytest.raises(NoDeviceError, match=r"CUDA device 1: cannot read its properties.*2 device"):
        Hardware.from_device(1)
    for bad in ("x", -1, 1.0, True):
        with pytest.raises(FactorError, match=r"Hardware.from_device: device_id: expected an int >= 0"):
            Hardware.from_device(bad)


def _crashing_plugin_dir(tmp_path):
    from tests.conftest import build_plugin
    build_plugin(tmp_path / "crash", defines={"CRASH": True})
    return tmp_path / "crash"


def test_list_factors_and_verify_probe_by_default_and_run_prints_a_fault_traceback(tmp_path):
    """A library that crashes in ex_get_factor killed list-factors and verify with only the
    shell's "Segmentation fault" unless --probe was given. They probe by default now (a
    rejected row naming the crash); --no-probe opens in-process; run moe stays in-process but a
    crash prints Python's fault traceback, and run's help says --probe finds the library."""
    folder = str(_crashing_plugin_dir(tmp_path))
    env = child_env()
    r = subprocess.run([sys.executable, "-m", "ex_engine", "list-factors", "--dir", folder, "--hardware", "h200"],
                       capture_output=True, text=True, env=env, timeout=120)
    # exit status 1: its only library was rejected, no plugin is ready
    assert r.returncode == 1 and "crashed in ex_get_factor: signal SIGSEGV" in r.stdout, (r.returncode, r.stdout, r.stderr)
    r = subprocess.run([sys.executable, "-m", "ex_engine", "verify", "--dir", folder, "--hardware", "h200"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1 and "no ready plugins" in r.stderr, (r.returncode, r.stdout, r.stderr)
    r = subprocess.run([sys.executable, "-m", "ex_engine", "list-factors", "--no-probe", "--dir", folder,
                        "--hardware", "h200"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode < 0 and "Fatal Python error: Segmentation fault" in r.stderr, (r.returncode, r.stderr)
    r = subprocess.run([sys.executable, "-m", "ex_engine", "run", "moe", "--tokens", "1", "--dir", folder,
                        "--hardware", "h200"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode < 0 and "Fatal Python error: Segmentation fault" in r.stderr, (r.returncode, r.stderr)
    assert "cli.py" in r.stderr, r.stderr   # the traceback says where
    run_help = build_parser()._subparsers._group_actions[0].choices["run"]._subparsers \
        ._group_actions[0].choices["moe"].format_help()
    assert "--probe finds" in " ".join(run_help.split()), run_help


def test_run_moe_prints_the_registrys_notes(tmp_path, capsys):
    """--prefer moe_fused_gemm=nope.so gave PASS with no mention in run moe (list-factors says
    'note: prefer: ...'): run prints the registry's notes on stderr."""
    code = main(["run", "moe", "--model", "granite-3.0-3b-a800m", "--tokens", "1", "--dir", str(tmp_path),
                 "--prefer", "moe_fused_gemm=nope.so"])
    captured = capsys.readouterr()
    assert code == 0, captured
    assert "note: prefer: moe_fused_gemm -> nope.so: no ready plugin" in captured.err, captured.err


@pytest.mark.parametrize("argv", [
    ["list-factors", "--dir", ""], ["list-factors", "--hardware", ""], ["list-factors", "--lock", ""],
    ["verify", "--dir", ""], ["run", "moe", "--dir", ""], ["lock", "--dir", "", "--output", "x"],
    ["lock", "--output", ""], ["hardware", "--profile", ""], ["build", "--archs="]])
def test_an_empty_string_is_an_error_naming_the_option(argv, capsys, tmp_path, monkeypatch):
    """--dir '' was the default folder for list-factors but the current one for lock (which
    locked it), --profile '' was 'not given', --build --archs='' ran a plain make: each is a
    usage error naming the option now."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    opt = next(a.split("=")[0] for a in argv if a.startswith("--"))
    assert f"argument {opt}: expected a non-empty value, got ''" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_build_takes_factor_names(tmp_path, monkeypatch, capsys):
    """`ex-engine build` could only run make's `all` (every factor: minutes, the CUTLASS one);
    `build NAME...` builds factors/<NAME>.so alone, and a name with no source is a usage error
    listing the known factors (make is not run)."""
    import shutil
    from ex_engine import _paths
    if shutil.which("make") is None or shutil.which("cc") is None:
        pytest.skip("make or cc not installed")
    assert main(["build", "no_such_factor"]) == 2
    err = capsys.readouterr().err
    assert "ex-engine build: no factor source for 'no_such_factor'" in err, err
    assert "known are fused_add_rmsnorm, moe_fused_gemm, moe_fused_gemm_sm90, topk_softmax" in err, err
    # a checkout of its own (the test writes no .so into this one), with two host factors
    proj = tmp_path / "checkout"
    (proj / "factors").mkdir(parents=True)
    shutil.copy(ROOT / "Makefile", proj / "Makefile")
    shutil.copytree(ROOT / "include", proj / "include")
    for stem in ("one", "two"):
        shutil.copy(ROOT / "tests" / "plugins" / "host_scale.c", proj / "factors" / f"{stem}.c")
    monkeypatch.setattr(_paths, "ROOT", proj)
    assert main(["build", "one"]) == 0
    assert (proj / "factors" / "one.so").is_file() and not (proj / "factors" / "two.so").exists()
    assert main(["build", "two.so", "-j", "1"]) == 0           # the library's file name works too
    assert (proj / "factors" / "two.so").is_file()
    out = capsys.readouterr().out
    assert [ln.split()[-1] for ln in out.splitlines() if ln.startswith("running: make ")] == \
        ["factors/one.so", "factors/two.so"], out
    assert main(["build", "one"]) == 0          # built already: says so instead of make's silence
    out = capsys.readouterr().out
    assert "ex-engine build: factors/one.so up to date" in out, out
    assert main(["build", "three"]) == 2
    assert "known are one, two (the file stems of factors/*.cu, *.c and *.cpp)" in capsys.readouterr().err
    # --archs: no -B (it rebuilt every library named, or all, whatever their flags): the flag
    # stamps rebuild the libraries whose own flags change (host factors: none here)
    assert main(["build", "--archs=-gencode=arch=compute_80,code=sm_80", "one"]) == 0
    out = capsys.readouterr().out
    assert " -B " not in out and "built factors/one.so" not in out, out


def test_manifests_search_path_keeps_the_shipped_profiles_and_manifests(tmp_path, monkeypatch, capsys):
    """EX_ENGINE_MANIFESTS set to an author's own folder lost the shipped manifests and hardware
    profiles ('expected one of []'): it takes several folders joined with os.pathsep, searched
    in order; profiles and tuning come from the first folder with a hardware/ folder."""
    import os
    from ex_engine import FactorRegistry, _paths
    from ex_engine.errors import FactorError
    from ex_engine.hardware import Hardware, list_profiles
    from tests.conftest import build_plugin
    shipped = ROOT / "manifests"
    mine, plugs = tmp_path / "mine", tmp_path / "plugs"
    mine.mkdir()
    build_plugin(plugs, manifest=False)                    # host_scale.so, no manifest beside it
    host_text = (ROOT / "tests" / "plugins" / "host_scale.yaml").read_text(encoding="utf-8")
    (mine / "host_scale.yaml").write_text(host_text, encoding="utf-8")
    # a shipped factor's manifest in the first folder wins over the shipped one
    topk = (shipped / "topk_softmax.yaml").read_text(encoding="utf-8")
    (mine / "topk_softmax.yaml").write_text(topk.replace("summary: \"", "summary: \"mine: ", 1), encoding="utf-8")
    path = os.pathsep.join([str(mine), str(shipped)])
    monkeypatch.setenv("EX_ENGINE_MANIFESTS", path)
    assert _paths.manifests_dirs() == [mine, shipped] and _paths.manifests_dir() == shipped
    assert list_profiles() == ["a100", "bi-v100", "h100", "h200"]
    assert Hardware.from_profile("h200").name == "NVIDIA H200"
    for reg in (FactorRegistry.load(plugs, hardware="h200"),                    # from the variable
                FactorRegistry.load(plugs, hardware="h200", manifests_dir=path)):   # or given
        p = reg.get("host_scale")
        assert p is not None and p.status == "ready", [(q.path.name, q.reason) for q in reg.plugins]
        assert p.manifest.path == str(mine / "host_scale.yaml")
        assert {"fused_add_rmsnorm", "moe_fused_gemm"} <= set(reg.manifests)
        assert reg.manifests["topk_softmax"].path == str(mine / "topk_softmax.yaml")
        assert reg.manifests["moe_fused_gemm"].path == str(shipped / "moe_fused_gemm.yaml")
        assert reg.tuning.folder == shipped / "tuning"
        assert str(reg.manifests_dir) == path
    # verify's child process loads the same manifests (it gets the registry's manifests_dir)
    assert main(["verify", "--dir", str(plugs), "--hardware", "h200"]) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    assert "host_scale" in out and "FAIL" not in out, out
    assert main(["list-factors", "--dir", str(plugs), "--hardware", "h200", "--no-probe"]) == 0
    capsys.readouterr()
    # a folder of the path that does not exist is a note, not an error, in the variable and in
    # manifests_dir= alike (one rule, session 32; manifests_dir= was an error); none there is
    gone = tmp_path / "gone"
    monkeypatch.setenv("EX_ENGINE_MANIFESTS", os.pathsep.join([str(gone), path]))
    reg = FactorRegistry.load(plugs, hardware="h200")
    assert reg.get("host_scale").status == "ready"
    assert any(f"manifests folder {gone} " in n and "does not exist; skipped" in n for n in reg.notes), reg.notes
    reg = FactorRegistry.load(plugs, hardware="h200", manifests_dir=os.pathsep.join([path, str(gone)]))
    assert reg.get("host_scale").status == "ready"
    assert any(f"manifests folder {gone} " in n and "does not exist; skipped" in n for n in reg.notes), reg.notes
    with pytest.raises(FactorError, match=f"manifests_dir '{gone}': does not exist"):
        FactorRegistry.load(plugs, hardware="h200", manifests_dir=gone)
    # one folder replaces the default, as before (no hardware/ there: no profiles)
    monkeypatch.setenv("EX_ENGINE_MANIFESTS", str(mine))
    assert _paths.manifests_dirs() == [mine] and list_profiles() == []


def test_the_readme_dispatch_example_runs(capsys):
    """README said to dispatch 'with the manifest's parameters' but not how (keyword arguments
    are a TypeError): its example, parameters as the third argument, runs as printed."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    at = text.index('reg.dispatch("fused_add_rmsnorm"')
    code = text[text.rindex("```python", 0, at) + len("```python"):text.index("```", at)]
    exec(compile(code, "README.md", "exec"), {})
    assert capsys.readouterr().out.strip() == "python_fallback"


def test_no_cupy_is_named_as_such_not_as_no_gpu(monkeypatch, capsys):
    """Without CuPy, `ex-engine hardware` said 'no GPU visible to CuPy': on a GPU machine where
    the gpu extra was forgotten that points the wrong way. It names the import and the extra."""
    import sys
    from ex_engine import FactorRegistry
    from ex_engine.hardware import Hardware
    monkeypatch.setitem(sys.modules, "cupy", None)     # import cupy raises ImportError
    assert Hardware.detect() is None
    assert main(["hardware"]) == 0
    out = capsys.readouterr().out
    assert "CuPy cannot be imported" in out and "pip install -e '.[gpu]'" in out, out
    reg = FactorRegistry(hardware=None)
    assert reg.no_gpu_note.startswith("CuPy cannot be imported")


def test_run_moe_says_when_no_plugin_serves(tmp_path, capsys):
    """With no ready plugin (an empty folder, or every library rejected), run moe printed only
    'python_fallback ... PASS'; it now says on stderr that the Python fallback serves, and why."""
    assert main(["run", "moe", "--model", "granite-3.0-3b-a800m", "--tokens", "1", "--dir", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert f"note: no ready plugin for moe_fused_gemm in {tmp_path} (no *.so there): the Python fallback serves it" in err, err


def test_a_relative_factor_folder_that_is_not_there_names_where_it_looked(tmp_path, monkeypatch):
    """From another working directory, FactorRegistry.load('factors/') said only "factor folder
    'factors': not a directory"; it names the absolute path, whether it exists, and the variable
    it came from."""
    from ex_engine import FactorError, FactorRegistry
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FactorError, match=f"factor folder 'factors' \\(= {tmp_path / 'factors'}\\): does not exist"):
        FactorRegistry.load("factors/", hardware="h200")
    (tmp_path / "factors").write_text("a file")
    with pytest.raises(FactorError, match="not a directory"):
        FactorRegistry.load("factors/", hardware="h200")


def test_run_moe_without_a_factors_manifest_fails_before_building_weights(tmp_path, monkeypatch, capsys):
    """A manifests folder without topk_softmax.yaml: run moe said 'the Python fallback serves it',
    built the layer's weights, then failed with a bare 'no factor named' (the fallback needs the
    manifest too). It now fails first, naming the library set aside and the manifest it lacks."""
    import shutil
    from tests.conftest import ROOT
    if not (ROOT / "factors" / "topk_softmax.so").exists():
        pytest.skip("factors not built")
    shutil.copytree(ROOT / "manifests", tmp_path / "m")
    (tmp_path / "m" / "topk_softmax.yaml").unlink()
    monkeypatch.setenv("EX_ENGINE_MANIFESTS", str(tmp_path / "m"))
    assert main(["run", "moe", "--model", "granite-3.0-3b-a800m", "--tokens", "1"]) == 2
    captured = capsys.readouterr()
    assert "no factor named 'topk_softmax' (topk_softmax.so: manifest: expected topk_softmax.yaml" in captured.err
    assert "fallback serves it" not in captured.err and "building the layer" not in captured.out


# ---------------------------------------------------------------- a new-user trial's findings

def _lock_folder(tmp_path):
    """A folder of two libraries (their bytes need not be ELF: lock only hashes them)."""
    folder = tmp_path / "lk"
    folder.mkdir()
    (folder / "topk_softmax.so").write_bytes(b"\x7fELF library one")
    (folder / "other.so").write_bytes(b"\x7fELF library two")
    return folder


@pytest.mark.parametrize("output,says", [
    ("topk_softmax.so", "is the library {folder}/topk_softmax.so (one of those being locked)"),
    ("alias", "is the library {folder}/topk_softmax.so (one of those being locked)"),
    ("new.so", "expected a lock file name, got a library's (*.so)"),
    ("notes.txt", "exists and is not a lock file (not readable JSON"),
    ("other.json", "exists and is not a lock file (entry 'a': expected a SHA-256 digest"),
    ("sub", "is a folder; expected a file name"),
])
def test_lock_refuses_an_output_it_would_destroy(tmp_path, capsys, output, says):
    """`lock --dir D --output D/topk_softmax.so` wrote the lock JSON over the library (and
    recorded the hash of the library it destroyed); any existing file was overwritten likewise.
    A *.so name, a library (by any name), a folder or a file that is not a lock file is refused,
    exit status 2, and nothing is written."""
    folder = _lock_folder(tmp_path)
    (folder / "alias").symlink_to(folder / "topk_softmax.so")
    (folder / "notes.txt").write_text("my notes\n")
    (folder / "other.json").write_text('{"a": 1}\n')
    (folder / "sub").mkdir()
    before = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    assert main(["lock", "--dir", str(folder), "--output", str(folder / output)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith(f"ex-engine: error: lock: --output {folder / output}: "), err
    assert says.format(folder=folder) in err and "\n" not in err, err
    assert captured.out == ""
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()} == before
    assert not (folder / "new.so").exists() and not (folder / "ex_engine.lock").exists()


def test_lock_replaces_a_lock_file_or_an_empty_file_and_refuses_a_bad_default(tmp_path, capsys):
    """Writing over an existing lock file stays allowed (as over an empty one, e.g. mktemp's);
    the default <dir>/ex_engine.lock is refused like --output when it holds something else."""
    folder = _lock_folder(tmp_path)
    assert main(["lock", "--dir", str(folder)]) == 0
    lock = folder / "ex_engine.lock"
    first = json.loads(lock.read_text(encoding="utf-8"))
    (folder / "other.so").write_bytes(b"\x7fELF library two, rebuilt")
    assert main(["lock", "--dir", str(folder)]) == 0
    assert json.loads(lock.read_text(encoding="utf-8"))["other.so"] != first["other.so"]
    empty = tmp_path / "empty.lock"
    empty.write_text("")
    assert main(["lock", "--dir", str(folder), "--output", str(empty)]) == 0
    assert json.loads(empty.read_text(encoding="utf-8")) == json.loads(lock.read_text(encoding="utf-8"))
    capsys.readouterr()
    lock.write_text("not a lock\n")
    assert main(["lock", "--dir", str(folder)]) == 2
    err = capsys.readouterr().err
    assert f"lock: the default lock file {lock}: exists and is not a lock file" in err, err
    assert lock.read_text(encoding="utf-8") == "not a lock\n"


def test_lock_notes_each_so_entry_it_leaves_out(tmp_path, capsys):
    """A dangling link dangling.so and a folder dir.so were left out of the lock without a word,
    while `lock --help` said "every *.so in the folder": each now has a note saying why."""
    import os
    folder = _lock_folder(tmp_path)
    (folder / "dangling.so").symlink_to(tmp_path / "gone")
    (folder / "dir.so").mkdir()
    (folder / "linkdir.so").symlink_to(folder / "dir.so")
    os.mkfifo(folder / "fifo.so")
    assert main(["lock", "--dir", str(folder)]) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if line.startswith("note: ")]
    tail = "; a lock lists regular files only (the registry refuses anything else)"
    assert notes == [f"note: dangling.so left out: a dangling symbolic link (to {tmp_path / 'gone'})" + tail,
                     "note: dir.so left out: a folder" + tail,
                     "note: fifo.so left out: a FIFO" + tail,
                     "note: linkdir.so left out: a link to a folder" + tail], out
    assert set(json.loads((folder / "ex_engine.lock").read_text(encoding="utf-8"))) == {"other.so", "topk_softmax.so"}
    text = " ".join(build_parser()._subparsers._group_actions[0].choices["lock"].format_help().split())
    assert "every *.so file in the folder (an entry named *.so that is not a regular file" in text


@pytest.mark.parametrize("command", [["list-factors"], ["verify"], ["run", "moe", "--tokens", "1"]])
def test_a_folder_given_as_lock_is_named_as_a_folder(tmp_path, capsys, command):
    """`list-factors --lock DIR` said 'lock file DIR: not readable JSON ([Errno 21] Is a
    directory ...)'; it now says DIR is a folder and a lock file was expected, and names the
    one inside if there is one."""
    folder = _lock_folder(tmp_path)
    assert main(command + ["--dir", str(folder), "--lock", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err == (f"ex-engine: error: --lock {folder}: is a folder; expected a lock file (the JSON "
                   f"{{file name: sha256}} written by `ex-engine lock`); `ex-engine lock --dir {folder}` "
                   f"writes one ({folder / 'ex_engine.lock'})\n"), err
    assert main(["lock", "--dir", str(folder)]) == 0
    capsys.readouterr()
    assert main(command + ["--dir", str(folder), "--lock", str(folder)]) == 2
    err = capsys.readouterr().err
    assert f"is a folder; expected a lock file" in err and f"did you mean --lock {folder / 'ex_engine.lock'}?" in err, err
    assert "Errno" not in err


@pytest.mark.parametrize("model,hint", [("ALL", "; did you mean 'all'? (names are case-sensitive)"),
                                        ("Mixtral-8x7B", "; did you mean 'mixtral-8x7b'?"), ("gpt-5", "")])
def test_run_moe_unknown_model_names_all_as_a_choice(capsys, model, hint):
    """`run moe --model ALL` listed the models but not 'all', which is valid too."""
    assert main(["run", "moe", "--model", model, "--tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert (f"model '{model}': unknown; expected one of ['deepseek-v2-lite'" in err
            and "'qwen3-30b-a3b'] or 'all' (every model)" + hint in err), err


def _readme_command_lines() -> dict:
    """The README's "Command line" block: {command (e.g. 'run moe'): its options part}."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text.split("## Command line\n", 1)[1].split("```\n", 2)[1]
    out = {}
    for line in block.splitlines():
        usage = re.split(r"\s{2,}", line)[0]          # the description follows two spaces
        words = usage.split()
        name = " ".join(words[1:3]) if words[1] == "run" else words[1]
        out[name] = usage.split(name, 1)[1]
    return out


def test_the_readmes_command_lines_match_each_commands_help():
    """The README showed `run moe --model M|all --tokens T [T ...]` as if both were required
    (they are optional: qwen3-30b-a3b and 64) and `--dtype`, `--seed`, `--repeat` without their
    values. Each line now names the options of its command's usage (bar --help and the --lock,
    --lock-warn, --prefer the paragraph below gives), every option in brackets, as optional as
    the parser has it."""
    lines = _readme_command_lines()
    ap = build_parser()
    parsers = ap._subparsers._group_actions[0].choices
    parsers = {**parsers, "run moe": parsers["run"]._subparsers._group_actions[0].choices["moe"]}
    assert set(lines) == {"list-factors", "hardware", "run moe", "verify", "lock", "build"}, lines
    shared = {"-h", "--help", "--lock", "--lock-warn", "--prefer"}
    for name, usage in lines.items():
        p = parsers[name]
        opts = {o for a in p._actions for o in a.option_strings} - shared
        shown = set(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", usage))
        assert shown <= opts | {"--no-probe"}, (name, shown - opts)
        for a in p._actions:    # every option of the parser is shown (one of --probe/--no-probe)
            if a.option_strings and not set(a.option_strings) & shared:
                assert set(a.option_strings) & shown, (name, a.option_strings)
            if a.option_strings:
                assert not a.required
        bare = usage
        while re.search(r"\[[^\[\]]*\]", bare):     # what is left outside brackets is required
            bare = re.sub(r"\[[^\[\]]*\]", "", bare)
        assert not re.search(r"(?<![\w-])--?[a-z]", bare), (name, bare)
        real = " ".join(p.format_usage().split())
        for shown_as in re.findall(r"\[--?[a-z][\w-]* [A-Z]+", usage):   # an option's value as named
            assert shown_as in real, (name, shown_as, real)


def test_the_readme_says_build_needs_a_checkout_not_the_folder_variables():
    """After a plain `pip install .` with EX_ENGINE_MANIFESTS and EX_ENGINE_FACTORS set, as the
    README said to, `ex-engine build` still refuses (no Makefile in site-packages): the README
    says so where it names the two variables."""
    text = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    at = text.index("A plain `pip install .`")
    paragraph = text[at:text.index("**Run the tests**", at)]
    assert "`EX_ENGINE_FACTORS=<checkout>/factors`" in paragraph
    assert ("The two variables serve every command but `ex-engine build`, which runs the Makefile "
            "beside the package: it works only from a checkout") in paragraph, paragraph
    assert "`no Makefile in .../site-packages`" in paragraph and "`make -C <checkout>`" in paragraph


def test_run_moe_builds_each_models_weights_once_for_all_its_token_counts(tmp_path, monkeypatch, capsys):
    """`run moe --model all --tokens 1 3` built each model's weights once per T (2.82 GB twice
    for mixtral). Now once per model, reused for its other T; the next model's replace them (one
    model's weights alive at a time)."""
    from ex_engine import moe_layer
    _models_file(tmp_path, monkeypatch, "models:\n  tiny-a: {H: 64, I: 32, E: 4, K: 2}\n"
                                        "  tiny-b: {H: 32, I: 16, E: 8, K: 2, renormalize: true}\n")
    built, alive = [], []
    real = moe_layer.MoELayer

    class Counted(real):
        def __init__(self, shape, *a, **k):
            built.append(shape.model)
            super().__init__(shape, *a, **k)
            alive.append(sum(1 for r in refs if r() is not None))   # layers alive besides this one
            refs.append(weakref.ref(self))

    import weakref
    refs = []
    monkeypatch.setattr(moe_layer, "MoELayer", Counted)
    assert main(["run", "moe", "--model", "all", "--tokens", "1", "3", "2", "--dir", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert built == ["tiny-a", "tiny-b"] and alive == [0, 0], (built, alive)
    assert captured.err.count("building the layer's weights") == 2, captured.err
    assert captured.err.count("reusing the layer's weights (0.00 GB), built for an earlier T") == 4
    assert captured.out.count("PASS") == 6 and "[6/6] MoE layer tiny-b: T=2" in captured.out
    # a library caller's dict holds one layer at most; without one, each call builds its own
    layers = {}
    for model, T in (("tiny-a", 1), ("tiny-a", 2), ("tiny-b", 1)):
        assert moe_layer.run_moe(model, T, echo=lambda *a: None, layers=layers)["ok"]
        assert [k[0].model for k in layers] == [model]
    assert moe_layer.run_moe("tiny-b", 1, echo=lambda *a: None)["ok"] and len(built) == 5
    with pytest.raises(moe_layer.FactorError, match="run_moe: layers: expected None or a dict"):
        moe_layer.run_moe("tiny-b", 1, echo=lambda *a: None, layers=[])
