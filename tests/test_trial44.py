"""Session forty-four's fresh-user trial. Each test failed before its mend. CPU only."""
from __future__ import annotations

import re
import warnings

import yaml

from ex_engine.tuning import TuningTable

from .conftest import ROOT


# ------------------------------------------------- 1. the README's tuning-file example
def _readme_tuning_example() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("A factor of your own can have a table too")
    block = re.search(r"```yaml\n(.*?)```", text[start:], re.S)
    assert block, "no yaml example after 'A factor of your own can have a table too'"
    return block.group(1)


def test_readme_tuning_example_is_the_format_the_loader_reads(tmp_path):
    """The README said to add a table 'under `factors:`', a level the format does not have: the
    whole file was set aside as malformed. Its example (less moe_fused_gemm's elided table)
    loads as a top-level table."""
    example = _readme_tuning_example()
    assert "factors:" not in example.split("#")[0]
    body = "\n".join(ln for ln in example.splitlines()
                     if not ln.startswith("moe_fused_gemm:") and ln.strip() != "...")
    assert "my_op" in yaml.safe_load(body)
    (tmp_path / "h200.yaml").write_text(body, encoding="utf-8")
    t = TuningTable.for_hardware("h200", folder=tmp_path)
    assert t.problems == [] and t.path == str(tmp_path / "h200.yaml"), t.problems
    assert t.factors["my_op"].lookup({"N": 4096}) == 2   # large
    assert t.factors["my_op"].lookup({"N": 4096, "T": 9}) == 2


def test_a_factors_level_is_named_in_the_malformed_note(tmp_path):
    """Tables put under `factors:` (what the README said) still set the file aside, and the note
    says where the tables go."""
    (tmp_path / "h200.yaml").write_text(
        "device: NVIDIA H200\nmultiprocessor_count: 132\nfactors:\n  my_op:\n    dim: block\n"
        "    key: [N]\n    values: {auto: 0}\n    shapes: [{N: 1, by_T: [[0, auto]]}]\n", encoding="utf-8")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = TuningTable.for_hardware("h200", folder=tmp_path)
    assert t.set_aside == [str(tmp_path / "h200.yaml")] and len(t.problems) == 1
    assert "not an entry under `factors:`" in t.problems[0], t.problems


