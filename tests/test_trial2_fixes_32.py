"""Defects a second new-user trial found (session thirty-two): tune_moe taking --margin nan;
bench_moe's JSON not recording --sets; README's environment table missing EX_ENGINE_CACHE and
EX_COMMIT, and its rule for a bad switch value wrong for EX_MOE_SM90_RASTER_N; StaticDecoder.step
taking bool ids with plain ValueErrors; run_moe / MoELayer.reference / load_models raising raw
Python errors; host_moe --help without defaults or stages; ab_moe's '(default: )', an empty
--json called a folder, a --factors file called a missing folder; hf_moe_generate ignoring
--stock-graph on CPU silently and printing '0.00 B params'; patch_moe's GPU advice for a CPU
model. (table_moe's refusal of other tools' JSON is in test_bench_tools.py.)"""
import ast
import re
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT

PY = sys.executable


def script(path, *args, timeout=120):
    return subprocess.run([PY, str(ROOT / path), *args], capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------------ 2. tune_moe --margin nan
@pytest.mark.parametrize("margin", ["nan", "inf", "-inf", "-1"])
def test_tune_moe_refuses_a_margin_that_is_not_a_finite_fraction(margin):
    """`--margin nan` passed `margin < 0` and turned the margin test off (every comparison with
    nan is False): the fastest forced configuration was recorded even when slower than auto."""
    r = script("benchmarks/tune_moe.py", f"--margin={margin}")
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert f"tune_moe: --margin: expected a finite fraction >= 0, got {float(margin)}" in r.stderr, r.stderr


# ------------------------------------------------------------ 3. bench_moe's meta records sets
def test_bench_moe_json_records_sets_in_its_meta():
    """bench_moe.py --json wrote no 'sets', so table_moe.py printed "how many: not recorded" for
    every file (bench_moe needs a GPU to run: the run_meta call is read from the source)."""
    tree = ast.parse((ROOT / "benchmarks" / "bench_moe.py").read_text(encoding="utf-8"))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "run_meta"]
    assert len(calls) == 1
    kw = {k.arg: ast.unparse(k.value) for k in calls[0].keywords}
    assert kw.get("sets") == "args.sets", kw


# ------------------------------------------------------------------ 4. README's environment table
def _readme_table():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import ab_moe
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return ab_moe


