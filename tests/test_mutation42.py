"""Session 42's mutation test of the code changed in sessions 40-41 (264d8b3..): each test here
fails on one small change of the code (named in its docstring) that the suite let pass. CPU only:
the tests' host plugin (tests/plugins/host_scale.c), the tuning table, tune_moe driven with
stand-ins for its GPU parts."""
from __future__ import annotations

import os
import signal
import threading
import warnings

import numpy as np
import pytest
import yaml

from ex_engine import DeviceSideError, FactorRegistry, _yaml
from ex_engine.errors import ArgumentError
from ex_engine.hardware import Hardware
from ex_engine.manifest import Manifest
from ex_engine.verify import verify_plugin

from .conftest import ROOT, build_plugin
from .test_bench_tools import drive_tune_moe, import_tool
from .test_trial41cc import start_inside_the_choice


# ------------------------------------------------------------------------------ registry: loads
def test_load_library_runs_one_at_a_time_with_a_load_folder(tmp_path, monkeypatch):
    """registry.load_library without ``with self._load_lock``: a library loaded while a
    load_folder was choosing was overwritten by that older choice (get() and dispatch lost it).
    Forced as test_trial41cc forces it for two load_folder calls: thread B's load_library is
    started from inside thread A's choice."""
    build_plugin(tmp_path / "a")
    lib = build_plugin(tmp_path / "b", "other", defines={"NAME": '"other"', "FACTOR_ID": 1201})
    reg = FactorRegistry(hardware="h200")
    started = start_inside_the_choice(monkeypatch, reg.load_library, lib)
    reg.load_folder(tmp_path / "a")
    started[0].join(timeout=30)
    assert not started[0].is_alive()
    assert reg.get("host_scale") is not None and reg.get("other") is not None, sorted(reg._chosen)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork")
def test_a_forked_child_loads_although_the_parent_held_the_load_lock(tmp_path):
    """renew_after_fork without "_load_lock": a child forked while a load held the lock (another
    thread's, here the parent's own) inherited it held, and its first load waited forever."""
    build_plugin(tmp_path / "a")
    lib = build_plugin(tmp_path / "b", "other", defines={"NAME": '"other"', "FACTOR_ID": 1201})
    reg = FactorRegistry.load(tmp_path / "a", hardware="h200")
    with reg._load_lock:
        pid = os.fork()
        if pid == 0:   # the child: ends here, whatever happens
            status = 2
            try:
                signal.alarm(10)   # a deadlock ends the child by SIGALRM
                status = 0 if reg.load_library(lib).status == "ready" else 3
            finally:
                os._exit(status)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, \
        f"the child's load: status {status:#x} (SIGALRM {signal.SIGALRM}: it waited for the lock)"


# ------------------------------------------------------------------------------ registry: _choose
def test_a_plugin_whose_factor_id_is_taken_is_not_served(tmp_path):
    """_choose without ``del chosen[q.name]``: the library rejected for a factor id another
    factor's plugin holds was still get()'s and dispatch's choice (its status said rejected)."""
    build_plugin(tmp_path)
    build_plugin(tmp_path, "other", defines={"NAME": '"host_scale_other"'})   # the same id, 1100
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    loser = next(p for p in reg.plugins if p.status == "rejected")
    assert "factor id 1100 already taken" in loser.reason
    assert reg.get(loser.name) is None
    assert sum(reg.get(n) is not None for n in ("host_scale", "host_scale_other")) == 1


def test_a_later_load_that_wins_a_factor_id_drops_the_earlier_winner(tmp_path):
    """_choose's new dict merged into ``_chosen`` (update) in place of replacing it: a factor
    whose plugin a later load rejected (its id taken by a higher version) stayed chosen."""
    build_plugin(tmp_path / "a", "first", defines={"NAME": '"scale_a"', "FACTOR_ID": 1200})
    build_plugin(tmp_path / "b", "second", defines={"NAME": '"scale_b"', "FACTOR_ID": 1200,
                                                    "VERSION": '"2.0.0"'})
    reg = FactorRegistry.load(tmp_path / "a", hardware="h200")
    assert reg.get("scale_a") is not None
    reg.load_folder(tmp_path / "b")
    first = next(p for p in reg.plugins if p.name == "scale_a")
    assert first.status == "rejected" and "factor id 1200 already taken by 'scale_b'" in first.reason
    assert reg.get("scale_a") is None and reg.get("scale_b") is not None


