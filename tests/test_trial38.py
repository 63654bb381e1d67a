"""A new user's trial (trial 38): table_moe.py's tracebacks on a meta or row it cannot format,
a model named 'all' in moe_models.yaml, the tests' verify cache, EX_MOE_CLUSTER_COMBINE read as
a count instead of an on/off switch."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ex_engine import FactorError
from ex_engine.moe_layer import load_models

ROOT = Path(__file__).resolve().parents[1]
ROW = {"model": "m", "T": 1, "floor_us": 1.0, "ours_us": 2.0, "x_floor": 2.0, "tflops": 1.0, "gbs": 1.0}


def _table(tmp_path, data) -> subprocess.CompletedProcess:
    f = tmp_path / "b.json"
    f.write_text(json.dumps(data), encoding="utf-8")
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "table_moe.py"), str(f)],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("meta, row, needle", [
    ({"warm_ms": "200"}, ROW, "meta: 'warm_ms': expected a number or null, got '200'"),
    ({"sets": [4]}, ROW, "meta: 'sets': expected a number or null"),
    ({}, dict(ROW, ours_us=0), "'ours_us': expected a finite number > 0, got 0"),
    ({}, dict(ROW, ours_us=-3.0, gmm_us=5.0), "'ours_us': expected a finite number > 0, got -3.0"),
])
def test_table_moe_refuses_what_it_cannot_format_instead_of_a_traceback(tmp_path, meta, row, needle):
    """A string warm_ms raised ValueError ('Unknown format code g'), ours_us = 0 a
    ZeroDivisionError, both as tracebacks: now exit status 2 naming the field."""
    r = _table(tmp_path, {"meta": meta, "rows": [row]})
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and needle in r.stderr, r.stderr


def test_table_moe_still_tabulates_a_good_row(tmp_path):
    r = _table(tmp_path, {"meta": {"warm_ms": 200, "sets": 4}, "rows": [ROW]})
    assert r.returncode == 0, r.stderr
    assert "| m | 1 | uniform |" in r.stdout


def test_a_model_named_all_is_refused(tmp_path):
    """'all' means every model to run moe and the tools: a model of that name could never be
    run alone (`--model all` ran every model), and the help listed 'all, all, ...'."""
    f = tmp_path / "moe_models.yaml"
    f.write_text("models:\n  all: {H: 8, I: 4, E: 2, K: 1}\n  one: {H: 8, I: 4, E: 2, K: 1}\n")
    with pytest.raises(FactorError, match="model name 'all': expected another name"):
        load_models(f)
    f.write_text("models:\n  one: {H: 8, I: 4, E: 2, K: 1}\n")
    assert list(load_models(f)) == ["one"]


def test_the_tests_verify_cache_is_not_the_users():
    """tests/conftest.py gives the run its own EX_ENGINE_CACHE: a test loading with verify=True
    and no cache of its own wrote ~/.cache/ex_engine/verified.json."""
    cache = os.environ.get("EX_ENGINE_CACHE", "")
    assert cache and Path(cache).resolve() != (Path.home() / ".cache" / "ex_engine").resolve()


@pytest.mark.parametrize("value", ["2", "yes"])
def test_cluster_combine_is_an_on_off_switch(value):
    """README: an on/off switch takes 0 or 1, any other value is reported on stderr. The
    portable plugin read EX_MOE_CLUSTER_COMBINE as a count: '2' passed silently as on, 'yes' was
    reported as 'expected a decimal integer >= 0'."""
    lib = ROOT / "factors" / "moe_fused_gemm.so"
    if not lib.is_file():
        pytest.skip("factors/moe_fused_gemm.so not built")
    env = dict(os.environ, EX_MOE_CLUSTER_COMBINE=value)
    code = ("from ex_engine import FactorRegistry; "
            f"FactorRegistry.load({str(lib.parent)!r}, hardware='h200')")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    line = f"moe_fused_gemm.so: EX_MOE_CLUSTER_COMBINE='{value}' ignored: expected 0 (off) or 1 (on)"
    assert line in r.stderr, r.stderr


def test_verify_names_a_refused_library_and_strict_fails_on_it(tmp_path, capsys):
    """A truncated library beside a good host factor: verify printed '1 passed', named the
    refused one nowhere, and --strict passed (exit 0). Now a note names it, a warning counts
    it, and --strict exits 3."""
    from ex_engine.cli import main as cli_main
    from tests.conftest import build_plugin
    build_plugin(tmp_path)
    (tmp_path / "broken.so").write_bytes((tmp_path / "host_scale.so").read_bytes()[:100])
    assert cli_main(["verify", "--dir", str(tmp_path), "--hardware", "h200"]) == 0
    err = capsys.readouterr().err
    assert "note: broken.so refused: " in err
    assert ("warning: 1 library refused at load, not verified: broken.so (the notes above say why; "
            "verify --strict fails on this)") in err, err
    assert cli_main(["verify", "--dir", str(tmp_path), "--hardware", "h200", "--strict"]) == 3
    err = capsys.readouterr().err
    assert "verify --strict: error: 1 library refused at load, not verified: broken.so" in err
    assert "verify --strict: 1 library(ies) refused at load (exit status 3)" in err, err


def test_verify_strict_takes_a_library_for_another_gpu_as_a_note(tmp_path, capsys):
    """A library refused only because it has no code for this GPU (or its ex_get_factor
    declines the hardware) is not a broken one: a note, and --strict does not count it."""
    from ex_engine.cli import _note_refused
    from ex_engine.registry import HARDWARE_CHECKS, Check, Plugin

    class Reg:
        plugins = [Plugin(tmp_path / "sm90.so", checks=[Check("elf", True), Check("cuda code", False, "no SASS")]),
                   Plugin(tmp_path / "bad.so", checks=[Check("cuda code", False, "x"), Check("elf", False, "y")]),
                   Plugin(tmp_path / "ok.so", status="ready")]
    assert "ex_get_factor(hw)" in HARDWARE_CHECKS
    assert [p.path.name for p in _note_refused(Reg)] == ["bad.so"]
    err = capsys.readouterr().err
    assert "note: sm90.so refused" in err and "note: bad.so refused" in err and "ok.so" not in err
