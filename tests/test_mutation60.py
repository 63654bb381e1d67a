"""Mutation testing of sessions 57-59's changes (ex_engine/_paths.py, registry.py, tuning.py,
arrays.py, ops.py, benchmarks/tune_moe.py): each test pins a behaviour that a hand-made mutant
changed without any other test failing. CPU only."""
import os
import shutil
import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from ex_engine import FactorRegistry, _paths, topk_softmax
from ex_engine.errors import DeviceError, DTypeError
from ex_engine.manifest import Manifest
from ex_engine.tuning import TuningTable
from tests.conftest import ROOT, build_plugin

from .test_bench_tools import drive_tune_moe, import_tool
from .test_tune_follow59 import _cliff
from .test_tune_follow59 import _rows as _rows_by_T
from .test_tuning import small_moe_inputs

SHIPPED = ROOT / "manifests"
H200 = SimpleNamespace(name="NVIDIA H200", multiprocessor_count=132, live=False)
_Q = (2048, 768, 128, 8)   # qwen3-30b-a3b's key, the model drive_tune_moe tunes


def _table(by_T, values=None):
    return {"device": "NVIDIA H200", "multiprocessor_count": 132,
            "moe_fused_gemm": {"dim": "config", "key": ["H", "I", "G", "K"],
                               "values": values or {"auto": -1, "tiny": 0, "mid": 2},
                               "shapes": [{"H": 64, "I": 32, "G": 8, "K": 2, "by_T": by_T}]}}


def _dump(path, body):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(body), encoding="utf-8")
    return path


# ------------------------------------------------------------------ _paths.unread_tuning
def test_unread_tuning_passes_over_a_tuning_entry_that_is_no_folder(tmp_path):
    """A folder whose tuning/ is a file (NotADirectoryError, an OSError but no
    FileNotFoundError) says nothing, and the registry still starts."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "tuning").write_text("not a folder", encoding="utf-8")
    assert _paths.unread_tuning([other, SHIPPED]) == []
    FactorRegistry(hardware="h200", manifests_dir=os.pathsep.join([str(other), str(SHIPPED)]))


def test_unread_tuning_names_every_folder_not_read_in_search_order(tmp_path):
    """Two folders with tuning files before the one read: a note for each, in the path's order."""
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        _dump(d / "tuning" / "x.yaml", _table([[1, "tiny"]]))
    notes = _paths.unread_tuning([a, b, SHIPPED])
    assert len(notes) == 2, notes
    assert notes[0].startswith(f"tuning: tuning folder {a / 'tuning'}: not read (1 ")
    assert notes[1].startswith(f"tuning: tuning folder {b / 'tuning'}: not read (1 ")


# ------------------------------------------------------------------ tuning: which file serves
def test_a_file_after_the_one_that_serves_names_it_as_the_first_usable_one(tmp_path):
    """a_bad (no table usable), b_good, c_good: b serves, and c's remark says b is the first file
    by name with a table that can be used (not 'first by name': a_bad is first by name)."""
    outrange = _table([[1, "x"]], {"auto": -1, "x": 99})
    _dump(tmp_path / "a_bad.yaml", outrange)
    _dump(tmp_path / "b_good.yaml", _table([[1, "tiny"]]))
    c = _dump(tmp_path / "c_good.yaml", _table([[1, "mid"]]))
    t = TuningTable.for_hardware(H200, tmp_path)
    assert t.check({"moe_fused_gemm": Manifest.load(SHIPPED / "moe_fused_gemm.yaml")}) == []
    b = str(tmp_path / "b_good.yaml")
    assert t.in_use == b and t.unused_files == [str(tmp_path / "a_bad.yaml")]
    assert t.remarks[-1] == (f"tuning file {c}: also for NVIDIA H200; {b} (first by name with a table that "
                             "can be used) is used, this one is not"), t.remarks


