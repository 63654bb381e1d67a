"""The registry on small host-memory plugins built with gcc: loading, checks, dispatch, fallbacks."""
import json
import os
import re
import shutil

import numpy as np
import pytest

from ex_engine import FactorRegistry, KernelError, abi
from ex_engine.cli import main as cli_main
from tests.conftest import ROOT, build_plugin


def call(reg, n=7, alpha=3.0):
    x = np.random.default_rng().standard_normal(n).astype(np.float32) + 0.5
    out = np.full(n, np.nan, np.float32)
    path = reg.dispatch("host_scale", {"x": x, "out": out, "alpha": np.array([alpha], np.float32)})
    return path, x, out


def test_new_plugin_no_code_knows_is_loaded_and_dispatched(tmp_path):
    build_plugin(tmp_path)
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    p = reg.get("host_scale")
    assert p is not None and p.status == "ready", [c.__dict__ for c in reg.plugins[0].checks]
    assert p.factor_id == 1100 and p.version == "1.0.0" and p.tuning["num_warps"] == 8
    path, x, out = call(reg)
    assert path == "plugin"
    np.testing.assert_array_equal(out, np.float32(3.0) * x)
    assert reg.stats()["host_scale"] == {"plugin": 1, "kernel_fallback": 0, "python_fallback": 0, "errors": 0}


def test_kernel_fallback_serves_when_kernel_declines(tmp_path):
    build_plugin(tmp_path, defines={"BEHAVIOUR": 1})
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    path, x, out = call(reg)
    assert path == "kernel_fallback"
    np.testing.assert_array_equal(out, 2 * x)


def test_python_fallback_serves_when_c_paths_decline(tmp_path):
    build_plugin(tmp_path, defines={"BEHAVIOUR": 2})
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    path, x, out = call(reg, alpha=5.0)
    assert path == "python_fallback"
    np.testing.assert_allclose(out, 5 * x, rtol=1e-6)
    assert reg.stats()["host_scale"]["python_fallback"] == 1


def test_error_status_is_raised_by_name_with_detail(tmp_path):
    build_plugin(tmp_path, defines={"BEHAVIOUR": 3})
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    with pytest.raises(KernelError, match=r"EX_ERR_SHAPE \(3\): N must be even"):
        call(reg)
    assert reg.stats()["host_scale"]["errors"] == 1


@pytest.mark.parametrize("defines,needle", [
    ({"ABI_OVERRIDE": (2 << 16) | 0}, "library built against 2.0"),
    ({"RETURN_NULL": True}, "returned NULL"),
    ({"NULL_NAME": True}, "expected a name, got NULL"),
    ({"NULL_KERNEL": True}, "expected a kernel function, got NULL"),
    ({"NO_GET_FACTOR": True}, "ex_get_factor"),
    ({"TPB": 2048}, "expected 1..1024, got 2048"),
    ({"TPB": 48}, "expected a multiple of 32, got 48"),
])
def test_bad_plugin_is_rejected_with_reason_and_the_rest_keep_working(tmp_path, defines, needle):
    build_plugin(tmp_path, "bad", defines={**defines, "NAME": '"host_scale_bad"', "FACTOR_ID": 1101})
    build_plugin(tmp_path)  # a good one beside it
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    bad = next(p for p in reg.plugins if p.path.stem == "bad")
    assert bad.status == "rejected" and needle in bad.reason, bad.reason
    assert call(reg)[0] == "plugin"


def test_not_a_library_and_truncated_library_are_rejected(tmp_path):
    good = build_plugin(tmp_path)
    (tmp_path / "notes.so").write_text("this is not ELF")
    (tmp_path / "trunc.so").write_bytes(good.read_bytes()[:200])
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    st = {p.path.name: p for p in reg.plugins}
    assert st["notes.so"].status == "rejected" and "not a loadable shared library" in st["notes.so"].reason
    assert st["trunc.so"].status == "rejected"
    assert reg.get("host_scale").status == "ready"


def test_abi_version_read_before_any_code_runs(tmp_path):
    build_plugin(tmp_path, defines={"ABI_OVERRIDE": (abi.ABI_VERSION_MAJOR + 1) << 16, "RETURN_NULL": True})
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    p = reg.plugins[0]
    assert [c.name for c in p.checks][-1] == "abi version"   # ex_get_factor never called
    assert f"expected major {abi.ABI_VERSION_MAJOR}" in p.reason


def test_missing_manifest_is_rejected(tmp_path):
    build_plugin(tmp_path, manifest=False, defines={"NAME": '"nobody_knows"'})
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    assert "nobody_knows.yaml" in reg.plugins[0].reason


def test_same_name_higher_version_wins(tmp_path):
    build_plugin(tmp_path, "a_old", defines={"VERSION": '"1.2.0"', "BEHAVIOUR": 1})
    build_plugin(tmp_path, "b_new", defines={"VERSION": '"1.10.0"'})
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    assert reg.get("host_scale").path.stem == "b_new"
    old = next(p for p in reg.plugins if p.path.stem == "a_old")
    assert old.status == "shadowed" and "version 1.10.0" in old.reason
    assert call(reg)[0] == "plugin"


def test_each_library_has_its_own_symbols(tmp_path):
    build_plugin(tmp_path, "one", defines={"NAME": '"scale_one"', "FACTOR_ID": 1200})
    build_plugin(tmp_path, "two", defines={"NAME": '"scale_two"', "FACTOR_ID": 1201, "BEHAVIOUR": 1})
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    assert reg.get("scale_one").factor_id == 1200 and reg.get("scale_two").factor_id == 1201
    x = np.ones(4, np.float32)
    for name, want in (("scale_one", 3.0), ("scale_two", 2.0)):
        out = np.zeros(4, np.float32)
        reg.dispatch(name, {"x": x, "out": out, "alpha": np.array([3.0], np.float32)})
        assert (out == want).all(), name


def test_duplicate_id_with_other_name_is_rejected(tmp_path):
    build_plugin(tmp_path)
    build_plugin(tmp_path, "other", defines={"NAME": '"host_scale_other"'})  # same id 1100
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    rejected = [p for p in reg.plugins if p.status == "rejected"]
    assert len(rejected) == 1 and "factor id 1100 already taken" in rejected[0].reason


def test_warp64_profile_changes_tuning_checks(tmp_path):
    build_plugin(tmp_path, defines={"TPB": 96})
    assert FactorRegistry.load(tmp_path, hardware="h200").get("host_scale") is not None
    reg = FactorRegistry.load(tmp_path, hardware="bi-v100")
    assert "expected a multiple of 64, got 96" in reg.plugins[0].reason


