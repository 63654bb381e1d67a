"""Session 57's docs audit (a helper compared README, docs/ and every --help with what the
commands do, on a CPU machine): the findings that were behaviour or help text, each kept."""
import subprocess
import sys
from pathlib import Path

from ex_engine import FactorRegistry, abi
from tests.conftest import build_plugin

ROOT = Path(__file__).resolve().parents[1]


def test_a_reserved_id_is_refused_with_the_range_a_third_party_factor_may_take(tmp_path):
    """Id 0 (topk_softmax's) taken by host_scale read 'expected an id >= 0 (...), got 0: id 0 is
    reserved': the id met the rule it named. The message names the rule that failed: an id of
    1024 or more for a factor of another name."""
    build_plugin(tmp_path, defines={"FACTOR_ID": 0})
    p = FactorRegistry.load(tmp_path, hardware="h200").plugins[0]
    assert p.status == "rejected", p.reason
    first = abi.FACTOR_BUILTIN_LAST + 1
    assert p.reason.startswith(f"factor id: expected an id of {first} or more for a factor named 'host_scale'"), p.reason
    assert "got 0: id 0 is reserved for ex_engine's 'topk_softmax'" in p.reason, p.reason
    assert "expected an id >= 0" not in p.reason, p.reason


def test_a_negative_id_still_names_the_non_negative_rule(tmp_path):
    build_plugin(tmp_path, defines={"FACTOR_ID": -5})
    p = FactorRegistry.load(tmp_path, hardware="h200").plugins[0]
    assert p.status == "rejected" and "expected an id >= 0" in p.reason and "got -5" in p.reason, p.reason