def test_calls_bind_again_when_another_file_comes_to_serve(tmp_path):
    """A later load that passes the serving file over for the next one (its only table now set
    aside) drops the remembered calls even though neither file has a refused table: the next
    call takes the new file's value, not the old file's from the cache."""
    from ex_engine import moe_fused_gemm

    m = tmp_path / "m"
    shutil.copytree(SHIPPED, m, ignore=shutil.ignore_patterns("tuning"))
    _dump(m / "tuning" / "a.yaml", _table([[1, "tiny"], [64, "mid"]]))    # T = 64: mid (2)
    b = _dump(m / "tuning" / "b.yaml", _table([[1, "tiny"], [64, "tiny"]]))  # T = 64: tiny (0)
    (tmp_path / "none").mkdir()
    reg = FactorRegistry.load(tmp_path / "none", hardware="h200", manifests_dir=m)
    assert reg.tuning.in_use == str(m / "tuning" / "a.yaml")
    seen = []
    value = reg.tuning.value
    reg.tuning.value = lambda *a, **k: seen.append(value(*a, **k)) or seen[-1]
    x, w13, w2, w, ids = small_moe_inputs(np.random.default_rng())
    for _ in range(2):
        moe_fused_gemm(x, w13, w2, w, ids, registry=reg)
    assert seen == [2], seen
    reg.manifests["moe_fused_gemm"].dim_sources["config"] = {"tuned": -1, "options": [-1, 0]}
    reg._note_unused_tuning()                 # what each load does
    assert reg.tuning.in_use == str(b) and reg.tuning.refused == {}
    moe_fused_gemm(x, w13, w2, w, ids, registry=reg)
    assert seen == [2, 0], seen               # bound again, on b.yaml's row


