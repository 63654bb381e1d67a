"""The ex-engine command line on a machine without a GPU."""
import json
import subprocess
import sys

import pytest
from pathlib import Path

from ex_engine.cli import build_parser, main


@pytest.mark.parametrize("argv", [[], ["list-factors"], ["hardware"], ["run"], ["run", "moe"], ["build"],
                                  ["verify"], ["lock"]])
def test_every_command_has_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv + ["--help"])
    assert e.value.code == 0
    assert "usage: ex-engine" in capsys.readouterr().out


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
    assert "hardware profile 'tpu9': no such profile; expected one of ['a100', 'bi-v100', 'h200']" in err


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


def test_run_without_a_job_prints_runs_help(capsys):
    """`ex-engine run` alone: run's usage (not the last subcommand's), exit status 2."""
    assert main(["run"]) == 2
    out = capsys.readouterr().out
    assert "usage: ex-engine run" in out and "ex-engine build" not in out


def test_lock_to_a_missing_folder_is_a_clear_error(tmp_path, capsys):
    assert main(["lock", "--dir", str(tmp_path), "--output", str(tmp_path / "no" / "x.lock")]) == 2
    assert "ex-engine: error: lock: cannot write the lock file" in capsys.readouterr().err


@pytest.mark.parametrize("argv,says", [
    (["run", "moe", "--model", "granite-3.0-3b-a800m", "--tokens", "1", "--repeat", "0"], "--repeat: expected >= 1, got 0"),
    (["build", "--jobs", "0"], "--jobs: expected >= 1, got 0"),
])
def test_bad_counts_are_refused_before_any_work(argv, says, capsys):
    assert main(argv) == 2
    assert says in capsys.readouterr().err


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


def test_list_factors_names_the_tuning_file_in_use(tmp_path, capsys):
    from ex_engine.tuning import tuning_dir
    assert main(["list-factors", "--dir", str(tmp_path), "--hardware", "h200"]) == 0
    assert f"tuning: {tuning_dir() / 'h200.yaml'}" in capsys.readouterr().out
    assert main(["list-factors", "--dir", str(tmp_path), "--hardware", "a100"]) == 0
    assert "tuning: no file for NVIDIA A100-SXM4-80GB (108 SMs) in" in capsys.readouterr().out
    assert main(["list-factors", "--dir", str(tmp_path), "--hardware", "h200", "--json"]) == 0
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
    with pytest.raises(FactorError, match="factor folder .*not a directory.*pip install -e <checkout>"):
        FactorRegistry.load(hardware=str(real_profile))
    assert main(["hardware"]) == 0
    out = capsys.readouterr().out
    if "no GPU visible" in out:       # with a GPU it describes the GPU instead
        assert "no hardware profiles: ex_engine at" in out and "--profile h200" not in out
    monkeypatch.setenv("EX_ENGINE_MANIFESTS", str(tmp_path / "elsewhere"))
    assert _paths.not_a_checkout() == ""     # pointed somewhere on purpose: the plain message


def test_small_argument_faults_from_a_fresh_users_review(tmp_path, capsys):
    """lock --output '' wrote the default lock file; verify=\"no\" switched verification on;
    eps = 1e-60 passed 'gt: 0' and was 0 in float32 (NaN rows); verify without a GPU said
    'verifying' for factors it then skipped."""
    import numpy as np
    from ex_engine import FactorRegistry, fused_add_rmsnorm
    from ex_engine.errors import ArgumentError, FactorError
    assert main(["lock", "--dir", str(tmp_path), "--output", ""]) == 2
    assert "--output: expected a file name, got ''" in capsys.readouterr().err
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
    if Hardware.detect() is None:
        main(["verify"])
        out = capsys.readouterr().out
        assert "skipping moe_fused_gemm" in out and "verifying moe_fused_gemm" not in out


def _models_file(tmp_path, monkeypatch, text):
    """A copy of manifests/ whose moe_models.yaml is ``text``, in use through EX_ENGINE_MANIFESTS."""
    import shutil
    mdir = tmp_path / "manifests"
    shutil.copytree(Path(__file__).resolve().parents[1] / "manifests", mdir)
    (mdir / "moe_models.yaml").write_text(text)
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
                      "computing the float64 reference", "timing each factor (1 call)", "served by", "PASS")}
    assert None not in at.values(), r.stdout
    assert list(at.values()) == sorted(at.values()), r.stdout
    from ex_engine.moe_layer import run_moe        # a library caller gets the steps only if it asks
    seen = []
    res = run_moe("granite-3.0-3b-a800m", 1, echo=lambda *a: None, progress=seen.append)
    assert res["ok"] and [s.split()[0] for s in seen] == ["building", "running", "computing", "timing"]
