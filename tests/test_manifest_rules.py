"""Review findings on the manifest reader: pathological YAML (deep nesting, alias bombs),
YAML 1.2 integers, and manifest rules checked at load instead of failing every call."""
import shutil
import time

import numpy as np
import pytest
import yaml

from ex_engine import ArgumentError, FactorError, FactorRegistry, _yaml
from ex_engine.hardware import Hardware
from ex_engine.manifest import Manifest
from ex_engine.tuning import TuningTable, TuningWarning
from tests.conftest import ROOT, build_plugin

BASE = (ROOT / "tests" / "plugins" / "host_scale.yaml").read_text(encoding="utf-8")
DEEP = "[" * 500 + "]" * 500                       # ~1 KB; RecursionError in PyYAML's composer
# ~1 KB "billion laughs": 10**9 elements if every alias were copied
BOMB = "[" + ", ".join(f"&a{i} [" + ",".join([f"*a{i - 1}" if i else "x"] * 10) + "]"
                       for i in range(9)) + "]"


def manifest(tmp_path, change=lambda t: t, name="m.yaml"):
    p = tmp_path / name
    p.write_text(change(BASE), encoding="utf-8")
    return p


# ---- 1, 2: pathological YAML is a malformed file, reported and skipped ------------------------
@pytest.mark.parametrize("text,needle", [
    (f"summary: {DEEP}\n", "nested deeper than 100 levels"),
    ("summary: " + "{a: " * 600 + "1" + "}" * 600 + "\n", "nested deeper than 100 levels"),
    (f"summary: {BOMB}\n", "aliases would expand the document by"),
    ("".join(f"a{i}: &a{i} [*a{i - 1}]\n" if i else "a0: &a0 [1]\n" for i in range(300)),
     "aliases would nest the document 302 levels deep"),
    ("a: &a [1, *a]\n", "found an alias inside its own anchor's value"),
])
def test_pathological_yaml_is_a_yaml_error(text, needle):
    t = time.monotonic()
    with pytest.raises(yaml.YAMLError, match=needle):
        _yaml.load(text)
    assert time.monotonic() - t < 2


def test_ordinary_anchors_aliases_and_merge_keys_still_load():
    assert _yaml.load("a: &x {q: 1, r: [1, 2]}\nb: {<<: *x, q: 2}\nc: *x\n") == {
        "a": {"q": 1, "r": [1, 2]}, "b": {"q": 2, "r": [1, 2]}, "c": {"q": 1, "r": [1, 2]}}
    ok = "[" * 99 + "]" * 99
    assert _yaml.load(f"a: {ok}\n")["a"] is not None


def test_a_deep_or_aliased_manifest_refuses_its_plugin_and_the_registry_goes_on(tmp_path):
    folder = tmp_path / "p"
    build_plugin(folder)
    for i, (stem, value) in enumerate((("deep", DEEP), ("bomb", BOMB))):
        name = f"host_scale_{stem}"
        build_plugin(folder, stem, defines={"NAME": f'"{name}"', "FACTOR_ID": 1101 + i})
        text = BASE.replace("name: host_scale", f"name: {name}").replace("id: 1100", f"id: {1101 + i}")
        (folder / f"{name}.yaml").write_text(text.replace('summary: "test factor: out = alpha * in, '
                                                          'float32, on host memory"', f"summary: {value}"), encoding="utf-8")
    t = time.monotonic()
    reg = FactorRegistry.load(folder, hardware="h200")
    assert time.monotonic() - t < 20
    st = {p.path.stem: p for p in reg.plugins}
    assert st["deep"].status == "rejected" and "host_scale_deep.yaml: malformed" in st["deep"].reason
    assert "nested deeper than 100 levels" in st["deep"].reason
    assert st["bomb"].status == "rejected" and "aliases would expand" in st["bomb"].reason
    assert len(st["bomb"].reason) < 600, st["bomb"].reason
    assert st["host_scale"].status == "ready"


