"""Session forty-two's operations trial (bad plugins, long life): each test failed before its
mend. CPU only: host plugins built with gcc (tests/plugins/host_scale.c, and a few lines of C
of their own where host_scale.c has no knob)."""
from __future__ import annotations

import numpy as np
import pytest

from ex_engine import FactorRegistry, abi

from .conftest import build_plugin


def _x(n: int = 7) -> dict:
    x = np.arange(n, dtype=np.float32)
    return {"x": x, "out": np.empty_like(x), "alpha": np.array([2.0], np.float32)}


def test_loading_a_library_again_keeps_one_cffi_library_object(tmp_path):
    """cffi's FFI.dlopen keeps every library object it makes: a server that loaded its plugins
    folder once per registry grew ~12 KB per load for good (2000 loads: +25 MB RSS)."""
    build_plugin(tmp_path)
    FactorRegistry.load(tmp_path, hardware="h200")
    kept = getattr(abi.lib_ffi, "_libraries", None)
    if kept is None:
        pytest.skip("this cffi keeps no list of its libraries")
    before = len(kept)
    for _ in range(20):
        reg = FactorRegistry.load(tmp_path, hardware="h200")
        assert reg.dispatch("host_scale", _x()) == "plugin"
    assert len(abi.lib_ffi._libraries) == before
    assert abi.dlopen(tmp_path / "host_scale.so") is abi.dlopen(str(tmp_path / "host_scale.so"))
