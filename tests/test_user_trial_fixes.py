"""Defects a new-user trial found: a fallback module that exits at import, run moe --probe that
never named the library it refused, an unreadable manifest called malformed, a user fallback
that writes nothing handing back uninitialised memory, and PERF.md cited as if in the checkout."""
import re
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from ex_engine import FactorError, FactorRegistry, topk_softmax
from ex_engine.cli import main as cli_main
from tests.conftest import ROOT, build_plugin, child_env


def _exiting_fallback_plugin(tmp_path, body: str, stem: str = "host_scale"):
    """A host_scale plugin in tmp_path/p whose manifest names the fallback 'MOD:scale', MOD a
    fresh module in tmp_path/mods whose source is ``body``. Returns (folder, mods, MOD)."""
    folder, mods = tmp_path / "p", tmp_path / "mods"
    mods.mkdir(parents=True, exist_ok=True)
    mod = f"exitmod_{uuid.uuid4().hex[:12]}"   # not in sys.modules: its code runs at import
    (mods / f"{mod}.py").write_text(body, encoding="utf-8")
    name = stem
    defines = {} if stem == "host_scale" else {"NAME": f'"{stem}"', "FACTOR_ID": 1101}
    build_plugin(folder, stem, defines=defines)
    yaml = folder / f"{name}.yaml"
    yaml.write_text(yaml.read_text(encoding="utf-8").replace("fallback: tests.plugins.host_scale_fallback:scale",
                                             f"fallback: {mod}:scale"), encoding="utf-8")
    return folder, mods, mod


@pytest.mark.parametrize("body, what", [
    ("import sys\nsys.exit(3)\n", "SystemExit: 3"),
    ("import sys\nsys.exit()\n", "SystemExit while"),
    ("class Odd(BaseException):\n    pass\nraise Odd('odd')\n", "Odd: odd"),
])
def test_a_fallback_module_that_exits_at_import_rejects_its_plugin_only(tmp_path, monkeypatch, body, what):
    """sys.exit(3) in a fallback module's import ended plugin loading (list-factors printed
    nothing, exit status 3): SystemExit, or another BaseException, is reported as a module's
    RuntimeError is, naming the module and the exception; the other plugins load and serve."""
    folder, mods, mod = _exiting_fallback_plugin(tmp_path, body, stem="host_scale_x")
    build_plugin(folder)   # a good one beside it
    monkeypatch.syspath_prepend(str(mods))
    reg = FactorRegistry.load(folder, hardware="h200")
    st = {p.path.stem: p for p in reg.plugins}
    bad = st["host_scale_x"]
    assert bad.status == "rejected", bad.reason
    assert bad.reason.startswith("python fallback: ") and f"fallback '{mod}:scale' cannot be loaded" in bad.reason
    assert what in bad.reason and f"importing module '{mod}'" in bad.reason, bad.reason
    assert st["host_scale"].status == "ready", st["host_scale"].reason
    x, out = np.arange(5, dtype=np.float32), np.empty(5, np.float32)
    assert reg.dispatch("host_scale", {"out": out, "x": x, "alpha": np.float32([2.0])}) == "plugin"
    assert np.array_equal(out, 2 * x)


def test_ctrl_c_in_a_fallback_modules_import_stays_ctrl_c(tmp_path, monkeypatch):
    """KeyboardInterrupt is the user's, not the module's: it is not turned into a rejection."""
    folder, mods, _ = _exiting_fallback_plugin(tmp_path, "raise KeyboardInterrupt\n")
    monkeypatch.syspath_prepend(str(mods))
    with pytest.raises(KeyboardInterrupt):
        FactorRegistry.load(folder, hardware="h200")


def test_list_factors_survives_a_fallback_module_that_exits(tmp_path):
    """The trial's repro: list-factors printed nothing and exited 3; now a rejected row names
    the module and SystemExit (exit status 1: its only library rejected)."""
    folder, mods, mod = _exiting_fallback_plugin(tmp_path, "import sys\nsys.exit(3)\n")
    r = subprocess.run([sys.executable, "-m", "ex_engine", "list-factors", "--dir", str(folder),
                        "--hardware", "h200"], capture_output=True, text=True, env=child_env(mods),
                       timeout=120)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "rejected" in r.stdout and f"fallback '{mod}:scale' cannot be loaded (SystemExit: 3" in r.stdout, r.stdout


