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


