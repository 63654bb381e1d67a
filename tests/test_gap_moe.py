"""benchmarks/gap_moe.py (the per-kernel decomposition of a call against the card's rates) and
the rows kernel_times_moe.py --json records for it; CPU only."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_bench_tools import import_tool

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gap():
    return import_tool("benchmarks", "gap_moe")


def row(**kw):
    # qwen3-30b-a3b T = 16384 in kernel_times_moe.py --json's form: the kernel times measured on the
    # H200 in session 44 (that run recorded no routing: tile_rows is the expectation under uniform
    # routing, 8.5 tiles an expert), graph_us their sum (that run's graph read 2507.3, span 2232.7)
    r = {"model": "qwen3-30b-a3b", "T": 16384, "H": 2048, "I": 768, "E": 128, "K": 8,
         "slots": 131072.0, "tile_rows": 139264.0, "tile": 128, "experts_hit": 128.0,
         "kernels_us": {"cutlass_grouped_gemm<gated GEMM1>": 1216.4, "cutlass_grouped_gemm": 685.9,
                        "sm90_prepare_kernel": 168.9, "sm90_combine_kernel": 158.5,
                        "moe_route_place_kernel": 11.0, "moe_route_hist_kernel": 2.5},
         "graph_us": 2243.2}
    r.update(kw)
    return r


RATES = {"matmul_tflops": 690.0, "copy_gbs": 4060.0, "write_gbs": 3180.0}


@pytest.mark.parametrize("name,want", [
    ("cutlass_grouped_gemm<gated GEMM1>", "GEMM1"), ("cutlass_grouped_gemm", "GEMM2"),
    ("cutlass_grouped_gemm<128 x 128 tiles>", "GEMM2"), ("chunked_gemm_kernel<GEMM1>", "GEMM1"),
    ("chunked_gemm_kernel<GEMM2>", "GEMM2"), ("moe_gemm_kernel<GEMM1>", "GEMM1"),
    ("sm90_prepare_kernel", "gather"), ("sm90_combine_kernel", "combine"),
    ("moe_route_place_kernel", "routing"), ("sm90_silu_mul_kernel", "other")])
def test_kernels_are_told_apart_by_name(gap, name, want):
    assert gap.role(name) == want


def test_rates_and_bounds_by_hand(gap):
    a = gap.analyse(row(), RATES)
    slots, tiles, H, I, T = 131072, 139264, 2048, 768, 16384
    assert a["call_us"] == 2243.2
    flops = 6.0 * slots * H * I
    floor = flops / 787.0 / 1e6          # compute-bound: the weights are 1.2 GB at most
    assert a["x_floor"] == pytest.approx(2243.2 / floor)
    assert a["GEMM1"]["tflops"] == pytest.approx(4.0 * slots * H * I / 1216.4 / 1e6)
    assert a["GEMM1"]["tile_tflops"] == pytest.approx(4.0 * tiles * H * I / 1216.4 / 1e6)
    assert a["GEMM2"]["tflops"] == pytest.approx(2.0 * slots * H * I / 685.9 / 1e6)
    assert not a["GEMM2"]["both"]
    assert a["gather_gbs"] == pytest.approx((slots + T) * H * 2 / 168.9 / 1e3)
    assert a["combine_gbs"] == pytest.approx((slots + T) * H * 2 / 158.5 / 1e3)
    passes = slots * H * 2 / 3180.0 / 1e3 + (slots + T) * H * 2 / 4060.0 / 1e3 + 13.5
    assert a["bound_a"] == pytest.approx((flops / 690.0 / 1e6 + passes) / floor)
    assert a["bound_b"] == pytest.approx((6.0 * tiles * H * I / 690.0 / 1e6 + passes) / floor)
    # the measured call is above both bounds, and padding only adds
    assert 1.0 < a["bound_a"] < a["bound_b"] < a["x_floor"]


def test_an_ungated_gemm1_counts_both_gemms_under_gemm2(gap):
    k = {"cutlass_grouped_gemm": 1900.0, "sm90_silu_mul_kernel": 30.0}
    a = gap.analyse(row(kernels_us=k, graph_us=None), RATES)
    assert a["GEMM1"] is None and a["GEMM2"]["both"]
    assert a["GEMM2"]["tflops"] == pytest.approx(6.0 * 131072 * 2048 * 768 / 1900.0 / 1e6)
    assert a["call_us"] == pytest.approx(1930.0)   # no graph time: the kernels' sum


def test_the_profiled_span_is_the_call_where_recorded(gap):
    assert gap.analyse(row(span_us=2232.7), RATES)["call_us"] == 2232.7
    assert gap.analyse(row(), RATES)["call_us"] == 2243.2     # else the graph's time
    assert gap.analyse(row(graph_us=None, wall_us=2400.0), RATES)["call_us"] == 2400.0   # else eager wall


def test_no_write_rate_leaves_the_bounds_out(gap):
    a = gap.analyse(row(), {"matmul_tflops": 787.0, "copy_gbs": 4230.0, "write_gbs": None})
    assert a["bound_a"] is None and a["bound_b"] is None


def run(*args):
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gap_moe.py"), *map(str, args)],
                          capture_output=True, text=True, encoding="utf-8")


def test_cli_prints_a_row_with_the_files_rates(tmp_path):
    f = tmp_path / "kt.json"
    f.write_text(json.dumps({"meta": {"date": "2026-12-05", "device": "NVIDIA H200", "commit": "x",
                                      "ceilings_here": RATES}, "rows": [row()]}), encoding="utf-8")
    r = run(f)
    assert r.returncode == 0, r.stderr
    assert "matmul 690 TFLOP/s, copy 4060 GB/s, write 3180 GB/s" in r.stdout
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("qwen3-30b-a3b")][0]
    assert "2243.2" in line
    assert line.split()[3] == "1.43"   # x floor: 2243.2 over 6 * 131072 * 2048 * 768 / 787e12 s
    # an override beats the file's rate
    assert "matmul 600 TFLOP/s" in run(f, "--matmul-tflops", 600).stdout


@pytest.mark.parametrize("content,expect", [
    (None, "No such file"), ("not json", "expected the JSON"), ('{"meta": {}}', "expected the JSON"),
    ('{"meta": {}, "rows": [{"model": "m"}]}', "rows[0]: lacks T, H, I, K")])
def test_cli_refuses_what_is_not_its_json(tmp_path, content, expect):
    f = tmp_path / "kt.json"
    if content is not None:
        f.write_text(content, encoding="utf-8")
    r = run(f)
    assert r.returncode == 2 and expect in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_cli_refuses_a_rate_that_is_not_positive(tmp_path):
    r = run(tmp_path / "kt.json", "--write-gbs", 0)
    assert r.returncode == 2 and "--write-gbs: expected a finite rate > 0, got 0" in r.stderr


def test_kernel_times_counts_slots_and_tile_rows():
    torch = pytest.importorskip("torch")
    kt = import_tool("scripts", "kernel_times_moe")
    # expert 0: 130 rows (2 tiles), expert 1: 1 row (1 tile), expert 2: none; an id of -1 goes nowhere
    ids = torch.tensor([0] * 130 + [1, -1, 3], dtype=torch.int32).reshape(-1, 1)
    got = kt.routing_rows([(None, ids)], E=3)
    assert got == {"slots": 131.0, "tile_rows": 384.0, "tile": 128, "experts_hit": 2.0}
    # the mean over sets
    got = kt.routing_rows([(None, ids), (None, torch.zeros(1, 1, dtype=torch.int32))], E=3)
    assert got["slots"] == 66.0 and got["tile_rows"] == 256.0 and got["experts_hit"] == 1.5


def write(tmp_path, data, raw=None):
    f = tmp_path / "kt.json"
    f.write_text(raw if raw is not None else json.dumps(data), encoding="utf-8")
    return f


def meta(**kw):
    return {"date": "2026-12-05", "device": "NVIDIA H200", "commit": "x", "ceilings_here": RATES, **kw}


@pytest.mark.parametrize("data,expect", [
    ([1, 2], "expected an object with 'meta' and 'rows', got a list"),
    ({"rows": [row()]}, "no 'meta'"),
    ({"meta": [], "rows": [row()]}, "meta: expected an object, got a list"),
    ({"meta": None, "rows": [row()]}, "meta: expected an object, got null"),
    ({"meta": meta(), "rows": {"a": 1}}, "rows: expected a list of cases, got an object"),
    ({"meta": meta(), "rows": "modelTHIKslotstile_rowsexperts_hitkernels_us"}, "rows: expected a list"),
    ({"meta": meta(), "rows": []}, "rows: expected at least one case, got none"),
    ({"meta": meta(), "rows": [[1]]}, "rows[0]: expected an object, got a list"),
    ({"meta": meta(ceilings_here=[1]), "rows": [row()]}, "meta.ceilings_here: expected an object"),
    ({"meta": meta(ceilings_here={**RATES, "copy_gbs": 0}), "rows": [row()]},
     "meta.ceilings_here.copy_gbs: expected a rate > 0, got 0"),
    ({"meta": meta(ceilings_here={**RATES, "matmul_tflops": -1}), "rows": [row()]},
     "meta.ceilings_here.matmul_tflops: expected a rate > 0, got -1"),
    ({"meta": meta(ceilings_here={**RATES, "matmul_tflops": "690"}), "rows": [row()]},
     "meta.ceilings_here.matmul_tflops: expected a rate > 0, got '690'"),
    ({"meta": meta(), "rows": [row(model=None)]}, "rows[0].model: expected a name, got null"),
    ({"meta": meta(), "rows": [row(T="16384")]}, "rows[0].T: expected a whole number >= 1, got '16384'"),
    ({"meta": meta(), "rows": [row(T=0, slots=0.0, tile_rows=0.0, experts_hit=0.0)]},
     "rows[0].T: expected a whole number >= 1, got 0"),
    ({"meta": meta(), "rows": [row(H=None)]}, "rows[0].H: expected a whole number >= 1, got null"),
    ({"meta": meta(), "rows": [row(K=True)]}, "rows[0].K: expected a whole number >= 1, got true"),
    ({"meta": meta(), "rows": [row(I=2.5)]}, "rows[0].I: expected a whole number >= 1, got 2.5"),
    ({"meta": meta(), "rows": [row(slots=-5.0)]}, "rows[0].slots: expected a number >= 0, got -5.0"),
    ({"meta": meta(), "rows": [row(slots=131073.0)]}, "rows[0].slots: expected at most T*K = 131072"),
    ({"meta": meta(), "rows": [row(tile_rows=100.0)]}, "rows[0].tile_rows: expected at least slots"),
    ({"meta": meta(), "rows": [row(kernels_us=[1, 2])]}, "rows[0].kernels_us: expected an object"),
    ({"meta": meta(), "rows": [row(kernels_us={"cutlass_grouped_gemm": "x"})]},
     "rows[0].kernels_us['cutlass_grouped_gemm']: expected a time >= 0 µs, got 'x'"),
    ({"meta": meta(), "rows": [row(kernels_us={"cutlass_grouped_gemm": None})]},
     "rows[0].kernels_us['cutlass_grouped_gemm']: expected a time >= 0 µs, got null"),
    ({"meta": meta(), "rows": [row(kernels_us={"cutlass_grouped_gemm": -1.0})]},
     "rows[0].kernels_us['cutlass_grouped_gemm']: expected a time >= 0 µs, got -1.0"),
    ({"meta": meta(), "rows": [row(graph_us="2243")]}, "rows[0].graph_us: expected a time >= 0 µs"),
    ({"meta": meta(), "rows": [row(span_us=-3.0)]}, "rows[0].span_us: expected a time >= 0 µs, got -3.0"),
    ({"meta": meta(), "rows": [row(wall_us=-3.0)]}, "rows[0].wall_us: expected a time >= 0 µs, got -3.0"),
])
def test_cli_names_what_it_expected_and_what_came(tmp_path, data, expect):
    r = run(write(tmp_path, data))
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"gap_moe: {tmp_path / 'kt.json'}: expected the JSON of "
                               "scripts/kernel_times_moe.py --json: ")
    assert expect in r.stderr, r.stderr
    assert r.stdout == ""   # nothing printed before the refusal


@pytest.mark.parametrize("raw,expect", [
    ('{"meta": {}, "rows": [ROW]}'.replace("ROW", json.dumps(row()).replace("2243.2", "NaN")),
     "rows[0].graph_us: expected a time >= 0 µs, got NaN"),
    ('{"meta": {}, "rows": [ROW]}'.replace("ROW", json.dumps(row()).replace("2243.2", "Infinity")),
     "rows[0].graph_us: expected a time >= 0 µs, got Infinity"),
    ('{"meta": {}, "rows": [ROW]}'.replace("ROW", json.dumps(row()).replace("16384", "1" + "0" * 400, 1)),
     "rows[0].T: expected a whole number >= 1, got 1000000000"),
    ('{"meta": {}, "rows": [ROW]}'.replace("ROW", json.dumps(row(H=10 ** 200, I=10 ** 200))),
     "rows[0]: expected sizes whose FLOPs fit a float"),
    ('{"meta": {}, "rows": [ROW]}'.replace("ROW", json.dumps(
        row(kernels_us={"cutlass_grouped_gemm": 1e-320}))), "rows[0]: a figure overflows"),
    ("NaN", "expected an object with 'meta' and 'rows', got a number"),
])
def test_cli_refuses_non_finite_and_huge_values(tmp_path, raw, expect):
    r = run(write(tmp_path, None, raw=raw))
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    assert expect in r.stderr, r.stderr
    assert len(r.stderr) < 400     # a huge value is shown cut short


def test_cli_refuses_a_folder_and_an_unreadable_file(gap, tmp_path, monkeypatch, capsys):
    r = run(tmp_path)
    assert r.returncode == 2 and "Is a directory" in r.stderr and "Traceback" not in r.stderr, r.stderr
    f = write(tmp_path, {"meta": meta(), "rows": [row()]})

    def refuse(self, *a, **kw):   # as a file without read permission (root reads any file)
        raise PermissionError(13, "Permission denied", str(self))
    monkeypatch.setattr(gap.Path, "read_text", refuse)
    assert gap.main([str(f)]) == 2
    err = capsys.readouterr().err
    assert "expected the JSON of scripts/kernel_times_moe.py --json: [Errno 13] Permission denied" in err


def test_cli_prints_zero_time_kernels_without_dividing_by_zero(tmp_path):
    k = {n: 0.0 for n in row()["kernels_us"]}
    r = run(write(tmp_path, {"meta": meta(), "rows": [row(kernels_us=k, graph_us=None), row(kernels_us={"foo": 0.0},
                                                                                     graph_us=None)]}))
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("qwen3-30b-a3b")]
    assert len(lines) == 2
    for ln in lines:   # no call time: no ratio to the floor
        assert ln.split()[2:4] == ["0.0", "-"], ln


def test_cli_header_reads_unknown_for_a_run_it_does_not_know(tmp_path):
    r = run(write(tmp_path, {"meta": {}, "rows": [row()]}))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("# ? ? commit ?;"), r.stdout


@pytest.mark.parametrize("value", ["inf", "nan", "-1"])
def test_cli_refuses_a_rate_that_is_not_finite(tmp_path, value):
    r = run(write(tmp_path, {"meta": meta(), "rows": [row()]}), f"--copy-gbs={value}")
    assert r.returncode == 2 and f"--copy-gbs: expected a finite rate > 0, got {value}" in r.stderr, r.stderr
    assert r.stdout == ""


def test_the_floor_counts_t_times_k_as_bench_moe_does(gap):
    # ids outside the layer's experts (slots < T*K) leave the floor as bench_moe.py counts it
    # (FLOPs 6*T*K*H*I): the same case reads the same ratio to the floor in both tools
    a = gap.analyse(row(slots=120000.0, tile_rows=128000.0), RATES)
    floor = 6.0 * 16384 * 8 * 2048 * 768 / 787.0 / 1e6
    assert a["floor_us"] == pytest.approx(floor)
    assert a["x_floor"] == pytest.approx(2243.2 / floor)
    # the GEMMs' useful rate and bound (a) stay on the slots
    assert a["GEMM1"]["tflops"] == pytest.approx(4.0 * 120000 * 2048 * 768 / 1216.4 / 1e6)


def test_a_gemm1_of_0_us_is_not_counted_under_gemm2(gap):
    # GEMM1 has a name of its own in the JSON (at 0 µs): GEMM2's time is GEMM2's alone
    k = {**row()["kernels_us"], "cutlass_grouped_gemm<gated GEMM1>": 0.0}
    a = gap.analyse(row(kernels_us=k), RATES)
    assert a["GEMM1"] is None
    assert not a["GEMM2"]["both"]
    assert a["GEMM2"]["tflops"] == pytest.approx(2.0 * 131072 * 2048 * 768 / 685.9 / 1e6)


def test_cli_columns_never_run_together(tmp_path):
    # a 'both' GEMM2 cell (ungated GEMM1) of 20 characters ran into the gather's figure, and a
    # model name of 22 characters into a T of 6 digits
    k = {"cutlass_grouped_gemm": 1300.0, "sm90_silu_mul_kernel": 30.0, "sm90_prepare_kernel": 168.9,
         "sm90_combine_kernel": 158.5}
    long = row(model="a-model-of-22-letters-", T=131072, slots=131072 * 8.0, tile_rows=131072 * 8.0)
    r = run(write(tmp_path, {"meta": meta(), "rows": [row(kernels_us=k, graph_us=None), long]}))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()[2:]
    first = lines[0].split()
    assert first[5:9] == ["both", "952/1011", "(147%)", "3576"], lines[0]
    assert lines[1].split()[:2] == ["a-model-of-22-letters-", "131072"], lines[1]
    # the header's columns line up with the rows': each header name ends (right-aligned) or
    # starts (left-aligned) where the rows' cells do
    head = r.stdout.splitlines()[1]
    assert head.index("x floor") + len("x floor") == lines[0].index(first[3]) + len(first[3])
    assert head.index("gather") == lines[0].index("3576")


def test_the_help_says_a_rate_given_here_beats_the_files(gap):
    # the docstring said the JSON's ceilings_here came first, "else given here"; the code (and
    # test_cli_prints_a_row_with_the_files_rates) lets a rate given here win
    doc = " ".join(gap.__doc__.split())
    assert "The rates are those given here (--matmul-tflops, --copy-gbs, --write-gbs), else the JSON's" in doc
    r = run("--help")
    assert "else the JSON's" in " ".join(r.stdout.split())


def test_kernel_times_help_names_what_its_json_holds():
    # gap_moe's call time is the profiled replays' span (span_us), which the --json paragraph did
    # not name; --ceilings without --json records nothing (the rates are printed only)
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel_times_moe.py"), "--help"],
                       capture_output=True, text=True, encoding="utf-8")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "the profiled replays' first kernel start to last end (span_us) and busy time (busy_us)" in text
    assert "prints them and, with --json, records them in the JSON" in text


@pytest.mark.parametrize("dest,expect", [("nowhere/kt.json", "--json: folder"), (".", "is a folder")])
def test_kernel_times_checks_its_json_before_any_work(tmp_path, dest, expect):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel_times_moe.py"), "--cases",
                        "qwen3-30b-a3b:1", "--json", str(tmp_path / dest)],
                       capture_output=True, text=True, encoding="utf-8", timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert any(ln.startswith("kernel_times_moe: --json: ") and expect in ln for ln in r.stderr.splitlines()), r.stderr


def test_gpu_check_gap_stage_fails_plainly_without_a_gpu(tmp_path):
    """scripts/gpu_check.sh's gap stage runs kernel_times_moe.py then gap_moe.py; with no GPU the
    first says so, the second is not run on a JSON that was never written, and the stage fails."""
    import os
    env = {**os.environ, "OUT": str(tmp_path), "CUDA_VISIBLE_DEVICES": "",   # no GPU, wherever it runs
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "gap"], capture_output=True, text=True,
                       encoding="utf-8", env=env, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "kernel_times_moe: needs PyTorch and a CUDA GPU" in r.stdout + r.stderr
    assert not (tmp_path / "gap_moe.txt").exists()
    # then gemm_shape_rate.py (cuBLAS and torch._grouped_mm at the GEMMs' shapes) says so too
    assert "gemm_shape_rate.py: needs a GPU with PyTorch" in r.stdout + r.stderr
    assert "done: status 1" in r.stdout


@pytest.mark.gpu
def test_kernel_times_json_feeds_gap_moe_on_the_gpu(tmp_path):
    """The whole path on a GPU: kernel_times_moe.py --graph --ceilings --json on one case, then
    gap_moe.py on its JSON (as scripts/gpu_check.sh's gap stage runs them)."""
    pytest.importorskip("torch")
    from tests.conftest import child_env
    f = tmp_path / "kt.json"
    T, K, E = 4096, 8, 40
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel_times_moe.py"), "--graph", "--ceilings",
                        "--calls", "3", "--json", str(f), "--cases", f"granite-3.0-3b-a800m:{T}"],
                       capture_output=True, text=True, encoding="utf-8", env=child_env(), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(f.read_text(encoding="utf-8"))
    assert set(data["meta"]["ceilings_here"]) == {"matmul_tflops", "copy_gbs", "write_gbs"}
    assert all(v > 0 for v in data["meta"]["ceilings_here"].values())
    (row,) = data["rows"]
    assert row["slots"] == T * K                          # uniform routing: every slot valid
    assert row["slots"] <= row["tile_rows"] and round(row["tile_rows"] * 3) % 128 == 0   # mean of 3 sets
    assert 0 < row["experts_hit"] <= E
    assert row["span_us"] > 0 and row["graph_us"] > 0
    gap = import_tool("benchmarks", "gap_moe")
    assert "GEMM1" in {gap.role(n) for n in row["kernels_us"]}
    assert "GEMM2" in {gap.role(n) for n in row["kernels_us"]}
    out = run(f)
    assert out.returncode == 0, out.stderr
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("granite-3.0-3b-a800m")][0]
    assert float(line.split()[3]) > 0.5   # over the floor: a figure, not '-'


def test_kernel_times_median_wall_groups_kernels_into_calls():
    kt = import_tool("scripts", "kernel_times_moe")
    # two calls (a gap of more than 20 µs between them), the second with overlapping kernels
    spans = [(100.0, 110.0, "b"), (0.0, 10.0, "a"), (12.0, 30.0, "b"), (105.0, 140.0, "c")]
    assert kt.median_wall(spans) == (40.0, 2)
    assert kt.median_wall([]) == (0.0, 0)
