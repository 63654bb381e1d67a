"""Review 41: defects in the commits 264d8b3..2bdf0d0 (CPU only, deterministic)."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from ex_engine import FactorRegistry
from ex_engine.errors import ArgumentError
from ex_engine.manifest import Manifest
from ex_engine.tuning import TuningWarning
from ex_engine.verify import format_table, verify_plugin

from .conftest import ROOT, build_plugin
from .test_trial41cc import table_outside_the_manifest


@pytest.fixture
def host_reg(tmp_path, monkeypatch):
    monkeypatch.setenv("EX_ENGINE_CACHE", str(tmp_path / "cache"))
    build_plugin(tmp_path / "lib")
    return FactorRegistry.load(tmp_path / "lib")


# ------------------------------------------------------------------------------ verify.format_table
def test_format_table_takes_the_tuple_its_check_lets_through(host_reg):
    """format_table's new check accepts a list or a tuple of CaseResult, but the table was built
    from ``[None] + results``: a tuple passed the check and then raised TypeError ('can only
    concatenate list (not "tuple") to list')."""
    rows = verify_plugin(host_reg, host_reg.get("host_scale"))
    assert format_table(tuple(rows)) == format_table(rows)
    assert format_table(()).startswith("factor")


# ------------------------------------------------------------------------------ verify's arguments
def test_verify_plugin_seed_from_a_numpy_generator_runs_in_process(host_reg):
    """A seed drawn by NumPy (np.int64, which the check accepts as 'an int >= 0') was multiplied
    as np.int64 (seed * 1000 + k): a large one wrapped around to a negative number, and each case
    became a FAIL row blaming the plugin ('could not run this case: ValueError ...'), the very
    outcome the check was added to prevent for seed -1."""
    seed = np.random.default_rng(0).integers(2 ** 61, 2 ** 62, dtype=np.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # (NumPy's overflow warning, before)
        rows = verify_plugin(host_reg, host_reg.get("host_scale"), seed=seed)
    assert [r.status for r in rows] == ["pass"], [r.detail for r in rows]
    # the same cases as the Python int of the same value
    again = verify_plugin(host_reg, host_reg.get("host_scale"), seed=int(seed))
    assert [r.error for r in rows] == [r.error for r in again]


def test_verify_plugin_numpy_seed_in_a_child_process(host_reg):
    """isolate=True sends the seed to the child as JSON: an np.int64 seed (accepted by the check)
    raised TypeError ('Object of type int64 is not JSON serializable') from deep inside."""
    rows = verify_plugin(host_reg, host_reg.get("host_scale"), seed=np.int64(3), isolate=True, timeout=60)
    assert [r.status for r in rows] == ["pass"], [r.detail for r in rows]


@pytest.mark.parametrize("timeout", [np.int64(60), np.float32(60.0), 60])
def test_verify_plugin_takes_a_numpy_number_of_seconds(host_reg, timeout):
    """The new timeout check took only int and float: np.int64(60) or np.float32(60), which the
    child wait used to take, became ArgumentError 'expected a number of seconds > 0, got
    np.int64(60)', a message that says the value is no number of seconds > 0."""
    rows = verify_plugin(host_reg, host_reg.get("host_scale"), isolate=True, timeout=timeout)
    assert [r.status for r in rows] == ["pass"], [r.detail for r in rows]


@pytest.mark.parametrize("timeout", [np.float64("nan"), np.int64(0), np.float32(-1), np.bool_(True), "1"])
def test_verify_plugin_still_refuses_a_bad_numpy_timeout(host_reg, timeout):
    with pytest.raises(ArgumentError) as err:
        verify_plugin(host_reg, host_reg.get("host_scale"), isolate=True, timeout=timeout)
    assert err.value.argument == "timeout"



# ------------------------------------------------------------------------------ tuning.value
class _SwapOnSecondContains(dict):
    """A ``refused`` dict whose second membership test is the moment check() (in another thread)
    assigns a new ``refused`` to the table, one without this factor."""

    def __init__(self, data, table):
        super().__init__(data)
        self.table, self.n = table, 0

    def __contains__(self, key):
        self.n += 1
        if self.n == 2:
            self.table.refused = {}
        return super().__contains__(key)


def test_tuning_value_reads_refused_once(tmp_path):
    """check() now replaces ``refused`` whole so that value() "reads the old one or the new one",
    but value() read the attribute up to three times: ``factor not in self.refused`` (old: set
    aside), then ``factor in self.refused`` and ``self.refused[factor]`` for its warning; a check()
    in between (new: not refused) made the call raise KeyError('moe_fused_gemm') out of dispatch."""
    t = table_outside_the_manifest(tmp_path)
    manifests = {"moe_fused_gemm": Manifest.load(ROOT / "manifests" / "moe_fused_gemm.yaml")}
    t.check(manifests)
    assert "moe_fused_gemm" in t.refused
    t.warn = True   # (as on a live GPU: the path that names why the table was set aside)
    t.refused = _SwapOnSecondContains(t.refused, t)
    sizes = {"H": 64, "I": 32, "G": 8, "K": 2, "T": 4}
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always", TuningWarning)
        assert t.value("moe_fused_gemm", "config", sizes, -1) == -1
    assert any("running on the kernel's default choice" in str(w.message) for w in got)


def test_tuning_value_unchanged_without_a_race(tmp_path):
    t = table_outside_the_manifest(tmp_path)
    sizes = {"H": 64, "I": 32, "G": 8, "K": 2, "T": 4}
    assert t.value("moe_fused_gemm", "config", sizes, -1) == 99   # not yet checked: in use
    t.check({"moe_fused_gemm": Manifest.load(ROOT / "manifests" / "moe_fused_gemm.yaml")})
    assert t.value("moe_fused_gemm", "config", sizes, -1) == -1   # set aside


# ------------------------------------------------------------------------------ tune_moe --replace
from .test_bench_tools import drive_tune_moe  # noqa: E402


_OTHER = {"H": 1024, "I": 256, "G": 16, "K": 2, "model": "other", "by_T": [[1, "tiny", 1.0, 2.0]]}


def _shapes(tune, out):
    data, _ = tune.existing_table(out, "NVIDIA H200", 132)
    return {e["model"]: e for e in data["moe_fused_gemm"]["shapes"]}


def test_tune_moe_replace_keeps_rows_another_tuner_wrote_during_the_run(tmp_path, monkeypatch):
    """Two tuners at once (one per GPU) with --replace over a file that cannot be merged: the
    merge at the end of the run, under the folder lock, was skipped for --replace, so the
    tuner that finished last wrote a table of its own rows only, and the other's (written
    during this run, into the file this run was told to replace) were lost, the loss the
    commit set out to close. Now --replace replaces the file as it was when the run started."""
    import yaml
    out = tmp_path / "h200.yaml"
    out.write_text("device: NVIDIA A100\nmultiprocessor_count: 108\nnot_a_tuning_table: 1\n")

    def other_tuner(tune):   # with --replace too: a new table of its own rows
        data = tune.merge_rows({}, {}, "NVIDIA H200", 132)
        data["moe_fused_gemm"]["shapes"] = [dict(_OTHER)]
        out.write_text("# the other tuner\n" + yaml.safe_dump(data, sort_keys=False), encoding="utf-8")

    rc, tune = drive_tune_moe(monkeypatch, out, ["--replace"], during=other_tuner)
    assert rc == 0
    shapes = _shapes(tune, out)
    assert "other" in shapes, "the other tuner's rows were dropped"
    assert shapes["other"]["by_T"] == [[1, "tiny", 1.0, 2.0]]
    assert [r for r in shapes["qwen3-30b-a3b"]["by_T"] if r[0] == 1][0][2:] == [5.0, 10.0]


def test_tune_moe_replace_still_replaces_the_file_it_was_given(tmp_path, monkeypatch):
    """(guard of the mend) unchanged during the run, --replace writes a new table over the file:
    another GPU's table, or this GPU's, keeps none of its rows."""
    import yaml
    out = tmp_path / "h200.yaml"
    out.write_text("device: NVIDIA A100\nmultiprocessor_count: 108\nnot_a_tuning_table: 1\n")
    rc, tune = drive_tune_moe(monkeypatch, out, ["--replace"])
    assert rc == 0 and list(_shapes(tune, out)) == ["qwen3-30b-a3b"]
    data = tune.merge_rows({}, {}, "NVIDIA H200", 132)
    data["moe_fused_gemm"]["shapes"] = [dict(_OTHER)]
    out.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    rc, tune = drive_tune_moe(monkeypatch, out, ["--replace"])
    assert rc == 0 and list(_shapes(tune, out)) == ["qwen3-30b-a3b"]
    out.unlink()   # and where there was no file
    rc, tune = drive_tune_moe(monkeypatch, out, ["--replace"])
    assert rc == 0 and list(_shapes(tune, out)) == ["qwen3-30b-a3b"]


def test_verify_plugin_timeout_none_is_the_default_in_a_child_process(host_reg):
    """The new check passes a timeout of None (as 'not given'), and in-process it is unused, but
    with isolate=True the child's wait added it to a float: TypeError ('unsupported operand
    type(s) for +: 'float' and 'NoneType''), the deep-inside error the check set out to end."""
    rows = verify_plugin(host_reg, host_reg.get("host_scale"), isolate=True, timeout=None)
    assert [r.status for r in rows] == ["pass"], [r.detail for r in rows]