def test_a_shadowed_plugin_names_the_winner_of_the_latest_choice(tmp_path):
    """_choose taking only "ready" plugins (not "shadowed" ones back to ready): a plugin
    shadowed by one load kept the reason of that load after a later load brought a newer
    winner (list-factors --why named a winner that no longer served the factor)."""
    build_plugin(tmp_path / "a", "a_old", defines={"VERSION": '"1.0.0"'})
    build_plugin(tmp_path / "a", "b_mid", defines={"VERSION": '"1.5.0"'})
    lib = build_plugin(tmp_path / "c", "c_new", defines={"VERSION": '"2.0.0"'})
    reg = FactorRegistry.load(tmp_path / "a", hardware="h200")
    old = next(p for p in reg.plugins if p.path.stem == "a_old")
    assert old.status == "shadowed" and "wins: b_mid.so" in old.reason
    reg.load_library(lib)
    assert reg.get("host_scale").path.stem == "c_new"
    for stem in ("a_old", "b_mid"):
        p = next(q for q in reg.plugins if q.path.stem == stem)
        assert p.status == "shadowed" and "wins: c_new.so" in p.reason, (stem, p.reason)


def test_a_prefer_met_by_the_first_load_leaves_no_note(tmp_path):
    """_choose's prefer notes read ``self._chosen`` (the choice before this one) in place of
    the new choice: the first load noted "no plugin of 'host_scale' is ready" for a prefer= it
    had just honoured."""
    build_plugin(tmp_path, "a_old", defines={"VERSION": '"1.0.0"'})
    build_plugin(tmp_path, "b_new", defines={"VERSION": '"2.0.0"'})
    reg = FactorRegistry.load(tmp_path, hardware="h200", prefer={"host_scale": "a_old.so"})
    assert reg.get("host_scale").path.stem == "a_old"
    assert not [n for n in reg.notes if n.startswith("prefer:")], reg.notes


def test_a_malformed_lock_refuses_the_folder_before_any_library(tmp_path):
    """load_folder reading the folder's lock after its libraries (not before): the refusal of a
    malformed lock left a record of the first library in ``plugins`` (list-factors showed a
    library of a folder whose load had raised)."""
    from ex_engine.errors import FactorError
    build_plugin(tmp_path)
    build_plugin(tmp_path, "b_other", defines={"NAME": '"other"', "FACTOR_ID": 1201})
    (tmp_path / "ex_engine.lock").write_text('["host_scale.so"]')
    reg = FactorRegistry(hardware="h200", lock=True)
    with pytest.raises(FactorError, match="expected a JSON object"):
        reg.load_folder(tmp_path)
    assert reg.plugins == [] and reg.get("host_scale") is None


# ------------------------------------------------------------------------------ tuning
_HEAD = "device: NVIDIA H200\nmultiprocessor_count: 132\n"


def _table(folder, table: str):
    from ex_engine.tuning import TuningTable
    (folder / "h200.yaml").write_text(_HEAD + "moe_fused_gemm:\n" + table, encoding="utf-8")
    return TuningTable.for_hardware(Hardware.from_profile("h200"), folder, report=False)


def _manifests():
    return {"moe_fused_gemm": Manifest.load(ROOT / "manifests" / "moe_fused_gemm.yaml")}


_SIZES = {"H": 64, "I": 32, "G": 8, "K": 2, "T": 4}


def test_a_tuning_value_below_minus_one_sets_the_file_aside(tmp_path):
    """FactorTuning's values read with a lower bound of -2 (not -1): a value no kernel accepts
    passed, and the call was refused at dispatch in place of the file at load."""
    t = _table(tmp_path, "  dim: config\n  key: [H, I, G, K]\n  values: {bad: -2}\n"
                         "  shapes:\n    - {H: 64, I: 32, G: 8, K: 2, by_T: [[1, bad]]}\n")
    assert t.path is None and len(t.problems) == 1, t.problems
    assert "values.bad: expected an integer >= -1, got -2" in t.problems[0]