# ------------------------------------------------------------------ registry notes and checks
def test_a_fallback_module_that_raises_at_import_is_a_warn_probe(tmp_path, monkeypatch):
    """probe='subprocess': the child's import raised (reported by the next check, which fails):
    the probe check passes as WARN, not ok."""
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "m60_raises_at_import.py").write_text("raise RuntimeError('boom at import')\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(mods))
    m = tmp_path / "m"
    shutil.copytree(SHIPPED, m)
    text = (ROOT / "tests" / "plugins" / "host_scale.yaml").read_text(encoding="utf-8")
    (m / "host_scale.yaml").write_text(text.replace("tests.plugins.host_scale_fallback:scale",
                                                    "m60_raises_at_import:scale"), encoding="utf-8")
    build_plugin(tmp_path / "lib", manifest=False)
    reg = FactorRegistry.load(tmp_path / "lib", hardware="h200", manifests_dir=m, probe="subprocess")
    (p,) = reg.plugins
    assert p.status == "rejected", p.reason
    (probe,) = [c for c in p.checks if c.name == "python fallback probe (child process)"]
    assert probe.ok and probe.label == "WARN" and probe.detail.endswith("raised RuntimeError (reported below)"), probe
    assert "boom at import" in p.reason or "RuntimeError" in p.reason, p.reason


def test_ex_engines_own_fallback_is_known_to_import_in_the_rejected_note(tmp_path):
    """A library rejected before its fallback check, whose manifest's fallback is ex_engine's
    own: the note does not say the fallback was never checked (the load's probe takes
    ex_engine's fallbacks as importable)."""
    m = tmp_path / "m"
    shutil.copytree(SHIPPED, m)
    text = (ROOT / "tests" / "plugins" / "host_scale.yaml").read_text(encoding="utf-8")
    (m / "host_scale.yaml").write_text(text.replace("tests.plugins.host_scale_fallback:scale",
                                                    "ex_engine.fallbacks:topk_softmax"), encoding="utf-8")
    build_plugin(tmp_path / "lib", defines={"FACTOR_ID": 1101}, manifest=False)   # the manifest says 1100
    reg = FactorRegistry.load(tmp_path / "lib", hardware="h200", manifests_dir=m)
    (p,) = reg.plugins
    assert p.status == "rejected" and not any(c.name.startswith("python fallback") for c in p.checks), p.checks
    (note,) = [n for n in reg.notes if n.startswith("fallback: host_scale:")]
    assert note.endswith("its calls go to the Python fallback ex_engine.fallbacks:topk_softmax; see "
                         "list-factors --why"), note


def test_the_id_clash_note_is_not_repeated_by_a_copy_of_the_loser_in_another_folder(tmp_path):
    """other_scale loses id 1040 to host_scale; the same library from another folder loses it
    the same way: one note, not two identical ones."""
    build_plugin(tmp_path / "a", defines={"FACTOR_ID": 1040})
    build_plugin(tmp_path / "a", stem="other_scale", defines={"FACTOR_ID": 1040, "NAME": '"other_scale"',
                                                               "VERSION": '"0.1.0"'})
    reg = FactorRegistry.load(tmp_path / "a", hardware="h200")
    (tmp_path / "b").mkdir()
    for f in ("other_scale.so", "other_scale.yaml"):
        shutil.copy(tmp_path / "a" / f, tmp_path / "b" / f)
    reg.load_folder(tmp_path / "b")
    lost = [p for p in reg.plugins if p.name == "other_scale"]
    assert [p.status for p in lost] == ["rejected", "rejected"], [(p.status, p.reason) for p in lost]
    assert len([n for n in reg.notes if n.startswith("factor id 1040:")]) == 1, reg.notes


# ------------------------------------------------------------------ manifest: sizes the kernel receives
def test_a_size_tied_to_a_dim_with_a_default_dim_loads(tmp_path):
    """A dim with a default_dim (G: from an optional array, else N) is one every call gives:
    out: [M] with 'M == G' is tied to it, and the manifest loads."""
    base = (ROOT / "tests" / "plugins" / "host_scale.yaml").read_text(encoding="utf-8")
    text = (base.replace("output: {name: out, shape: [N]", "output: {name: out, shape: [M]")
            .replace("dims: [N]", "dims: [N, G]")
            .replace("role: input}", "role: input}\n  - {name: o, shape: [G], dtype: [float32], optional: true}")
            .replace("- {N: 7}", "- {N: 7, M: 7}")
            + "dim_sources: {G: {default_dim: N}}\nconstraints: [\"M == G\"]\n")
    p = tmp_path / "m.yaml"
    p.write_text(text, encoding="utf-8")
    assert Manifest.load(p).dims == ["N", "G"]


# ------------------------------------------------------------------ __cuda_array_interface__ / CuPy
class _CAI:
    def __init__(self, d):
        self.__cuda_array_interface__ = d


_GOOD = {"shape": (2, 8), "typestr": "<f4", "data": (0xDEAD000, False), "version": 3}


def test_a_size_of_minus_one_is_refused_by_name():
    """-1 is a negative size too (the trial's case was -4)."""
    with pytest.raises(DTypeError, match="router_logits"):
        topk_softmax(_CAI({**_GOOD, "shape": (-1, 8)}), 2, registry=FactorRegistry.load())


def test_an_interface_mapping_without_get_is_refused_by_name():
    """An interface object that indexes like a dict but has no .get (AttributeError inside)."""
    class NoGet:
        def __getitem__(self, k):
            return _GOOD[k]

    with pytest.raises(DTypeError, match="router_logits"):
        topk_softmax(_CAI(NoGet()), 2, registry=FactorRegistry.load())


def test_cupys_out_of_memory_is_raised_as_is_not_as_a_device_error(monkeypatch):
    """CuPy's OutOfMemoryError (a MemoryError from a cupy module) says what it needed: it is
    not turned into the DeviceError for a CuPy that cannot use the device."""
    from ex_engine import arrays

    OOM = type("OutOfMemoryError", (MemoryError,), {"__module__": "cupy.cuda.memory"})

    class Device:
        def __init__(self, i):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def empty(shape, dtype=None):
        raise OOM("out of memory allocating 64 bytes")

    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(Device=Device)
    cupy.empty, cupy.uint16 = empty, np.uint16
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(arrays, "_CUPY_IMPORT", [True])
    monkeypatch.setattr(arrays, "_CUPY_RUNTIME", [None])
    with pytest.raises(OOM) as exc:
        topk_softmax(_CAI(dict(_GOOD)), 2, registry=FactorRegistry.load())
    assert not isinstance(exc.value, DeviceError)


# ------------------------------------------------------------------ benchmarks/tune_moe.py
def _data(by_T):
    return {"moe_fused_gemm": {"shapes": [{"H": 2048, "I": 768, "G": 128, "K": 8, "model": "q", "by_T": by_T}]}}


def test_between_is_strictly_between_from_a_row_at_zero():
    """_between(0, hi): T = 1, not 0 (the geometric mean with 0 is 0, the row itself)."""
    tune = import_tool("benchmarks", "tune_moe")
    assert tune._between(0, 2) == 1 and tune._between(0, 100) == 1
    assert all(lo < tune._between(lo, hi) < hi for lo in range(0, 20) for hi in range(lo + 2, 40))


def test_the_lower_choice_is_lent_where_it_ties_auto_at_the_row_above():
    """'ran no slower than auto there': a tie at the row above (tuned in this run) lends it."""
    tune = import_tool("benchmarks", "tune_moe")
    data = _data([[256, "tiny", 1.0, 2.0], [384, "auto", 3.0, 3.0], [512, "mid", 1.0, 2.0]])
    timed = {_Q + (384,): ("q", {"auto": 3.0, "tiny": 2.8, "mid": 3.2}),
             _Q + (512,): ("q", {"auto": 2.0, "mid": 1.0, "tiny": 2.0})}
    (line,) = tune.keep_neighbour_choices(data, timed)
    assert "records the T = 256 row's tiny" in line


def test_a_loss_equal_to_the_margin_is_no_gap():
    """A gap is a loss of more than the margin: with --margin 0, a tie names nothing."""
    tune = import_tool("benchmarks", "tune_moe")
    data = _data([[1024, "chunked_nomc", 143.5, 150.7], [1536, "auto", 188.9, 188.9]])
    timed = {_Q + (1536,): ("q", {"auto": 200.0, "chunked_nomc": 200.0})}
    assert tune.gap_notes(data, timed, 0.0) == []
    timed = {_Q + (1536,): ("q", {"auto": 200.0, "chunked_nomc": 200.1})}
    assert len(tune.gap_notes(data, timed, 0.0)) == 1


def test_follow_cases_leaves_ranges_under_two_percent_and_follows_those_of_two():
    """FOLLOW_SPAN: a gap 980..999 (20 = 2% of 1000) is followed; 985..999 (1.5%) is left."""
    tune = import_tool("benchmarks", "tune_moe")
    new_rows = {_Q: ("q", {1000: [1000, "auto", 10.0, 10.0]})}
    timed = {_Q + (1000,): ("q", {"auto": 10.0, "chunked_nomc": 20.0})}
    for lo, want in ((980, [("q", 990)]), (985, [])):
        start = _data([[lo, "chunked_nomc", 1.0, 2.0]])
        assert tune.follow_cases(start, new_rows, timed, 0.03, "NVIDIA H200", 132) == want, lo


def _rows(out):
    return sorted(_rows_by_T(out))


def test_follow_gaps_judges_gaps_against_the_files_own_rows(monkeypatch, tmp_path, capsys):
    """The file already has rows at the cliff (2990 mid, 3010 auto): a run at 2048 and 4096
    with --follow-gaps names no gap (2048..2989 and 3010..4095 run the right choice), so no
    row more is tuned."""
    out = tmp_path / "h200.yaml"
    assert drive_tune_moe(monkeypatch, out, ["--tokens", "2990", "3010"], us=_cliff)[0] == 0
    assert _rows(out) == [2990, 3010]
    capsys.readouterr()
    assert drive_tune_moe(monkeypatch, out, ["--tokens", "2048", "4096", "--follow-gaps", "5"], us=_cliff)[0] == 0
    assert _rows(out) == [2048, 2990, 3010, 4096]
    assert "gap round" not in capsys.readouterr().err


def test_without_follow_gaps_no_budget_line_is_printed(monkeypatch, tmp_path, capsys):
    """No --follow-gaps: the run ends after the rows asked for, with no '# --follow-gaps:' line."""
    out = tmp_path / "h200.yaml"
    assert drive_tune_moe(monkeypatch, out, ["--tokens", "2048", "4096"], us=_cliff)[0] == 0
    text = capsys.readouterr().out
    assert "# --follow-gaps" not in text and "# gap: qwen3-30b-a3b T = 2048..4095" in text
    assert _rows(out) == [2048, 4096]
