"""tune_moe's checks after a run: gap_notes (the ranges around each tuned row where a call runs a
choice that lost, or was never timed, at a neighbouring row's T; session fifty-eight found such
gaps costing up to 36% on an H100) and keep_neighbour_choices (an auto row inside the margin
takes a neighbour's faster choice)."""
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
    assert lines[0].endswith("--tokens 2896) to find where the choice changes")
    assert tune.gap_notes(data, timed, 0.03, "my.yaml")[0].endswith("--tokens 2896 --out my.yaml) to find where "
                                                                    "the choice changes")
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
    assert gap > wrote and f"--models qwen3-30b-a3b --tokens 3 --out {out})" in text[gap:]   # the next run merges into the same file


def test_an_auto_row_between_configurations_keeps_a_neighbours_choice_that_ran_faster_here():
    """keep_neighbour_choices: phi-3.5's T = 384 row recorded auto (870.6 µs) inside the 3%
    margin, and T = 384..511 then ran auto, 10% slower than chunked at T = 512 (H100, session
    fifty-eight). Now such a row records the row above's choice where it ran faster than auto
    here (faster at both ends of the range), else the row below's; under an auto row (mixtral T
    = 1133 under 1254: chunked_tail 1.5% faster at 1133, 30% slower at 1254) or at the top, auto
    stays."""
    tune = import_tool("benchmarks", "tune_moe")
    data = _data([[256, "chunked_nomc", 846.0, 900.0], [384, "auto", 870.6, 870.6], [512, "chunked", 890.0, 980.8],
                  [1024, "chunked_tail", 1.0, 2.0], [1133, "auto", 1795.9, 1795.9], [1254, "auto", 1778.1, 1778.1],
                  [1536, "chunked", 3.0, 4.0], [1906, "auto", 1212.3, 1212.3], [2048, "chunked_tail", 5.0, 6.0],
                  [4096, "auto", 7.0, 7.0]])
    timed = {_Q + (1133,): ("q", {"auto": 1795.9, "chunked_tail": 1769.4}),   # under auto: stays
             _Q + (384,): ("q", {"auto": 870.6, "chunked_nomc": 846.0, "chunked": 850.0}),   # above's, not below's
             _Q + (512,): ("q", {"auto": 980.8, "chunked": 890.0}),            # not auto: left alone
             _Q + (1906,): ("q", {"auto": 1212.3, "chunked": 1266.1, "chunked_tail": 1202.2}),
             _Q + (4096,): ("q", {"auto": 7.0, "chunked": 6.9})}               # the top row: stays
    lines = tune.keep_neighbour_choices(data, timed)
    rows = data["moe_fused_gemm"]["shapes"][0]["by_T"]
    assert [r[:2] for r in rows] == [[256, "chunked_nomc"], [384, "chunked"], [512, "chunked"],
                                     [1024, "chunked_tail"], [1133, "auto"], [1254, "auto"], [1536, "chunked"],
                                     [1906, "chunked_tail"], [2048, "chunked_tail"], [4096, "auto"]]
    assert rows[1] == [384, "chunked", 850.0, 870.6] and rows[7] == [1906, "chunked_tail", 1202.2, 1212.3]
    assert lines == ["# kept: q T = 1906 records the T = 2048 row's chunked_tail (1202.2 µs), within the margin of "
                     "auto (1212.3) but faster here, between the T = 1536 row's chunked and the T = 2048 row's "
                     "chunked_tail",
                     "# kept: q T = 384 records the T = 512 row's chunked (850.0 µs), within the margin of auto "
                     "(870.6) but faster here, between the T = 256 row's chunked_nomc and the T = 512 row's chunked"]
    # highest T first: an auto row under a row this run settles takes that row's new choice
    chain = _data([[256, "auto", 1.0, 1.0], [384, "auto", 9.0, 9.0], [448, "auto", 9.0, 9.0], [512, "mid", 1.0, 2.0]])
    tune.keep_neighbour_choices(chain, {_Q + (384,): ("q", {"auto": 9.0, "mid": 8.9}),
                                        _Q + (448,): ("q", {"auto": 9.0, "mid": 8.8})})
    assert [r[1] for r in chain["moe_fused_gemm"]["shapes"][0]["by_T"]] == ["auto", "mid", "mid", "mid"]
    # the row above's choice slower than auto here (or not timed): the row below's where it is faster
    data = _data([[256, "tiny", 1.0, 2.0], [384, "auto", 3.0, 3.0], [512, "mid", 1.0, 2.0]])
    assert tune.keep_neighbour_choices(data, {_Q + (384,): ("q", {"auto": 3.0, "chunked": 2.9})}) == []
    assert tune.keep_neighbour_choices(data, {_Q + (384,): ("q", {"auto": 3.0, "tiny": 3.1, "mid": 3.2})}) == []
    assert data["moe_fused_gemm"]["shapes"][0]["by_T"][1] == [384, "auto", 3.0, 3.0]
    (line,) = tune.keep_neighbour_choices(data, {_Q + (384,): ("q", {"auto": 3.0, "tiny": 2.8, "mid": 3.2})})
    assert line.startswith("# kept: q T = 384 records the T = 256 row's tiny (2.8 µs)")


