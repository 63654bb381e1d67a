"""The tools under an ASCII locale with Python's UTF-8 mode off (LC_ALL=C PYTHONUTF8=0
PYTHONCOERCECLOCALE=0; plain LANG=C is coerced to UTF-8 and hid it): they read the project's
UTF-8 files (README.md, the tuning YAML) in the locale's encoding, a UnicodeDecodeError, and
printing 'µs', '×' or '≥' (a table, a --help) was a UnicodeEncodeError. Now the files are read
as UTF-8 and what the stream cannot encode is escaped ('\\xb5s')."""
import subprocess
import sys

from tests.conftest import ROOT, child_env

BENCH = ROOT / "benchmarks"


def test_tools_run_under_an_ascii_locale(tmp_path):
    env = child_env()
    env.pop("PYTHONIOENCODING", None)
    env.update(LC_ALL="C", PYTHONUTF8="0", PYTHONCOERCECLOCALE="0")
    runs = [  # (arguments, expected exit status, words expected in stdout + stderr)
        ([BENCH / "table_moe.py", "--help"], 0, b"usage: table_moe.py"),
        ([BENCH / "table_moe.py", BENCH / "bench_moe_h200_2026-12-02_fe1d21b.json"], 0, b"\\xb5s per call"),
        ([BENCH / "perf_peers.py", "--help"], 0, b"usage: perf_peers.py"),
        # reads README.md's table of variables, then refuses the missing folder (before any GPU work)
        ([BENCH / "ab_moe.py", "--cases", "olmoe-1b-7b:1", "--configs", f"a={ROOT / 'factors'}",
          f"b={tmp_path / 'none'}"], 2, b"does not exist"),
        (["-m", "ex_engine", "run", "moe", "--model", "granite-3.0-3b-a800m", "--tokens", "1",
          "--dir", str(tmp_path)], 0, b"time (\\xb5s)"),
    ]
    for args, status, words in runs:
        r = subprocess.run([sys.executable, *map(str, args)],
                           capture_output=True, timeout=300, env=env, cwd=tmp_path)
        out = r.stdout + r.stderr
        assert r.returncode == status and b"Traceback" not in out and words in out, (args, out.decode(errors="replace"))
