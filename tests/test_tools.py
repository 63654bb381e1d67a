"""The benchmark and example scripts refuse a bad output destination before any work (a run's
measurements were lost at its end), on a machine without a GPU or PyTorch too."""
import os
import subprocess
import sys

import pytest

from ex_engine.moe_layer import output_file_problem
from tests.conftest import ROOT

SCRIPTS = [
    ["benchmarks/bench_moe.py", "--json"],
    ["benchmarks/bench_router_norm.py", "--json"],
    ["benchmarks/host_moe.py", "--json"],
    ["benchmarks/ab_moe.py", "--cases", "qwen3-30b-a3b:1", "--configs", "a=factors", "b=factors", "--json"],
    ["benchmarks/tune_moe.py", "--out"],
    ["examples/ep_moe.py", "--json"],
    ["examples/hf_moe_generate.py", "--json"],
    ["benchmarks/plot_moe.py", "bench_moe.json", "-o"],
]


def test_output_file_problem(tmp_path):
    assert output_file_problem("--json", None) == ""
    assert output_file_problem("--json", tmp_path / "new.json") == ""
    (tmp_path / "old.json").write_text("{}")
    assert output_file_problem("--json", tmp_path / "old.json") == ""
    assert output_file_problem("--json", tmp_path) == f"--json: {tmp_path} is a folder; expected a file path"
    assert "folder" in output_file_problem("--out", tmp_path / "nowhere" / "x.yaml")
    assert "does not exist" in output_file_problem("--out", tmp_path / "nowhere" / "x.yaml")


def test_output_file_problem_refuses_another_kind_of_file(tmp_path):
    """A fresh user's trial: --json factors/topk_softmax.so and --json benchmarks/bench_moe.py
    passed the check, and bench_moe replaces its --json after every row. With suffixes, a name
    of another kind and an existing .json that is not JSON are refused; their content is kept."""
    json_only = (".json",)
    script = tmp_path / "bench_moe.py"
    script.write_text("print('kept')")
    assert output_file_problem("--json", script, json_only) == \
        f"--json: expected a .json file name, got {script}"
    assert output_file_problem("--json", tmp_path / "new.so", json_only).startswith("--json: expected a .json")
    not_json = tmp_path / "notes.json"
    not_json.write_text("not json at all")
    problem = output_file_problem("--json", not_json, json_only)
    assert problem == f"--json: {not_json} exists and is not JSON: refusing to replace it (remove it, or name another file)"
    assert not_json.read_text() == "not json at all" and script.read_text() == "print('kept')"
    for fine in ("old.json", "empty.json", "NEW.JSON"):
        if fine != "NEW.JSON":
            (tmp_path / fine).write_text('{"rows": []}' if fine == "old.json" else "")
        assert output_file_problem("--json", tmp_path / fine, json_only) == "", fine
    # a device is no file the tools can replace (write_json refused it after the measurements)
    assert output_file_problem("--json", "/dev/null", json_only) == \
        "--json: /dev/null is not a regular file (a device or a pipe); expected a .json file the tool can replace"
    assert output_file_problem("--json", tmp_path / ".json", json_only).startswith("--json: expected a .json file name")
    assert output_file_problem("--json", script) == ""   # without suffixes: the old check only
    assert output_file_problem("--out", tmp_path / "t.yml", (".yaml", ".yml")) == ""
    assert output_file_problem("--out", script, (".yaml", ".yml")) == f"--out: expected a .yaml or .yml file name, got {script}"


def test_output_file_problem_judges_a_large_json_by_its_first_character(tmp_path, monkeypatch):
    """A helper's review: the check read a 142 MB JSON whole (11 s, 1.1 GB) before a run; past
    64 MiB it now reads the first 4 KiB only. A file with a byte-order mark is JSON too."""
    import ex_engine._scripts as scripts
    monkeypatch.setattr(scripts, "_JSON_PARSE_MAX", 16)
    big = tmp_path / "big.json"
    big.write_text('  {"rows": [' + "1, " * 100 + '1]}')
    assert scripts.output_file_problem("--json", big, (".json",)) == ""
    big.write_text("x" * 100)
    assert "exists and is not JSON" in scripts.output_file_problem("--json", big, (".json",))
    monkeypatch.setattr(scripts, "_JSON_PARSE_MAX", 64 << 20)
    bom = tmp_path / "bom.json"
    bom.write_bytes(b"\xef\xbb\xbf{}")
    assert scripts.output_file_problem("--json", bom, (".json",)) == ""


def test_output_file_problem_tries_to_open_the_file(tmp_path):
    """As root, os.access said /proc/p.png and /sys/p.png were writable: plot_moe then failed at
    savefig after the drawing, bench_moe after its first row. The check now opens the file for
    writing: a new file is created and removed again, an existing one keeps its content."""
    for path in ("/proc/p.png", "/sys/p.png"):
        problem = output_file_problem("-o", path)
        assert problem.startswith(f"-o: cannot create {path} ("), problem
    (tmp_path / "old.json").write_text("kept")
    assert output_file_problem("--json", tmp_path / "old.json") == ""
    assert (tmp_path / "old.json").read_text(encoding="utf-8") == "kept"
    assert output_file_problem("--json", tmp_path / "new.json") == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.json"]   # new.json not left behind
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)                          # no reader: refused at once, not waited on
    assert "is not writable" in output_file_problem("--json", fifo)