def test_the_range_above_a_row_is_checked_against_the_next_rows_own_figures():
    """gap_notes above a row: an auto row under a chunked row not tuned in this run loses what
    that row's figures say auto lost there; a non-auto choice never timed at the next row's T is
    named as unchecked; a row above that this run tuned is left to its own check."""
    tune = import_tool("benchmarks", "tune_moe")
    data = _data([[384, "auto", 870.6, 870.6], [512, "chunked", 890.0, 980.8], [1024, "auto", 5.0, 5.0]])
    (line,) = tune.gap_notes(data, {_Q + (384,): ("q", {"auto": 870.6, "chunked_nomc": 846.0})}, 0.03)
    assert line.startswith("# gap: q T = 384..511 runs this row's auto, 10% slower at T = 512 (980.8 µs, "
                           "that row's figures) than the T = 512 row's chunked (890.0); tune a T between them")
    assert "--tokens 443)" in line
    below, line = tune.gap_notes(data, {_Q + (512,): ("q", {"auto": 980.8, "chunked": 890.0})}, 0.03)
    assert below.startswith("# gap: q T = 384..511 runs the T = 384 row's auto, 10% slower at T = 512")
    assert line.startswith("# unchecked: q T = 512..1023 runs this row's chunked, never timed at T = 1024, "
                           "whose row chose auto; tune a T between them (e.g. --models q --tokens 724) to check it")
    both = {_Q + (384,): ("q", {"auto": 870.6}), _Q + (512,): ("q", {"auto": 980.8, "chunked": 890.0}),
            _Q + (1024,): ("q", {"auto": 5.0, "chunked": 9.0})}
    lines = tune.gap_notes(data, both, 0.03)
    # 384..511: 512's own check (auto at 512 timed: 10% slower); 512..1023: 1024's (chunked 80%)
    assert [ln.split(" runs ")[0] for ln in lines] == ["# gap: q T = 384..511", "# gap: q T = 512..1023"]
    assert tune.gap_notes(data, both, 0.9) == []


def test_gap_notes_take_a_choice_given_as_its_value_and_survive_a_zero_time():
    """A file's row may give its configuration as the value (11 for chunked_nomc); a time of 0
    (a stand-in, a broken timer) is no ZeroDivisionError after the file was written."""
    tune = import_tool("benchmarks", "tune_moe")
    data = _data([[1024, tune.VALUES["chunked_nomc"], 143.5, 150.7], [1536, "auto", 188.9, 188.9]])
    (line,) = tune.gap_notes(data, {_Q + (1536,): ("q", {"auto": 188.9, "chunked_nomc": 237.3})}, 0.03)
    assert "runs the T = 1024 row's chunked_nomc, 26% slower" in line
    assert tune.gap_notes(data, {_Q + (1536,): ("q", {"auto": 0.0, "chunked_nomc": 237.3})}, 0.03) == []
    zero_up = _data([[384, "auto", 1.0, 1.0], [512, "chunked", 0.0, 980.8]])
    assert tune.gap_notes(zero_up, {_Q + (384,): ("q", {"auto": 1.0})}, 0.03) == []