def test_deep_and_aliased_tuning_files_and_profiles_are_reported(tmp_path):
    from types import SimpleNamespace
    (tmp_path / "deep.yaml").write_text(f"device: {DEEP}\n", encoding="utf-8")
    (tmp_path / "bomb.yaml").write_text(f"device: NVIDIA H200\nmoe_fused_gemm: {BOMB}\n", encoding="utf-8")
    hw = SimpleNamespace(name="NVIDIA H200", multiprocessor_count=132, live=True)
    with pytest.warns(TuningWarning) as w:
        TuningTable.for_hardware(hw, tmp_path)
    text = " ".join(str(x.message) for x in w)
    assert "deep.yaml: not readable YAML" in text and "nested deeper than 100 levels" in text
    assert "bomb.yaml: not readable YAML" in text and "aliases would expand" in text
    for stem, value in (("deep", DEEP), ("bomb", BOMB)):
        p = tmp_path / f"{stem}_hw.yaml"
        p.write_text(f"name: {value}\n", encoding="utf-8")
        with pytest.raises(FactorError, match=f"hardware profile .*{stem}_hw.yaml: malformed") as e:
            Hardware.from_profile(str(p))
        assert "\n" not in str(e.value)     # one line, as a manifest's or a tuning file's


# ---- 8: YAML 1.2 integers ---------------------------------------------------------------------
def test_integers_follow_yaml_1_2():
    assert _yaml.load("a: 02260\nb: 0o17\nc: 0x1F\nd: -007\ne: +5\nf: 0b101\ng: 1_000\nh: 1:30\ni: 0") == {
        "a": 2260, "b": 15, "c": 31, "d": -7, "e": 5, "f": "0b101", "g": "1_000", "h": "1:30", "i": 0}
    assert yaml.safe_load("a: 02260") == {"a": 1200}     # PyYAML's own loader is left as it was


def test_floats_follow_yaml_1_2_and_explicit_ints_are_held_to_its_forms():
    """1.1's float forms 1_000.5 and 1:30.5 (sexagesimal: 90.5) are strings; 1e-5, .inf and .nan
    stay floats and plain digits ints. `!!int '-0x-5'` was read as 5 and `!!int '0o'` gave
    int()'s own message; a signed hex is a string in 1.2's core schema."""
    assert _yaml.load("a: 1_000.5\nb: 1:30.5\nc: 1e-5\nd: -.inf\ne: 5\nf: 5.\ng: -0x1F") == {
        "a": "1_000.5", "b": "1:30.5", "c": 1e-05, "d": float("-inf"), "e": 5, "f": 5.0, "g": "-0x1F"}
    assert _yaml.load("a: .nan")["a"] != _yaml.load("a: .nan")["a"]
    for bad in ("-0x-5", "0o", "0x", "1_0"):
        with pytest.raises(yaml.YAMLError, match="expected \\[-\\+\\]digits, 0o octal or 0x hex"):
            _yaml.load(f"a: !!int '{bad}'")


def test_an_id_with_a_leading_zero_is_decimal(tmp_path):
    m = Manifest.load(manifest(tmp_path, lambda t: t.replace("id: 1100", "id: 02260")))
    assert m.id == 2260


# ---- 2: descriptions of values are bounded ----------------------------------------------------
def _aliased(levels=9):
    x = ["x"]
    for _ in range(levels):
        x = [x] * 10       # one list shared ten times: 10**levels elements if expanded
    return x


@pytest.mark.parametrize("field", ["summary", "shape", "dims", "constraints", "test_shapes", "memory",
                                   "dtype", "values", "tolerance", "params"])