@pytest.mark.parametrize("table,needle", [
    ("  dim: ''\n  key: [H, I, G, K]\n  values: {tiny: 1}\n", "dim: expected the name of the manifest's tuned dim"),
    ("  dim: config\n  key: [H, I, G, K]\n  values: {1: 1}\n", "got int 1 (quote it)"),
    ("  dim: config\n  key: [H, I, G, K]\n  values: {yes: 1}\n", "got bool True (YAML reads unquoted on/off"),
])
def test_a_tuning_table_names_an_empty_dim_and_hints_by_the_names_type(tmp_path, table, needle):
    """FactorTuning: ``or not data["dim"]`` dropped let dim '' through (set aside later as no
    tuned dim, not as malformed); the booleans' hint (quote on/off/yes/no) given for an int
    name too (``isinstance(k, int)``)."""
    t = _table(tmp_path, table + "  shapes:\n    - {H: 64, I: 32, G: 8, K: 2, by_T: [[1, tiny]]}\n")
    assert t.path is None and len(t.problems) == 1, t.problems
    assert needle in t.problems[0], t.problems[0]
    assert "int" not in needle or "on/off" not in t.problems[0]


def test_refused_gives_every_reason_for_a_table(tmp_path):
    """check() kept the first of a table's reasons only (why[0] for "; ".join(why)): the
    warning that the kernel runs on its default named one of two faults to mend."""
    t = _table(tmp_path, "  dim: config\n  key: [H, I, G, Z]\n  values: {huge: 99}\n"
                         "  shapes:\n    - {H: 64, I: 32, G: 8, Z: 2, by_T: [[1, huge]]}\n")
    t.check(_manifests())
    why = t.refused["moe_fused_gemm"]
    assert "key: ['Z'] no size of moe_fused_gemm's calls" in why and "values: huge: 99 outside" in why, why


def test_check_with_more_manifests_takes_a_table_back_into_use(tmp_path):
    """check() merging its decision into ``refused`` (update) in place of replacing it: a table
    set aside while its factor had no manifest stayed aside once the manifest was known ("called
    again with more manifests, it decides again")."""
    t = _table(tmp_path, "  dim: config\n  key: [H, I, G, K]\n  values: {tiny: 1}\n"
                         "  shapes:\n    - {H: 64, I: 32, G: 8, K: 2, by_T: [[1, tiny]]}\n")
    assert t.check({}) and "moe_fused_gemm" in t.refused
    assert t.value("moe_fused_gemm", "config", _SIZES, -1) == -1
    assert t.check(_manifests()) == []
    assert t.refused == {}
    assert t.value("moe_fused_gemm", "config", _SIZES, -1) == 1


class _SwapOnFirstContains(dict):
    """A ``refused`` whose first membership test is the moment check() (in another thread)
    assigns a new ``refused`` without this factor (the table back in use)."""

    def __init__(self, data, table):
        super().__init__(data)
        self.table, self.n = table, 0

    def __contains__(self, key):
        self.n += 1
        if self.n == 1:
            self.table.refused = {}
        return super().__contains__(key)


def test_tuning_value_warns_with_the_refusal_it_acted_on(tmp_path):
    """value() asking ``factor in self.refused`` again for its warning (not the ``refused`` it
    read once): a check() in between made a call that had run on the default because its
    table was set aside warn that the table had no row for its shape."""
    from ex_engine.tuning import TuningWarning
    t = _table(tmp_path, "  dim: config\n  key: [H, I, G, K]\n  values: {huge: 99}\n"
                         "  shapes:\n    - {H: 64, I: 32, G: 8, K: 2, by_T: [[1, huge]]}\n")
    t.check(_manifests())
    t.warn = True
    t.refused = _SwapOnFirstContains(t.refused, t)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always", TuningWarning)
        assert t.value("moe_fused_gemm", "config", _SIZES, -1) == -1
    assert len(got) == 1 and "values: huge: 99 outside" in str(got[0].message), [str(w.message) for w in got]


