"""Review findings on the loader (registry, probe, ABI reading, verify, CLI), each with the
fault it showed: a bad plugin is reported and skipped, the registry keeps working."""
import shutil

import numpy as np
import pytest

from ex_engine import FactorRegistry
from ex_engine.cli import main as cli_main
from tests.conftest import ROOT, build_plugin


def _stray_copy(text: str) -> str:
    """host_scale.yaml with its dims' meaning changed (as an author's stray copy would be)."""
    return text.replace('summary: "test factor', 'summary: "a stray copy of the test factor')


def test_two_manifests_naming_one_factor_prefer_the_file_of_that_name(tmp_path):
    """a_topk.yaml, a copy of topk_softmax.yaml with dims swapped, sorted first and won: the
    real topk_softmax.yaml was skipped (on a GPU the kernel got T and E swapped). The file whose
    stem is the name wins, whatever the order; the stray is a note."""
    mdir = tmp_path / "m"
    mdir.mkdir()
    text = (ROOT / "manifests" / "topk_softmax.yaml").read_text()
    assert "dims: [T, E, K, renormalize, dtype]" in text
    (mdir / "a_topk.yaml").write_text(text.replace("dims: [T, E, K, renormalize, dtype]",
                                                   "dims: [E, T, K, renormalize, dtype]"))
    (mdir / "topk_softmax.yaml").write_text(text)
    reg = FactorRegistry(hardware="h200", manifests_dir=mdir)
    m = reg.manifests["topk_softmax"]
    assert m.path.endswith("topk_softmax.yaml") and m.dims[:2] == ["T", "E"]
    note = next(n for n in reg.notes if "a_topk.yaml" in n)
    assert "names 'topk_softmax'" in note and "topk_softmax.yaml) is the factor's manifest" in note


def test_two_manifests_naming_one_factor_neither_by_its_name_refuse_its_plugin(tmp_path):
    """No file is <name>.yaml: which one describes the library cannot be told, so its plugin is
    refused naming both files; other plugins still load."""
    lib, mdir = tmp_path / "lib", tmp_path / "m"
    build_plugin(lib, manifest=False)
    build_plugin(lib, "other", defines={"NAME": '"other"', "FACTOR_ID": 1101}, manifest=False)
    mdir.mkdir()
    text = (ROOT / "tests" / "plugins" / "host_scale.yaml").read_text()
    (mdir / "b_copy.yaml").write_text(text)
    (mdir / "c_copy.yaml").write_text(_stray_copy(text))
    (mdir / "other.yaml").write_text(text.replace("name: host_scale", "name: other").replace("id: 1100", "id: 1101"))
    reg = FactorRegistry.load(lib, hardware="h200", manifests_dir=mdir)
    p = next(q for q in reg.plugins if q.path.name == "host_scale.so")
    assert p.status == "rejected"
    assert "b_copy.yaml" in p.reason and "c_copy.yaml" in p.reason and "none is host_scale.yaml" in p.reason
    assert reg.get("other") is not None                     # the registry keeps working
    with pytest.raises(Exception, match="b_copy.yaml .*c_copy.yaml"):   # dispatch says why too
        reg.dispatch("host_scale", {})
    from ex_engine.manifest import load_all
    from ex_engine.errors import FactorError
    with pytest.raises(FactorError, match="none is host_scale.yaml"):   # load_all's raising mode
        load_all(mdir)


def test_a_stray_copy_does_not_stand_in_for_a_malformed_manifest_of_that_name(tmp_path):
    lib, mdir = tmp_path / "lib", tmp_path / "m"
    build_plugin(lib, manifest=False)
    mdir.mkdir()
    text = (ROOT / "tests" / "plugins" / "host_scale.yaml").read_text()
    (mdir / "a_copy.yaml").write_text(_stray_copy(text))
    (mdir / "host_scale.yaml").write_text(text.replace("dims: [N]", "dims: [N"))   # malformed
    reg = FactorRegistry.load(lib, hardware="h200", manifests_dir=mdir)
    p = reg.plugins[0]
    assert p.status == "rejected" and "host_scale.yaml: malformed" in p.reason, p.reason
    assert any("a_copy.yaml" in n and "not used in its place" in n for n in reg.notes), reg.notes
