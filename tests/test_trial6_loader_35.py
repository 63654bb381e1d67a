"""Session 35's plugin-author trial of the loader (helpers, no GPU): each defect it found has a
test here."""
import numpy as np
import pytest

from ex_engine import FactorRegistry
from ex_engine.errors import FactorError
from ex_engine.manifest import Manifest
from tests.conftest import ROOT, build_plugin

HOST_SCALE_YAML = (ROOT / "tests" / "plugins" / "host_scale.yaml").read_text()
OUT = "output: {name: out, shape: [N], dtype: [float32]}"
IN = "input: {name: x, shape: [N], dtype: [float32]}"


def _manifest(tmp_path, text, stem="host_scale"):
    p = tmp_path / f"{stem}.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("old,new,field", [
    (OUT, "output: {name: out, shape: [N], dtype: [float32], role: input}", "output: role"),
    (OUT, "output: {name: out, shape: [N], dtype: [float32], role: inout}", "output: role"),
    (OUT, "output: {name: out, shape: [N], dtype: [float32], role: workspace}", "output: role"),
    (IN, "input: {name: x, shape: [N], dtype: [float32], role: output}", "input: role"),
    (IN, "input: {name: x, shape: [N], dtype: [float32], role: inout}", "input: role"),
])
def test_the_output_and_input_keep_their_roles(tmp_path, old, new, field):
    """output: {..., role: input} turned off the checks of what the kernel writes: a read-only
    memmap given as out was written by the kernel (SIGSEGV). The role of output and input is
    the one their place in the ABI gives them."""
    path = _manifest(tmp_path, HOST_SCALE_YAML.replace(old, new))
    with pytest.raises(FactorError, match=rf"manifest {path}: {field}: expected"):
        Manifest.load(path)


def test_a_read_only_output_is_refused_not_written(tmp_path):
    build_plugin(tmp_path)
    (tmp_path / "host_scale.yaml").write_text(HOST_SCALE_YAML.replace(
        OUT, "output: {name: out, shape: [N], dtype: [float32], role: input}"))
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    p = reg.plugins[0]
    assert p.status == "rejected" and "host_scale.yaml: output: role: expected output" in p.reason, p.reason