# ------------------------------------------------- 2. gpu_check.sh on a machine with no GPU
def _gpu_check(tmp_path, *stages, fake_cupy_count=None):
    """scripts/gpu_check.sh STAGES with no GPU (CUDA_VISIBLE_DEVICES=''); with fake_cupy_count,
    a stand-in cupy whose getDeviceCount() gives that number and an nvidia-smi that succeeds
    (CuPy imports, nvidia-smi answers, yet no device)."""
    import os
    import subprocess
    import sys
    out, path, pythonpath = tmp_path / "out", [os.path.dirname(sys.executable)], []
    if fake_cupy_count is not None:
        fake = tmp_path / "fake"
        (fake / "cupy" / "cuda").mkdir(parents=True)
        (fake / "cupy" / "__init__.py").write_text("__version__ = '0.fake'\nfrom . import cuda\n")
        (fake / "cupy" / "cuda" / "__init__.py").write_text(
            f"class runtime:\n    @staticmethod\n    def getDeviceCount():\n        return {fake_cupy_count}\n")
        (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'name, driver_version'\n")
        (fake / "nvidia-smi").chmod(0o755)
        path.insert(0, str(fake))
        pythonpath.append(str(fake))
    env = {**os.environ, "OUT": str(out), "CUDA_VISIBLE_DEVICES": "",
           "PATH": os.pathsep.join(path + [os.environ.get("PATH", "")]),
           "PYTHONPATH": os.pathsep.join(pythonpath + [os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *stages], capture_output=True,
                          text=True, encoding="utf-8", env=env, timeout=300)


def test_gpu_check_stops_after_setup_without_a_gpu(tmp_path):
    """Setup's device check failed, and the script went on to run pytest and `run moe --model
    all` on the CPU. It stops there now, naming the stages it did not run."""
    r = _gpu_check(tmp_path, "setup", "tests", "run")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "gpu_check.sh: no CUDA device" in r.stderr and "stages that need one: tests run" in r.stderr
    assert "=== GPU tests" not in r.stdout and "=== run moe" not in r.stdout, r.stdout
    assert not (tmp_path / "out" / "gpu_tests.log").exists()
    # a Python without CuPy said so in a ModuleNotFoundError traceback (a fresh user's trial)
    assert "Traceback" not in r.stderr, r.stderr
    try:
        import cupy  # noqa: F401
    except ImportError:
        assert "gpu_check.sh: setup: cupy is not installed for " in r.stderr, r.stderr


def test_gpu_check_names_a_broken_cupy_in_one_line(tmp_path):
    """CuPy installed but broken raises ImportError('CuPy is not correctly installed.\\n...') with
    no module name: the setup printed that whole message and 'is not installed'. Now one line
    that says an import failed and quotes the error's first line."""
    import os
    import subprocess
    import sys
    fake = tmp_path / "fake" / "cupy"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise ImportError("CuPy is not correctly installed.\\n\\noriginal error: x")\n')
    env = {**os.environ, "OUT": str(tmp_path / "out"), "CUDA_VISIBLE_DEVICES": "",
           "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "fake"), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "setup"], capture_output=True, text=True,
                       encoding="utf-8", env=env, timeout=300)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("gpu_check.sh: setup:")]
    assert len(lines) == 1 and lines[0].startswith("gpu_check.sh: setup: an import failed for "), r.stderr
    assert lines[0].endswith(": CuPy is not correctly installed."), r.stderr
    assert "Traceback" not in r.stderr and "original error" not in r.stderr and r.returncode == 1, r.stderr


def test_gpu_check_stops_when_cupy_imports_but_sees_no_device(tmp_path):
    r = _gpu_check(tmp_path, "setup", "selftest", fake_cupy_count=0)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "no CUDA device: cupy.cuda.runtime.getDeviceCount() = 0" in r.stderr, r.stderr
    assert "stages that need one: selftest" in r.stderr and "=== scripts/" not in r.stdout


def test_gpu_check_without_a_gpu_stage_goes_on(tmp_path):
    """Stages that need no GPU (build, list) still run after a failed setup; status 1."""
    r = _gpu_check(tmp_path, "setup", "list")
    assert r.returncode == 1 and "=== list-factors" in r.stdout and "done: status 1" in r.stdout, r.stdout
    assert "no CUDA device (setup" not in r.stderr


# ------------------------------------------------- 4. UnsupportedModelError is a FactorError
def test_unsupported_model_error_is_a_factor_error_and_a_value_error():
    """patch_moe's error was a ValueError only: `except FactorError` (every other ex_engine
    error) let it through. Needs torch (the module imports it), not transformers."""
    import pickle

    import pytest
    pytest.importorskip("torch")
    from ex_engine.errors import FactorError
    from ex_engine.integrations.transformers import UnsupportedModelError
    assert issubclass(UnsupportedModelError, FactorError) and issubclass(UnsupportedModelError, ValueError)
    err = pickle.loads(pickle.dumps(UnsupportedModelError("model.layers.0.mlp: x")))
    assert type(err) is UnsupportedModelError and str(err) == "model.layers.0.mlp: x"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "| `UnsupportedModelError` | `patch_moe`" in readme


# ------------------------------------------------- 6. the first line names a profile as such
def test_list_factors_and_verify_say_the_hardware_is_a_profile(tmp_path, capsys, monkeypatch):
    """Without a GPU, 'hardware: NVIDIA H200 (sm_90, 132 SMs, warp 32; profile h200)' read as if an
    H200 had been detected. A live GPU's line is unchanged (test_gpu)."""
    from ex_engine import hardware as hwmod
    from ex_engine.cli import main
    monkeypatch.setattr(hwmod.Hardware, "detect", classmethod(lambda cls, *a, **k: None))
    empty = tmp_path / "none"
    empty.mkdir()
    main(["list-factors", "--dir", str(empty), "--no-probe"])
    assert capsys.readouterr().out.splitlines()[0] == \
        "hardware: NVIDIA H200 (no GPU here: profile h200; sm_90, 132 SMs, warp 32)"
    main(["list-factors", "--dir", str(empty), "--no-probe", "--hardware", "h100"])
    assert capsys.readouterr().out.splitlines()[0] == ("hardware: NVIDIA H100 80GB HBM3 (profile h100 from "
                                                       "--hardware, not a detected GPU; sm_90, 132 SMs, warp 32)")
    main(["verify", "--dir", str(empty), "--no-probe", "--in-process"])
    assert capsys.readouterr().out.splitlines()[0] == "hardware: NVIDIA H200 (no GPU here: profile h200)"


# ------------------------------------------------- 7. a missing manifest names the folders searched
def test_a_missing_manifest_names_every_folder_searched(tmp_path):
    """'expected x.yaml beside the library or in the manifests folder, found none' named no folder."""
    import os

    from ex_engine import FactorRegistry

    from .conftest import build_plugin
    a, b, plugins = tmp_path / "ma", tmp_path / "mb", tmp_path / "plugins"
    a.mkdir()
    b.mkdir()
    build_plugin(plugins, manifest=False)
    reg = FactorRegistry.load(plugins, hardware="h200", manifests_dir=f"{a}{os.pathsep}{b}")
    assert reg.plugins[0].reason == (f"manifest: expected host_scale.yaml beside the library (in {plugins}) "
                                     f"or in the manifests folders {a}, {b}, found none"), reg.plugins[0].reason


# ------------------------------------------------- 8. a negative manifest id
def test_a_manifest_with_a_negative_id_is_malformed(tmp_path):
    """The ABI's factor ids are >= 0; a manifest of id: -5 loaded (only a library claiming it was
    refused, by the registry's factor id check)."""
    import pytest

    from ex_engine.errors import FactorError
    from ex_engine.manifest import Manifest, load_all
    text = (ROOT / "tests" / "plugins" / "host_scale.yaml").read_text(encoding="utf-8")
    assert re.search(r"^id: 1100$", text, re.M)
    for bad in ("-5", "-1"):
        f = tmp_path / bad / "host_scale.yaml"
        f.parent.mkdir()
        f.write_text(re.sub(r"^id: 1100$", f"id: {bad}", text, flags=re.M), encoding="utf-8")
        with pytest.raises(FactorError, match=rf"host_scale.yaml: id: expected an integer >= 0 .*got {bad}$"):
            Manifest.load(f)
        errors: dict = {}
        assert load_all(f.parent, errors) == {} and "id: expected an integer >= 0" in errors["host_scale"]
    f = tmp_path / "zero.yaml"
    f.write_text(re.sub(r"^name: host_scale$", "name: zero", re.sub(r"^id: 1100$", "id: 0", text, flags=re.M),
                        flags=re.M), encoding="utf-8")
    assert Manifest.load(f).id == 0