def test_readme_environment_table_lists_every_variable_the_python_reads():
    """EX_ENGINE_CACHE (ex_engine/verify.py) and EX_COMMIT (benchmarks/_timing.py) were read but
    missing from the table; ab_moe still treats only load-time rows as a folder's settings."""
    ab_moe = _readme_table()
    table = ab_moe.readme_variables()
    read = set()
    for f in [*(ROOT / "ex_engine").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py")]:
        # (os.environ, or _paths.env_value, which reads a value of whitespace as unset)
        read |= set(re.findall(r'(?:environ(?:\.get\(|\[)|env_value\()\s*"(EX_[A-Z0-9_]+)"', f.read_text(encoding="utf-8")))
    assert {"EX_ENGINE_CACHE", "EX_COMMIT"} <= read
    assert read <= set(table), sorted(read - set(table))
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    row = next(line for line in text.splitlines() if line.startswith("| `EX_ENGINE_CACHE"))
    assert "~/.cache/ex_engine/" in row and "verified.json" in row
    row = next(line for line in text.splitlines() if line.startswith("| `EX_COMMIT"))
    assert "git describe --always --dirty" in row
    cfg = ab_moe.parse_cfg
    assert ab_moe.variable_problems([cfg("a=factors:EX_COMMIT=x,EX_ENGINE_CACHE=/tmp/c"), cfg("b=factors")],
                                    table) == []


def test_readme_rule_for_a_bad_switch_value_holds_for_every_switch():
    """README said a bad value keeps "the default (on, for a switch)"; EX_MOE_SM90_RASTER_N is an
    on/off switch that defaults to off (env_choice(..., kOffOn, 2, 0)): the rule names it."""
    src = "\n".join(f.read_text(encoding="utf-8") for f in (ROOT / "factors").glob("*.cu*"))
    off = set(re.findall(r'env_choice\("(EX_[A-Z0-9_]+)", kOffOn, 2, 0\)', src))
    on = set(re.findall(r'env_switch\("(EX_[A-Z0-9_]+)"\)', src))
    assert "EX_MOE_SM90_RASTER_N" in off and on
    text = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    rule = text[text.index("An on/off switch takes"):][:400]
    assert "(on, for a switch)" not in rule
    for name in off:
        assert f"off for `{name}=1`" in rule, rule
    table = _readme_table().readme_variables()
    for name in on:   # each on-by-default switch's row names its off value
        line = next(li for li in (ROOT / "README.md").read_text(encoding="utf-8").splitlines() if li.startswith(f"| `{name}"))
        assert f"`{name}=0`" in line, line
    assert "on for those written `=0`" in rule and set(table) >= on | off


# ------------------------------------------------------------------ 5. StaticDecoder.step's checks
def test_static_decoder_step_refuses_bool_and_names_tokens_as_prefill_does():
    """step(torch.tensor([True])) ran as token 1, and a wrong count or dtype raised a plain
    ValueError ("step: tokens: ..."), where its docstring promises ArgumentError naming tokens
    and prefill refuses bool ids."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from ex_engine.errors import ArgumentError
    from ex_engine.integrations import transformers as hf
    from tests.test_integrations import tiny_model
    m = tiny_model("qwen3_moe")
    d = hf.StaticDecoder(m, batch_size=1, max_len=8)
    d.prefill(torch.zeros(1, 3, dtype=torch.long))
    cases = [(torch.tensor([True]), r"dtype: expected integer token ids \(e.g. torch.long\), got torch.bool"),
             (torch.tensor([1.0]), r"dtype: .*got torch.float32"),
             (torch.tensor([1, 2]), r"shape: expected 1 token ids \(batch_size\), got \(2,\)")]
    for bad, msg in cases:
        with pytest.raises(ArgumentError, match=r"^StaticDecoder.step: argument 'tokens': " + msg):
            d.step(bad)
    assert d.next_pos == 3   # nothing refused moved the cache
    assert d.step(torch.tensor([1])).shape[0] == 1


# ------------------------------------------------------------------ 6. moe_layer's named errors
def test_run_moe_names_an_unknown_model_of_any_type_and_takes_numpy_integers():
    """run_moe(['x'], 1) was a TypeError (unhashable list) where the docstring promises
    FactorError; run_moe(model, np.int64(1)) was refused though MoELayer takes NumPy integers."""
    from ex_engine import FactorError
    from ex_engine import moe_layer as M
    for bad in (["x"], None, 3):
        with pytest.raises(FactorError, match=r"^model .*: unknown; expected one of \["):
            M.run_moe(bad, 1, echo=lambda *a: None)
    r = M.run_moe("olmoe-1b-7b", np.int64(1), seed=np.int32(0), repeat=np.int64(1), echo=lambda *a: None)
    assert r["ok"]
    with pytest.raises(FactorError, match=r"run_moe: tokens: expected an int >= 1, got True"):
        M.run_moe("olmoe-1b-7b", True)


def test_moe_layer_reference_names_bad_weights_and_ids():
    """Float ids, ids or weights of the wrong width, or a list of weights raised IndexError /
    AttributeError from inside the float64 reference."""
    from ex_engine import moe_layer as M
    from ex_engine.errors import ArgumentError, DTypeError, ShapeError
    L = M.MoELayer(M.MoEShape("x", 64, 32, 8, 2, True))
    x = L.hidden_states(3)
    _, w, ids, _ = L.forward(x)
    cases = [((x, w, ids.astype(np.float32)), DTypeError, r"'topk_ids': dtype: expected integer expert ids, got float32"),
             ((x, w, ids.astype(bool)), DTypeError, r"'topk_ids': dtype: .*got bool"),
             ((x, w[:, :1], ids), ShapeError, r"'topk_weights': shape \(T, K\): expected \(3, 2\), got \(3, 1\)"),
             ((x, w, ids[:, :1]), ShapeError, r"'topk_ids': shape \(T, K\): expected \(3, 2\), got \(3, 1\)"),
             ((x, [[1.0]], ids), ArgumentError, r"'topk_weights': type: expected an array of numpy \(T, K\), got list")]
    for args, err, msg in cases:
        with pytest.raises(err, match=r"^MoELayer.reference: argument " + msg):
            L.reference(*args)
    assert L.reference(x, w, ids).shape == (3, 64)


def test_load_models_refuses_an_empty_path():
    """load_models('') loaded the default file (`path or default`): None is the default."""
    from ex_engine import moe_layer as M
    from ex_engine.errors import ArgumentError
    with pytest.raises(ArgumentError, match=r"^load_models: argument 'path': .*non-empty path, got ''"):
        M.load_models("")
    assert "olmoe-1b-7b" in M.load_models(None)


# ------------------------------------------------------------------ 7. host_moe --help
def test_host_moe_help_shows_defaults_and_the_stage_list():
    """--help showed no defaults and only the docstring's first line, not its table of stages."""
    r = script("benchmarks/host_moe.py", "--help")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    for want in ("(default: qwen3-30b-a3b)", "(default: 1)", "(default: 3)",
                 "describe x6 TensorRef.of on the six arrays", "cffi no-op", "new_empty"):
        assert want in text, (want, r.stdout)
    assert "  call, out=     the same with a preallocated out" in r.stdout   # as written


# ------------------------------------------------------------------ 8. ab_moe and the shared checks
def test_help_says_none_for_an_empty_list_default():
    r = script("benchmarks/ab_moe.py", "--help")
    text = " ".join(r.stdout.split())
    assert r.returncode == 0 and "(default: )" not in text and "checks are still reported (default: none)" in text, text


def test_an_empty_output_path_is_called_empty_not_a_folder(tmp_path):
    from ex_engine._scripts import output_file_problem
    assert output_file_problem("--json", "") == "--json: expected a file path, got an empty value"
    assert output_file_problem("--json", str(tmp_path)).endswith("is a folder; expected a file path")
    r = script("benchmarks/ab_moe.py", "--cases", "olmoe-1b-7b:1", "--configs", "a=factors", "b=factors",
               "--json", "")
    assert r.returncode == 2 and "ab_moe: --json: expected a file path, got an empty value" in r.stderr, r.stderr


@pytest.mark.parametrize("tool, args", [("benchmarks/bench_moe.py", []), ("benchmarks/host_moe.py", []),
                                        ("scripts/kernel_times_moe.py", ["--cases", "olmoe-1b-7b:1"]),
                                        ("benchmarks/tune_moe.py", None)])
def test_a_factors_file_is_called_a_file_not_a_missing_folder(tool, args, monkeypatch):
    """`--factors README.md` said "folder 'README.md' does not exist": it exists, as a file."""
    from ex_engine.moe_layer import case_problems, load_models
    if args is None:   # tune_moe has no --factors: the shared check, through case_problems
        monkeypatch.chdir(ROOT)   # 'README.md' is the checkout's, as the tools' cwd=ROOT below
        p = case_problems(load_models(), ["olmoe-1b-7b"], [1], "README.md")
        assert p == ["--factors: 'README.md' is a file, not a folder; expected a plugin folder"], p
        assert case_problems(load_models(), ["olmoe-1b-7b"], [1], "/nonexistent") == \
            ["--factors: folder '/nonexistent' does not exist"]
        return
    r = subprocess.run([PY, str(ROOT / tool), *args, "--factors", "README.md"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    name = tool.split("/")[1][:-3]
    assert r.returncode == 2, r.stderr
    assert f"{name}: --factors: 'README.md' is a file, not a folder; expected a plugin folder\n" in r.stderr, r.stderr
    assert "does not exist" not in r.stderr


def test_ab_moe_calls_a_config_file_a_file():
    r = subprocess.run([PY, str(ROOT / "benchmarks/ab_moe.py"), "--cases", "olmoe-1b-7b:1", "--configs",
                        "a=factors", "b=README.md", "c=/nonexistent"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 2
    assert "ab_moe: config b: 'README.md' is a file, not a folder; expected a plugin folder" in r.stderr, r.stderr
    assert "ab_moe: config c: folder '/nonexistent' does not exist" in r.stderr, r.stderr


# ------------------------------------------------------------------ 9. hf_moe_generate on the CPU
def test_hf_moe_generate_prints_a_parameter_count_that_shows():
    """A tiny model printed '0.00 B params'."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import hf_moe_generate as g
    finally:
        sys.path.remove(str(ROOT / "examples"))
    assert [g.params_text(n) for n in (30_532_122_624, 2_457_600, 123_456, 0)] == \
        ["30.53 B", "2.46 M", "123,456", "0"]


def test_hf_moe_generate_says_stock_graph_needs_cuda_on_the_cpu(tmp_path):
    """`--stock-graph --device cpu` ran without the variant and without a word."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    r = subprocess.run([PY, "examples/hf_moe_generate.py", "--tiny", "--device", "cpu", "--stock-graph",
                        "--model", "qwen3", "--tokens", "5"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    notes = [li for li in r.stdout.splitlines() if "--stock-graph" in li]
    assert notes == ["[hf_moe] note: --stock-graph needs a CUDA device (a CUDA graph), got --device cpu: "
                     "stock_grouped_mm_graph is not run"], r.stdout
    assert " B params" not in r.stdout and " params on cpu" in r.stdout


# ------------------------------------------------------------------ 10. patch_moe twice
def test_patch_moe_twice_advises_patching_once_not_a_gpu():
    """A second patch_moe of a CPU model advised "patch a model that is fully on one GPU, once"."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from ex_engine import FactorRegistry
    from ex_engine.integrations import transformers as hf
    from tests.test_integrations import tiny_model
    reg = FactorRegistry(hardware="h200")
    m = tiny_model("qwen3_moe")
    handle = hf.patch_moe(m, registry=reg)
    with pytest.raises(hf.UnsupportedModelError,
                       match=r"\(patched by ex_engine\); patch each model once \(undo\(\) its handle to patch it again\)$"):
        hf.patch_moe(m, registry=reg)
    handle.undo()
    hf.patch_moe(m, registry=reg).undo()   # after undo() it patches again