def test_the_lower_choice_is_not_lent_where_the_row_above_shows_it_losing_or_never_timed():
    """keep_neighbour_choices (a review of 4ed1480): where the row above was tuned in this run,
    the row below's choice is lent only if it ran no slower than auto there too; one that
    candidates() left out there (tiny above 64 rows per expert) or that lost there stays out, so
    no range runs a choice that lost, or went untimed, at both ends."""
    tune = import_tool("benchmarks", "tune_moe")
    for at_512 in ({"auto": 2.0, "mid": 1.0}, {"auto": 2.0, "mid": 1.0, "tiny": 4.0}):
        data = _data([[256, "tiny", 1.0, 2.0], [384, "auto", 3.0, 3.0], [512, "mid", 1.0, 2.0]])
        timed = {_Q + (384,): ("q", {"auto": 3.0, "tiny": 2.8, "mid": 3.2}), _Q + (512,): ("q", at_512)}
        assert tune.keep_neighbour_choices(data, timed) == []
        assert data["moe_fused_gemm"]["shapes"][0]["by_T"][1][1] == "auto"
        # and the range 384..511, auto, is reported against mid at 512 (100% slower)
        assert any("T = 384..511 runs the T = 384 row's auto, 100% slower" in ln
                   for ln in tune.gap_notes(data, timed, 0.03))
    data = _data([[256, "tiny", 1.0, 2.0], [384, "auto", 3.0, 3.0], [512, "mid", 1.0, 2.0]])
    timed = {_Q + (384,): ("q", {"auto": 3.0, "tiny": 2.8, "mid": 3.2}),
             _Q + (512,): ("q", {"auto": 2.0, "mid": 1.0, "tiny": 1.9})}          # tiny no slower than auto at 512
    (line,) = tune.keep_neighbour_choices(data, timed)
    assert "records the T = 256 row's tiny" in line
    # a difference the row's 0.1 µs cannot show is no reason to change it
    data = _data([[256, "tiny", 1.0, 2.0], [384, "auto", 870.6, 870.6], [512, "mid", 1.0, 2.0]])
    assert tune.keep_neighbour_choices(data, {_Q + (384,): ("q", {"auto": 870.64, "mid": 870.56})}) == []


def test_gap_notes_take_a_file_row_without_figures():
    """A file's row may give only [T, configuration] or a note after it (ex_engine/tuning.py);
    the range below it is then not judged from its figures, and nothing raises."""
    tune = import_tool("benchmarks", "tune_moe")
    for up in ([512, "chunked"], [512, "chunked", "a note", None], [512, "chunked", None, None],
               [512, "chunked", True, 3.0]):
        data = _data([[384, "auto", 9.0, 9.0], up])
        assert tune.gap_notes(data, {_Q + (384,): ("q", {"auto": 9.0})}, 0.03) == []


def test_the_progress_line_says_how_long_is_left_from_the_second_row(monkeypatch, tmp_path, capsys):
    """A default run is ~105 rows (~18 minutes on an H100): from the second row on, the progress
    line estimates the minutes left at the mean pace so far."""
    assert drive_tune_moe(monkeypatch, tmp_path / "h200.yaml", ["--tokens", "1", "8", "64"])[0] == 0
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("[")]
    assert err[0] == "[1/3] qwen3-30b-a3b T=1 ..."
    assert err[1].startswith("[2/3] qwen3-30b-a3b T=8 ... (about ") and err[2].endswith(" min left)")
