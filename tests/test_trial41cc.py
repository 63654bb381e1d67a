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
    m.write_text(m.read_text(encoding="utf-8").replace("fallback: tests.plugins.host_scale_fallback:scale", "fallback: null"), encoding="utf-8")


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


def start_inside_the_choice(monkeypatch, load, *args) -> list:
    """The next choice the main thread makes (FactorRegistry._preferred) first starts
    ``load(*args)`` in a thread of its own and waits up to 0.5 s for it (it returns at once where
    nothing serialises the loads); returns the list that will hold that thread."""
    real = FactorRegistry._preferred
    started = []

    def preferred(self, p):
        if not started and threading.current_thread() is threading.main_thread():
            b = threading.Thread(target=load, args=args)
            started.append(b)
            b.start()
            b.join(timeout=0.5)
        return real(self, p)

    monkeypatch.setattr(FactorRegistry, "_preferred", preferred)
    return started


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
    started = start_inside_the_choice(monkeypatch, reg.load_folder, tmp_path / "b")
    reg.load_folder(tmp_path / "a")
    started[0].join(timeout=30)
    assert not started[0].is_alive()
    assert reg.get("host_scale") is not None and reg.get("other") is not None, sorted(reg._chosen)
    assert _scale_call(reg)[0] == "plugin"


def table_outside_the_manifest(folder):
    """An H200 TuningTable read from ``folder``, where a tuning file is written whose one row
    (H 64, I 32, G 8, K 2 from T = 1) names config 99, outside moe_fused_gemm's manifest range
    (-1..12): check() sets that table aside."""
    (folder / "h200.yaml").write_text(
        "device: NVIDIA H200\nmultiprocessor_count: 132\nmoe_fused_gemm:\n  dim: config\n"
        "  key: [H, I, G, K]\n  values: {huge: 99}\n"
        "  shapes:\n    - {H: 64, I: 32, G: 8, K: 2, by_T: [[1, huge]]}\n")
    return TuningTable.for_hardware(Hardware.from_profile("h200"), folder, report=False)


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
    t = table_outside_the_manifest(tmp_path)
    manifests = {"moe_fused_gemm": Manifest.load(ROOT / "manifests" / "moe_fused_gemm.yaml")}
    assert t.check(manifests) and "moe_fused_gemm" in t.refused
    sizes = {"H": 64, "I": 32, "G": 8, "K": 2, "T": 4}
    got = []
    t.factors = _HookDict(t.factors, lambda: got.append(t.value("moe_fused_gemm", "config", sizes, -1)))
    t.check(manifests)
    assert got == [-1], f"value() during check() gave {got}: the set-aside table's value"
    assert "moe_fused_gemm" in t.refused


def test_tune_moe_keeps_rows_another_tuner_wrote_during_its_run(tmp_path, monkeypatch):
    """Two tuners on one host (one per GPU, other models, one tuning file): each read the file
    when it started and wrote that reading back with its own rows after minutes of work, so the
    rows the other had written meanwhile were lost. Now the file is read, merged and written
    at the end, under a lock on its folder. Driven on the CPU: the GPU parts of the tuner are
    stand-ins, and 'the other tuner' writes its table while this one times its first case."""
    import yaml

    from .test_bench_tools import drive_tune_moe, import_tool
    tune = import_tool("benchmarks", "tune_moe")
    out = tmp_path / "h200.yaml"
    out.write_text((ROOT / "manifests" / "tuning" / "h200.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    other_key = (1024, 256, 16, 2)

    def other_tuner_writes():   # its table: the file as it found it, with one shape more
        data, notes = tune.existing_table(out, "NVIDIA H200", 132)
        data["moe_fused_gemm"]["shapes"].append({"H": 1024, "I": 256, "G": 16, "K": 2, "model": "other",
                                                "by_T": [[1, "tiny", 1.0, 2.0]]})
        out.write_text("\n".join(notes) + "\n" + yaml.safe_dump(data, sort_keys=False), encoding="utf-8")

    rc, _ = drive_tune_moe(monkeypatch, out, [], during=lambda _tune: other_tuner_writes())
    assert rc == 0
    data, _ = tune.existing_table(out, "NVIDIA H200", 132)
    shapes = {tuple(e[k] for k in ("H", "I", "G", "K")): e for e in data["moe_fused_gemm"]["shapes"]}
    assert other_key in shapes, "the other tuner's rows were dropped"
    assert shapes[other_key]["by_T"] == [[1, "tiny", 1.0, 2.0]]
    qwen = next(e for e in shapes.values() if e.get("model") == "qwen3-30b-a3b")
    assert [r for r in qwen["by_T"] if r[0] == 1][0][2:] == [5.0, 10.0]   # this run's row


def test_verify_at_load_leaves_no_device_flag_for_the_engine(tmp_path, monkeypatch):
    """FactorRegistry.load(verify=True) runs the plugin's test cases in the loading thread, on
    that thread's host workspace, with random inputs: a case whose alpha came out negative set
    the kernel's status bit there, and the engine's first check_device_errors() raised
    DeviceSideError "host_scale_ws: device status word 0x1 (alpha was negative)" for a call it
    never made. The word is put back after each case; a call of the engine's own still flags."""
    import shutil

    import pytest

    from ex_engine import DeviceSideError
    monkeypatch.setenv("EX_ENGINE_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "ws"
    build_plugin(folder, "host_scale_ws", defines={"WORKSPACE": True, "NAME": '"host_scale_ws"',
                                                   "FACTOR_ID": 1107}, manifest=False)
    shutil.copy(ROOT / "tests" / "plugins" / "host_scale_ws.yaml", folder / "host_scale_ws.yaml")
    reg = FactorRegistry.load(folder, hardware="h200", verify=True)
    p = reg.get("host_scale_ws")
    assert p is not None and "cases passed" in next(c.detail for c in p.checks if c.name == "verify")
    assert reg._workspaces, "verify's cases ran in this process (the flag they set is the subject)"
    reg.check_device_errors()   # raised DeviceSideError for verify's own input
    x = np.ones(8, np.float32)
    reg.dispatch("host_scale_ws", {"out": np.empty_like(x), "x": x, "alpha": np.array([-1.0], np.float32)})
    with pytest.raises(DeviceSideError, match="alpha was negative"):
        reg.check_device_errors()
