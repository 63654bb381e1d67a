"""Session 37's new user's trial (a helper on a clean clone, no GPU): `run moe`'s CPU time
estimate was off by ~100x ("about 618-1855 s" for a run of 20 s, "0-0 s" at T = 1); a library
with overwritten headers was called "truncated"; an empty manifests folder led with "expected
one of []"; `run moe --tokens 0` built the weights to check nothing; a variable of whitespace
named a folder of spaces. Each has a test here."""
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from ex_engine import FactorError, FactorRegistry
from ex_engine import moe_layer as M
from tests.conftest import ROOT, build_plugin


# ------------------------------------------------------------- run moe's CPU time estimate
def test_cpu_seconds_is_the_drawing_two_calls_and_the_reference_at_the_speeds_given():
    """The estimate is the weights' drawing, two fallback calls and the float64 reference at
    the speeds measured here (the old line assumed ~1 GFLOP/s: "about 0-0 s" at T = 1 and 100x
    the real time at T = 4096)."""
    shape = M.model_shape("granite-3.0-3b-a800m")
    elems = shape.E * 3 * shape.I * shape.H
    draw, conv, r32, r64 = 2e-8, 1e-9, 1e11, 5e10
    flops = 2.0 * 4096 * shape.K * 3 * shape.H * shape.I
    want = elems * draw + 3.5 * elems * conv + 2 * flops / r32 + flops / r64
    assert M.cpu_seconds(shape, 4096, "bfloat16", speeds=(draw, conv, r32, r64)) == pytest.approx(want)
    assert M.cpu_seconds(shape, 4096, "bfloat16", build=False, speeds=(draw, conv, r32, r64)) == \
        pytest.approx(want - elems * draw)
    # T = 1 converts only the K experts it hits
    flops1 = 2.0 * shape.K * 3 * shape.H * shape.I
    hit = shape.K / shape.E
    assert M.cpu_seconds(shape, 1, "bfloat16", build=False, speeds=(draw, conv, r32, r64)) == \
        pytest.approx(3.5 * hit * elems * conv + 2 * flops1 / r32 + flops1 / r64)


def test_numpy_speeds_are_positive_and_finite():
    for dtype in ("bfloat16", "float16"):
        sp = M.numpy_speeds(dtype)
        assert len(sp) == 4 and all(0 < v < float("inf") for v in sp), sp
    shape = M.model_shape("granite-3.0-3b-a800m")
    assert 0 < M.cpu_seconds(shape, 1, "bfloat16") < 60   # a measured estimate, here


def test_run_moe_prints_an_estimate_in_seconds_not_a_range_of_hundreds(capsys):
    seen = []
    M.run_moe("granite-3.0-3b-a800m", 1, echo=lambda *a: None, progress=seen.append)
    line = seen[0]
    assert line.startswith("  on the CPU: about 0.2 GB, and about ") and "from NumPy's speed" in line, line
    assert "0-0 s" not in line and "GFLOP/s of NumPy" not in line, line


def test_run_moe_without_progress_measures_nothing(monkeypatch):
    """A library caller that asks for no progress lines pays for no calibration."""
    monkeypatch.setattr(M, "cpu_seconds", lambda *a, **k: pytest.fail("calibrated without progress"))
    assert M.run_moe("granite-3.0-3b-a800m", 1, echo=lambda *a: None)["ok"]


# ------------------------------------------------------------------------------ T = 0
def test_run_moe_refuses_an_empty_batch():
    with pytest.raises(FactorError, match=r"run_moe: tokens: expected an int >= 1, got 0"):
        M.run_moe("granite-3.0-3b-a800m", 0, echo=lambda *a: None)


def test_cli_run_moe_refuses_tokens_zero_before_building_anything():
    r = subprocess.run([sys.executable, "-m", "ex_engine", "run", "moe", "--model", "granite-3.0-3b-a800m",
                        "--tokens", "1", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "argument --tokens: expected an integer >= 1, got '0'" in r.stderr
    assert "building" not in r.stdout


# --------------------------------------------------------------------- a corrupt library
def test_overwritten_program_headers_read_truncated_or_corrupt(tmp_path):
    """Random bytes over the program header table name impossible byte ranges: the library is
    refused before dlopen, and the message no longer says only 'truncated' of a file that has
    its whole length."""
    from ex_engine import fatbin
    good = build_plugin(tmp_path / "src")
    data = bytearray(good.read_bytes())
    e_phoff, = struct.unpack_from("<Q", data, 0x20)
    data[e_phoff + 8:e_phoff + 40] = b"\xff" * 32      # segment 0's offset, addresses and size
    with pytest.raises(fatbin.TruncatedElfError, match=r"beyond the end of the file .*: truncated or corrupt$"):
        fatbin.check_segments(bytes(data))
    folder = tmp_path / "plugins"
    folder.mkdir()
    (folder / "bad.so").write_bytes(bytes(data))
    code = ("from ex_engine import FactorRegistry\n"
            f"r = FactorRegistry.load({str(folder)!r}, hardware='h200')\n"
            "p = r.plugins[0]; print(p.status, '|', p.reason)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("rejected |") and "truncated or corrupt" in r.stdout, r.stdout
    assert "not opened" in r.stdout, r.stdout


# ------------------------------------------------------------ an empty manifests folder
def test_an_empty_manifests_folder_leads_with_its_missing_profiles(tmp_path, monkeypatch):
    from ex_engine.hardware import Hardware
    monkeypatch.setenv("EX_ENGINE_MANIFESTS", str(tmp_path))
    with pytest.raises(FactorError) as e:
        Hardware.from_profile("h200")
    msg = str(e.value)
    assert msg.startswith(f"hardware profile 'h200': no profiles to choose from: the profiles folder "
                          f"{tmp_path / 'hardware'} does not exist"), msg
    assert "expected one of []" not in msg


def test_a_wrong_profile_name_still_lists_the_profiles_there():
    from ex_engine.hardware import Hardware
    with pytest.raises(FactorError, match=r"'tpu9': no such profile; expected one of \['a100', 'bi-v100', 'h100', 'h200'\]"):
        Hardware.from_profile("tpu9")


# ------------------------------------------------------------- whitespace-only variables
@pytest.mark.parametrize("var", ["EX_ENGINE_FACTORS", "EX_ENGINE_MANIFESTS"])
def test_a_variable_of_whitespace_counts_as_unset(monkeypatch, var):
    from ex_engine import _paths
    monkeypatch.setenv(var, "  ")
    assert _paths.env_value(var) == ""
    assert _paths.factors_dir() == ROOT / "factors"
    assert _paths.manifests_dirs() == [ROOT / "manifests"]
    reg = FactorRegistry.load(ROOT / "factors", hardware="h200", probe=None)
    assert reg.manifest("topk_softmax") is not None
    monkeypatch.setenv(var, " x ")           # a name with spaces around it is still a name
    assert _paths.env_value(var) == " x "
    monkeypatch.delenv(var)
    assert _paths.env_value(var) == ""
    assert os.environ.get(var) is None
