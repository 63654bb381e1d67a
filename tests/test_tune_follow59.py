"""tune_moe --follow-gaps: after the T asked for, the tuner tunes the T its own gap and unchecked
lines name, round after round, within a time budget, and writes the file once. Session
fifty-eight closed an H100 file's gaps by hand in six rounds of device calls (32% -> 7%)."""
import copy

import yaml

from .test_bench_tools import drive_tune_moe, import_tool

_Q = (2048, 768, 128, 8)   # qwen3-30b-a3b's key, the model drive_tune_moe tunes


def _cliff(cfg, T):
    """mid wins up to T = 3000 and loses beyond (as a chunked tiling does once its chunks are
    outgrown; the stand-in plugin is not the Hopper one, so mid stands in for it); auto 10 µs
    everywhere; every other candidate slower than both."""
    if cfg == "auto":
        return 10.0
    if cfg == "mid":
        return 5.0 if T <= 3000 else 20.0
    return 30.0


def _rows(out):
    data = yaml.safe_load(out.read_text(encoding="utf-8"))
    (entry,) = data["moe_fused_gemm"]["shapes"]
    return {r[0]: r[1] for r in entry["by_T"]}


def test_follow_gaps_tunes_the_named_T_until_the_cliff_is_found(monkeypatch, tmp_path, capsys):
    out = tmp_path / "h200.yaml"
    rc, _ = drive_tune_moe(monkeypatch, out, ["--tokens", "2048", "4096", "--follow-gaps", "5"], us=_cliff)
    assert rc == 0
    rows = _rows(out)
    assert rows[2048] == "mid" and rows[4096] == "auto"
    # the rows the gap lines named close in on the cliff, to within 2% of T (FOLLOW_SPAN): the
    # last mid row and the first auto row above it are under 60 apart, around 3000
    assert all(c == ("mid" if T <= 3000 else "auto") for T, c in rows.items())
    last_mid = max(T for T, c in rows.items() if c == "mid")
    first_auto = min(T for T in rows if T > last_mid)
    assert 2940 < last_mid <= 3000 < first_auto < 3060 and first_auto - last_mid < 0.02 * first_auto
    text = capsys.readouterr()
    (left,) = [ln for ln in text.out.splitlines() if ln.startswith(("# gap:", "# unchecked:"))]
    assert left.startswith(f"# gap: qwen3-30b-a3b T = {last_mid}..{first_auto - 1} runs")   # printed, not followed
    assert "(gap round 1;" in text.err
    header = out.read_text(encoding="utf-8").splitlines()[1]
    assert header.startswith("# This run: qwen3-30b-a3b at T = 2048 4096; then, in ")
    assert "round(s) of its gap lines (--follow-gaps), qwen3-30b-a3b T = 2896 " in header


def test_without_follow_gaps_the_lines_are_printed_and_nothing_more_is_tuned(monkeypatch, tmp_path, capsys):
    out = tmp_path / "h200.yaml"
    assert drive_tune_moe(monkeypatch, out, ["--tokens", "2048", "4096"], us=_cliff)[0] == 0
    assert sorted(_rows(out)) == [2048, 4096]
    assert "--tokens 2896 --out" in capsys.readouterr().out