def test_plot_moe_reports_a_failed_savefig_in_one_line(tmp_path, monkeypatch, capsys):
    """A destination that passes the check but fails at savefig (a full disk) was a traceback."""
    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import plot_moe
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    def full(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(plot_moe.plt.Figure, "savefig", full)
    data = sorted((ROOT / "benchmarks").glob("bench_moe_h200_*.json"))[-1]
    monkeypatch.setattr(sys, "argv", ["plot_moe.py", str(data), "-o", str(tmp_path / "p.png")])
    assert plot_moe.main() == 2
    err = capsys.readouterr().err
    assert err == f"plot_moe: --output: cannot write {tmp_path / 'p.png'}: No space left on device\n", err


@pytest.mark.parametrize("argv", SCRIPTS, ids=lambda a: a[0])
def test_scripts_refuse_a_bad_output_destination_first(tmp_path, argv):
    for dest, msg in ((tmp_path, "is a folder; expected a file path"),
                      (tmp_path / "nowhere" / "x.json", "does not exist")):
        r = subprocess.run([sys.executable, *argv, str(dest)], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 2 and msg in r.stderr, (argv, r.returncode, r.stdout, r.stderr)
        assert not (tmp_path / "nowhere").exists()


def test_hf_moe_generate_reports_every_argument_problem_at_once():
    """Without PyTorch it said only that PyTorch was missing: the bad arguments surfaced one
    install later. Now each problem is a line, the missing PyTorch one of them."""
    for rtol in ("0", "inf"):   # inf made every comparison pass
        r = subprocess.run([sys.executable, "examples/hf_moe_generate.py", "--tokens", "2", "--rtol", rtol,
                            "--device", "tpu"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, (r.stdout, r.stderr)
        assert "--tokens: expected >= 5" in r.stderr and "--rtol: expected a finite fraction > 0" in r.stderr
        assert "--device: expected cpu or cuda[:N], got 'tpu'" in r.stderr, r.stderr


def test_hf_moe_generate_refuses_full_size_models_on_the_cpu_unless_asked():
    """Without a GPU it quietly built full-size models on the CPU (12 GB, minutes). Now it asks
    for --tiny --device cpu (a smoke test) or an explicit --device cpu. GPU hidden from torch."""
    import os
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    need = "needs a CUDA GPU for full-size models (none visible): use --tiny --device cpu"
    r = subprocess.run([sys.executable, "examples/hf_moe_generate.py", "--model", "mixtral", "--tokens", "2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and need in r.stderr, (r.stdout, r.stderr)
    assert "--tokens: expected >= 5" in r.stderr          # reported together
    for extra in (["--tiny"], ["--device", "cpu"]):        # asked for: no such problem
        r = subprocess.run([sys.executable, "examples/hf_moe_generate.py", "--model", "mixtral", "--tokens", "2",
                            *extra], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 2 and need not in r.stderr, (extra, r.stderr)


def test_plot_moe_checks_its_output_name_and_rows_before_drawing(tmp_path):
    """An output name matplotlib cannot write (.txt) failed with a traceback after the drawing,
    one without a suffix was written as NAME.png while 'wrote NAME' was printed, and a row with a
    zero floor ended in ZeroDivisionError; a missing matplotlib hid the other problems."""
    bad = tmp_path / "b.json"
    bad.write_text('{"meta": {"dtype": "bfloat16", "device": "x", "date": "d", "commit": "c"}, '
                   '"rows": [{"model": "m", "T": 1, "ours_us": 2.0, "floor_us": 0}]}')
    for out in (tmp_path / "p.txt", tmp_path / "p"):
        r = subprocess.run([sys.executable, "benchmarks/plot_moe.py", str(bad), "-o", str(out)], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "--output: expected a .png, .pdf or .svg file name" in r.stderr, r.stderr
        assert "'floor_us': expected a finite number > 0, got 0" in r.stderr and not out.exists() and not out.with_suffix(".png").exists()


# ---- moe_layer's helpers check their arguments up front ------------------------------------
def _small_shape(**kw):
    from ex_engine.moe_layer import MoEShape
    d = dict(model="tiny", H=16, I=8, E=4, K=2, renormalize=False)
    d.update(kw)
    return MoEShape(**d)


@pytest.mark.parametrize("kwargs, exc, words", [
    ({"dtype": "float32"}, "DTypeError", ["MoELayer", "'dtype'", "'float32'"]),
    ({"dtype": "x"}, "DTypeError", ["MoELayer", "'dtype'", "'x'"]),
    ({"seed": -1}, "ArgumentError", ["MoELayer", "'seed'", ">= 0", "-1"]),
    ({"seed": 1.5}, "ArgumentError", ["MoELayer", "'seed'", "1.5"]),
    ({"shape": {"H": -16}}, "ArgumentError", ["MoELayer", "'shape.H'", ">= 1", "-16"]),
    ({"shape": {"K": 5}}, "ArgumentError", ["MoELayer", "'shape.K'", "E = 4", "5"]),
    ({"shape": "tiny"}, "ArgumentError", ["MoELayer", "'shape'", "MoEShape", "str"]),
])
def test_moe_layer_refuses_bad_constructor_arguments(kwargs, exc, words):
    import ex_engine.errors as E
    from ex_engine.moe_layer import MoELayer
    shape = kwargs.pop("shape", {})
    shape = _small_shape(**shape) if isinstance(shape, dict) else shape
    with pytest.raises(getattr(E, exc)) as ei:
        MoELayer(shape, **kwargs)
    for w in words:
        assert w in str(ei.value)


def test_moe_layer_checks_hidden_states():
    import numpy as np
    from ex_engine.errors import ArgumentError, DTypeError, ShapeError
    from ex_engine.moe_layer import MoELayer
    layer = MoELayer(_small_shape(), "float16")
    assert layer.hidden_states(3).shape == (3, 16)
    for T in (-1, 2.5, True):
        with pytest.raises(ArgumentError, match=r"MoELayer.hidden_states: argument 'T'"):
            layer.hidden_states(T)
    with pytest.raises(ShapeError, match=r"MoELayer.forward: argument 'hidden_states'.*\(T, 16\).*\(2, 17\)"):
        layer.forward(np.zeros((2, 17), np.float16))
    with pytest.raises(DTypeError, match=r"MoELayer.forward: argument 'hidden_states'.*float16.*float32"):
        layer.forward(np.zeros((2, 16), np.float32))
    with pytest.raises(ShapeError, match=r"MoELayer.router_logits"):
        layer.router_logits(np.zeros(16, np.float16))
    with pytest.raises(DTypeError, match=r"^MoELayer.forward: argument 'hidden_states': type"):
        layer.forward([[0.0] * 16])        # no array at all: named as well (it said 'ex_engine')


def test_moe_layer_reference_refuses_ids_outside_the_experts():
    import numpy as np
    from ex_engine.errors import ArgumentError
    from ex_engine.moe_layer import MoELayer
    layer = MoELayer(_small_shape(), "float16")
    x = layer.hidden_states(3)
    w = np.full((3, 2), 0.5, np.float32)
    ids = np.array([[0, 1], [2, 3], [1, 2]], np.int32)
    assert layer.reference(x, w, ids).shape == (3, 16)
    with pytest.raises(ArgumentError, match=r"MoELayer.reference: argument 'topk_ids'.*\[0, 4\).*6 slot"):
        layer.reference(x, w, ids + 100)


def test_random_array_refuses_other_dtypes():
    import numpy as np
    from ex_engine.errors import DTypeError
    from ex_engine.moe_layer import random_array
    rng = np.random.default_rng(0)
    assert random_array(np, rng, (2, 3), "float32").dtype == np.float32
    for dt in ("int8", "float64", np.float16):
        with pytest.raises(DTypeError, match=r"random_array: argument 'dtype'"):
            random_array(np, rng, (2, 3), dt)


def test_rel_error_time_call_and_load_models_refuse_bad_arguments():
    import numpy as np
    from ex_engine.errors import ArgumentError, ShapeError
    from ex_engine.moe_layer import load_models, rel_error, time_call
    assert rel_error(np, np.ones((2, 3)), np.ones((2, 3))) == 0.0
    with pytest.raises(ShapeError, match=r"rel_error: argument 'ref'.*\(2, 3\).*\(3,\)"):
        rel_error(np, np.ones((2, 3)), np.ones((3,)))
    for n in (0, -1, 2.0):
        with pytest.raises(ArgumentError, match=r"time_call: argument 'repeat'"):
            time_call(np, lambda: None, n)
    assert time_call(np, lambda: None, 1) >= 0
    with pytest.raises(ArgumentError, match=r"load_models: argument 'path'.*int 3"):
        load_models(3)


def test_output_file_problem_follows_a_dangling_link(tmp_path):
    """A link to a file not yet written is a fine output path (open(..., 'w') creates the
    target); it was refused as 'cannot create ... (File exists)'. A link into a missing folder
    names that folder; nothing is left behind."""
    (tmp_path / "ok.json").symlink_to(tmp_path / "target.json")
    assert output_file_problem("--json", tmp_path / "ok.json") == ""
    assert not (tmp_path / "target.json").exists()
    (tmp_path / "bad.json").symlink_to(tmp_path / "sub" / "target.json")
    assert output_file_problem("--json", tmp_path / "bad.json") == f"--json: folder {tmp_path / 'sub'} does not exist"
