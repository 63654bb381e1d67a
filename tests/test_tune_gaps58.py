"""tune_moe.gap_notes: after a run, the rows whose lower neighbour's choice lost at this row's T
(a call between the two T runs that choice; session fifty-eight found such gaps costing 26-27%
on an H100)."""
from .test_bench_tools import drive_tune_moe, import_tool

_Q = (2048, 768, 128, 8)


def _data(by_T):
    return {"moe_fused_gemm": {"shapes": [{"H": 2048, "I": 768, "G": 128, "K": 8, "model": "q", "by_T": by_T}]}}


def test_a_lower_rows_choice_that_loses_here_is_named_with_the_T_to_tune():
    tune = import_tool("benchmarks", "tune_moe")
    data = _data([[1024, "chunked_nomc", 143.5, 150.7], [1536, "auto", 188.9, 188.9]])
    timed = {_Q + (1536,): ("q", {"auto": 188.9, "chunked_nomc": 237.3, "chunked": 236.1})}
    (line,) = tune.gap_notes(data, timed, 0.03)
    assert line.startswith("# gap: q T = 1024..1535 runs the T = 1024 row's chunked_nomc, 26% slower "
                           "at T = 1536 (237.3 µs) than this row's auto (188.9)")
    assert "--models q --tokens 1254" in line   # the geometric mean of 1024 and 1536


def test_no_gap_where_the_choice_is_the_same_within_the_margin_or_untimed_or_lowest():
    tune = import_tool("benchmarks", "tune_moe")
    data = _data([[512, "chunked", 1.0, 1.2], [1024, "chunked", 2.0, 2.4], [2048, "auto", 4.0, 4.0],
                  [4096, "grouped", 8.0, 9.0]])
    timed = {
        _Q + (512,): ("q", {"auto": 1.2, "chunked": 1.0}),          # the lowest row: none below
        _Q + (1024,): ("q", {"auto": 2.4, "chunked": 2.0}),         # the same choice as below
        _Q + (2048,): ("q", {"auto": 4.0, "chunked": 4.1}),         # 2.5% slower: inside 3%
        _Q + (4096,): ("q", {"auto": 9.0, "grouped": 8.0}),         # auto below 12.5% slower: a gap
    }
    lines = tune.gap_notes(data, timed, 0.03)
    assert len(lines) == 1 and lines[0].startswith("# gap: q T = 2048..4095 runs the T = 2048 row's auto, 12% slower")
    assert tune.gap_notes(data, timed, 0.2) == []                   # the margin is the tuner's
    # the lower row's choice not among this row's timings (candidates() left it out): no claim
    assert tune.gap_notes(data, {_Q + (4096,): ("q", {"grouped": 8.0})}, 0.03) == []
    # a timed row the merged table lacks (or a shape it lacks): nothing, no KeyError
    assert tune.gap_notes(data, {_Q + (3000,): ("q", {"auto": 1.0})}, 0.03) == []
    assert tune.gap_notes({}, timed, 0.03) == []
    # adjacent T: no call runs between them; T two apart: the one between is the T to tune
    near = _data([[1, "auto", 9.0, 9.0], [2, "tiny", 5.0, 9.0], [4, "tiny", 5.0, 9.0]])
    assert tune.gap_notes(near, {_Q + (2,): ("q", {"auto": 9.0, "tiny": 5.0})}, 0.03) == []
    near["moe_fused_gemm"]["shapes"][0]["by_T"][1][1] = "auto"
    (line,) = tune.gap_notes(near, {_Q + (4,): ("q", {"auto": 9.0, "tiny": 5.0})}, 0.03)
    assert "T = 2..3 runs" in line and "--tokens 3)" in line


def test_the_tuner_prints_the_gap_after_writing_its_file(monkeypatch, tmp_path, capsys):
    """main(): a run at T = 8 into a file whose T = 1 row chose auto, which runs 10 µs at T = 8
    against the candidates' 5 (drive_tune_moe's stand-ins), prints that gap after the file."""
    import yaml
    out = tmp_path / "h200.yaml"
    assert drive_tune_moe(monkeypatch, out, [])[0] == 0
    data = yaml.safe_load(out.read_text(encoding="utf-8"))
    (entry,) = data["moe_fused_gemm"]["shapes"]
    entry["by_T"] = [[1, "auto", 10.0, 10.0]]
    out.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    capsys.readouterr()
    assert drive_tune_moe(monkeypatch, out, ["--tokens", "8"])[0] == 0
    text = capsys.readouterr().out
    wrote = text.index("# wrote ")
    gap = text.index("# gap: qwen3-30b-a3b T = 1..7 runs the T = 1 row's auto, 100% slower at T = 8 (10.0 µs)")
    assert gap > wrote and "--models qwen3-30b-a3b --tokens 3)" in text[gap:]
