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



