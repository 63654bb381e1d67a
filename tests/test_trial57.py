"""Session 57's docs audit (a helper compared README, docs/ and every --help with what the
commands do, on a CPU machine): the findings that were behaviour or help text, each kept."""
import subprocess
import sys
from pathlib import Path

from ex_engine import FactorRegistry, abi
from tests.conftest import build_plugin

ROOT = Path(__file__).resolve().parents[1]


def test_a_reserved_id_is_refused_with_the_range_a_third_party_factor_may_take(tmp_path):
    """Id 0 (topk_softmax's) taken by host_scale read 'expected an id >= 0 (...), got 0: id 0 is
    reserved': the id met the rule it named. The message names the rule that failed: an id of
    1024 or more for a factor of another name."""
    build_plugin(tmp_path, defines={"FACTOR_ID": 0})
    p = FactorRegistry.load(tmp_path, hardware="h200").plugins[0]
    assert p.status == "rejected", p.reason
    first = abi.FACTOR_BUILTIN_LAST + 1
    assert p.reason.startswith(f"factor id: expected an id of {first} or more for a factor named 'host_scale'"), p.reason
    assert "got 0: id 0 is reserved for ex_engine's 'topk_softmax'" in p.reason, p.reason
    assert "expected an id >= 0" not in p.reason, p.reason


def test_a_negative_id_still_names_the_non_negative_rule(tmp_path):
    build_plugin(tmp_path, defines={"FACTOR_ID": -5})
    p = FactorRegistry.load(tmp_path, hardware="h200").plugins[0]
    assert p.status == "rejected" and "expected an id >= 0" in p.reason and "got -5" in p.reason, p.reason


def _help(*args: str) -> str:
    r = subprocess.run([sys.executable, *args, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    return " ".join(r.stdout.split())


def test_the_selftest_help_names_every_decode_mode_it_accepts():
    """gpu_moe_selftest.py accepted EX_MOE_DECODE_CONFIG=gridwait; its help left it out."""
    import re
    src = (ROOT / "scripts" / "gpu_moe_selftest.py").read_text(encoding="utf-8")
    modes = re.search(r"known_modes = \(([^)]*)\)", src).group(1)
    text = _help("scripts/gpu_moe_selftest.py")
    for mode in re.findall(r'"(\w+)"', modes):
        assert mode in text, mode


def test_hardware_help_says_what_no_gpu_prints():
    text = _help("-m", "ex_engine.cli", "hardware")
    assert "null where no GPU is visible" in text and "exit status 0" in text


def test_list_factors_help_says_the_checks_stop_at_the_first_failure_and_what_exit_does():
    text = _help("-m", "ex_engine.cli", "list-factors")
    assert "up to its first failure" in text and "every check" not in text
    assert "its own status, even 0" in text
