"""Session 41 (cc) trial: an engine that serves from many threads and processes and loads more
plugins while it serves. CPU only: the tests' host plugin (tests/plugins/host_scale.c), the
Python fallbacks, the tuning table. Interleavings are forced with hooks, not timing."""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from ex_engine import FactorRegistry
from ex_engine.hardware import Hardware
from ex_engine.manifest import Manifest
from ex_engine.tuning import TuningTable

from .conftest import ROOT, build_plugin


def _no_fallback(folder: Path) -> None:
    """The folder's host_scale.yaml without a Python fallback: a call no plugin takes raises."""
    m = folder / "host_scale.yaml"
    m.write_text(m.read_text().replace("fallback: tests.plugins.host_scale_fallback:scale", "fallback: null"))


def _scale_call(reg, alpha: float = 2.0):
    """(path, out) of host_scale on 16 floats, or (the exception, None)."""
    x = np.arange(16, dtype=np.float32)
    out = np.empty_like(x)
    try:
        return reg.dispatch("host_scale", {"out": out, "x": x, "alpha": np.array([alpha], np.float32)}), out
    except Exception as exc:   # noqa: BLE001 (what the other thread got is the test's subject)
        return exc, None


def test_dispatch_during_a_reload_sees_the_plugin_chosen_before(tmp_path, monkeypatch):
    """load_folder of another folder while threads serve: _choose emptied ``_chosen`` and refilled
    it in place, so a call in that window found no plugin for a factor that stayed loaded and
    ready: FactorNotFoundError (its manifest beside the library), else the Python fallback or
    "no ready plugin" (36 of ~49,000 calls in four threads). The other thread's call is made
    inside the reload's choice here (a hook on _preferred, which the choice calls)."""
    build_plugin(tmp_path / "a")
    _no_fallback(tmp_path / "a")
    build_plugin(tmp_path / "b", "other", defines={"NAME": '"other"', "FACTOR_ID": 1201})
    reg = FactorRegistry.load(tmp_path / "a", hardware="h200")
    assert _scale_call(reg)[0] == "plugin"
    seen = []
    real = FactorRegistry._preferred

    def preferred(self, p):
        if not seen:   # the first question of the reload's choice: another thread calls now
            t = threading.Thread(target=lambda: seen.append(_scale_call(reg)))
            t.start()
            t.join()
        return real(self, p)

    monkeypatch.setattr(FactorRegistry, "_preferred", preferred)
    reg.load_folder(tmp_path / "b")
    path, out = seen[0]
    assert path == "plugin", f"a call during the reload got {path!r}"
    assert np.array_equal(out, 2 * np.arange(16, dtype=np.float32))
    assert reg.get("other") is not None and reg.get("host_scale") is not None


def test_concurrent_loads_into_one_registry_keep_both_choices(tmp_path, monkeypatch):
    """Two threads loading folders into one registry: each load's choice is computed from the
    plugin list and then replaces ``_chosen`` whole (the test above), so loads run one at a time
    (_load_lock); without it a load that finished while another was choosing was overwritten by
    the older choice and its ready plugin was missing from get() and dispatch. A guard of that
    mend: before it, this interleaving passed by accident (B's dict was refilled in place by A;
    the same loss needed B to finish between A's reading of the plugin list and its emptying of
    ``_chosen``, which no hook reaches cleanly). Forced: thread B's whole load is started from
    inside thread A's choice (B waits for A's lock, then loads)."""
    build_plugin(tmp_path / "a")
    build_plugin(tmp_path / "b", "other", defines={"NAME": '"other"', "FACTOR_ID": 1201})
    reg = FactorRegistry(hardware="h200")
    real = FactorRegistry._preferred
    started = []

    def preferred(self, p):
        if not started and threading.current_thread() is threading.main_thread():
            b = threading.Thread(target=reg.load_folder, args=(tmp_path / "b",))
            started.append(b)
            b.start()
            b.join(timeout=0.5)   # returns at once where nothing serialises the loads
        return real(self, p)

    monkeypatch.setattr(FactorRegistry, "_preferred", preferred)
    reg.load_folder(tmp_path / "a")
    started[0].join(timeout=30)
    assert not started[0].is_alive()
    assert reg.get("host_scale") is not None and reg.get("other") is not None, sorted(reg._chosen)
    assert _scale_call(reg)[0] == "plugin"


class _HookDict(dict):
    """A dict that runs ``hook`` the first time it is iterated (the moment check() rebuilds
    ``refused`` while it walks the table's factors)."""

    def __init__(self, data, hook):
        super().__init__(data)
        self.hook = hook

    def __iter__(self):
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()
        return super().__iter__()


def test_tuning_check_never_exposes_an_empty_refused(tmp_path):
    """TuningTable.check (run by every registry load) emptied ``refused`` and refilled it, so a
    value() in another thread meanwhile read a table that had been set aside: a registry
    loading more plugins while serving refused about a third of moe_fused_gemm's new-shape
    calls with "tuned dim ...: expected a value in the range -1..12, got 99" (226 of 685, three
    threads). Forced: value() is asked from inside check()."""
    (tmp_path / "h200.yaml").write_text(
        "device: NVIDIA H200\nmultiprocessor_count: 132\nmoe_fused_gemm:\n  dim: config\n"
        "  key: [H, I, G, K]\n  values: {huge: 99}\n"
        "  shapes:\n    - {H: 64, I: 32, G: 8, K: 2, by_T: [[1, huge]]}\n")
    t = TuningTable.for_hardware(Hardware.from_profile("h200"), tmp_path, report=False)
    manifests = {"moe_fused_gemm": Manifest.load(ROOT / "manifests" / "moe_fused_gemm.yaml")}
    assert t.check(manifests) and "moe_fused_gemm" in t.refused
    sizes = {"H": 64, "I": 32, "G": 8, "K": 2, "T": 4}
    got = []
    t.factors = _HookDict(t.factors, lambda: got.append(t.value("moe_fused_gemm", "config", sizes, -1)))
    t.check(manifests)
    assert got == [-1], f"value() during check() gave {got}: the set-aside table's value"
    assert "moe_fused_gemm" in t.refused
