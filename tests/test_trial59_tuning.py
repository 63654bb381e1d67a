"""Defects a new user's trial found (session fifty-nine) in which tuning file the registry uses:
A. a well-formed tuning file for this GPU none of whose tables can be used (its only table's
values outside the manifest's range) shadowed the shipped one: every shipped row was dropped for
a file that served nothing, and two notes contradicted each other ("c04 (first by name) is used"
beside "c04's table is never used"), while a malformed file in its place was skipped;
B. tuning files in a folder of EX_ENGINE_MANIFESTS other than the one tuning is read from (the
first with a hardware/ folder) were ignored without a word."""
import json
import os
import shutil
import warnings
from types import SimpleNamespace

import pytest
import yaml

from ex_engine import FactorRegistry
from ex_engine.cli import main as cli_main
from ex_engine.manifest import Manifest
from ex_engine.tuning import TuningTable, TuningWarning
from tests.conftest import ROOT

SHIPPED = ROOT / "manifests"
H200 = SimpleNamespace(name="NVIDIA H200", multiprocessor_count=132, live=False)
# a shape the shipped h200.yaml tunes (qwen3-30b-a3b) and a T its rows give a choice for
QWEN = {"H": 2048, "I": 768, "G": 128, "K": 8}

OUTRANGE = {"device": "NVIDIA H200", "multiprocessor_count": 132,
            "moe_fused_gemm": {"dim": "config", "key": ["H", "I", "G", "K"],
                               "values": {"auto": -1, "x": 99},
                               "shapes": [{**QWEN, "model": "qwen3-30b-a3b", "by_T": [[1, "x"]]}]}}
GOOD = {"device": "NVIDIA H200", "multiprocessor_count": 132,
        "moe_fused_gemm": {"dim": "config", "key": ["H", "I", "G", "K"],
                           "values": {"auto": -1, "tiny": 0, "mid": 2},
                           "shapes": [{"H": 64, "I": 32, "G": 8, "K": 2, "by_T": [[1, "tiny"], [64, "mid"]]}]}}


def _dump(path, body):
    path.write_text(yaml.safe_dump(body), encoding="utf-8")
    return path


def _copy(tmp_path, name="m"):
    mdir = tmp_path / name
    shutil.copytree(SHIPPED, mdir)
    return mdir


def _moe_manifest():
    return {"moe_fused_gemm": Manifest.load(SHIPPED / "moe_fused_gemm.yaml")}


def _tuning_notes(reg):
    return [n for n in reg.notes if n.startswith("tuning:")]


# ------------------------------------------- A. a file none of whose tables can be used
def test_a_file_none_of_whose_tables_can_be_used_does_not_shadow_the_shipped_one(tmp_path):
    """The trial's repro: c04_outrange.yaml (first by name) with one table whose value is outside
    the manifest's range. h200.yaml serves; one note says c04 is set aside and why, and none
    says c04 is used or that h200.yaml is not."""
    mdir = _copy(tmp_path)
    bad = _dump(mdir / "tuning" / "c04_outrange.yaml", OUTRANGE)
    shipped = str(mdir / "tuning" / "h200.yaml")
    reg = FactorRegistry(hardware="h200", manifests_dir=mdir)
    assert reg.tuning.path == reg.tuning.in_use == shipped, _tuning_notes(reg)
    assert reg.tuning.refused == {} and reg.tuning.unused_files == [str(bad)]
    notes = _tuning_notes(reg)
    assert len(notes) == 1, notes
    assert notes[0].startswith(f"tuning: tuning file {bad}: for NVIDIA H200, but none of its tables can "
                               "be used (moe_fused_gemm: values: x: 99 outside what "), notes
    assert notes[0].endswith(f"): set aside; {shipped} (the first file for NVIDIA H200 by name with a "
                             "table that can be used) is used instead"), notes
    assert not any("also for" in n or "never used" in n for n in notes), notes
    # the shipped rows serve: a row that chose a configuration gives it, not the default (-1)
    ft = reg.tuning.factors["moe_fused_gemm"]
    shape, t, v = next((s, t, v) for s, (ts, vs) in ft.table.items() for t, v in zip(ts, vs) if v >= 0)
    assert reg.tuning.value("moe_fused_gemm", "config", {**dict(zip(ft.key, shape)), "T": t}, -1) == v


