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