# ------------------------------------------------------------------------------ _yaml
def test_a_float_tag_on_underscores_only_is_named_at_its_line():
    """construct_yaml_float testing ``text.strip()`` (not with the underscores taken out, as
    PyYAML reads the number): ``!!float _`` reached PyYAML's IndexError, reported as
    "IndexError: string index out of range" without the line."""
    with pytest.raises(yaml.YAMLError, match=r"invalid float '_'.*\n.*f\.yaml\", line 2"):
        _yaml.load("a: 1\nk: !!float _\n", name="f.yaml")


# ------------------------------------------------------------------------------ manifest
@pytest.mark.parametrize("src", ["{}", "3", "null", "[tuned]", "{range: [0, 3]}", "{encode: f64_bits}"])
def test_a_dim_source_without_a_source_is_named(tmp_path, src):
    """Manifest's dim_sources check with ``if not given`` weakened (``given is None``): an entry
    that names no source (only a qualifier, or no mapping) became IndexError, reported as a
    malformed manifest, not "expected one of [...]"."""
    from ex_engine.errors import FactorError
    p = tmp_path / "f.yaml"
    p.write_text("name: f\nid: 7\ndims: [N, X]\noutput: {name: out, shape: [N], dtype: [float32]}\n"
                 "input: {name: x, shape: [N], dtype: [float32]}\nparams: {a: {type: int, default: 1}}\n"
                 f"dim_sources: {{X: {src}}}\n", encoding="utf-8")
    with pytest.raises(FactorError, match=r"dim_sources: X: expected one of \['default_dim', 'dtype_of', "
                                          r"'param', 'row_stride_of', 'tuned'\], got "):
        Manifest.load(p)


# ------------------------------------------------------------------------------ tune_moe
_OTHER = {"H": 1024, "I": 256, "G": 16, "K": 2, "model": "other", "by_T": [[1, "tiny", 1.0, 2.0]]}


def test_merge_rows_replaces_a_rows_T_keeps_the_rest_in_order():
    """merge_rows: a row of the same shape and T replaces the file's, the file's other rows and
    shapes stay, rows sorted by T (list(rows.values()) left T = 64 after 4096), shapes sorted."""
    tune = import_tool("benchmarks", "tune_moe")
    data = tune.merge_rows({}, {}, "NVIDIA H200", 132)
    data["moe_fused_gemm"]["shapes"] = [
        dict(_OTHER), {"H": 2048, "I": 768, "G": 128, "K": 8, "model": "q",
                       "by_T": [[1, "tiny", 3.0, 4.0], [4096, "grouped", 9.0, 10.0]]}]
    new = {(2048, 768, 128, 8): ("q", {64: [64, "decode", 5.0, 6.0], 1: [1, "auto", 2.0, 2.0]}),
           (512, 128, 8, 2): ("n", {8: [8, "tiny", 1.0, 1.5]})}
    got = tune.merge_rows(data, new, "NVIDIA H200", 132)["moe_fused_gemm"]["shapes"]
    assert [(e["H"], e["model"]) for e in got] == [(512, "n"), (1024, "other"), (2048, "q")]
    assert got[2]["by_T"] == [[1, "auto", 2.0, 2.0], [64, "decode", 5.0, 6.0], [4096, "grouped", 9.0, 10.0]]
    assert got[1]["by_T"] == _OTHER["by_T"]
    # a file of an older tuner (fewer configurations): its values become this tuner's, or the
    # rows naming a new configuration name a value the file lacks (the table set aside)
    old = {"device": "NVIDIA H200", "multiprocessor_count": 132,
           "moe_fused_gemm": {"dim": "config", "key": ["H", "I", "G", "K"], "values": {"auto": -1, "tiny": 1},
                              "shapes": [dict(_OTHER)]}}
    assert tune.merge_rows(old, new, "NVIDIA H200", 132)["moe_fused_gemm"]["values"] == tune.VALUES


