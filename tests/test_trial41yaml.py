"""Trial 41 (YAML author): defects found in how manifests, tuning files and profiles are read."""
import shutil

import pytest

from ex_engine import FactorRegistry, _yaml
from ex_engine.errors import FactorError
from ex_engine.hardware import Hardware
from ex_engine.tuning import TuningTable
from tests.conftest import ROOT, build_plugin
import yaml

BAD_TAGS = ["!!bool maybe", "!!timestamp abc", "!!float ''"]


@pytest.mark.parametrize("value", BAD_TAGS)
def test_explicit_tag_a_constructor_cannot_read_is_a_yaml_error(value):
    # PyYAML raised KeyError / AttributeError / IndexError, which no reader caught
    with pytest.raises(yaml.YAMLError, match=r"invalid (boolean|timestamp|float).*\n.*f\.yaml\", line 2"):
        _yaml.load(f"a: 1\nk: {value}\n", name="f.yaml")


def test_explicit_tags_that_are_well_formed_still_read():
    assert _yaml.load("a: !!bool yes\nb: !!float 1.5\nc: !!timestamp 2024-01-02\nd: !!bool FALSE\n") \
        == {"a": True, "b": 1.5, "c": __import__("datetime").date(2024, 1, 2), "d": False}


@pytest.mark.parametrize("value", BAD_TAGS)
def test_manifest_with_bad_explicit_tag_rejects_its_plugin_not_the_registry(tmp_path, value):
    build_plugin(tmp_path)
    y = tmp_path / "host_scale.yaml"
    y.write_text(y.read_text(encoding="utf-8").replace("summary:", f"math: {value}\nsummary:"), encoding="utf-8")
    reg = FactorRegistry.load(tmp_path, hardware="h200")   # raised AttributeError / KeyError
    p = reg.plugins[0]
    assert p.status == "rejected" and "host_scale.yaml" in p.reason and "invalid" in p.reason, p.reason


@pytest.mark.parametrize("value", BAD_TAGS)
def test_profile_with_bad_explicit_tag_is_a_named_factor_error(tmp_path, value):
    p = tmp_path / "hw.yaml"
    p.write_text((ROOT / "manifests" / "hardware" / "h200.yaml").read_text(encoding="utf-8")
                 .replace("warp_size: 32", f"warp_size: {value}"), encoding="utf-8")
    with pytest.raises(FactorError, match=r"hardware profile .*hw\.yaml: malformed .*invalid"):
        Hardware.from_profile(p)


@pytest.mark.parametrize("value", BAD_TAGS)
def test_tuning_file_with_bad_explicit_tag_is_skipped_with_a_problem(tmp_path, value):
    (tmp_path / "a.yaml").write_text(f"device: NVIDIA H200\nmultiprocessor_count: {value}\n", encoding="utf-8")
    shutil.copy(ROOT / "manifests" / "tuning" / "h200.yaml", tmp_path / "b.yaml")
    t = TuningTable.for_hardware("h200", folder=tmp_path, report=False)
    assert len(t.problems) == 1 and "a.yaml" in t.problems[0] and "invalid" in t.problems[0]
    assert t.path == str(tmp_path / "b.yaml")


# ---- a dim_sources entry with two sources, or a qualifier of another source ------------------
_BASE = """name: f
id: 7
dims: [N, X]
output: {name: out, shape: [N], dtype: [float32]}
input: {name: x, shape: [N], dtype: [float32]}
params: {a: {type: int, default: 1}}
"""