def test_a_huge_shared_structure_in_any_field_is_described_briefly(tmp_path, field):
    """Data as a YAML file with aliases gives it (the YAML reader now refuses such a file; a
    caller may still pass parsed data): checked and described in bounded time and length."""
    d = _yaml.load(BASE)
    bomb = _aliased()
    if field in ("shape", "dtype", "values"):
        d["input"][field] = bomb
    elif field == "tolerance":
        d["tolerance"] = {"float32": bomb}
    elif field == "params":
        d["params"] = {"alpha": {"type": "float", "default": bomb}}
    else:
        d[field] = bomb
    t = time.monotonic()
    with pytest.raises(FactorError) as e:
        Manifest.load(tmp_path / "m.yaml", data=d)
    assert time.monotonic() - t < 1 and len(str(e.value)) < 400, str(e.value)
    assert field in str(e.value)


def test_a_hardware_profile_value_is_described_briefly(tmp_path):
    good = (ROOT / "manifests" / "hardware" / "h200.yaml").read_text(encoding="utf-8")
    p = tmp_path / "hw.yaml"
    p.write_text(good.replace("warp_size: 32", "warp_size: [" + ", ".join(["12345678"] * 5000) + "]"), encoding="utf-8")
    with pytest.raises(FactorError, match="warp_size: expected 32 or 64") as e:
        Hardware.from_profile(str(p))
    assert len(str(e.value)) < 400


# ---- 6: huge numbers given as parameters ------------------------------------------------------
@pytest.mark.parametrize("value,needle", [
    (10 ** 5000, "<an integer of about 5001 digits>"),
    (10 ** 400, "<an integer of 401 digits>"),
    (-10 ** 400, "-<an integer of 401 digits>"),
    ([1.0] * 100000, "[1.0, 1.0, 1.0, 1.0, ...]"),
    ("e" * 10000, "'eeeee"),
], ids=["1e5000", "1e400", "-1e400", "list", "str"])
def test_a_huge_parameter_value_is_an_argument_error_with_a_bounded_description(tmp_path, value, needle):
    from ex_engine import fused_add_rmsnorm
    x, r, w = np.zeros((2, 8), np.float32), np.zeros((2, 8), np.float32), np.ones(8, np.float32)
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    with pytest.raises(ArgumentError, match="argument 'eps'") as e:
        reg.dispatch("fused_add_rmsnorm", {"x": x, "residual": r, "weight": w}, {"eps": value})
    assert needle in str(e.value) and len(str(e.value)) < 300, str(e.value)
    with pytest.raises(ArgumentError, match="argument 'eps'"):
        fused_add_rmsnorm(x, r, w, eps=value, registry=reg)


def test_a_huge_int_parameter_is_named_briefly(tmp_path):
    m = Manifest.load(manifest(tmp_path, lambda t: t + "params: {k: {type: int, default: 1}}\n"))
    with pytest.raises(ArgumentError, match=r"argument 'k': value: expected an int in the int64 range, "
                                            r"got <an integer of about 5001 digits>$"):
        m.param_values({"k": 10 ** 5000})


# ---- 3: one name per array; parameters not named like an array or a size ----------------------
@pytest.mark.parametrize("change,needle", [
    (lambda t: t.replace("{name: alpha, shape: [1]", "{name: out, shape: [1]"),
     "aux[0]: name: 'out' names output already; expected each array named once"),
    (lambda t: t.replace("{name: alpha, shape: [1]", "{name: x, shape: [1]"),
     "aux[0]: name: 'x' names input already"),
    (lambda t: t.replace("input: {name: x,", "input: {name: out,"), "input: name: 'out' names output already"),
    (lambda t: t + "params: {N: {type: int, default: 3}}\n",
     "params: N: named like the size N of the arrays' shapes; expected a name no array, size or dim uses"),
    (lambda t: t + "params: {alpha: {type: float, default: 1.0}}\n",
     "params: alpha: named like the array aux[0]"),
])
def test_duplicate_array_names_and_clashing_parameters_are_refused_at_load(tmp_path, change, needle):
    with pytest.raises(FactorError, match="m.yaml: ") as e:
        Manifest.load(manifest(tmp_path, change))
    assert needle in str(e.value), str(e.value)


