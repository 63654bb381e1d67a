"""Trial 41 (docs vs behaviour, CPU): what a help text or a message said against what the code did."""
import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from ex_engine import FactorRegistry
from ex_engine._scripts import HelpFormatter
from ex_engine.errors import ArgumentError
from ex_engine.verify import format_table, run_case, verify_plugin
from tests.conftest import build_plugin

ROOT = Path(__file__).resolve().parents[1]


def test_help_leaves_out_a_store_false_flags_default():
    # a flag's default is the state without it: '(default: True)' after a store_false flag
    # (bench_moe.py's --shared-weights, whose dest weight_copies is True) read as on by default
    ap = argparse.ArgumentParser(formatter_class=HelpFormatter)
    ap.add_argument("--shared", dest="copies", action="store_false", help="share one copy")
    ap.add_argument("--n", type=int, default=3, help="a count")
    text = ap.format_help()
    assert "share one copy (default" not in text
    assert "a count (default: 3)" in text


def test_bench_moe_help_does_not_say_shared_weights_is_the_default():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_moe.py"), "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    shared = out.stdout.rsplit("\n  --shared-weights", 1)[1].split("\n  --json")[0]
    assert "(default: True)" not in " ".join(shared.split())


# ------------------------------------------------------------------------------ verify's arguments

@pytest.fixture
def host_reg(tmp_path, monkeypatch):
    monkeypatch.setenv("EX_ENGINE_CACHE", str(tmp_path / "cache"))
    build_plugin(tmp_path)
    return FactorRegistry.load(tmp_path)


@pytest.mark.parametrize("kwargs, argument", [
    ({"seed": -1}, "seed"), ({"seed": "a"}, "seed"), ({"seed": None}, "seed"), ({"seed": 1.5}, "seed"),
    ({"seed": True}, "seed"), ({"timeout": -1, "isolate": True}, "timeout"),
    ({"timeout": "a", "isolate": True}, "timeout"), ({"timeout": float("nan")}, "timeout"),
    ({"isolate": "no"}, "isolate"), ({"count": None}, "count")])
def test_verify_plugin_names_a_bad_argument(host_reg, kwargs, argument):
    # were a raw TypeError deep inside (seed 'a' or None, timeout 'a'), or a FAIL row blaming the
    # plugin (seed -1: 'could not run this case'; timeout -1: 'timed out after -1 s')
    with pytest.raises(ArgumentError) as err:
        verify_plugin(host_reg, host_reg.get("host_scale"), **kwargs)
    assert err.value.argument == argument and "verify_plugin" in str(err.value)


def test_verify_plugin_and_run_case_name_a_registry_that_is_none(host_reg):
    # were AttributeError: 'str' object has no attribute 'hardware'
    p = host_reg.get("host_scale")
    for fn in (lambda: verify_plugin("reg", p), lambda: run_case(None, p, {"N": 3}, "float32"),
               lambda: run_case(host_reg, p, {"N": 3}, "float32", seed=-2)):
        with pytest.raises(ArgumentError) as err:
            fn()
        assert err.value.argument in ("registry", "seed")
    assert [r.status for r in verify_plugin(host_reg, p, seed=3, isolate=True, timeout=60)] == ["pass"]


def test_format_table_names_rows_that_are_not_results(host_reg):
    # were TypeError ('NoneType' object is not iterable) and AttributeError ('int' object has no
    # attribute 'error')
    for bad in (None, [1], "rows"):
        with pytest.raises(ArgumentError) as err:
            format_table(bad)
        assert err.value.argument == "results"
    assert "host_scale" in format_table(verify_plugin(host_reg, host_reg.get("host_scale")))