def test_tune_moe_writes_its_file_under_an_exclusive_folder_lock(tmp_path, monkeypatch):
    """_folder_locked without its flock (or with LOCK_SH): two tuners finishing at once read,
    merged and wrote one file unserialised. Probed where the file is written: a shared
    non-blocking flock of the folder from another open file must fail then."""
    import fcntl
    tune = import_tool("benchmarks", "tune_moe")
    real = tune.replace_file
    probes = []

    def replace_file(path, text):
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            probes.append("unlocked")
        except BlockingIOError:
            probes.append("locked")
        finally:
            os.close(fd)
        return real(path, text)

    monkeypatch.setattr(tune, "replace_file", replace_file)
    out = tmp_path / "h200.yaml"
    rc, _ = drive_tune_moe(monkeypatch, out, [])
    assert rc == 0 and out.exists()
    assert probes == ["locked"]


def test_tune_moe_writes_unlocked_where_the_folder_cannot_be_locked(tmp_path, monkeypatch):
    """_folder_locked is best effort: where flock fails (a file system without it) the file is
    written unlocked; without ``contextlib.suppress(OSError)`` the run's rows were lost to an
    OSError traceback after the whole run."""
    import errno
    import fcntl

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    out = tmp_path / "h200.yaml"
    rc, tune = drive_tune_moe(monkeypatch, out, [])
    assert rc == 0
    data, _ = tune.existing_table(out, "NVIDIA H200", 132)
    assert [e["model"] for e in data["moe_fused_gemm"]["shapes"]] == ["qwen3-30b-a3b"]


def _a100(out):
    out.write_text((ROOT / "manifests" / "tuning" / "h200.yaml").read_text(encoding="utf-8")
                   .replace("device: NVIDIA H200", "device: NVIDIA A100").replace("multiprocessor_count: 132", "multiprocessor_count: 108"), encoding="utf-8")


def test_tune_moe_refuses_another_gpus_file_before_any_work(tmp_path, monkeypatch, capsys):
    """main() without its check once the GPU is known: another GPU's tuning file (a table that
    passes the check of the arguments, which knows no GPU) was refused only after the whole
    run's timing, at the merge (the docstring: refused before any work)."""
    out = tmp_path / "h200.yaml"
    _a100(out)
    before = out.read_text(encoding="utf-8")
    timed = []
    rc, _ = drive_tune_moe(monkeypatch, out, [], during=lambda tune: timed.append(1))
    assert rc == 2 and timed == [] and out.read_text(encoding="utf-8") == before
    assert "the table of NVIDIA A100 (108 SMs), not of this GPU" in capsys.readouterr().err


