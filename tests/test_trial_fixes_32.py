"""Defects a new-user trial found (session thirty-two): a missing EX_ENGINE_MANIFESTS folder
reported as a missing hardware profile, and manifests_dir= refusing what the variable skips;
bool parameters taking a one-element torch tensor of any rank, and their message hiding 0/1; a
malformed tuning file called unreadable, and a file none of whose tables is used shown as in
use; YAML syntax errors pointing at "<unicode string>"; fused_add_rmsnorm blaming x for
residual's T; a sparse torch tensor raising DTypeError for a layout rule."""
import json
import os
import shutil

import numpy as np
import pytest
import yaml

from ex_engine import FactorError, FactorRegistry, fused_add_rmsnorm, topk_softmax
from ex_engine.cli import main as cli_main
from ex_engine.errors import ArgumentError, DTypeError, LayoutError, ShapeError
from ex_engine.hardware import Hardware
from ex_engine.manifest import bool_like, load_all
from ex_engine.tuning import TuningTable
from tests.conftest import ROOT

SHIPPED = ROOT / "manifests"
H200 = Hardware.from_profile("h200")


@pytest.fixture(scope="module")
def reg():
    return FactorRegistry(hardware="h200")


# ------------------------------------------------------------- 1. the manifests search path
@pytest.mark.parametrize("kind", ["missing", "file", "both"])
def test_a_manifests_variable_naming_no_folder_is_the_error_not_a_profile(tmp_path, monkeypatch, capsys, kind):
    """EX_ENGINE_MANIFESTS=/nonexistent made list-factors say "hardware profile 'h200': no such
    profile; expected one of []": the user asked for no profile. The error names the variable,
    its value and what each folder is instead (missing, or a file)."""
    gone, afile = tmp_path / "gone", tmp_path / "afile"
    afile.write_text("")
    value = {"missing": str(gone), "file": str(afile), "both": os.pathsep.join([str(gone), str(afile)])}[kind]
    monkeypatch.setenv("EX_ENGINE_MANIFESTS", value)
    (tmp_path / "plugs").mkdir()
    assert cli_main(["list-factors", "--dir", str(tmp_path / "plugs"), "--no-probe"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ex-engine: error: EX_ENGINE_MANIFESTS={value}: "), err
    assert "profile" not in err, err
    if kind == "missing":
        assert f": the folder {gone} does not exist; expected a folder of factor manifests" in err, err
    elif kind == "file":
        assert f": {afile} is a file, not a folder; expected a folder of factor manifests" in err, err
    else:
        assert f"none of its 2 folders is there ({gone} does not exist; {afile} is a file, not a folder)" in err, err
    # the registry itself says so first, whatever hardware it is given
    with pytest.raises(FactorError, match=f"^EX_ENGINE_MANIFESTS={value}: "):
        FactorRegistry(hardware=H200)


def test_manifests_dir_takes_the_variables_rule_for_a_missing_entry(tmp_path, monkeypatch):
    """EX_ENGINE_MANIFESTS=/gone:<manifests> noted and skipped /gone, while manifests_dir= of the
    same value raised "manifests_dir '/gone': not a directory" (README: it takes the same form).
    Both now note and skip it; neither raises while one folder is there."""
    gone = tmp_path / "gone"
    value = os.pathsep.join([str(gone), str(SHIPPED)])
    note = f"manifests folder {gone} (of the search path {value}) does not exist; skipped"
    given = FactorRegistry(hardware="h200", manifests_dir=value)
    monkeypatch.setenv("EX_ENGINE_MANIFESTS", value)
    from_env = FactorRegistry(hardware="h200")
    for reg in (given, from_env):
        assert note in reg.notes, reg.notes
        assert reg.manifests_dirs == [SHIPPED] and {"topk_softmax", "moe_fused_gemm"} <= set(reg.manifests)


def test_manifests_dir_says_does_not_exist_or_is_not_a_folder(tmp_path):
    """manifests_dir= of a path that does not exist said "not a directory": it says 'does not
    exist' there, and 'is a file, not a folder' for a file; none of several entries there names
    each."""
    gone, afile = tmp_path / "gone", tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(FactorError, match=f"^manifests_dir '{gone}': does not exist; expected a folder"):
        FactorRegistry(hardware="h200", manifests_dir=gone)
    with pytest.raises(FactorError, match=f"^manifests_dir '{afile}': is a file, not a folder; expected"):
        FactorRegistry(hardware="h200", manifests_dir=str(afile))
    both = os.pathsep.join([str(gone), str(afile)])
    with pytest.raises(FactorError, match=f"none of its 2 folders is there \\({gone} does not exist; "
                                          f"{afile} is a file, not a folder\\)"):
        FactorRegistry(hardware="h200", manifests_dir=both)


# ------------------------------------------------------------- 2, 3. bool parameters
class _OneElement:
    """What a torch tensor of one element and rank 2 offers bool_like: a shape and __index__
    (torch's works for one element of any rank; NumPy's refuses a rank above 0)."""
    shape = (1, 1)

    def __index__(self):
        return 1


def test_bool_like_takes_only_zero_dimensional_values():
    """bool_like took any one-element object with __index__ (torch.tensor([[1]])), though its
    docstring says 0-d only and NumPy's np.array([1]) is refused."""
    assert not bool_like(_OneElement())
    assert not bool_like(np.array([1])) and not bool_like(np.array([True]))
    assert bool_like(np.array(1)) and bool_like(np.bool_(True)) and bool_like(1) and bool_like(False)


def test_bool_like_follows_numpy_for_torch_tensors():
    torch = pytest.importorskip("torch")
    for v in (torch.tensor([[1]]), torch.tensor([True]), torch.tensor([0])):
        assert not bool_like(v), v
    for v in (torch.tensor(1), torch.tensor(True), torch.tensor(0, dtype=torch.int8)):
        assert bool_like(v), v
    with pytest.raises(ArgumentError, match=r"'renormalize': type: expected a bool \(or 0/1\), got tensor\(\[True\]\)"):
        topk_softmax(torch.randn(4, 16), 2, torch.tensor([True]), registry=FactorRegistry(hardware="h200"))


def test_a_bad_bool_parameter_says_0_or_1_are_accepted(reg):
    """topk_softmax(L, 2, 2) said "expected a bool, got 2" although 0 and 1 are taken."""
    logits = np.zeros((4, 16), np.float32)
    with pytest.raises(ArgumentError, match=r"^topk_softmax: argument 'renormalize': type: expected a bool "
                                            r"\(or 0/1\), got 2$"):
        topk_softmax(logits, 2, 2, registry=reg)
    w, _ = topk_softmax(logits, 2, 1, registry=reg)     # 0/1 still taken
    assert np.allclose(w.sum(1), 1.0)


# ------------------------------------------------------------- 4. tuning files
def _tuning_folder(tmp_path, text: str):
    folder = tmp_path / "tuning"
    folder.mkdir(exist_ok=True)
    (folder / "h200.yaml").write_text(text, encoding="utf-8")
    return folder, str(folder / "h200.yaml")


def test_a_malformed_tuning_file_is_malformed_not_unreadable(tmp_path):
    """multiprocessor_count: many in this device's file, or an empty file, were counted as
    "unreadable" in list-factors' header (the file was read: it is malformed). The file for
    this device (its device read) is set aside as malformed; malformed and unreadable list
    the files by what was wrong."""
    shipped = (SHIPPED / "tuning" / "h200.yaml").read_text(encoding="utf-8")
    assert "\nmultiprocessor_count: 132\n" in shipped
    folder, path = _tuning_folder(tmp_path, shipped.replace("\nmultiprocessor_count: 132\n",
                                                            "\nmultiprocessor_count: many\n"))
    t = TuningTable.for_hardware(H200, folder, report=False)
    assert t.set_aside == [path] and t.malformed == [path] and t.unreadable == [], (t.set_aside, t.problems)
    folder, path = _tuning_folder(tmp_path, "")
    t = TuningTable.for_hardware(H200, folder, report=False)
    assert t.malformed == [path] and t.unreadable == [] and len(t.problems) == 1
    (folder / "h200.yaml").unlink()
    (folder / "h200.yaml").symlink_to(folder / "nowhere.yaml")     # cannot be read at all
    t = TuningTable.for_hardware(H200, folder, report=False)
    assert t.unreadable == [path] and t.malformed == [] and "not readable" in t.problems[0]


def test_list_factors_calls_a_malformed_sm_count_set_aside_as_malformed(tmp_path, monkeypatch, capsys):
    mdir = tmp_path / "m"
    shutil.copytree(SHIPPED, mdir)
    path = mdir / "tuning" / "h200.yaml"
    path.write_text(path.read_text(encoding="utf-8").replace("\nmultiprocessor_count: 132\n", "\nmultiprocessor_count: many\n"), encoding="utf-8")
    monkeypatch.setenv("EX_ENGINE_MANIFESTS", str(mdir))
    (tmp_path / "plugs").mkdir()
    cli_main(["list-factors", "--dir", str(tmp_path / "plugs"), "--hardware", "h200", "--no-probe"])
    out = capsys.readouterr().out
    assert f"tuning: {path} (for NVIDIA H200) set aside as malformed" in out, out
    assert "unreadable" not in out, out


def test_a_file_none_of_whose_tables_is_used_is_not_in_use(tmp_path):
    """With its only table never used (dim: nodim) the file was still the tuning in use
    (TuningTable.path, which list-factors prints): in_use says None then, path still names
    the file read; with the table in use, in_use is the file."""
    shipped = (SHIPPED / "tuning" / "h200.yaml").read_text(encoding="utf-8")
    assert "\n  dim: config\n" in shipped
    mdir = tmp_path / "m"
    shutil.copytree(SHIPPED, mdir)
    good = FactorRegistry(hardware="h200", manifests_dir=mdir)
    assert good.tuning.in_use == good.tuning.path == str(mdir / "tuning" / "h200.yaml")
    (mdir / "tuning" / "h200.yaml").write_text(shipped.replace("\n  dim: config\n", "\n  dim: nodim\n"), encoding="utf-8")
    reg = FactorRegistry(hardware="h200", manifests_dir=mdir)
    assert reg.tuning.path == str(mdir / "tuning" / "h200.yaml") and set(reg.tuning.refused) == {"moe_fused_gemm"}
    assert reg.tuning.in_use is None
    assert any("its table is never used" in n for n in reg.notes), reg.notes


def test_list_factors_header_names_what_was_wrong_with_the_tuning_files(tmp_path, monkeypatch, capsys):
    """list-factors' header said "1 unreadable file(s) set aside" for an empty (readable,
    malformed) tuning file of another name, and printed a file none of whose tables is used as
    the tuning in use (also in --json's tuning_file)."""
    mdir = tmp_path / "m"
    shutil.copytree(SHIPPED, mdir)
    monkeypatch.setenv("EX_ENGINE_MANIFESTS", str(mdir))
    plugs = tmp_path / "plugs"
    plugs.mkdir()
    args = ["list-factors", "--dir", str(plugs), "--hardware", "h200", "--no-probe"]
    shipped = (mdir / "tuning" / "h200.yaml").read_text(encoding="utf-8")
    (mdir / "tuning" / "h200.yaml").unlink()
    (mdir / "tuning" / "empty.yaml").write_text("")
    (mdir / "tuning" / "gone.yaml").symlink_to(mdir / "tuning" / "nowhere.yaml")
    cli_main(args)
    out = capsys.readouterr().out
    assert "(1 unreadable file(s) and 1 malformed file(s) set aside, see the notes)" in out, out
    (mdir / "tuning" / "empty.yaml").unlink()
    (mdir / "tuning" / "gone.yaml").unlink()
    path = mdir / "tuning" / "h200.yaml"
    path.write_text(shipped.replace("\n  dim: config\n", "\n  dim: nodim\n"), encoding="utf-8")
    cli_main(args)
    out = capsys.readouterr().out
    assert f"tuning: {path} (for NVIDIA H200): none of its tables is used" in out, out
    cli_main(args + ["--json"])
    assert json.loads(capsys.readouterr().out)["tuning_file"] is None
    path.write_text(shipped, encoding="utf-8")
    cli_main(args + ["--json"])
    assert json.loads(capsys.readouterr().out)["tuning_file"] == str(path)


def test_run_moe_names_a_missing_manifests_folder_first(tmp_path, monkeypatch, capsys):
    """EX_ENGINE_MANIFESTS naming no folder: `run moe` said the model list inside it was
    "malformed or unreadable (FileNotFoundError ...)"; it names the variable, as list-factors."""
    monkeypatch.setenv("EX_ENGINE_MANIFESTS", str(tmp_path / "nowhere"))
    assert cli_main(["run", "moe", "--tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert f"EX_ENGINE_MANIFESTS={tmp_path / 'nowhere'}: the folder" in err and "does not exist" in err, err
    assert "moe_models.yaml" not in err, err


# ------------------------------------------------------------- 5. YAML errors name the file
def test_yaml_syntax_errors_name_the_file_not_a_unicode_string(tmp_path):
    """A YAML syntax error in a manifest, a hardware profile or a tuning file pointed at
    "<unicode string>" (PyYAML's name for a str): the marks name the file."""
    from ex_engine import _yaml
    with pytest.raises(yaml.YAMLError, match=r'in "/some/where\.yaml", line 1, column 7'):
        _yaml.load("name: [x\n", name="/some/where.yaml")
    with pytest.raises(yaml.YAMLError, match='in "/some/where.yaml", position 6'):
        _yaml.load("name: \x01\n", name="/some/where.yaml")    # refused before parsing starts
    mdir = tmp_path / "mm"
    mdir.mkdir()
    text = (SHIPPED / "topk_softmax.yaml").read_text(encoding="utf-8")
    assert "\nname: topk_softmax\n" in text
    (mdir / "topk_softmax.yaml").write_text(text.replace("\nname: topk_softmax\n", "\nname: [topk_softmax\n"), encoding="utf-8")
    errors: dict = {}
    load_all(mdir, errors)
    msg = errors["topk_softmax"]
    assert f'in "{mdir / "topk_softmax.yaml"}", line' in msg and "<unicode string>" not in msg, msg
    profile = tmp_path / "hw.yaml"
    profile.write_text("name: [NVIDIA H200\n")
    with pytest.raises(FactorError, match=f'in "{profile}", line') as info:
        Hardware.from_profile(profile)
    assert "<unicode string>" not in str(info.value)
    folder, path = _tuning_folder(tmp_path, "device: [NVIDIA H200\n")
    t = TuningTable.for_hardware(H200, folder, report=False)
    assert f'in "{path}", line' in t.problems[0] and "<unicode string>" not in t.problems[0], t.problems


# ------------------------------------------------------------- 6. fused_add_rmsnorm's T
def test_fused_add_rmsnorm_takes_its_sizes_from_x(reg):
    """x (4, 64) with residual (5, 64) said "argument 'x': shape[0] = T: expected 5 (T=5 from
    residual), got 4": x, the in-place input and output, is checked first, as the input it is,
    so residual is named; all-int32 arguments name x, the first."""
    x, w = np.zeros((4, 64), np.float32), np.ones(64, np.float32)
    with pytest.raises(ShapeError, match=r"^fused_add_rmsnorm: argument 'residual': shape\[0\] = T: "
                                         r"expected 4 \(T=4 from x\), got 5$"):
        fused_add_rmsnorm(x, np.zeros((5, 64), np.float32), w, registry=reg)
    with pytest.raises(ShapeError, match=r"argument 'residual': shape\[1\] = H: expected 64 \(H=64 from x\)"):
        fused_add_rmsnorm(x, np.zeros((4, 63), np.float32), w, registry=reg)
    with pytest.raises(DTypeError, match="^fused_add_rmsnorm: argument 'x': dtype: expected"):
        fused_add_rmsnorm(x.astype(np.int32), np.zeros((4, 64), np.int32), w.astype(np.int32), registry=reg)
    r = np.ones((4, 64), np.float32)
    fused_add_rmsnorm(x, r, w, registry=reg)                # a valid call still runs
    assert np.allclose(x, 1.0, atol=1e-5)


# ------------------------------------------------------------- 7. a sparse tensor's layout
def test_a_sparse_or_nested_torch_tensor_is_a_layout_error():
    """topk_softmax(torch.randn(4, 16).to_sparse(), 2) raised DTypeError for its 'layout'
    rule: it is a LayoutError (a FactorError; still a DTypeError, as before, for code that
    caught that). A meta tensor stays a DeviceError."""
    torch = pytest.importorskip("torch")
    from ex_engine.arrays import TensorRef
    from ex_engine.errors import DeviceError
    reg = FactorRegistry(hardware="h200")
    with pytest.raises(LayoutError, match="'router_logits': layout: expected a dense .*sparse_coo") as info:
        topk_softmax(torch.randn(4, 16).to_sparse(), 2, registry=reg)
    assert isinstance(info.value, FactorError) and isinstance(info.value, DTypeError)
    with pytest.raises(LayoutError, match="'x': layout: .*nested"):
        TensorRef.of(torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "x")
    with pytest.raises(DeviceError) as info:
        topk_softmax(torch.empty(4, 16, device="meta"), 2, registry=reg)
    assert not isinstance(info.value, LayoutError)
