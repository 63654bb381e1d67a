"""A fresh user's trial (session sixty): plot_moe.py drew its T axis as raw TeX strings
("$\\mathdefault{2^{12}}$"), and the scripts of benchmarks/ and scripts/ ended in a traceback
(or, for --help, in status 0 with the text lost) when stdout could not be written, where
ex-engine's own commands print one line and exit 2."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .test_bench_tools import import_tool

ROOT = Path(__file__).resolve().parents[1]
B = ROOT / "benchmarks"


class _FullStdout:
    """A stdout on a full disk: every write fails with ENOSPC."""

    def write(self, text):
        raise OSError(28, "No space left on device")

    def flush(self):
        pass


def _t_labels(tmp_path, monkeypatch, files):
    """The T axis labels of each panel of plot_moe's chart of ``files``."""
    pytest.importorskip("matplotlib")
    import matplotlib.figure
    plot_moe = import_tool("benchmarks", "plot_moe")
    figs = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda self, *a, **k: figs.append(self))
    monkeypatch.setattr(sys, "argv", ["plot_moe.py", *map(str, files), "-o", str(tmp_path / "x.png")])
    assert plot_moe.main() is None and len(figs) == 1
    fig = figs[0]
    fig.canvas.draw()
    return {ax.get_title(): [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
            for ax in fig.axes if ax.get_title()}


def test_plot_moe_labels_its_t_axis_with_plain_numbers(tmp_path, monkeypatch):
    """text.parse_math = False (a '$' in a model name stays text) made the base-2 log axis's
    default tick labels, TeX, print literally; the T axis now has its own formatter."""
    files = [B / f"bench_moe_{p}_1acb49f-tmc56_h200_2026-12-06.json" for p in ("small", "large")]
    panels = _t_labels(tmp_path, monkeypatch, files)
    assert len(panels) == 7
    for title, labels in panels.items():
        assert labels and not any("$" in t or "mathdefault" in t for t in labels), (title, labels)
        shown = {float(t) for t in labels}   # every label a number, the table's T among them
        assert {1.0, 64.0, 4096.0} <= shown, (title, labels)


def test_plot_moe_writes_a_large_t_in_full(tmp_path, monkeypatch):
    """A review: '{:g}' wrote T = 2^20 as '1.04858e+06' (not the tick's value); T >= 1 is now
    written as an integer."""
    import json
    data = json.loads((B / "bench_moe_large_1acb49f-tmc56_h200_2026-12-06.json").read_text(encoding="utf-8"))
    for r in data["rows"]:
        r["T"] *= 256   # 4096 and 16384 -> 2^20 and 2^22
    big = tmp_path / "big.json"
    big.write_text(json.dumps(data), encoding="utf-8")
    for title, labels in _t_labels(tmp_path, monkeypatch, [big]).items():
        assert "1048576" in labels and not any("e+" in t for t in labels), (title, labels)


# scripts that run here without a GPU (a table from a shipped JSON, or --help), each into /dev/full
FULL_CASES = [
    ["benchmarks/table_moe.py", "benchmarks/bench_moe_full_ca93569_h100_2026-12-06.json"],
    ["benchmarks/gap_moe.py", "benchmarks/kernel_times_gap_57215dd_h200_2026-12-06.json"],
    ["benchmarks/perf_peers.py"],
    ["benchmarks/topk_variants/model.py", "3"],
    ["benchmarks/table_moe.py", "--help"],
    ["benchmarks/bench_moe.py", "--help"],
    ["benchmarks/plot_moe.py", "--help"],
    ["benchmarks/_timing.py", "--help"],
    ["benchmarks/decode_read_probe.py", "--help"],
    ["benchmarks/dram_rows_probe.py", "--help"],
    ["benchmarks/topk_variants/run_tune.py", "--help"],
    ["scripts/gpu_moe_selftest.py", "--help"],
    ["scripts/gpu_router_norm_selftest.py", "--help"],
]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("cmd", FULL_CASES, ids=lambda c: " ".join(Path(x).name for x in c))
def test_scripts_say_in_one_line_that_their_output_cannot_be_written(cmd):
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, *(str(ROOT / c) if "/" in c else c for c in cmd)], stdout=full,
                           stderr=subprocess.PIPE, text=True, timeout=120, cwd=ROOT)
    tool = Path(cmd[0]).name
    assert (r.returncode, r.stderr) == (2, f"{tool}: error: cannot write the output: No space left on device\n"), \
        r.stderr[-2000:]