def test_the_probe_imports_a_fallback_module_in_a_child_first(tmp_path, monkeypatch):
    """os._exit(7) at import cannot be caught in this process: with probe='subprocess' the
    module is imported in a child process first and the plugin refused, naming the module and
    the status; the module is never imported here. A module that imports cleanly passes."""
    folder, mods, mod = _exiting_fallback_plugin(tmp_path, "import os\nos._exit(7)\n", stem="host_scale_x")
    build_plugin(folder)
    monkeypatch.syspath_prepend(str(mods))
    reg = FactorRegistry.load(folder, hardware="h200", probe="subprocess")
    st = {p.path.stem: p for p in reg.plugins}
    bad = st["host_scale_x"]
    assert bad.status == "rejected", bad.reason
    assert bad.reason.startswith("python fallback probe (child process): ") and f"'{mod}'" in bad.reason
    assert "ended with status 7 while importing it" in bad.reason, bad.reason
    assert mod not in sys.modules
    assert st["host_scale"].status == "ready", st["host_scale"].reason

    good_mod = f"okmod_{uuid.uuid4().hex[:12]}"
    (mods / f"{good_mod}.py").write_text("from tests.plugins.host_scale_fallback import scale\n")
    folder2 = tmp_path / "q"
    build_plugin(folder2)
    yaml = folder2 / "host_scale.yaml"
    yaml.write_text(yaml.read_text(encoding="utf-8").replace("tests.plugins.host_scale_fallback:scale", f"{good_mod}:scale"), encoding="utf-8")
    reg = FactorRegistry.load(folder2, hardware="h200", probe="subprocess")
    p = reg.plugins[0]
    assert p.status == "ready", p.reason
    assert any(c.name == "python fallback probe (child process)" and c.ok and good_mod in c.detail
               for c in p.checks), p.checks


def test_run_moe_probe_names_the_library_it_refuses(tmp_path, capsys):
    """run moe --probe refused a library that crashes in ex_get_factor and printed PASS without
    naming it, though its help said '--probe names it': every refused library is a note on
    stderr with list-factors' reason."""
    folder = tmp_path / "crash"
    build_plugin(folder, defines={"CRASH": True})
    code = cli_main(["run", "moe", "--model", "granite-3.0-3b-a800m", "--tokens", "1", "--dir", str(folder),
                     "--hardware", "h200", "--probe"])
    captured = capsys.readouterr()
    assert code == 0, captured
    assert "note: host_scale.so refused: probe (child process): crashed in ex_get_factor: signal SIGSEGV" \
        in captured.err, captured.err


def test_an_unreadable_manifest_is_not_readable_not_malformed(tmp_path, monkeypatch):
    """A manifest this process may not read (chmod 000) was 'malformed (PermissionError: ...)';
    it is 'not readable (permission denied)', beside a library or in the manifests folder."""
    import shutil
    folder, mdir = tmp_path / "p", tmp_path / "m"
    build_plugin(folder)
    shutil.copytree(ROOT / "manifests", mdir)
    denied = {folder / "host_scale.yaml", mdir / "topk_softmax.yaml"}
    from ex_engine import _paths
    real = _paths.read_small

    def read_small(path, *args):   # (the manifests' reader; root reads a chmod 000 file)
        if Path(path) in denied:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, *args)

    monkeypatch.setattr(_paths, "read_small", read_small)
    reg = FactorRegistry.load(folder, hardware="h200", manifests_dir=mdir)
    p = reg.plugins[0]
    assert p.status == "rejected", p.reason
    assert p.reason == f"manifest: manifest {folder / 'host_scale.yaml'}: not readable (permission denied)", p.reason
    assert f"manifest {mdir / 'topk_softmax.yaml'}: not readable (permission denied); skipped" in reg.notes, reg.notes
    assert not any("malformed" in n for n in reg.notes), reg.notes


