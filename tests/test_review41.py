"""Review 41: defects in the commits 264d8b3..2bdf0d0 (CPU only, deterministic)."""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

from ex_engine import FactorRegistry
from ex_engine.errors import ArgumentError
from ex_engine.hardware import Hardware
from ex_engine.manifest import Manifest
from ex_engine.tuning import TuningTable, TuningWarning
from ex_engine.verify import format_table, run_case, verify_plugin

from .conftest import ROOT, build_plugin


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
    (tmp_path / "h200.yaml").write_text(
        "device: NVIDIA H200\nmultiprocessor_count: 132\nmoe_fused_gemm:\n  dim: config\n"
        "  key: [H, I, G, K]\n  values: {huge: 99}\n"
        "  shapes:\n    - {H: 64, I: 32, G: 8, K: 2, by_T: [[1, huge]]}\n")
    t = TuningTable.for_hardware(Hardware.from_profile("h200"), tmp_path, report=False)
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
    (tmp_path / "h200.yaml").write_text(
        "device: NVIDIA H200\nmultiprocessor_count: 132\nmoe_fused_gemm:\n  dim: config\n"
        "  key: [H, I, G, K]\n  values: {huge: 99}\n"
        "  shapes:\n    - {H: 64, I: 32, G: 8, K: 2, by_T: [[1, huge]]}\n")
    t = TuningTable.for_hardware(Hardware.from_profile("h200"), tmp_path, report=False)
    sizes = {"H": 64, "I": 32, "G": 8, "K": 2, "T": 4}
    assert t.value("moe_fused_gemm", "config", sizes, -1) == 99   # not yet checked: in use
    t.check({"moe_fused_gemm": Manifest.load(ROOT / "manifests" / "moe_fused_gemm.yaml")})
    assert t.value("moe_fused_gemm", "config", sizes, -1) == -1   # set aside


