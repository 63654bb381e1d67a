"""The benchmark and example scripts refuse a bad output destination before any work (a run's
measurements were lost at its end), on a machine without a GPU or PyTorch too."""
import subprocess
import sys

import pytest

from ex_engine.moe_layer import output_file_problem
from tests.conftest import ROOT

SCRIPTS = [
    ["benchmarks/bench_moe.py", "--json"],
    ["benchmarks/bench_router_norm.py", "--json"],
    ["benchmarks/ab_moe.py", "--cases", "qwen3-30b-a3b:1", "--configs", "a=factors", "b=factors", "--json"],
    ["benchmarks/tune_moe.py", "--out"],
    ["examples/ep_moe.py", "--json"],
    ["examples/hf_moe_generate.py", "--json"],
    ["benchmarks/plot_moe.py", "bench_moe.json", "-o"],
]


def test_output_file_problem(tmp_path):
    assert output_file_problem("--json", None) == ""
    assert output_file_problem("--json", tmp_path / "new.json") == ""
    (tmp_path / "old.json").write_text("{}")
    assert output_file_problem("--json", tmp_path / "old.json") == ""
    assert output_file_problem("--json", tmp_path) == f"--json: {tmp_path} is a folder; expected a file path"
    assert "folder" in output_file_problem("--out", tmp_path / "nowhere" / "x.yaml")
    assert "does not exist" in output_file_problem("--out", tmp_path / "nowhere" / "x.yaml")


@pytest.mark.parametrize("argv", SCRIPTS, ids=lambda a: a[0])
def test_scripts_refuse_a_bad_output_destination_first(tmp_path, argv):
    for dest, msg in ((tmp_path, "is a folder; expected a file path"),
                      (tmp_path / "nowhere" / "x.json", "does not exist")):
        r = subprocess.run([sys.executable, *argv, str(dest)], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 2 and msg in r.stderr, (argv, r.returncode, r.stdout, r.stderr)
        assert not (tmp_path / "nowhere").exists()


def test_hf_moe_generate_reports_every_argument_problem_at_once():
    """Without PyTorch it said only that PyTorch was missing: the bad arguments surfaced one
    install later. Now each problem is a line, the missing PyTorch one of them."""
    r = subprocess.run([sys.executable, "examples/hf_moe_generate.py", "--tokens", "2", "--rtol", "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "--tokens: expected >= 5" in r.stderr and "--rtol: expected a fraction > 0" in r.stderr