def test_a_duplicate_array_name_refuses_the_plugin_the_registry_goes_on(tmp_path):
    folder = tmp_path / "p"
    build_plugin(folder)
    build_plugin(folder, "dup", defines={"NAME": '"host_scale_dup"', "FACTOR_ID": 1101})
    (folder / "host_scale_dup.yaml").write_text(
        BASE.replace("name: host_scale", "name: host_scale_dup").replace("id: 1100", "id: 1101")
        .replace("{name: alpha, shape: [1]", "{name: x, shape: [1]"), encoding="utf-8")
    reg = FactorRegistry.load(folder, hardware="h200")
    st = {p.path.stem: p for p in reg.plugins}
    assert st["dup"].status == "rejected" and "names input already" in st["dup"].reason
    assert st["host_scale"].status == "ready"


# ---- 4: impossible shapes refused at load; no ZeroDivisionError on dispatch --------------------
@pytest.mark.parametrize("shape,needle", [
    ("[0*N]", "shape[0]: expected a coefficient >= 1 in '0*N'"),
    ("[N*0]", "shape[0]: expected a coefficient >= 1 in 'N*0'"),
    ("[-3]", "shape[0]: expected a size >= 0, got -3"),
    ("[2*N*3]", "shape[0]: expected N, SYM or N*SYM (one coefficient), got '2*N*3'"),
    ("[N+1]", "shape[0]: expected N, SYM or N*SYM (N an integer >= 1), got 'N+1'"),
    ("[1.5]", "shape[0]: expected entries N, SYM or N*SYM, got float 1.5"),
])
def test_impossible_shapes_are_refused_at_load(tmp_path, shape, needle):
    with pytest.raises(FactorError) as e:
        Manifest.load(manifest(tmp_path, lambda t: t.replace("input: {name: x, shape: [N]",
                                                             f"input: {{name: x, shape: {shape}")))
    assert f"m.yaml: input (x): {needle}" in str(e.value), str(e.value)


def test_constant_and_scaled_shapes_still_load_and_bind(tmp_path):
    from ex_engine.arrays import TensorRef
    m = Manifest.load(manifest(tmp_path, lambda t: t.replace("input: {name: x, shape: [N]",
                                                             "input: {name: x, shape: [N*2]")
                               .replace("test_shapes:\n  - {N: 7}", "test_shapes:\n  - {N: 0}")))
    assert m.input.parsed == [(2, "N")] and m.aux[0].parsed == [(1, None)]
    refs = {k: TensorRef.of(np.zeros(n, np.float32)) for k, n in (("out", 3), ("x", 6), ("alpha", 1))}
    assert m.bind(refs)[2] == {"N": 3}
    refs["x"] = TensorRef.of(np.zeros(5, np.float32))
    with pytest.raises(ArgumentError, match="expected a multiple of 2, got 5"):
        m.bind(refs)


def test_an_array_of_zero_byte_elements_is_a_layout_error(tmp_path):
    from types import SimpleNamespace
    m = Manifest.load(manifest(tmp_path))
    with pytest.raises(ArgumentError, match="argument 'x': element size: expected at least 1 byte, got 0"):
        m.check_alignment("x", SimpleNamespace(ptr=0x1000, itemsize=0))


# ---- 5: gt and float32 on int and bool parameters --------------------------------------------
@pytest.mark.parametrize("spec,needle", [
    ("{type: int, default: 0, gt: 0}", "params: k: default: expected an int > 0, got 0"),
    ("{type: bool, default: false, gt: 5}", "params: k: gt: expected no gt on a bool parameter"),
    ("{type: int, default: 1, float32: true}", "params: k: float32: expected no float32 on an int parameter"),
    ("{type: bool, default: false, float32: false}", "params: k: float32: expected no float32 on a bool"),
    ("{type: float, default: 1.0, gt: " + "9" * 400 + "}", "params: k: gt: expected a finite number"),
    ("{type: float, default: 1.0, gt: '0'}", "params: k: gt: expected a finite number (the bound the value "
                                              "must exceed), got str '0'"),
    ("{type: double, default: 1.0}", "params: k: type: expected float, int or bool, got str 'double'"),
])
def test_parameter_keys_that_do_not_apply_or_a_default_that_breaks_them_are_refused(tmp_path, spec, needle):
    with pytest.raises(FactorError) as e:
        Manifest.load(manifest(tmp_path, lambda t: t + f"params:\n  k: {spec}\n"))
    assert f"m.yaml: {needle}" in str(e.value), str(e.value)