@pytest.mark.parametrize("src,needle", [
    ("{dtype_of: x, tuned: 3}", "expected one source (a dim takes one value), got dtype_of and tuned"),
    ("{tuned: 1, param: a}", "got param and tuned"),
    ("{row_stride_of: x, param: a}", "got row_stride_of and param"),
    ("{tuned: 1, default_dim: N}", "got default_dim and tuned"),
    ("{param: a, range: [0, 3]}", "range: expected it only with tuned, got it with param"),
    ("{param: a, options: [1]}", "options: expected it only with tuned, got it with param"),
    ("{dtype_of: x, encode: f64_bits}", "encode: expected it only with param, got it with dtype_of"),
])
def test_dim_source_with_two_sources_or_a_stray_qualifier_is_refused(tmp_path, src, needle):
    # each was accepted: _dim_value read one source and ignored the rest without a word (a
    # tuned dim no table could fill; a param "bounded" by a range no call was held to)
    from ex_engine.manifest import Manifest
    p = tmp_path / "f.yaml"
    p.write_text(_BASE + f"dim_sources: {{X: {src}}}\n", encoding="utf-8")
    with pytest.raises(FactorError, match=r"f\.yaml: dim_sources: X: ") as e:
        Manifest.load(p)
    assert needle in str(e.value), str(e.value)


@pytest.mark.parametrize("src", ["{param: a}", "{param: a, encode: f64_bits}", "{tuned: 1, range: [0, 3]}",
                                 "{tuned: 1, options: [1, 2]}", "{dtype_of: x}", "{row_stride_of: x}"])
def test_dim_source_of_one_kind_still_loads(tmp_path, src):
    from ex_engine.manifest import Manifest
    p = tmp_path / "f.yaml"
    p.write_text(_BASE.replace("type: int, default: 1", "type: float, default: 1.0") if "encode" in src
                 else _BASE + "", encoding="utf-8")
    p.write_text(p.read_text(encoding="utf-8") + f"dim_sources: {{X: {src}}}\n", encoding="utf-8")
    assert Manifest.load(p).dim_sources["X"]


# ---- tuning tables: names that str() bent --------------------------------------------------
_TUNING_HEAD = "device: NVIDIA H200\nmultiprocessor_count: 132\n"
_SHAPE = "{H: 2, I: 1, G: 1, K: 1, by_T: [[1, 1]]}"


@pytest.mark.parametrize("table,needle", [
    # `on`/`off` are YAML booleans: the names became 'True'/'False', which no row could name
    ("{dim: config, key: [H, I, G, K], values: {off: 0, on: 1}, shapes: [%s]}" % _SHAPE,
     "values: expected choice names (strings), got bool False (YAML reads unquoted on/off"),
    # 1 and '1' folded into one name '1', the last value kept without a word
    ("{dim: config, key: [H, I, G, K], values: {1: 2, '1': 1}, shapes: [%s]}" % _SHAPE,
     "values: expected choice names (strings), got int 1"),
    # [H, H] (for [H, I]) was accepted: every entry held H to itself
    ("{dim: config, key: [H, H], values: {a: 1}, shapes: [{H: 2, by_T: [[1, a]]}]}",
     "key: expected each size once, got 'H' 2 times"),
    # dim: [config] was str()'d to "['config']", reported later as an unknown dim
    ("{dim: [config], key: [H, I, G, K], values: {a: 1}, shapes: [%s]}" % _SHAPE,
     "dim: expected the name of the manifest's tuned dim (e.g. config), got list ['config']"),
])
def test_tuning_table_names_are_read_as_written(tmp_path, table, needle):
    (tmp_path / "t.yaml").write_text(_TUNING_HEAD + f"moe_fused_gemm: {table}\n", encoding="utf-8")
    t = TuningTable.for_hardware("h200", folder=tmp_path, report=False)
    assert t.path is None and t.set_aside == [str(tmp_path / "t.yaml")]
    assert len(t.problems) == 1 and "t.yaml: moe_fused_gemm: malformed" in t.problems[0]
    assert needle in t.problems[0], t.problems[0]


def test_tuning_table_with_quoted_names_still_loads(tmp_path):
    (tmp_path / "t.yaml").write_text(_TUNING_HEAD + "moe_fused_gemm: {dim: config, key: [H, I, G, K], "
                                     "values: {'off': 0, 'on': 1}, shapes: [{H: 2, I: 1, G: 1, K: 1, "
                                     "by_T: [[1, 'on']]}]}\n", encoding="utf-8")
    t = TuningTable.for_hardware("h200", folder=tmp_path, report=False)
    assert not t.problems and t.factors["moe_fused_gemm"].values == {"off": 0, "on": 1}