def _help(*args: str) -> str:
    r = subprocess.run([sys.executable, *args, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    return " ".join(r.stdout.split())


def test_the_selftest_help_names_every_decode_mode_it_accepts():
    """gpu_moe_selftest.py accepted EX_MOE_DECODE_CONFIG=gridwait; its help left it out."""
    import re
    src = (ROOT / "scripts" / "gpu_moe_selftest.py").read_text(encoding="utf-8")
    modes = re.search(r"known_modes = \(([^)]*)\)", src).group(1)
    text = _help("scripts/gpu_moe_selftest.py")
    for mode in re.findall(r'"(\w+)"', modes):
        assert mode in text, mode


def test_hardware_help_says_what_no_gpu_prints():
    text = _help("-m", "ex_engine.cli", "hardware")
    assert "null where no GPU is visible" in text and "exit status 0" in text


def test_list_factors_help_says_the_checks_stop_at_the_first_failure_and_what_exit_does():
    text = _help("-m", "ex_engine.cli", "list-factors")
    assert "up to its first failure" in text and "every check" not in text
    assert "its own status, even 0" in text


# ---- a plugin author's trial (session 57): manifest holes, notes and messages -----------------
BASE = (ROOT / "tests" / "plugins" / "host_scale.yaml").read_text(encoding="utf-8")


def _manifest_problem(tmp_path, change) -> str:
    import pytest
    from ex_engine import FactorError
    from ex_engine.manifest import Manifest
    p = tmp_path / "m.yaml"
    p.write_text(change(BASE), encoding="utf-8")
    with pytest.raises(FactorError) as exc:
        Manifest.load(p)
    return str(exc.value)


def test_a_shape_size_the_kernel_never_receives_is_refused(tmp_path):
    """out: [M] beside dims [N] loaded, verify passed (test shapes gave M = N), and a call
    with out shorter than x was written past out's end: the kernel learns only N."""
    msg = _manifest_problem(tmp_path, lambda t: t.replace("output: {name: out, shape: [N]",
                                                          "output: {name: out, shape: [M]"))
    assert "output (out): shape: size M: expected a size the kernel receives" in msg, msg
    msg = _manifest_problem(tmp_path, lambda t: t.replace("shape: [1], dtype: [float32], role: input",
                                                          "shape: [2*M], dtype: [float32], role: input"))
    assert "aux[0] (alpha): shape: size M" in msg, msg


def test_a_shape_size_tied_to_a_dim_by_a_constraint_loads(tmp_path):
    from ex_engine.manifest import Manifest
    p = tmp_path / "m.yaml"
    p.write_text(BASE.replace("output: {name: out, shape: [N]", "output: {name: out, shape: [M]")
                 .replace("- {N: 7}", "- {N: 7, M: 7}") + 'constraints: ["M == N"]\n', encoding="utf-8")
    assert Manifest.load(p).dims == ["N"]


def test_a_float_parameter_passed_as_a_dim_needs_its_bits(tmp_path):
    """{param: alpha} without encode: f64_bits made bind pass int(2.5) = 2 to the kernel."""
    def change(t):
        return (t.replace("dims: [N]", "dims: [N, beta]") + "params: {beta: {type: float, default: 1.0}}\n"
                + "dim_sources: {beta: {param: beta}}\n")
    msg = _manifest_problem(tmp_path, change)
    assert "dim_sources: beta: param beta: expected encode: f64_bits for a float parameter" in msg, msg
    from ex_engine.manifest import Manifest
    p = tmp_path / "ok.yaml"
    p.write_text(change(BASE).replace("{param: beta}", "{param: beta, encode: f64_bits}"), encoding="utf-8")
    Manifest.load(p)
    p.write_text(change(BASE).replace("type: float, default: 1.0", "type: int, default: 1"), encoding="utf-8")
    Manifest.load(p)   # an int parameter passes as it is


def test_a_dim_named_like_a_parameter_without_its_source_names_the_source(tmp_path):
    base = lambda t: t.replace("dims: [N]", "dims: [N, beta]") + "params: {beta: {type: int, default: 1}}\n"
    msg = _manifest_problem(tmp_path, base)
    assert msg.endswith("dim_sources: beta: expected a source for the dim beta (e.g. {param: beta}: the "
                        "parameter of that name), got no entry"), msg
    msg = _manifest_problem(tmp_path, lambda t: base(t).replace("params: {beta:", "params: {gamma: {type: int, default: 2}, beta:")
                            + "dim_sources: {beta: {param: gamma}}\n")
    assert "dim_sources: beta: param: expected the parameter 'beta'" in msg and "got str 'gamma'" in msg, msg


def test_a_host_library_whose_manifest_says_device_is_noted(tmp_path):
    build_plugin(tmp_path)
    (tmp_path / "host_scale.yaml").write_text(BASE.replace("memory: host\n", ""), encoding="utf-8")
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    p = reg.plugins[0]
    gpu = [c for c in p.checks if c.name == "gpu code"]
    assert gpu and gpu[0].warn and "needs memory: host" in gpu[0].detail, [str(c) for c in p.checks]
    assert any(n.startswith("host_scale.so: gpu code: warning") for n in reg.notes), reg.notes


def test_a_factor_lost_to_another_on_its_id_is_noted(tmp_path):
    build_plugin(tmp_path, defines={"FACTOR_ID": 1040})
    build_plugin(tmp_path, stem="other_scale", defines={"FACTOR_ID": 1040, "NAME": '"other_scale"',
                                                         "VERSION": '"0.1.0"'})
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    lost = [p for p in reg.plugins if p.status == "rejected"]
    assert [p.name for p in lost] == ["other_scale"], [(p.name, p.status, p.reason) for p in reg.plugins]
    notes = [n for n in reg.notes if n.startswith("factor id 1040:")]
    assert len(notes) == 1 and "'other_scale' is rejected" in notes[0], reg.notes
    build_plugin(tmp_path / "more", stem="third_scale", defines={"FACTOR_ID": 1041, "NAME": '"third_scale"'})
    reg.load_folder(tmp_path)          # loaded again: the note neither repeats nor goes
    reg.load_folder(tmp_path / "more")  # another folder's load keeps it too
    assert len([n for n in reg.notes if n.startswith("factor id 1040:")]) == 1, reg.notes


def _load_text(tmp_path, text):
    from ex_engine.manifest import Manifest
    p = tmp_path / "t.yaml"
    p.write_text(text, encoding="utf-8")
    return Manifest.load(p)


def test_a_tie_through_a_dim_bind_may_not_know_is_no_tie(tmp_path):
    """A review of the rule: 'M == beta' (a param dim), 'M == dt' (a dtype code) or a chain
    through a size only an optional array gives loaded, and bind skipped those constraints
    (one side unknown), so out of 3 elements beside x of 1000 passed."""
    import pytest
    from ex_engine import FactorError
    out_m = BASE.replace("output: {name: out, shape: [N]", "output: {name: out, shape: [M]").replace(
        "- {N: 7}", "- {N: 7, M: 7}")
    cases = [
        out_m.replace("dims: [N]", "dims: [N, beta]") + "params: {beta: {type: int, default: 7}}\n"
        "dim_sources: {beta: {param: beta}}\nconstraints: [\"M == beta\"]\n",
        out_m.replace("dims: [N]", "dims: [N, dt]") + "dim_sources: {dt: {dtype_of: x}}\nconstraints: [\"M == dt\"]\n",
        out_m.replace("role: input}", "role: input}\n  - {name: o, shape: [P], dtype: [float32], optional: true}")
        + "constraints: [\"M == P\", \"P == N\"]\n",
    ]
    for text in cases:
        with pytest.raises(FactorError, match=r"output \(out\): shape: size M: expected a size the kernel receives"):
            _load_text(tmp_path, text)


def test_sizes_pinned_to_a_number_and_workspace_shapes_still_load(tmp_path):
    text = BASE.replace("shape: [1], dtype: [float32], role: input", "shape: [S], dtype: [float32], role: input")
    _load_text(tmp_path, text.replace("- {N: 7}", "- {N: 7, S: 1}") + "constraints: [\"S == 1\"]\n")
    ws = (ROOT / "tests" / "plugins" / "host_scale_ws.yaml").read_text(encoding="utf-8")
    assert "role: workspace" in ws
    import re
    ws = re.sub(r"(\{name: \w+, )(?:shape: \[[^\]]*\], )?(.*role: workspace)", r"\1shape: [W], \2", ws)
    assert "shape: [W], role: workspace" in ws
    _load_text(tmp_path, ws)


def test_a_dim_source_of_an_odd_type_is_a_manifest_error_not_a_crash(tmp_path):
    import pytest
    from ex_engine import FactorError
    text = BASE.replace("dims: [N]", "dims: [N, b]") + "params: {beta: {type: int, default: 1}}\n" \
        "dim_sources: {b: {param: [beta]}}\n"
    with pytest.raises(FactorError, match=r"dim_sources: b: param: expected one of \['beta'\]"):
        _load_text(tmp_path, text)