def test_gt_bounds_an_int_parameter_on_every_call(tmp_path):
    m = Manifest.load(manifest(tmp_path, lambda t: t + "params:\n  k: {type: int, default: 2, gt: 0}\n"
                               "  f: {type: float, default: 0.5, gt: 0, float32: true}\n"))
    assert m.param_values({"k": 1}) == {"k": 1, "f": 0.5}
    for bad in (0, -5, np.int64(-1)):
        with pytest.raises(ArgumentError, match=f"argument 'k': value: expected an int > 0, got "):
            m.param_values({"k": bad})
    with pytest.raises(FactorError, match=r"test_shapes\[0\]: k: expected an int > 0, got -1"):
        Manifest.load(manifest(tmp_path, lambda t: t.replace("{N: 7}", "{N: 7, k: -1}")
                               + "params:\n  k: {type: int, default: 2, gt: 0}\n"))


def test_a_plugin_whose_int_default_breaks_its_gt_is_refused_and_calls_below_it_never_run(tmp_path):
    folder = tmp_path / "p"
    build_plugin(folder)
    text = (folder / "host_scale.yaml").read_text(encoding="utf-8")
    (folder / "host_scale.yaml").write_text(text + "params:\n  k: {type: int, default: 1, gt: 0}\n", encoding="utf-8")
    build_plugin(folder, "bad", defines={"NAME": '"host_scale_bad"', "FACTOR_ID": 1101})
    (folder / "host_scale_bad.yaml").write_text(
        BASE.replace("name: host_scale", "name: host_scale_bad").replace("id: 1100", "id: 1101")
        + "params:\n  k: {type: int, default: 0, gt: 0}\n", encoding="utf-8")
    reg = FactorRegistry.load(folder, hardware="h200")
    st = {p.path.stem: p for p in reg.plugins}
    assert st["bad"].status == "rejected" and "params: k: default: expected an int > 0, got 0" in st["bad"].reason
    x, out, alpha = np.ones(7, np.float32), np.zeros(7, np.float32), np.array([2.0], np.float32)
    with pytest.raises(ArgumentError, match="argument 'k': value: expected an int > 0, got -5"):
        reg.dispatch("host_scale", {"x": x, "out": out, "alpha": alpha}, {"k": -5})
    assert not out.any()
    assert reg.dispatch("host_scale", {"x": x, "out": out, "alpha": alpha}, {"k": 3}) == "plugin"


# ---- 7: values checked at load ----------------------------------------------------------------
def _values(t, values, dtype="float32"):
    return t.replace("input: {name: x, shape: [N], dtype: [float32]}",
                     f"input: {{name: x, shape: [N], dtype: [{dtype}], values: {values}}}")


