"""Trial 41 (docs vs behaviour, CPU): what a help text or a message said against what the code did."""
import argparse
import subprocess
import sys
from pathlib import Path

from ex_engine._scripts import HelpFormatter

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