def test_a_user_fallback_that_writes_nothing_is_an_error_not_garbage(tmp_path):
    """set_fallback('topk_softmax', lambda a, s, p: None) handed back weights 1.0 and ids
    1065353216 (np.empty's old contents), no error. The outputs are poisoned before any Python
    fallback and a user's fallback that leaves them (partly) unwritten is a FactorError naming
    each output; one that writes them works as before."""
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    x = np.zeros((2, 8), np.float32)
    reg.set_fallback("topk_softmax", lambda a, s, p: None)
    with pytest.raises(FactorError, match=r"^topk_softmax: the Python fallback set with set_fallback "
                                          r"\(.*<lambda>\) left topk_weights: 4 of 4, topk_ids: 4 of 4 "
                                          r"element\(s\) unwritten"):
        topk_softmax(x, 2, registry=reg)
    assert reg.stats()["topk_softmax"]["errors"] == 1

    def half(arrays, sizes, params):   # writes the weights, forgets one row of ids
        arrays["topk_weights"].raw()[...] = 0.5
        arrays["topk_ids"].raw()[0] = [0, 1]

    reg.set_fallback("topk_softmax", half)
    with pytest.raises(FactorError, match=r"left topk_ids: 2 of 4 element\(s\) unwritten"):
        topk_softmax(x, 2, registry=reg)

    seen = {}

    def looks(arrays, sizes, params):   # what an output holds when a fallback starts: the poison
        seen["w"] = arrays["topk_weights"].raw().copy()
        seen["ids"] = arrays["topk_ids"].raw().copy()
        from ex_engine import fallbacks
        fallbacks.topk_softmax(arrays, sizes, params)

    reg.set_fallback("topk_softmax", looks)
    w, ids = topk_softmax(np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32), 2, registry=reg)
    assert np.isnan(seen["w"]).all() and (seen["ids"] < 0).all(), seen
    assert np.isfinite(w).all() and ((ids >= 0) & (ids < 8)).all()
    assert reg.stats()["topk_softmax"]["python_fallback"] == 1


def test_in_place_and_inout_arrays_are_not_poisoned_and_the_plugin_path_pays_nothing(tmp_path, monkeypatch):
    """Only pure outputs are poisoned: fused_add_rmsnorm's x (in place) and residual (inout)
    reach the fallback holding the caller's values. A call a plugin serves never poisons."""
    from ex_engine import fused_add_rmsnorm, registry as registry_mod
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    rng = np.random.default_rng(1)
    x0, r0 = rng.standard_normal((2, 8)).astype(np.float32), rng.standard_normal((2, 8)).astype(np.float32)
    seen = {}

    def own(arrays, sizes, params):
        seen["x"], seen["r"] = arrays["x"].raw().copy(), arrays["residual"].raw().copy()

    reg.set_fallback("fused_add_rmsnorm", own)
    x, r = x0.copy(), r0.copy()
    fused_add_rmsnorm(x, r, np.ones(8, np.float32), registry=reg)
    assert np.array_equal(seen["x"], x0) and np.array_equal(seen["r"], r0)

    folder = tmp_path / "p"
    build_plugin(folder)
    reg = FactorRegistry.load(folder, hardware="h200")
    monkeypatch.setattr(registry_mod, "_poison_outputs",
                        lambda *a: (_ for _ in ()).throw(AssertionError("poisoned on the plugin path")))
    xs, out = np.arange(5, dtype=np.float32), np.empty(5, np.float32)
    for _ in range(2):   # the full path, then the short one
        assert reg.dispatch("host_scale", {"out": out, "x": xs, "alpha": np.float32([3.0])}) == "plugin"
    assert np.array_equal(out, 3 * xs)


@pytest.mark.parametrize("rel", ["manifests/hardware/h200.yaml", "benchmarks/perf_peers.py",
                                 "benchmarks/table_moe.py", "scripts/gpu_moe_selftest.py"])
def test_perf_md_is_cited_where_it_is(rel):
    """PERF.md is ../shared/PERF.md, beside the checkout, not in it: each citation outside the
    table's short column header says so."""
    text = (ROOT / rel).read_text(encoding="utf-8").replace("vLLM (PERF.md)", "")
    bare = [m.start() for m in re.finditer(r"PERF\.md", text) if text[max(0, m.start() - 10):m.start()] != "../shared/"]
    assert not bare, [text[max(0, i - 40):i + 10] for i in bare]
    assert "../shared/PERF.md" in text