@pytest.mark.parametrize("values,dtype,needle", [
    ("{normal: 1/sqrt(Q)}", "float32", "normal: expected a number or SYM or 1/sqrt(SYM) with SYM a size every "
                                       "test shape gives (N), got str '1/sqrt(Q)'"),
    ("{uniform: [a, b]}", "float32", "uniform[0]: expected a number or SYM or 1/sqrt(SYM) with SYM a size"),
    ("{uniform: [0.5, .nan]}", "float32", "uniform[1]: expected a finite number or a size, got float nan"),
    ("{uniform: [2.0, 1.0]}", "float32", "uniform: expected [LO, HI] with LO <= HI, got list [2.0, 1.0]"),
    ("{uniform: [0, N]}", "int32", "uniform: expected integers [LO, HI] with LO < HI for an integer array"),
    ("{uniform: [3, 3]}", "int32", "uniform: expected integers [LO, HI] with LO < HI"),
    ("{normal: -1.0}", "float32", "normal: expected a standard deviation >= 0, got float -1.0"),
    ("{normal: 1.0}", "int32", "normal: expected uniform or ids_below for an integer array"),
    ("{normal: 1.0, uniform: [0, 1]}", "float32", "expected one of normal, uniform and ids_below, got normal and uniform"),
    ("{ids_below: Q}", "int32", "ids_below: expected a number or SYM with SYM a size every test shape gives (N), "
                                "got str 'Q'"),
    ("{ids_below: 0}", "int32", "ids_below: expected a size or an integer >= 1, got int 0"),
    ("{distinct: true}", "int32", "distinct: expected it only with ids_below"),
])
def test_values_naming_unknown_sizes_or_malformed_are_refused_at_load(tmp_path, values, dtype, needle):
    with pytest.raises(FactorError) as e:
        Manifest.load(manifest(tmp_path, lambda t: _values(t, values, dtype)))
    assert f"m.yaml: input (x): values: {needle}" in str(e.value), str(e.value)


@pytest.mark.parametrize("values,dtype", [
    ("{normal: 1/sqrt(N)}", "float32"), ("{normal: 0.5}", "float32"), ("{normal: N}", "float32"),
    ("{uniform: [0.1, 1.0]}", "float32"), ("{uniform: [-1, N]}", "float32"), ("{uniform: [0, 4]}", "int32"),
    ("{ids_below: N, distinct: true}", "int32"), ("{ids_below: 5}", "int32"),
])
def test_values_of_the_documented_forms_load(tmp_path, values, dtype):
    assert Manifest.load(manifest(tmp_path, lambda t: _values(t, values, dtype))).input.values


# ---- 9: hardware profiles are as strict about keys as manifests -------------------------------
@pytest.mark.parametrize("extra,needle", [
    ("foo: 1\n", "unknown key 'foo'; expected some of name, cc_major"),
    ("warpsize: 32\n", "unknown key 'warpsize' (did you mean 'warp_size'?)"),
    ("is_live: true\n", "unknown key 'is_live'"),
])
def test_a_hardware_profile_with_an_unknown_key_is_refused_with_a_hint(tmp_path, extra, needle):
    p = tmp_path / "hw.yaml"
    p.write_text((ROOT / "manifests" / "hardware" / "a100.yaml").read_text(encoding="utf-8") + extra, encoding="utf-8")
    with pytest.raises(FactorError) as e:
        Hardware.from_profile(str(p))
    assert f"hardware profile {p}: {needle}" in str(e.value), str(e.value)


def test_the_shipped_profiles_load():
    for name in ("a100", "h100", "h200", "bi-v100"):
        assert Hardware.from_profile(name).name


def test_the_h100_profile_finds_the_h100_tuning_file():
    """Session forty-two shipped a tuning file for the H100 80GB HBM3 (132 SMs) and a profile of
    that GPU: on a machine without it (CI), `--hardware h100` checks the plugins against it and
    picks that file, as the live GPU does (the device name and SM count must match the file's)."""
    from ex_engine.tuning import TuningTable
    hw = Hardware.from_profile("h100")
    assert (hw.name, hw.multiprocessor_count, hw.cc_major, hw.cc_minor) == ("NVIDIA H100 80GB HBM3", 132, 9, 0)
    table = TuningTable.for_hardware(hw)
    assert table.path is not None and table.path.endswith("nvidia_h100_80gb_hbm3_132sm.yaml"), table.path
    assert not table.problems and not table.remarks, (table.problems, table.remarks)
    assert TuningTable.for_hardware("h200").path.endswith("h200.yaml")