def test_list_factors_names_the_file_that_serves_and_the_notes_agree(tmp_path, monkeypatch, capsys):
    """The `tuning:` line and --json's tuning_file name h200.yaml (they named c04 as read, with
    none of its tables used, and null); no note calls h200.yaml unused."""
    mdir = _copy(tmp_path)
    bad = _dump(mdir / "tuning" / "c04_outrange.yaml", OUTRANGE)
    shipped = mdir / "tuning" / "h200.yaml"
    monkeypatch.setenv("EX_ENGINE_MANIFESTS", str(mdir))
    plugs = tmp_path / "plugs"
    plugs.mkdir()
    args = ["list-factors", "--dir", str(plugs), "--hardware", "h200", "--no-probe"]
    cli_main(args)
    out = capsys.readouterr().out
    assert f"\ntuning: {shipped}\n" in out, out
    assert f"note: tuning: tuning file {bad}: for NVIDIA H200, but none of its tables can be used" in out, out
    assert "also for" not in out and "never used" not in out and "none of its tables is used (see" not in out, out
    cli_main(args + ["--json"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["tuning_file"] == str(shipped), doc["tuning_file"]


def test_a_file_with_no_table_is_passed_over_too(tmp_path):
    """A file with device and SM count only has no table that can be used: it is passed over."""
    mdir = _copy(tmp_path)
    empty = _dump(mdir / "tuning" / "a_empty.yaml", {"device": "NVIDIA H200", "multiprocessor_count": 132})
    reg = FactorRegistry(hardware="h200", manifests_dir=mdir)
    assert reg.tuning.in_use == str(mdir / "tuning" / "h200.yaml")
    notes = _tuning_notes(reg)
    assert len(notes) == 1 and notes[0].startswith(f"tuning: tuning file {empty}: for NVIDIA H200, but none "
                                                   "of its tables can be used (it has no table): set aside"), notes


def test_of_two_usable_files_the_first_by_name_still_serves(tmp_path):
    """The documented rule is kept where both files have a table in use."""
    mdir = _copy(tmp_path)
    first = mdir / "tuning" / "a_copy.yaml"
    shutil.copy(mdir / "tuning" / "h200.yaml", first)
    reg = FactorRegistry(hardware="h200", manifests_dir=mdir)
    assert reg.tuning.in_use == str(first)
    assert _tuning_notes(reg) == [f"tuning: tuning file {mdir / 'tuning' / 'h200.yaml'}: also for NVIDIA "
                                  f"H200; {first} (first by name) is used, this one is not"], reg.notes


def test_with_no_usable_file_the_first_serves_and_the_others_are_set_aside(tmp_path):
    """No file for this GPU has a table that can be used: the first is the one read (its notes say
    why none of its tables is used, as before); the other is set aside, not called shadowed."""
    mdir = _copy(tmp_path)
    (mdir / "tuning" / "h200.yaml").unlink()
    a = _dump(mdir / "tuning" / "a.yaml", OUTRANGE)
    b = _dump(mdir / "tuning" / "b.yaml", OUTRANGE)
    reg = FactorRegistry(hardware="h200", manifests_dir=mdir)
    assert reg.tuning.path == str(a) and reg.tuning.in_use is None
    notes = _tuning_notes(reg)
    assert len(notes) == 2, notes
    assert notes[0].startswith(f"tuning: tuning file {b}: for NVIDIA H200, but none of its tables can be "
                               "used (moe_fused_gemm: values: x: 99"), notes
    assert notes[0].endswith("set aside; no file for NVIDIA H200 has a table that can be used"), notes
    assert notes[1].startswith(f"tuning: tuning file {a}: moe_fused_gemm: values: x: 99") \
        and notes[1].endswith("its table is never used"), notes
    assert reg.tuning.unused_files == [str(b)]


def test_check_decides_again_which_file_serves(tmp_path):
    """Which file serves follows the manifests check() is given (a registry checks again after
    each load): with moe_fused_gemm's manifest the out-of-range file is passed over and the good
    one's rows serve; with no manifest known no table can be used, and the first file is back
    (in_use None, calls on the default). path, factors and refused change together."""
    _dump(tmp_path / "a_bad.yaml", OUTRANGE)
    _dump(tmp_path / "b_good.yaml", GOOD)
    t = TuningTable.for_hardware(H200, tmp_path)
    assert t.path == str(tmp_path / "a_bad.yaml")        # before any check: the first by name
    sizes = {"H": 64, "I": 32, "G": 8, "K": 2, "T": 64}
    assert t.check(_moe_manifest()) == []
    assert t.in_use == str(tmp_path / "b_good.yaml") and t.refused == {}
    assert t.value("moe_fused_gemm", "config", sizes, -1) == 2          # mid, b_good's row
    assert t.unused_files == [str(tmp_path / "a_bad.yaml")]
    assert len(t.remarks) == 1 and "a_bad.yaml: for NVIDIA H200, but none of its tables" in t.remarks[0]
    msgs = t.check({})
    assert t.path == str(tmp_path / "a_bad.yaml") and t.in_use is None and "moe_fused_gemm" in t.refused
    assert len(msgs) == 1 and "a_bad.yaml: moe_fused_gemm: no factor of that name" in msgs[0], msgs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TuningWarning)
        assert t.value("moe_fused_gemm", "config", sizes, -1) == -1
    assert t.check(_moe_manifest()) == [] and t.in_use == str(tmp_path / "b_good.yaml")


def test_a_malformed_file_is_still_skipped_for_the_next(tmp_path):
    """The behaviour the fix matches: a malformed file for this GPU is skipped, the next serves."""
    mdir = _copy(tmp_path)
    (mdir / "tuning" / "c04_bad.yaml").write_text("device: NVIDIA H200\nmoe_fused_gemm: [1]\n", encoding="utf-8")
    reg = FactorRegistry(hardware="h200", manifests_dir=mdir)
    assert reg.tuning.in_use == str(mdir / "tuning" / "h200.yaml")


# ------------------------------- B. tuning files in a folder tuning is not read from
def test_tuning_files_in_a_folder_that_is_not_read_are_noted(tmp_path):
    """EX_ENGINE_MANIFESTS=/mine:<checkout>/manifests: tuning comes from the checkout's folder
    (the first with hardware/); /mine/tuning/a.yaml was ignored without a note."""
    mine = tmp_path / "mine"
    (mine / "tuning").mkdir(parents=True)
    shutil.copy(SHIPPED / "tuning" / "h200.yaml", mine / "tuning" / "a.yaml")
    reg = FactorRegistry(hardware="h200", manifests_dir=os.pathsep.join([str(mine), str(SHIPPED)]))
    assert reg.tuning.in_use == str(SHIPPED / "tuning" / "h200.yaml")
    notes = [n for n in reg.notes if str(mine / "tuning") in n]
    assert notes == [f"tuning: tuning folder {mine / 'tuning'}: not read (1 *.yaml/*.yml file(s)): tuning "
                     f"files come from {SHIPPED / 'tuning'} only ({SHIPPED} is the first folder of the "
                     "search path with a hardware/ folder); to use them, put them there"], reg.notes


def test_the_note_on_unread_tuning_files_is_printed_by_list_factors(tmp_path, monkeypatch, capsys):
    mine = tmp_path / "mine"
    (mine / "tuning").mkdir(parents=True)
    shutil.copy(SHIPPED / "tuning" / "h200.yaml", mine / "tuning" / "a.yaml")
    monkeypatch.setenv("EX_ENGINE_MANIFESTS", os.pathsep.join([str(mine), str(SHIPPED)]))
    plugs = tmp_path / "plugs"
    plugs.mkdir()
    cli_main(["list-factors", "--dir", str(plugs), "--hardware", "h200", "--no-probe"])
    out = capsys.readouterr().out
    assert f"note: tuning: tuning folder {mine / 'tuning'}: not read (1 *.yaml/*.yml file(s))" in out, out


def test_no_note_where_the_other_folders_have_no_tuning_files(tmp_path):
    """No tuning/, an empty one, or one without *.yaml / *.yml: nothing ignored, nothing said;
    one folder alone: it is the one read."""
    plain, empty, other = tmp_path / "plain", tmp_path / "empty", tmp_path / "other"
    plain.mkdir()
    (empty / "tuning").mkdir(parents=True)
    (other / "tuning").mkdir(parents=True)
    (other / "tuning" / "README.txt").write_text("notes")
    dirs = os.pathsep.join(map(str, [plain, empty, other, SHIPPED]))
    reg = FactorRegistry(hardware="h200", manifests_dir=dirs)
    assert not [n for n in reg.notes if "not read" in n], reg.notes
    reg = FactorRegistry(hardware="h200", manifests_dir=SHIPPED)
    assert not [n for n in reg.notes if "not read" in n], reg.notes


def test_the_note_says_so_where_no_folder_has_hardware(tmp_path):
    """With no hardware/ folder anywhere, tuning comes from the first folder: a later folder's
    tuning files are named, and why the first is the one read."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    for name in ("moe_fused_gemm.yaml", "topk_softmax.yaml", "fused_add_rmsnorm.yaml"):
        shutil.copy(SHIPPED / name, first / name)
    (second / "tuning").mkdir(parents=True)
    shutil.copy(SHIPPED / "tuning" / "h200.yaml", second / "tuning" / "h200.yaml")
    shutil.copy(SHIPPED / "tuning" / "h200.yaml", second / "tuning" / "h200_copy.yml")
    reg = FactorRegistry(hardware=SHIPPED / "hardware" / "h200.yaml",
                         manifests_dir=os.pathsep.join([str(first), str(second)]))
    notes = [n for n in reg.notes if "not read" in n]
    assert len(notes) == 1 and f"tuning folder {second / 'tuning'}: not read (2 *.yaml/*.yml file(s))" in notes[0]
    assert f"({first} is the first folder of the search path: none has a hardware/ folder)" in notes[0], notes


def test_a_table_for_a_rejected_library_does_not_make_its_file_serve(tmp_path):
    """A review of the file choice: a file (first by name) whose only table is for my_moe was
    passed over at start; loading a folder whose only my_moe library is rejected (its manifest
    beside it) made that file serve, dropping every shipped moe_fused_gemm row mid-run. A
    rejected library's manifest makes no table usable."""
    from tests.conftest import build_plugin

    mdir = _copy(tmp_path)
    mine = {"device": "NVIDIA H200", "multiprocessor_count": 132,
            "my_moe": {"dim": "config", "key": ["H", "I", "G", "K"], "values": {"auto": -1, "tiny": 0},
                       "shapes": [{**QWEN, "by_T": [[1, "tiny"]]}]}}
    _dump(mdir / "tuning" / "a_mine.yaml", mine)
    lib = tmp_path / "lib"
    build_plugin(lib, "my_moe", defines={"NAME": '"my_moe"', "FACTOR_ID": 1234}, manifest=False)
    (lib / "my_moe.yaml").write_text((SHIPPED / "moe_fused_gemm.yaml").read_text(encoding="utf-8")
                                     .replace("moe_fused_gemm", "my_moe"), encoding="utf-8")
    reg = FactorRegistry(hardware="h200", manifests_dir=mdir)
    assert reg.tuning.in_use == str(mdir / "tuning" / "h200.yaml")
    reg.load_folder(lib)
    assert [(p.name, p.status) for p in reg.plugins if p.name == "my_moe"] == [("my_moe", "rejected")]
    assert reg.tuning.in_use == str(mdir / "tuning" / "h200.yaml")


def test_the_folder_tuning_is_read_from_is_not_called_unread_under_another_name(tmp_path):
    """A review: the manifests folder listed once through a symlink and once by its path got a
    note that its own tuning files were not read."""
    from ex_engine import _paths

    mdir = _copy(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(mdir)
    assert _paths.unread_tuning([link, mdir]) == []
    other = _copy(tmp_path, "other")
    (notes,) = [_paths.unread_tuning([link, mdir, other])]
    assert len(notes) == 1 and str(other / "tuning") in notes[0]