def test_perf_peers_still_ends_quietly_when_the_reader_leaves():
    """It caught BrokenPipeError itself; it now ends through the scripts' helper, as table_moe.py."""
    p = subprocess.Popen([sys.executable, str(B / "perf_peers.py")], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 141 and err == "", err


def test_the_helper_leaves_other_errors_and_the_callers_stdout_alone(monkeypatch, capsys):
    """An OSError that is not stdout's (a file the script could not open) keeps its traceback;
    a caller in the same process gets its own sys.stdout back; a script's own SystemExit keeps
    its status."""
    from ex_engine._scripts import StdoutGuard, exit_quietly_on_broken_pipe
    monkeypatch.setattr(sys, "argv", ["/somewhere/tool.py"])
    before = sys.stdout

    def missing():
        open("/nonexistent/x")
    with pytest.raises(FileNotFoundError):
        exit_quietly_on_broken_pipe(missing)
    assert sys.stdout is before and not isinstance(sys.stdout, StdoutGuard)

    def usage():
        print("some text")
        raise SystemExit(3)
    with pytest.raises(SystemExit) as ended:
        exit_quietly_on_broken_pipe(usage)
    assert ended.value.code == 3 and sys.stdout is before and capsys.readouterr().out == "some text\n"

    def swallowing():   # a script that catches the write error itself still ends with status 2
        try:
            print("x")
        except OSError:
            pass
        return 0
    monkeypatch.setattr(sys, "stdout", _FullStdout())
    with pytest.raises(SystemExit) as ended:
        exit_quietly_on_broken_pipe(swallowing)
    assert ended.value.code == 2
    assert capsys.readouterr().err == "tool.py: error: cannot write the output: No space left on device\n"


def test_a_closed_stdout_keeps_the_scripts_own_status():
    """A review: the helper flushed sys.stdout even where there is none (`>&-`: Python sets it to
    None), so perf_peers.py ended in an AttributeError traceback, status 1 (0 before)."""
    for cmd, status in (([str(B / "perf_peers.py")], 0), ([str(B / "table_moe.py"), "--help"], 0),
                        ([str(B / "table_moe.py")], 2)):
        r = subprocess.run(" ".join([sys.executable, *cmd]) + " >&-", shell=True, stderr=subprocess.PIPE,
                           text=True, timeout=120)
        assert r.returncode == status and "Traceback" not in r.stderr, (cmd, r.returncode, r.stderr[-2000:])


def test_a_scripts_exit_message_is_said_even_when_stdout_is_lost(monkeypatch, capsys):
    """A review: sys.exit("why") caught by the helper, then a stdout that could not be written,
    ended with the 'cannot write' line (status 2) or 141, the script's own words lost."""
    from ex_engine._scripts import exit_quietly_on_broken_pipe
    monkeypatch.setattr(sys, "argv", ["/somewhere/tool.py"])

    def failing():
        try:
            print("table")
        except OSError:
            pass
        sys.exit("tool.py: 3 checks FAILED")
    monkeypatch.setattr(sys, "stdout", _FullStdout())
    with pytest.raises(SystemExit) as ended:
        exit_quietly_on_broken_pipe(failing)
    assert ended.value.code == 2
    assert capsys.readouterr().err == ("tool.py: 3 checks FAILED\n"
                                       "tool.py: error: cannot write the output: No space left on device\n")
    monkeypatch.setattr(sys, "stdout", sys.__stdout__)
    with pytest.raises(SystemExit) as ended:   # stdout fine: status 1 and the words, as Python's own
        exit_quietly_on_broken_pipe(lambda: sys.exit("tool.py: failed"))
    assert ended.value.code == 1 and capsys.readouterr().err == "tool.py: failed\n"