@pytest.mark.parametrize("change,needle", [
    (lambda t: t.replace("dims: [N]", "dims: [N, N]"), "dims: expected each size once, got 'N' 2 times"),
    (lambda t: t.replace("dims: [N]", "dims: [N]\ndim_sources: {M: {default_dim: N}}"),
     "dim_sources: 'M': expected one of dims"),
])
def test_a_dim_twice_or_a_source_of_no_dim_is_refused(tmp_path, change, needle):
    """dims lists each size the kernel receives once (twice, every slot after the second copy
    would be read off by one), and a dim_sources entry names one of them (else it is a misspelt
    or forgotten dim whose size the kernel never gets); both loaded before."""
    with pytest.raises(FactorError, match=needle):
        Manifest.load(manifest(tmp_path, change))


def test_a_profile_saved_from_the_hardware_command_loads(tmp_path, capsys):
    """`ex-engine hardware --profile h200 --json > my.yaml` then Hardware.from_profile('my.yaml'):
    the strict key check refused the fields the command adds (source, live, device_id)."""
    from ex_engine.cli import main as cli_main
    assert cli_main(["hardware", "--profile", "h200", "--json"]) == 0
    (tmp_path / "my.yaml").write_text(capsys.readouterr().out, encoding="utf-8")
    hw = Hardware.from_profile(str(tmp_path / "my.yaml"))
    assert hw.multiprocessor_count == 132 and hw.live is False and hw.source == "profile my"


def test_a_parameter_named_like_a_dim_of_another_source_is_refused(tmp_path):
    """params: {dtype: ...} beside dims' dtype (from dtype_of) loaded; its docstring said no
    parameter may share a dim's name. A dim that takes the parameter's own value is fine."""
    text = (ROOT / "manifests" / "topk_softmax.yaml").read_text(encoding="utf-8")
    p = tmp_path / "topk_softmax.yaml"
    p.write_text(text.replace("  renormalize: {type: bool, default: false}",
                              "  renormalize: {type: bool, default: false}\n  dtype: {type: int, default: 1}"), encoding="utf-8")
    with pytest.raises(FactorError, match="params: dtype: named like the dim dtype, whose value comes from"):
        Manifest.load(p)
    assert Manifest.load(ROOT / "manifests" / "topk_softmax.yaml").params["renormalize"]


def test_a_search_path_joined_with_the_other_platforms_separator_says_so(tmp_path, monkeypatch):
    import os
    other = ";" if os.pathsep == ":" else ":"
    value = f"{tmp_path / 'a'}{other}{ROOT / 'manifests'}"
    with pytest.raises(FactorError, match=f"folders are joined with '{os.pathsep}' here, not '{other}'"):
        FactorRegistry(hardware="h200", manifests_dir=value)
    monkeypatch.setenv("EX_ENGINE_MANIFESTS", value)
    with pytest.raises(FactorError, match=f"not '{other}'"):
        Hardware.from_profile("h200")


def test_parse_cases_lists_a_non_ascii_digit_as_a_problem():
    from ex_engine.moe_layer import parse_cases
    cases, problems = parse_cases({"m": None}, ["m:\u00b2", "m:3"])   # '²'.isdigit() is True
    assert cases == [("m", 3)] and len(problems) == 1 and "'m:\u00b2'" in problems[0]


@pytest.mark.parametrize("sources", ["{N: {dtype_of: x}}", "{N: {row_stride_of: x}}", "{N: {tuned: 0}}",
                                     "{N: {default_dim: N}}"])
def test_a_source_for_a_size_a_required_array_gives_is_refused(tmp_path, sources):
    """dims: [N] with N a size of out's and x's shapes and dim_sources: {N: {dtype_of: x}} loaded
    as ready: bind passes the size it measures, so the source was never read (the kernel got N,
    not the dtype code)."""
    p = manifest(tmp_path, lambda t: t.replace("dims: [N]", f"dims: [N]\ndim_sources: {sources}"))
    with pytest.raises(FactorError) as e:
        Manifest.load(p)
    assert str(e.value).startswith(
        f"manifest {p}: dim_sources: N: expected a source only for a dim that no required array's shape "
        "gives; got {"), str(e.value)
    assert str(e.value).endswith("for N, a size of the required array out's shape, so it is never read "
                                 "(the kernel receives the size)"), str(e.value)