def test_follow_gaps_stops_starting_rows_at_its_budget_and_says_what_is_left(monkeypatch, tmp_path, capsys):
    """Each timing takes 10 s on the tuner's clock here: the two rows asked for run whatever the
    budget (they were asked for), then no row starts that would end past 1 minute."""
    out = tmp_path / "h200.yaml"
    rc, _ = drive_tune_moe(monkeypatch, out, ["--tokens", "2048", "4096", "--follow-gaps", "1"], us=_cliff,
                           clock=10.0)
    assert rc == 0
    assert sorted(_rows(out)) == [2048, 4096]
    text = capsys.readouterr().out
    stop = text.index("# --follow-gaps: 1 min spent; the lines below name what is left")
    assert text.index("# gap: qwen3-30b-a3b T = 2048..4095") > stop
    # the rows' times on that clock: T = 2048 (128 rows per expert) times auto, mid, mid32, mid48
    # and prefill twice (100 s), T = 4096 and 2896 auto, mid and prefill (60 s). After the two
    # rows asked for, 160 s are spent at 80 s a row: under 3 minutes, but the next row would end
    # past them, so none starts; under 4.1 minutes (246 s) T = 2896 runs (160 + 80 <= 246), and
    # then (220 s, 73 s a row) none more. The header names what was written, not what was queued.
    for minutes, rows in (("3", [2048, 4096]), ("4.1", [2048, 2896, 4096])):
        out2 = tmp_path / minutes / "h200.yaml"
        out2.parent.mkdir()
        drive_tune_moe(monkeypatch, out2, ["--tokens", "2048", "4096", "--follow-gaps", minutes], us=_cliff,
                       clock=10.0)
        assert sorted(_rows(out2)) == rows
        header = out2.read_text(encoding="utf-8").splitlines()[1]
        assert header == ("# This run: qwen3-30b-a3b at T = 2048 4096."
                          if minutes == "3" else "# This run: qwen3-30b-a3b at T = 2048 4096; then, in 1 "
                          "round(s) of its gap lines (--follow-gaps), qwen3-30b-a3b T = 2896."), header
    header = out.read_text(encoding="utf-8").splitlines()[1]
    assert header == "# This run: qwen3-30b-a3b at T = 2048 4096.", header   # (2896: queued, not run)


def test_a_named_T_whose_checks_all_fail_is_not_tried_again(monkeypatch, tmp_path, capsys):
    """No row is written at a T where every configuration failed its check, so the same gap line
    names it again: it is tried once (exit status 1: a configuration failed), and the line is
    printed for the user."""
    out = tmp_path / "h200.yaml"
    rc, _ = drive_tune_moe(monkeypatch, out, ["--tokens", "2048", "4096", "--follow-gaps", "5"], us=_cliff,
                           err=lambda cfg, T: float("nan") if T == 2896 else 0.0)
    assert rc == 1
    assert sorted(_rows(out)) == [2048, 4096]
    assert out.read_text(encoding="utf-8").splitlines()[1] == "# This run: qwen3-30b-a3b at T = 2048 4096."
    text = capsys.readouterr()
    assert text.err.count("qwen3-30b-a3b T=2896 ...") == 1
    assert "--tokens 2896 --out" in text.out


def test_follow_gaps_must_be_finite_minutes_at_least_zero(monkeypatch, tmp_path, capsys):
    for bad in ("-1", "nan", "inf"):
        rc, _ = drive_tune_moe(monkeypatch, tmp_path / "h200.yaml", ["--follow-gaps", bad])
        assert rc == 2
        assert "--follow-gaps: expected finite minutes >= 0" in capsys.readouterr().err
    assert not (tmp_path / "h200.yaml").exists()


def test_follow_cases_judges_a_copy_as_the_file_will_be_written():
    """follow_cases merges this run's rows into a copy of the table as found, keeps the
    neighbours' choices as the written file will, and names each T once, none this run timed;
    its arguments are left as they were."""
    tune = import_tool("benchmarks", "tune_moe")
    start = {"moe_fused_gemm": {"shapes": [{"H": 2048, "I": 768, "G": 128, "K": 8, "model": "q",
                                            "by_T": [[1024, "chunked_nomc", 143.5, 150.7]]}]}}
    new_rows = {_Q[:4]: ("q", {1536: [1536, "auto", 188.9, 188.9], 4096: [4096, "auto", 9.0, 9.0]})}
    timed = {_Q + (1536,): ("q", {"auto": 188.9, "chunked_nomc": 237.3}),
             _Q + (4096,): ("q", {"auto": 9.0, "chunked_nomc": 9.5})}
    before = copy.deepcopy((start, new_rows, timed))
    assert tune.follow_cases(start, new_rows, timed, 0.03, "NVIDIA H200", 132) == [("q", 1254)]
    assert (start, new_rows, timed) == before
    # the T a line names, timed already in this run: not named again
    timed[_Q + (1254,)] = ("q", {"auto": 1.0})
    assert tune.follow_cases(start, new_rows, timed, 0.03, "NVIDIA H200", 132) == []