@pytest.mark.parametrize("replace", [False, True])
def test_tune_moe_file_made_unmergeable_during_the_run(tmp_path, monkeypatch, replace):
    """Another tuner leaves a file that cannot be merged (another GPU's) during this run:
    without --replace it is refused (status 2, the file untouched), with --replace written over
    (status 0, this run's rows). ``if not args.replace`` inverted did the opposite of both: wrote
    over it unasked, and dropped the run's rows where --replace asked for it."""
    out = tmp_path / "h200.yaml"
    out.write_text((ROOT / "manifests" / "tuning" / "h200.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    rc, tune = drive_tune_moe(monkeypatch, out, ["--replace"] if replace else [], during=lambda t: _a100(out))
    if replace:
        assert rc == 0
        data, _ = tune.existing_table(out, "NVIDIA H200", 132)
        assert [e["model"] for e in data["moe_fused_gemm"]["shapes"]] == ["qwen3-30b-a3b"]
    else:
        assert rc == 2 and "device: NVIDIA A100" in out.read_text(encoding="utf-8")


def test_tune_moe_keeps_the_merged_files_header(tmp_path, monkeypatch):
    """The merged file's comment header is kept below the new one ("Earlier header of this
    file"); dropping ``notes`` at the merge lost the provenance of the rows not re-tuned."""
    out = tmp_path / "h200.yaml"
    out.write_text("# hand-tuned rows, see notes/x.txt\n" + (ROOT / "manifests" / "tuning" / "h200.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    rc, _ = drive_tune_moe(monkeypatch, out, [])
    text = out.read_text(encoding="utf-8")
    assert rc == 0 and text.startswith("# Tuned tile configurations of moe_fused_gemm on NVIDIA H200 (written by")
    head = text.split("\ndevice:")[0]
    assert "# Earlier header of this file" in head and "# hand-tuned rows, see notes/x.txt" in head


# ------------------------------------------------------------------------------ verify
@pytest.fixture
def host_reg(tmp_path, monkeypatch):
    monkeypatch.setenv("EX_ENGINE_CACHE", str(tmp_path / "cache"))
    build_plugin(tmp_path / "lib")
    return FactorRegistry.load(tmp_path / "lib")


@pytest.mark.parametrize("count", ["no", None, 2])
def test_run_case_names_a_count_that_is_no_bool(host_reg, count):
    """run_case's docstring: count a bool, ArgumentError otherwise; without ``count=count`` in
    its check a count of None or 'no' ran the case (uncounted or counted, by truthiness)."""
    from ex_engine.verify import run_case
    with pytest.raises(ArgumentError) as err:
        run_case(host_reg, host_reg.get("host_scale"), {"N": 7}, "float32", count=count)
    assert err.value.argument == "count"


@pytest.mark.parametrize("timeout", [float("inf"), True, False])
def test_verify_plugin_refuses_an_infinite_or_bool_timeout(host_reg, timeout):
    """_check_call's timeout: ``< math.inf`` dropped let an endless wait through, and without
    ``isinstance(timeout, bool)`` True ran as one second (False is refused by the > 0 test)."""
    with pytest.raises(ArgumentError) as err:
        verify_plugin(host_reg, host_reg.get("host_scale"), isolate=True, timeout=timeout)
    assert err.value.argument == "timeout"


def _workspace_registry(tmp_path, monkeypatch):
    """A registry of host_scale_ws (host_scale.c with a workspace, tests/plugins/host_scale_ws.yaml),
    verify's cache in ``tmp_path``."""
    import shutil
    monkeypatch.setenv("EX_ENGINE_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "ws"
    build_plugin(folder, "host_scale_ws", defines={"WORKSPACE": True, "NAME": '"host_scale_ws"',
                                                   "FACTOR_ID": 1107}, manifest=False)
    shutil.copy(ROOT / "tests" / "plugins" / "host_scale_ws.yaml", folder / "host_scale_ws.yaml")
    return FactorRegistry.load(folder, hardware="h200")


def test_verify_in_process_keeps_a_flag_the_engine_set_before(tmp_path, monkeypatch):
    """_run_case puts the thread's host status word back as it was before the case, not to 0
    (``before = 0``): a flag the engine's own call had set in this thread was cleared by a
    verify_plugin run in the same thread, and check_device_errors() never reported it."""
    reg = _workspace_registry(tmp_path, monkeypatch)
    x = np.ones(8, np.float32)
    reg.dispatch("host_scale_ws", {"out": np.empty_like(x), "x": x, "alpha": np.array([-1.0], np.float32)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = verify_plugin(reg, reg.get("host_scale_ws"))
    assert rows and all(r.status == "pass" for r in rows), [r.detail for r in rows]
    with pytest.raises(DeviceSideError, match="alpha was negative"):
        reg.check_device_errors()


def test_run_case_puts_the_status_word_back_also_when_the_call_raises(tmp_path, monkeypatch):
    """_run_case restores the thread's host status word in a ``finally``: without it a case whose
    call flagged and then raised (a FAIL row) left its flag for the engine's next
    check_device_errors(), as a call the engine never made."""
    from ex_engine import verify
    from ex_engine.errors import FactorError
    reg = _workspace_registry(tmp_path, monkeypatch)
    p = reg.get("host_scale_ws")
    real = reg.call_plugin

    def flag_then_raise(plugin, arrays, params, count=True):
        real(plugin, arrays, params, count=count)
        verify._host_status_word(reg, (plugin.name, -1, threading.get_ident()), 1)
        raise FactorError("host_scale_ws: refused after flagging (a stand-in)")

    monkeypatch.setattr(reg, "call_plugin", flag_then_raise)
    row = verify.run_case(reg, p, {"N": 7}, "float32")
    assert row.status == "FAIL" and "refused after flagging" in row.detail, row
    reg.check_device_errors()   # raised DeviceSideError for the case's own flag