def test_a_source_for_a_size_only_an_optional_array_gives_is_read_where_it_is_absent(tmp_path):
    """A size that only an optional array gives takes its source where that array is absent
    (moe_fused_gemm's G: {default_dim: E}; here a param): the rule above must not refuse it."""
    p = manifest(tmp_path, lambda t: t.replace("dims: [N]", "dims: [N, S]\ndim_sources: {S: {param: ns}}\n"
                                                "params: {ns: {type: int, default: 7}}").replace(
        "role: input}\n", "role: input}\n  - {name: scale, shape: [S], dtype: [float32], role: input, "
        "optional: true}\n"))
    m = Manifest.load(p)
    from ex_engine.arrays import TensorRef
    arrays = {"out": TensorRef.of(np.zeros(3, np.float32)), "x": TensorRef.of(np.ones(3, np.float32)),
              "alpha": TensorRef.of(np.ones(1, np.float32))}
    assert m.bind({**arrays, "scale": None})[1] == [3, 7]
    assert m.bind({**arrays, "scale": TensorRef.of(np.ones(5, np.float32))})[1] == [3, 5]
    assert Manifest.load(ROOT / "manifests" / "moe_fused_gemm.yaml").dim_sources["G"] == {"default_dim": "E"}


@pytest.mark.parametrize("field,needle", [
    ("dims", "dims: expected a list of size names ([T, H, dtype]), got null"),
    ("output", "output: expected a mapping {name, shape, dtype, ...}, got null"),
    ("input", "input: expected a mapping {name, shape, dtype, ...}, got null"),
    ("aux", "aux: expected a list of array entries, got null"),
    ("params", "params: expected a mapping name -> {type, default, ...}, got null"),
    ("dim_sources", "dim_sources: expected a mapping dim -> {source: ...}, got null"),
    ("constraints", "constraints: expected a list of constraints (['K <= E']), got null"),
    ("tolerance", "tolerance: expected a mapping dtype -> relative error, got null"),
    ("test_shapes", "test_shapes: expected a list of test shapes ([{T: 3, H: 64}]), got null"),
    ("device_flags", "device_flags: expected a mapping bit -> meaning, got null"),
    ("memory", "memory: expected 'device' or 'host', got null"),
    ("shape", "input (x): shape: expected a list of sizes ([T, H], [N], [E, 2*I, H]), got null"),
    ("dtype", "input (x): dtype: expected a list of dtypes ([float32] or [float16, bfloat16]), got null"),
    ("values", "input (x): values: expected a mapping ({normal: STD}"),
])
def test_a_list_or_mapping_field_given_as_null_is_refused_naming_it(tmp_path, field, needle):
    """`aux: null` (or `aux:` with its entries commented out) was 'malformed (TypeError:
    'NoneType' object is not iterable)'; `params: null` and the like read as empty, and
    `memory: null` as the string 'None'. Each is now refused naming the field."""
    import re

    def change(t):
        t += "params: {}\ndim_sources: {}\nconstraints: []\ndevice_flags: {}\n"
        if field in ("shape", "dtype", "values"):
            return t.replace("{name: x, shape: [N], dtype: [float32]}",
                             "{name: x, " + {"shape": "shape: null, dtype: [float32]}",
                                             "dtype": "shape: [N], dtype: null}",
                                             "values": "shape: [N], dtype: [float32], values: null}"}[field])
        return re.sub(rf"^{field}:.*(\n  .*)*", f"{field}: null", t, count=1, flags=re.M)
    p = manifest(tmp_path, change)
    assert "null" in p.read_text(encoding="utf-8")
    with pytest.raises(FactorError) as e:
        Manifest.load(p)
    assert str(e.value).startswith(f"manifest {p}: {needle}"), str(e.value)