def test_cli_list_factors_table_json_and_why(tmp_path, capsys):
    build_plugin(tmp_path)
    (tmp_path / "junk.so").write_text("junk")
    assert cli_main(["list-factors", "--dir", str(tmp_path), "--hardware", "h200"]) == 0
    out = capsys.readouterr().out
    assert "host_scale" in out and "ready" in out and "junk.so" in out and "rejected" in out
    assert cli_main(["list-factors", "--dir", str(tmp_path), "--hardware", "h200", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {p["status"] for p in data["plugins"]} == {"ready", "rejected"}
    assert cli_main(["list-factors", "--dir", str(tmp_path), "--hardware", "h200", "--why"]) == 0
    out = capsys.readouterr().out
    assert "[ok] threads_per_block <= max_threads_per_block" in out and "[FAIL] dlopen" in out


def test_truncated_elf_is_rejected_before_dlopen(tmp_path):
    """A library cut short (an interrupted copy or build) is rejected from its bytes: dlopen of
    a file whose loadable segments reach past its end can kill the process with SIGBUS. Loaded
    in a child process, so a regression fails this test instead of crashing the run."""
    import subprocess
    import sys
    from ex_engine import fatbin
    good = build_plugin(tmp_path / "src")
    data = good.read_bytes()
    cuts = [4, 5, 63, len(data) // 4, len(data) // 2, len(data) - 64]
    for cut in cuts:
        with pytest.raises(fatbin.TruncatedElfError, match="truncated"):
            fatbin.check_segments(data[:cut]) or fatbin.elf_sections(data[:cut])
    fatbin.check_segments(data)  # the whole file passes
    big = ROOT / "factors" / "topk_softmax.so"  # a real plugin, ~20 MB: the case that crashed
    folder = tmp_path / "plugins"
    build_plugin(folder)
    sources = [(f"cut{i}.so", data[:c]) for i, c in enumerate(cuts)]
    if big.exists():
        sources.append(("topk_cut.so", big.read_bytes()[:20000]))
    for name, blob in sources:
        (folder / name).write_bytes(blob)
    code = ("import sys; from ex_engine import FactorRegistry\n"
            f"r = FactorRegistry.load({str(folder)!r}, hardware='h200')\n"
            "for p in r.plugins: print(p.path.name, p.status, p.reason)\n"
            "assert r.get('host_scale').status == 'ready'\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert res.returncode == 0, (res.returncode, res.stdout, res.stderr)
    lines = {ln.split(" ", 1)[0]: ln for ln in res.stdout.splitlines()}
    for name, _ in sources:
        assert "rejected" in lines[name] and "truncated" in lines[name], lines[name]


def test_a_library_without_the_abi_symbol_is_rejected_and_the_rest_load(tmp_path):
    """Any shared library in the folder (here cffi's own extension module) is rejected for its
    missing ex_abi_version, not a reason to abort the load."""
    import shutil
    import _cffi_backend
    build_plugin(tmp_path)
    shutil.copy(_cffi_backend.__file__, tmp_path / "other.so")
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    other = next(p for p in reg.plugins if p.path.name == "other.so")
    assert other.status == "rejected" and "ex_abi_version" in other.reason, other.reason
    assert call(reg)[0] == "plugin"


def test_a_malformed_manifest_rejects_only_its_plugin(tmp_path):
    """Beside a library or in the manifests folder, a manifest that does not parse rejects the
    plugin that needs it (its reason names the file) and the registry loads the rest."""
    import shutil
    beside = tmp_path / "beside"
    build_plugin(beside)
    build_plugin(beside, "bad", defines={"NAME": '"host_scale_bad"', "FACTOR_ID": 1101})
    (beside / "host_scale_bad.yaml").write_text("name: host_scale_bad\nid: [unclosed\n")
    reg = FactorRegistry.load(beside, hardware="h200")
    bad = next(p for p in reg.plugins if p.path.stem == "bad")
    assert bad.status == "rejected" and "host_scale_bad.yaml: malformed" in bad.reason, bad.reason
    assert call(reg)[0] == "plugin"

    mdir, plugins = tmp_path / "manifests", tmp_path / "plugins"
    mdir.mkdir()
    shutil.copy(ROOT / "tests" / "plugins" / "host_scale.yaml", mdir / "host_scale.yaml")
    (mdir / "host_scale_bad.yaml").write_text("name: host_scale_bad\nid: 0\n")  # no dims: malformed too
    (mdir / "broken.yaml").write_text("name: broken\ndims: [T\n")
    build_plugin(plugins, manifest=False)
    build_plugin(plugins, "broken", manifest=False, defines={"NAME": '"broken"', "FACTOR_ID": 1102})
    reg = FactorRegistry.load(plugins, hardware="h200", manifests_dir=mdir)
    broken = next(p for p in reg.plugins if p.path.stem == "broken")
    assert broken.status == "rejected" and "broken.yaml: malformed" in broken.reason, broken.reason
    assert any("broken.yaml: malformed" in n for n in reg.notes), reg.notes
    assert call(reg)[0] == "plugin"


@pytest.mark.parametrize("body, why", [("", "empty: expected"),
                                       (":::bad yaml[\n", "expected a mapping (name, id, dims, ...), got str")])
def test_an_empty_or_scalar_manifest_is_named_in_the_notes(tmp_path, body, why):
    """A manifests folder's <name>.yaml that is empty or one scalar (a clobbered file) refuses
    its factor's plugin, whose reason names the file, and the registry's notes name it too (a
    new user's trial, session fifty-three: the reason was there, the note was not); other YAML
    files there (a mapping of other keys) stay unmentioned."""
    mdir, plugins = tmp_path / "manifests", tmp_path / "plugins"
    mdir.mkdir()
    (mdir / "host_scale.yaml").write_text(body)
    (mdir / "other.yaml").write_text("colour: blue\n")
    build_plugin(plugins, manifest=False)
    reg = FactorRegistry.load(plugins, hardware="h200", manifests_dir=mdir)
    p = next(p for p in reg.plugins if p.path.stem == "host_scale")
    assert p.status == "rejected" and why in p.reason, p.reason
    hits = [n for n in reg.notes if "host_scale.yaml" in n]
    assert len(hits) == 1 and why in hits[0] and hits[0].endswith("not used"), reg.notes
    assert not any("other.yaml" in n for n in reg.notes), reg.notes


def test_manifest_problems_name_the_file_and_spare_the_rest(tmp_path, monkeypatch):
    """An unreadable manifest beside a plugin (here a folder in its place), a misspelt key and a
    bad params entry each refuse only their plugin, naming the file; a malformed hardware
    profile or model list is a FactorError naming the file, not a traceback."""
    import shutil
    from ex_engine import FactorError
    from ex_engine.hardware import Hardware
    from ex_engine.moe_layer import load_models
    folder = tmp_path / "plugins"
    build_plugin(folder)
    for stem, text in (("a", None), ("b", "name: host_scale_b\nid: 1102\ndim: [N]\n"),
                       ("c", None)):
        name = f"host_scale_{stem}"
        build_plugin(folder, stem, defines={"NAME": f'"{name}"', "FACTOR_ID": 1101 + ord(stem) - 97})
        (folder / f"{name}.yaml").unlink()
        if stem == "a":
            (folder / f"{name}.yaml").mkdir()
        elif stem == "b":
            (folder / f"{name}.yaml").write_text(text, encoding="utf-8")
        else:
            good = (ROOT / "tests" / "plugins" / "host_scale.yaml").read_text(encoding="utf-8")
            (folder / f"{name}.yaml").write_text(good.replace("name: host_scale", f"name: {name}")
                                                 .replace("id: 1100", "id: 1103") + "params: {alpha2: 3}\n", encoding="utf-8")
    reg = FactorRegistry.load(folder, hardware="h200")
    st = {p.path.stem: p for p in reg.plugins}
    assert "host_scale_a.yaml: not readable (IsADirectoryError" in st["a"].reason, st["a"].reason
    assert "host_scale_b.yaml: unknown key 'dim' (did you mean 'dims'?)" in st["b"].reason, st["b"].reason
    assert "host_scale_c.yaml: params: alpha2: expected" in st["c"].reason, st["c"].reason
    assert call(reg)[0] == "plugin"

    mdir = tmp_path / "manifests"
    shutil.copytree(ROOT / "manifests", mdir)
    (mdir / "hardware" / "h200.yaml").write_text("name: [\n")
    (mdir / "moe_models.yaml").write_text("models: [\n")
    monkeypatch.setenv("EX_ENGINE_MANIFESTS", str(mdir))
    with pytest.raises(FactorError, match="hardware profile .*h200.yaml: malformed"):
        Hardware.from_profile("h200")
    with pytest.raises(FactorError, match="model list .*moe_models.yaml: malformed"):
        load_models()


def _manifest_variant(folder, stem, name, fid, change):
    """A host_scale plugin named ``name`` with id ``fid`` whose manifest beside it went through
    ``change(text) -> text``."""
    build_plugin(folder, stem, defines={"NAME": f'"{name}"', "FACTOR_ID": fid})
    text = (ROOT / "tests" / "plugins" / "host_scale.yaml").read_text(encoding="utf-8")
    text = text.replace("name: host_scale", f"name: {name}").replace("id: 1100", f"id: {fid}")
    (folder / f"{name}.yaml").write_text(change(text), encoding="utf-8")


def test_manifest_cross_references_fallback_and_reserved_ids_are_checked_at_load(tmp_path):
    """What would fail on every call (a dim with no source, a source naming nothing, an
    unknown dtype, a fallback that does not import) or hijack a built-in (another name on a
    reserved id) refuses that plugin at load, naming the file; load(verify=True) survives a
    manifest whose test shapes it cannot use."""
    folder = tmp_path / "p"
    build_plugin(folder)
    cases = {
        "dims": (lambda t: t.replace("dims: [N]", "dims: [N, dtyp]"), "dims: dtyp"),
        "src": (lambda t: t + "dim_sources: {dt: {dtype_of: y}}\n", "dim_sources: dt: dtype_of"),
        "dtype": (lambda t: t.replace("input: {name: x, shape: [N], dtype: [float32]}",
                                      "input: {name: x, shape: [N], dtype: [float8]}"), "dtype: expected"),
        "constraint": (lambda t: t + "constraints: ['N <= M']\n", "M is no size"),
        "fallback": (lambda t: t.replace("fallback: tests.plugins.host_scale_fallback:scale",
                                         "fallback: nosuch_mod:scale"), "fallback 'nosuch_mod:scale' cannot be loaded"),
        # callable, but not as fn(arrays, sizes, params): every call falling back raised TypeError
        "sig": (lambda t: t.replace("fallback: tests.plugins.host_scale_fallback:scale", "fallback: os:system"),
                "fallback: 'os:system': expected a callable fn(arrays, sizes, params), got one with "
                "signature (command)"),
    }
    for i, (stem, (change, _)) in enumerate(cases.items()):
        _manifest_variant(folder, stem, f"host_scale_{stem}", 1101 + i, change)
    build_plugin(folder, "evil", defines={"NAME": '"evil"', "FACTOR_ID": 0, "VERSION": '"9.0.0"'})
    text = (ROOT / "tests" / "plugins" / "host_scale.yaml").read_text(encoding="utf-8")
    (folder / "evil.yaml").write_text(text.replace("name: host_scale", "name: evil").replace("id: 1100", "id: 0"), encoding="utf-8")
    reg = FactorRegistry.load(folder, hardware="h200")
    st = {p.path.stem: p for p in reg.plugins}
    for stem, (_, needle) in cases.items():
        assert st[stem].status == "rejected" and needle in st[stem].reason, (stem, st[stem].reason)
        assert f"host_scale_{stem}.yaml" in st[stem].reason, st[stem].reason
    assert st["evil"].status == "rejected" and "reserved for ex_engine's 'topk_softmax'" in st["evil"].reason
    assert call(reg)[0] == "plugin"

    vfolder = tmp_path / "v"
    build_plugin(vfolder)
    # (a negative size, or an ids_below naming no size, is refused as the manifest loads now;
    # more distinct ids per row than ids_below allows depends on the test shape: verify finds it)
    _manifest_variant(vfolder, "neg", "host_scale_neg", 1110,
                      lambda t: t.replace("input: {name: x, shape: [N], dtype: [float32]}",
                                          "input: {name: x, shape: [N], dtype: [float32], "
                                          "values: {ids_below: 2, distinct: true}}"))
    reg = FactorRegistry.load(vfolder, hardware="h200", verify=True)
    st = {p.path.stem: p for p in reg.plugins}
    assert st["neg"].status == "rejected" and "7 distinct ids per row asked, only 2 exist" in st["neg"].reason, \
        st["neg"].reason
    assert st["host_scale"].status == "ready", st["host_scale"].reason


def test_call_plugin_refuses_overlapping_arrays_as_dispatch_does(tmp_path):
    """verify's entry point (call_plugin) checks what dispatch checks: out is x is refused."""
    from ex_engine import LayoutError
    build_plugin(tmp_path)
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    p = reg.get("host_scale")
    x = np.ones(7, np.float32)
    alpha = np.array([2.0], np.float32)
    with pytest.raises(LayoutError, match="argument 'out': memory: .*overlaps 'x'"):
        reg.call_plugin(p, {"x": x, "out": x, "alpha": alpha})
    assert (x == 1).all()
    out = np.zeros(7, np.float32)
    assert reg.call_plugin(p, {"x": x, "out": out, "alpha": alpha}) == "plugin" and (out == 2).all()


def test_call_plugin_checks_names_and_types_as_dispatch_does(tmp_path):
    """call_plugin silently dropped a misspelt optional array (expert_mapp=...), raised
    AttributeError for a str plugin or a list of arrays, and passed a NULL pointer on: each is
    now refused as dispatch refuses it (its own checks, reused), naming the factor, and counted."""
    from ex_engine import ArgumentError, DeviceError, DTypeError
    build_plugin(tmp_path)
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    p = reg.get("host_scale")
    x, out, alpha = np.ones(7, np.float32), np.zeros(7, np.float32), np.array([2.0], np.float32)
    with pytest.raises(ArgumentError, match="^host_scale: argument 'alphaa': unknown argument: expected "
                                            "one of "):
        reg.call_plugin(p, {"x": x, "out": out, "alpha": alpha, "alphaa": alpha})
    with pytest.raises(ArgumentError, match="^host_scale: argument 'alphaa': unknown argument"):
        reg.call_plugin(p, {"x": x, "out": out, "alpha": alpha, "alphaa": None})
    with pytest.raises(ArgumentError, match="^call_plugin: argument 'plugin': type: expected a loaded "
                                            "Plugin .*got str 'host_scale'"):
        reg.call_plugin("host_scale", {"x": x, "out": out, "alpha": alpha})
    with pytest.raises(ArgumentError, match="^host_scale: argument 'arrays': type: expected a dict"):
        reg.call_plugin(p, [x, out, alpha])
    with pytest.raises(ArgumentError, match="^host_scale: argument 'params': type: expected a dict"):
        reg.call_plugin(p, {"x": x, "out": out, "alpha": alpha}, [1])
    with pytest.raises(DTypeError, match="^host_scale: argument 'x': type: "):
        reg.call_plugin(p, {"x": [1.0] * 7, "out": out, "alpha": alpha})
    from ex_engine.arrays import TensorRef
    null = TensorRef.of(x, "x")
    null.ptr = 0
    with pytest.raises(DeviceError, match="^host_scale: argument 'x': memory: .*NULL data pointer"):
        reg.call_plugin(p, {"x": null, "out": out, "alpha": alpha})
    assert reg.stats()["host_scale"]["errors"] == 6    # (a str plugin names no factor)
    with pytest.raises(DeviceError):
        reg.call_plugin(p, {"x": null, "out": out, "alpha": alpha}, count=False)
    assert reg.stats()["host_scale"]["errors"] == 6          # count=False: not counted
    # NULL in an array read and in the one written: refused as such before the overlap check,
    # whose NumPy stand-ins raised a bare ValueError for two NULL ranges (a new-user trial)
    null_out = TensorRef.of(out, "out")
    null_out.ptr = 0
    with pytest.raises(DeviceError, match="^host_scale: argument 'x': memory: .*NULL data pointer"):
        reg.call_plugin(p, {"x": null, "out": null_out, "alpha": alpha}, count=False)
    assert reg.call_plugin(p, {"x": x, "out": out, "alpha": alpha}) == "plugin" and (out == 2).all()


def test_a_folder_whose_name_is_not_utf8_is_a_rejection_not_a_crash(tmp_path):
    """list-factors and verify ended in UnicodeEncodeError (cffi's dlopen takes a str) for a
    library under a folder named with a byte that is not UTF-8."""
    import os
    from pathlib import Path
    folder = Path(os.fsdecode(os.fsencode(str(tmp_path)) + b"/v_\xe9"))
    build_plugin(folder)
    reg = FactorRegistry.load(folder, hardware="h200")
    p = reg.plugins[0]
    assert p.status == "rejected" and "the path is not valid UTF-8" in p.reason, p.reason


def test_the_probe_reads_output_that_is_not_utf8(tmp_path):
    """A constructor printing bytes that are not UTF-8 made load(probe='subprocess') raise
    UnicodeDecodeError (the probe decoded the child's output strictly)."""
    build_plugin(tmp_path, defines={"CTOR_STDERR": True})
    reg = FactorRegistry.load(tmp_path, hardware="h200", probe="subprocess")
    assert reg.get("host_scale") is not None and call(reg)[0] == "plugin"


def test_the_file_name_breaks_a_tie_not_the_folder(tmp_path):
    """Same name, version and priority: the file name that sorts last wins, as the README says
    (the whole path was compared, so the folder decided)."""
    build_plugin(tmp_path / "b", "aaa")
    build_plugin(tmp_path / "a", "zzz")
    reg = FactorRegistry.load(tmp_path / "b", hardware="h200")
    reg.load_folder(tmp_path / "a")
    assert reg.get("host_scale").path.name == "zzz.so"


@pytest.mark.parametrize("order", [("v9", "v11"), ("v11", "v9")])
def test_the_same_file_name_in_two_folders_the_one_loaded_last_wins(tmp_path, order):
    """A reload into a new folder (same name, version and priority) serves the new copy, in
    either order of the folders' names: the full path decided, so 'v9' beat 'v11' and a folder
    loaded since kept serving the old one (a leak trial, session sixty-three). The loser's
    reason says the rule."""
    first, last = order
    for v in order:
        build_plugin(tmp_path / v)
    reg = FactorRegistry.load(tmp_path / first, hardware="h200")
    reg.load_folder(tmp_path / last)
    assert reg.get("host_scale").path.parent.name == last
    [old] = [p for p in reg.plugins if p.path.parent.name == first]
    assert old.status == "shadowed" and "the one loaded last wins" in old.reason, old.reason


def test_a_device_manifest_on_a_library_without_gpu_code_is_said(tmp_path):
    """Allowed (kernels may come from a library it links or loads), but list-factors --why says
    that the library carries no GPU code of its own."""
    build_plugin(tmp_path)
    y = tmp_path / "host_scale.yaml"
    y.write_text(y.read_text(encoding="utf-8").replace("memory: host", "memory: device"), encoding="utf-8")
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    p = reg.plugins[0]
    assert p.status == "ready", p.reason
    gc = [c for c in p.checks if c.name == "gpu code"]
    assert len(gc) == 1 and gc[0].ok and "none in the library itself" in gc[0].detail
    build_plugin(tmp_path / "host")            # the host manifest: no such remark
    assert not [c for c in FactorRegistry.load(tmp_path / "host", hardware="h200").plugins[0].checks
                if c.name == "gpu code"]


def test_a_library_open_in_another_registry_for_other_settings_is_a_warning(tmp_path, monkeypatch):
    # one copy of a library per process: a second registry's ex_get_factor call (other hardware,
    # other EX_* variables) changes what the first one's calls run with; load says so
    build_plugin(tmp_path)
    first = FactorRegistry.load(tmp_path, hardware="h200")
    same = FactorRegistry.load(tmp_path, hardware="h200")          # same settings: nothing to say
    assert not [c for c in same.plugins[0].checks if c.name == "shared library"]
    with pytest.warns(UserWarning, match="already open in this process by another registry.*hardware"):
        other_hw = FactorRegistry.load(tmp_path, hardware="a100")
    check = next(c for c in other_hw.plugins[0].checks if c.name == "shared library")
    assert check.ok and check.warn and "h200" in check.detail
    assert any("shared library" not in n and "already open" in n for n in other_hw.notes)
    assert other_hw.get("host_scale") is not None                  # loaded all the same
    monkeypatch.setenv("EX_SOME_SETTING", "1")
    with pytest.warns(UserWarning, match=r"other EX_\* variables \(EX_SOME_SETTING=\(unset\) there, 1 here\)") as w:
        FactorRegistry.load(tmp_path, hardware="h200")
    assert w[0].filename == __file__       # the warning names the user's call, not the loader
    # a hard link is the same library to glibc (device and inode): the same warning
    import os
    (tmp_path / "linked").mkdir()
    os.link(tmp_path / "host_scale.so", tmp_path / "linked" / "host_scale.so")
    (tmp_path / "linked" / "host_scale.yaml").write_text((tmp_path / "host_scale.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    with pytest.warns(UserWarning, match="already open in this process by another registry"):
        FactorRegistry.load(tmp_path / "linked", hardware="a100")
    del first, same, other_hw


_CTOR_SRC = r'''
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
__attribute__((constructor)) static void ran(void) {
    FILE* f = fopen(getenv("EX_TEST_CTOR_MARK"), "w");
    if (f) { fputs("constructor ran\n", f); fclose(f); }
}
#ifdef ABI
__attribute__((visibility("default"))) const uint32_t ex_abi_version = ABI;
#endif
__attribute__((visibility("default"))) void* ex_get_factor(const void* hw) { (void)hw; return 0; }
'''


@pytest.mark.parametrize("abi_define, needle", [
    (None, "symbol ex_abi_version: not exported (not defined in the library's own dynamic symbol table); not opened"),
    ((abi.ABI_VERSION_MAJOR + 1) << 16, f"abi version: expected major {abi.ABI_VERSION_MAJOR}"),
])
def test_a_library_of_another_project_or_abi_is_refused_before_its_code_runs(tmp_path, monkeypatch,
                                                                              abi_define, needle):
    """ex_abi_version is read from the file's dynamic symbol table before dlopen: a library
    without it, or built against another ABI major, is refused and its static constructor
    never runs (it would have written the mark file)."""
    import shutil
    import subprocess
    if shutil.which("gcc") is None:
        pytest.skip("gcc not available")
    src = tmp_path / "ctor.c"
    src.write_text(_CTOR_SRC, encoding="utf-8")
    lib_dir = tmp_path / "lib"
    lib_dir.mkdir()
    flags = [] if abi_define is None else [f"-DABI={abi_define}u"]
    subprocess.run(["gcc", "-shared", "-fPIC", "-fvisibility=hidden", *flags, "-o",
                    str(lib_dir / "ctor.so"), str(src)], check=True)
    mark = tmp_path / "mark"
    monkeypatch.setenv("EX_TEST_CTOR_MARK", str(mark))
    reg = FactorRegistry.load(lib_dir, hardware="h200")
    p = reg.plugins[0]
    assert p.status == "rejected" and needle in p.reason, p.reason
    assert "none of its code ran" in p.reason
    assert "dlopen" not in [c.name for c in p.checks]
    assert not mark.exists(), "the library's constructor ran"


def test_abi_version_from_the_file_and_from_the_loaded_library_must_agree(tmp_path, monkeypatch):
    from ex_engine import fatbin
    build_plugin(tmp_path)
    monkeypatch.setattr(fatbin, "exported_u32", lambda data, name: abi.ABI_VERSION + 1)
    p = FactorRegistry.load(tmp_path, hardware="h200").plugins[0]
    assert p.status == "rejected" and "abi version (loaded)" in p.reason, p.reason


def test_a_library_without_a_section_table_is_checked_after_dlopen(tmp_path):
    """Stripped of its section table (e_shoff = 0; the loader needs only program headers), a
    library's ABI version cannot be read from the file: it is read after dlopen, as before."""
    import struct
    lib = build_plugin(tmp_path)
    data = bytearray(lib.read_bytes())
    struct.pack_into("<Q", data, 0x28, 0)          # e_shoff
    struct.pack_into("<HHH", data, 0x3A, 0, 0, 0)  # e_shentsize, e_shnum, e_shstrndx
    lib.write_bytes(bytes(data))
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    p = reg.plugins[0]
    assert reg.get("host_scale") is p, p.reason
    names = [c.name for c in p.checks]
    assert "abi version (file)" in names and "abi version" in names


def _patch_dynsym(lib, field_offset, value, link_field=False):
    """Overwrite a field of .dynsym's section header (or, link_field, of the section it links:
    .dynstr) in ``lib``; the dynamic loader reads neither."""
    import struct
    d = bytearray(lib.read_bytes())
    shoff, = struct.unpack_from("<Q", d, 0x28)
    se, n = struct.unpack_from("<HH", d, 0x3A)
    at = next(shoff + i * se for i in range(n) if struct.unpack_from("<I", d, shoff + i * se + 4)[0] == 11)
    if link_field:
        at = shoff + struct.unpack_from("<I", d, at + 40)[0] * se
    struct.pack_into("<Q", d, at + field_offset, value)
    lib.write_bytes(bytes(d))


@pytest.mark.parametrize("case", ["versioned", "bss", "entsize 25", "entsize 2^40", "dynstr outside"])
def test_libraries_whose_file_does_not_say_the_abi_version_for_sure_still_load(tmp_path, case):
    """Found by a review of the pre-dlopen read: a versioned ex_abi_version (the file's first
    entry is a hidden 2.0, dlsym takes the default 1.0), one in .bss set by a constructor, and
    section headers the loader never reads (odd .dynsym entry size, .dynstr outside the file)
    were refused; each loads as before, its version read after dlopen."""
    if case == "versioned":
        script = tmp_path / "versions.map"
        script.write_text("V0 { global: ex_abi_version; ex_get_factor; local: *; };\n"
                          "V1 { global: ex_abi_version; } V0;\n")
        lib = build_plugin(tmp_path / "lib", defines={"ABI_VERSIONED": True},
                           link=[f"-Wl,--version-script={script}"])
    else:
        lib = build_plugin(tmp_path / "lib", defines={"ABI_IN_BSS": True} if case == "bss" else None)
    if case == "entsize 25":
        _patch_dynsym(lib, 56, 25)
    elif case == "entsize 2^40":
        _patch_dynsym(lib, 56, 1 << 40)
    elif case == "dynstr outside":
        _patch_dynsym(lib, 24, lib.stat().st_size + 1000, link_field=True)
    reg = FactorRegistry.load(tmp_path / "lib", hardware="h200")
    p = reg.plugins[0]
    assert reg.get("host_scale") is p and p.abi_version == abi.ABI_VERSION, p.reason
    assert "abi version (file)" in [c.name for c in p.checks]


def test_a_library_rebuilt_in_place_is_still_the_copy_another_registry_holds(tmp_path):
    """dlopen hands a path it loaded before the same copy even after the file was replaced (a
    rebuild: new inode), so the shared-library warning keys the loaded copy itself (the address
    of its ex_get_factor), not the file: a review found it silent after a replace."""
    import os
    import shutil
    build_plugin(tmp_path)
    first = FactorRegistry.load(tmp_path, hardware="h200")
    shutil.copy(tmp_path / "host_scale.so", tmp_path / "new.tmp")
    os.replace(tmp_path / "new.tmp", tmp_path / "host_scale.so")
    with pytest.warns(UserWarning, match="already open in this process by another registry"):
        FactorRegistry.load(tmp_path, hardware="a100")
    del first


def test_a_symlink_loop_is_a_rejected_row_not_a_crash(tmp_path, capsys):
    """A link to itself in the plugin folder (resolve() raised RuntimeError: 'Symlink loop')
    is rejected with the read error as a dangling link is, through load and list-factors; a
    looping manifest beside a library rejects that library (it was looked past), a looping
    tuning file or manifest in the manifests folder is a note, and prefer= naming a loop
    matches nothing; the other plugins load."""
    import shutil
    folder = tmp_path / "odd"
    build_plugin(folder)
    (folder / "loop.so").symlink_to("loop.so")
    (folder / "dangling.so").symlink_to("nowhere.so")
    build_plugin(folder, "b", defines={"NAME": '"host_scale_b"', "FACTOR_ID": 1101})
    (folder / "host_scale_b.yaml").unlink()
    (folder / "host_scale_b.yaml").symlink_to("host_scale_b.yaml")
    mdir = tmp_path / "manifests"
    (mdir / "tuning").mkdir(parents=True)
    shutil.copy(ROOT / "tests" / "plugins" / "host_scale.yaml", mdir / "host_scale_b.yaml")
    (mdir / "x.yaml").symlink_to("x.yaml")
    (mdir / "tuning" / "h200.yaml").symlink_to("h200.yaml")
    reg = FactorRegistry.load(folder, hardware="h200", manifests_dir=mdir,
                              prefer={"host_scale": str(folder / "loop.so")})
    st = {p.path.name: p for p in reg.plugins}
    for name in ("loop.so", "dangling.so"):
        assert st[name].status == "rejected" and st[name].reason.startswith("read: "), st[name].reason
    assert "Too many levels of symbolic links" in st["loop.so"].reason
    assert st["b.so"].status == "rejected" and "host_scale_b.yaml: not readable" in st["b.so"].reason
    assert any("x.yaml: not readable" in n for n in reg.notes), reg.notes
    assert any("tuning" in n and "h200.yaml: not readable" in n for n in reg.notes), reg.notes
    assert any(n.startswith("prefer: host_scale") for n in reg.notes), reg.notes
    assert call(reg)[0] == "plugin"
    reg.load_library(folder / "loop.so")   # again: the same record, no crash
    assert cli_main(["list-factors", "--dir", str(folder), "--hardware", "h200"]) == 0
    out = capsys.readouterr().out
    assert "loop.so" in out and "rejected" in out, out


def test_manifest_tolerance_test_shapes_and_fallback_are_checked_at_load(tmp_path, capsys):
    """A tolerance of -1 or "abc", a test shape N: 7.5 (or a size the factor has not, or none
    for N) and a fallback that is no 'module:function' made a ready plugin whose every verify
    case failed (or ran N = 7.5); each refuses its plugin at load, naming the file and the
    field, and the rest load. A dtype the tolerance does not name gets the default, which
    verify's table says."""
    from ex_engine.verify import format_table, verify_plugin
    folder = tmp_path / "p"
    build_plugin(folder)
    tol = "tolerance: {float32: 1.0e-6}"
    cases = {
        "neg": (lambda t: t.replace(tol, "tolerance: {float32: -1}"),
                "tolerance: float32: expected a relative error > 0 (e.g. 1.0e-5), got int -1"),
        "str": (lambda t: t.replace(tol, "tolerance: {float32: abc}"),
                "tolerance: float32: expected a relative error > 0 (e.g. 1.0e-5), got str 'abc'"),
        "dt": (lambda t: t.replace(tol, "tolerance: {float23: 1.0e-6}"), "tolerance: float23: expected a dtype"),
        "frac": (lambda t: t.replace("{N: 7}", "{N: 7.5}"),
                 "test_shapes[0]: N: expected an integer >= 0, got float 7.5"),
        "neg_n": (lambda t: t.replace("{N: 7}", "{N: -3}"), "test_shapes[0]: N: expected an integer >= 0, got int -3"),
        "sym": (lambda t: t.replace("{N: 7}", "{N: 7, M: 2}"), "test_shapes[0]: M: expected a size (N) or a parameter"),
        "none": (lambda t: t.replace("{N: 7}", "{}"),
                 "test_shapes[0]: expected every size of the required arrays (N), got no N"),
        "fb": (lambda t: t.replace("fallback: tests.plugins.host_scale_fallback:scale", "fallback: os.system"),
               "fallback: expected 'module:function'"),
    }
    for i, (stem, (change, _)) in enumerate(cases.items()):
        _manifest_variant(folder, stem, f"host_scale_{stem}", 1101 + i, change)
    _manifest_variant(folder, "omit", "host_scale_omit", 1120, lambda t: t.replace(tol, "tolerance: {float16: 1.0e-3}"))
    reg = FactorRegistry.load(folder, hardware="h200")
    st = {p.path.stem: p for p in reg.plugins}
    for stem, (_, needle) in cases.items():
        assert st[stem].status == "rejected", (stem, st[stem].reason)
        assert f"host_scale_{stem}.yaml: {needle}" in st[stem].reason, (stem, st[stem].reason)
    assert call(reg)[0] == "plugin"
    assert st["omit"].status == "ready", st["omit"].reason
    res = verify_plugin(reg, st["omit"], isolate=False, count=False)
    assert [r.status for r in res] == ["pass"] and res[0].tol == 1e-5 and res[0].tol_default
    assert "1e-05 (default)" in format_table(res)
    res = verify_plugin(reg, st["host_scale"], isolate=False, count=False)
    assert res[0].tol == 1e-6 and not res[0].tol_default and "(default)" not in format_table(res)


def test_a_manifest_that_is_there_but_empty_or_misnamed_says_so(tmp_path):
    """An empty <name>.yaml, or one whose name field differs, in the manifests folder gave
    'expected <name>.yaml beside the library or in the manifests folder, found none' although
    the file is there: the reason says it is empty / names another factor. Beside the library
    an empty file said 'malformed (TypeError: 'NoneType' object is not subscriptable)'."""
    mdir, plugins = tmp_path / "manifests", tmp_path / "plugins"
    mdir.mkdir()
    good = (ROOT / "tests" / "plugins" / "host_scale.yaml").read_text(encoding="utf-8")
    (mdir / "host_scale.yaml").write_text("")
    (mdir / "host_scale_b.yaml").write_text(good.replace("name: host_scale", "name: host_scale_bb")
                                            .replace("id: 1100", "id: 1101"), encoding="utf-8")
    (mdir / "host_scale_c.yaml").write_text("# nothing but a comment\n- 1\n")
    build_plugin(plugins, manifest=False)
    build_plugin(plugins, "b", manifest=False, defines={"NAME": '"host_scale_b"', "FACTOR_ID": 1101})
    build_plugin(plugins, "c", manifest=False, defines={"NAME": '"host_scale_c"', "FACTOR_ID": 1102})
    build_plugin(plugins, "d", manifest=False, defines={"NAME": '"host_scale_d"', "FACTOR_ID": 1103})
    reg = FactorRegistry.load(plugins, hardware="h200", manifests_dir=mdir)
    st = {p.path.stem: p for p in reg.plugins}
    assert st["host_scale"].reason == (f"manifest: manifest {mdir / 'host_scale.yaml'}: empty: expected the "
                                       "manifest of 'host_scale' (name, id, dims, ...)"), st["host_scale"].reason
    assert st["b"].reason == (f"manifest: manifest {mdir / 'host_scale_b.yaml'}: names 'host_scale_bb', the "
                              "library 'host_scale_b': the manifest must name its factor as the library does")
    assert "host_scale_c.yaml: expected a mapping (name, id, dims, ...), got list" in st["c"].reason
    assert (f"expected host_scale_d.yaml beside the library (in {plugins}) or in the manifests folder {mdir}, "
            "found none") in st["d"].reason, st["d"].reason   # the folders searched, named
    beside = tmp_path / "beside"
    build_plugin(beside)
    (beside / "host_scale.yaml").write_text("# emptied\n")
    p = FactorRegistry.load(beside, hardware="h200").plugins[0]
    assert p.status == "rejected" and p.reason.endswith("host_scale.yaml: empty: expected a factor manifest "
                                                        "(name, id, dims, output, input, ...)"), p.reason


def test_an_exponent_without_a_dot_is_a_number_in_every_yaml_file(tmp_path):
    """YAML 1.1 (PyYAML's safe_load) reads 1e-6 as the string '1e-6': a manifest written that
    way had its plugin refused at load ('got str') once tolerances were checked there. ex_engine
    reads its YAML with 1.2's float rule: the plugin loads, with the tolerance 1e-6."""
    from ex_engine import _yaml
    from ex_engine.verify import verify_plugin
    assert _yaml.load("a: 1e-6\nb: -3E+8\nc: 10\nd: 1e\ne: yes\nf: 1.0e5\ng: ._\nh: 1_000e3\ni: 0x10") == {
        "a": 1e-6, "b": -3e8, "c": 10, "d": "1e", "e": True, "f": 1e5, "g": "._", "h": "1_000e3", "i": 16}
    import yaml
    with pytest.raises(yaml.YAMLError, match="month must be in 1..12"):   # a ValueError in PyYAML
        _yaml.load("note: 2024-13-01")
    m = tmp_path / "m"                      # such a file in the manifests folder is a note, the
    shutil.copytree(ROOT / "manifests", m)  # registry keeps working (it was a raw ValueError)
    (m / "junk.yaml").write_text("note: 2024-13-01\n")
    reg = FactorRegistry.load(tmp_path, hardware="h200", manifests_dir=m)
    assert "topk_softmax" in reg.manifests
    folder = tmp_path / "p"
    build_plugin(folder)
    _manifest_variant(folder, "exp", "host_scale_exp", 1130,
                      lambda t: t.replace("tolerance: {float32: 1.0e-6}", "tolerance: {float32: 1e-6}"))
    reg = FactorRegistry.load(folder, hardware="h200")
    p = {q.path.stem: q for q in reg.plugins}["exp"]
    assert p.status == "ready", p.reason
    res = verify_plugin(reg, p, isolate=False, count=False)
    assert [r.status for r in res] == ["pass"] and res[0].tol == 1e-6 and not res[0].tol_default


def test_a_newly_chosen_plugin_drops_the_calls_remembered_for_the_old_one(tmp_path):
    """A call's dims are remembered (bind cache, fast path) from the chosen plugin's manifest;
    when a later load_library makes another plugin the chosen one (a higher version, with its
    own manifest beside it), those are dropped and its calls bind again (the stale dims of
    the old manifest had been kept). A load that changes nothing keeps them."""
    build_plugin(tmp_path / "v1")
    reg = FactorRegistry.load(tmp_path / "v1", hardware="h200")
    assert call(reg)[0] == "plugin" and call(reg)[0] == "plugin"
    assert reg._bind_cache and reg._fast_calls
    build_plugin(tmp_path / "v1b", "host_scale_b", defines={"NAME": '"host_scale_b"', "FACTOR_ID": 1150})
    reg.load_library(tmp_path / "v1b" / "host_scale_b.so")          # another factor: kept
    assert reg._bind_cache and reg._fast_calls
    build_plugin(tmp_path / "v2", defines={"VERSION": '"2.0.0"'})
    reg.load_library(tmp_path / "v2" / "host_scale.so")
    assert reg.get("host_scale").version == "2.0.0"
    assert not reg._bind_cache and not reg._fast_calls
    path, x, out = call(reg)
    assert path == "plugin" and np.allclose(out, 3.0 * x)


def test_load_all_and_param_values_check_their_arguments(tmp_path):
    """load_all(None) and param_values(None) raised TypeError; load_all of a missing folder was
    {} without a word. The registry's mode (errors=) keeps {} for a missing folder."""
    from ex_engine.errors import ArgumentError, FactorError
    from ex_engine.manifest import load_all
    with pytest.raises(ArgumentError, match=r"load_all: argument 'folder': type: .*NoneType None"):
        load_all(None)
    with pytest.raises(FactorError, match=r"load_all: manifest folder '.*nonexistent': does not exist"):
        load_all(tmp_path / "nonexistent")
    (tmp_path / "f.yaml").write_text("x: 1\n")
    with pytest.raises(FactorError, match=r"not a directory"):
        load_all(tmp_path / "f.yaml")
    errors = {}
    assert load_all(tmp_path / "nonexistent", errors) == {} and errors == {}
    m = load_all(ROOT / "manifests")["topk_softmax"]
    assert m.param_values({}) == {"renormalize": False}
    with pytest.raises(ArgumentError, match=r"topk_softmax: argument 'params': type: expected a mapping.*NoneType"):
        m.param_values(None)


def test_manifest_booleans_unknown_keys_and_field_types_are_refused_at_load(tmp_path):
    """optional: "false" (a string) went through bool() and made alpha optional: the dispatch
    passed NULL and the process segfaulted. Misspelt keys (falback, tolerence, an array's
    optinal) were ignored; id: 0.7 was int()'d to 0, id: "1100" accepted; dtype: float32 was
    read as its letters; a test shape breaking the manifest's own constraint was accepted. Each
    refuses its plugin at load, naming the file, the field, what was expected and what came;
    the other plugins load."""
    folder = tmp_path / "p"
    build_plugin(folder)
    fb = "fallback: tests.plugins.host_scale_fallback:scale"
    cases = {
        "opt": (lambda t: t.replace("role: input}", 'role: input, optional: "false"}'),
                "aux[0] (alpha): optional: expected true or false, got str 'false'"),
        "rs": (lambda t: t.replace("input: {name: x, shape: [N], dtype: [float32]}",
                                   "input: {name: x, shape: [N], dtype: [float32], row_strided: 1}"),
               "input (x): row_strided: expected true or false, got int 1"),
        "fb": (lambda t: t.replace(fb, "fal" + fb[4:]), "unknown key 'falback' (did you mean 'fallback'?)"),
        "tol": (lambda t: t.replace("tolerance:", "tolerence:"), "unknown key 'tolerence' (did you mean 'tolerance'?)"),
        "bogus": (lambda t: t + "bogus_key: 1\n", "unknown key 'bogus_key'; expected some of name, id"),
        "arr": (lambda t: t.replace("role: input}", "role: input, optinal: true}"),
                "aux[0] (alpha): unknown key 'optinal' (did you mean 'optional'?)"),
        "par": (lambda t: t + "params: {beta: {type: bool, defualt: false}}\n",
                "params: beta: unknown key 'defualt' (did you mean 'default'?)"),
        "pdef": (lambda t: t + "params: {beta: {type: bool, default: 'false'}}\n",
                 "params: beta: default: expected a bool, got 'false'"),
        "src": (lambda t: t + "dim_sources: {M: {param: beta, encod: f64_bits}}\nparams: {beta: {type: float, default: 1.0}}\n",
                "dim_sources: M: unknown key 'encod' (did you mean 'encode'?)"),
        "val": (lambda t: t.replace("role: input}", "role: input, values: {uniform: [0, 1], distinct: 'no'}}"),
                "aux[0] (alpha): values: distinct: expected true or false, got str 'no'"),
        "id07": (lambda t: re.sub(r"\bid: \d+", "id: 0.7", t), "id: expected an integer (the factor id, an int32_t), got float 0.7"),
        "idstr": (lambda t: re.sub(r"\bid: \d+", 'id: "1100"', t), "id: expected an integer (the factor id, an int32_t), got str '1100'"),
        "idtrue": (lambda t: re.sub(r"\bid: \d+", "id: true", t), "id: expected an integer (the factor id, an int32_t), got bool True"),
        "idzero": (lambda t: re.sub(r"\bid: \d+", "id: zero", t), "id: expected an integer (the factor id, an int32_t), got str 'zero'"),
        "dtype": (lambda t: t.replace("dtype: [float32]}\ninput", "dtype: float32}\ninput"),
                  "output (out): dtype: expected a list of dtypes ([float32] or [float16, bfloat16]), got str 'float32'"),
        "cons": (lambda t: t + "constraints: ['N <= 5']\n",
                 "test_shapes[0]: expected sizes that keep the constraint 'N <= 5', got N=7"),
        "dup": (lambda t: t + "memory: host\n", "found duplicate key 'memory'"),
    }
    for i, (stem, (change, _)) in enumerate(cases.items()):
        _manifest_variant(folder, stem, f"host_scale_{stem}", 1101 + i, change)
    reg = FactorRegistry.load(folder, hardware="h200")
    st = {p.path.stem: p for p in reg.plugins}
    for stem, (_, needle) in cases.items():
        assert st[stem].status == "rejected", (stem, st[stem].reason)
        assert f"host_scale_{stem}.yaml: " in st[stem].reason and needle in st[stem].reason, (stem, st[stem].reason)
    assert call(reg)[0] == "plugin"


def test_every_shipped_manifest_loads_and_test_shapes_keep_the_constraints(tmp_path):
    """manifests/, docs/template and tests/plugins load under the stricter checks; topk_softmax
    with a test shape K > E (its constraint K <= E) is refused, naming the shape."""
    from ex_engine import FactorError
    from ex_engine.manifest import load_all
    assert sorted(load_all(ROOT / "manifests")) == ["fused_add_rmsnorm", "moe_fused_gemm", "topk_softmax"]
    assert sorted(load_all(ROOT / "docs" / "template")) == ["my_op"]
    assert sorted(load_all(ROOT / "tests" / "plugins")) == ["host_scale", "host_scale_ws"]
    text = (ROOT / "manifests" / "topk_softmax.yaml").read_text(encoding="utf-8")
    (tmp_path / "topk_softmax.yaml").write_text(text.replace("{T: 1, E: 128, K: 8,", "{T: 1, E: 128, K: 800,"), encoding="utf-8")
    with pytest.raises(FactorError, match=r"topk_softmax.yaml: test_shapes\[0\]: expected sizes that keep the "
                                          r"constraint 'K <= E', got K=800, E=128"):
        load_all(tmp_path)


def test_yaml_refuses_a_key_given_twice_in_a_mapping():
    """PyYAML kept the last of two 'name:' silently; every YAML file ex_engine reads is refused,
    naming the key and both lines (merge keys still work)."""
    import yaml
    from ex_engine import _yaml
    with pytest.raises(yaml.YAMLError, match=r"(?s)duplicate key 'name' \(first given on line 1\).*line 3"):
        _yaml.load("name: a\nid: 1\nname: b\n")
    with pytest.raises(yaml.YAMLError, match=r"duplicate key 'x'"):
        _yaml.load("top: {x: 1, x: 2}\n")
    assert _yaml.load("a: &x {q: 1}\nb: {<<: *x, q: 2}\n") == {"a": {"q": 1}, "b": {"q": 2}}


def test_a_folder_that_cannot_be_listed_is_named_not_taken_for_empty(tmp_path, monkeypatch):
    """A plugin folder without read permission was reported as 'no plugins (*.so)': glob reads an
    unreadable folder as an empty one. Listing it is refused by name (simulated: the tests run
    as root, whom permissions do not stop)."""
    import os
    from ex_engine import FactorError, FactorRegistry
    real = os.scandir

    def denied(path="."):
        if str(path) == str(tmp_path):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)
    monkeypatch.setattr(os, "scandir", denied)
    with pytest.raises(FactorError, match=r"factor folder '.*': cannot be read \(Permission denied\)"):
        FactorRegistry.load(tmp_path, hardware="h200")


def test_a_parameter_without_a_default_is_required_not_refused(tmp_path):
    """The load-time check of defaults refused a parameter that has none ('params: beta: default:
    expected a number, got None'): such a parameter is required of every call, as before that
    check. The manifest loads; a call that omits it is refused by name, one that gives it runs."""
    from ex_engine import ArgumentError, FactorError
    from ex_engine.manifest import Manifest
    text = ((ROOT / "tests" / "plugins" / "host_scale.yaml").read_text(encoding="utf-8").replace("- {N: 7}", "- {N: 7, beta: 0.5}")
            + "params: {beta: {type: float, gt: 0}}\n")
    (tmp_path / "host_scale.yaml").write_text(text, encoding="utf-8")
    m = Manifest.load(tmp_path / "host_scale.yaml")
    assert m._fields_problem() == ""
    with pytest.raises(ArgumentError, match=r"host_scale: argument 'beta': required: expected a value "
                                            r"\(the manifest gives no default\), got none given"):
        m.param_values({})
    assert m.param_values({"beta": 2}) == {"beta": 2.0}
    with pytest.raises(ArgumentError, match=r"argument 'beta': value: expected a finite number > 0"):
        m.param_values({"beta": -1.0})
    (tmp_path / "host_scale.yaml").write_text(text.replace("- {N: 7, beta: 0.5}", "- {N: 7}"), encoding="utf-8")
    with pytest.raises(FactorError, match=r"test_shapes\[0\]: beta: expected a value \(the manifest gives no default\)"):
        Manifest.load(tmp_path / "host_scale.yaml")     # verify could not run that shape


def test_device_flags_take_a_quoted_bit_number(tmp_path):
    """The stricter manifest check refused device_flags: {"0": text} (a quoted key), which had
    loaded as bit 0; it is bit 0 again, while a key that is no bit number is still refused."""
    from ex_engine import FactorError
    from ex_engine.manifest import Manifest
    base = (ROOT / "tests" / "plugins" / "host_scale.yaml").read_text(encoding="utf-8")
    (tmp_path / "host_scale.yaml").write_text(base + 'device_flags: {"0": a bad alpha}\n', encoding="utf-8")
    assert Manifest.load(tmp_path / "host_scale.yaml").device_flags == {0: "a bad alpha"}
    (tmp_path / "host_scale.yaml").write_text(base + 'device_flags: {0: one, "0": other}\n', encoding="utf-8")
    with pytest.raises(FactorError, match="device_flags: bit 0 given twice"):
        Manifest.load(tmp_path / "host_scale.yaml")          # (the second meaning had replaced the first)
    for key in ('"x"', "0.5", "32"):
        (tmp_path / "host_scale.yaml").write_text(base + f"device_flags: {{{key}: a bad alpha}}\n", encoding="utf-8")
        with pytest.raises(FactorError, match="device_flags: .*expected a bit number 0..31"):
            Manifest.load(tmp_path / "host_scale.yaml")


@pytest.mark.parametrize("text", ["models: [\n", "name: moe_models\nid: 77\ndims: [N]\n", "- 1\n- 2\n"])
def test_the_model_list_is_not_read_as_a_manifest(tmp_path, monkeypatch, text):
    """A corrupt or foreign moe_models.yaml in a folder of EX_ENGINE_MANIFESTS gave 'note: manifest
    .../moe_models.yaml: malformed ... skipped': it is the model list (moe_layer.load_models reads
    it, with its own message), not a factor manifest, in the home folder or a later one."""
    from ex_engine.errors import FactorError
    from ex_engine.moe_layer import load_models
    home, mine = tmp_path / "manifests", tmp_path / "mine"
    shutil.copytree(ROOT / "manifests", home)
    mine.mkdir()
    (tmp_path / "none").mkdir()
    for d in (home, mine):
        (d / "moe_models.yaml").write_text(text, encoding="utf-8")
    monkeypatch.setenv("EX_ENGINE_MANIFESTS", f"{mine}{os.pathsep}{home}")
    reg = FactorRegistry.load(tmp_path / "none", hardware="h200")
    assert not [n for n in reg.notes if "moe_models" in n], reg.notes
    assert "moe_models" not in reg.manifests and not reg.manifest_errors, reg.manifest_errors
    assert {"moe_fused_gemm", "topk_softmax"} <= set(reg.manifests)
    with pytest.raises(FactorError, match=f"model list {home / 'moe_models.yaml'}: "):
        load_models()


def test_a_file_dlopen_refuses_starts_no_process_and_leaves_no_cycle(tmp_path, monkeypatch):
    """A file the loader refuses (text named .so) is reported with dlerror's words, and costs
    no child process: cffi's dlopen, on a failure, asked ctypes.util.find_library, which starts
    ldconfig, gcc and ld (~36 ms a file, on every load of the folder), and kept its first error
    in a frame cycle that held the registry and the file's bytes until the cyclic GC ran (a leak
    trial, session sixty-three). The registry is freed when dropped, GC off."""
    import ctypes.util
    import gc
    import weakref
    (tmp_path / "b_text.so").write_text("not a library\n", encoding="utf-8")
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: pytest.fail(f"find_library({name!r}) ran"))
    gc.collect()
    gc.disable()
    try:
        reg = FactorRegistry.load(tmp_path, hardware="h200")
        [p] = reg.plugins
        [why] = [c.detail for c in p.checks if c.name == "dlopen" and not c.ok]
        assert "b_text.so" in why and "Additionally" not in why, why
        gone = weakref.ref(reg)
        del reg, p
        assert gone() is None
    finally:
        gc.enable()
