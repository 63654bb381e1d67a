"""CPU tests of the benchmark tools' argument parsing (they import without torch)."""
import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def import_tool(folder: str, module: str):
    """Import a script of ROOT/folder as a module, with the folder on sys.path only meanwhile."""
    sys.path.insert(0, str(ROOT / folder))
    try:
        return importlib.import_module(module)
    finally:
        sys.path.remove(str(ROOT / folder))


@pytest.fixture(scope="module")
def ab_moe():
    return import_tool("benchmarks", "ab_moe")


def test_ab_moe_config_with_variables(ab_moe):
    name, folder, env = ab_moe.parse_cfg("t64=/tmp/f:EX_A=1,EX_B=x")
    assert (name, folder, env) == ("t64", "/tmp/f", {"EX_A": "1", "EX_B": "x"})
    assert {"EX_A", "EX_B"} <= ab_moe.ENV_KEYS


def test_ab_moe_config_without_variables(ab_moe):
    assert ab_moe.parse_cfg("base=factors") == ("base", "factors", {})


@pytest.mark.parametrize("bad", ["nofolder", "=factors", "a=", "a=f:NOVALUE", "a=f:=1"])
def test_ab_moe_malformed_config_exits_2(ab_moe, bad, capsys):
    with pytest.raises(SystemExit) as e:
        ab_moe.parse_cfg(bad)
    assert e.value.code == 2
    assert "expected NAME=FOLDER" in capsys.readouterr().err


@pytest.fixture(scope="module")
def kernel_times():
    return import_tool("scripts", "kernel_times_moe")


@pytest.mark.parametrize("tile,label", [((128, 256, 64), "cutlass_grouped_gemm"),
                                        ((64, 256, 64), "cutlass_grouped_gemm<64-row tiles>"),
                                        ((128, 128, 64), "cutlass_grouped_gemm<128 x 128 tiles>")])
def test_kernel_times_names_the_cutlass_tilings(kernel_times, tile, label):
    m, n, k = tile
    name = ("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::"
            "GroupProblemShape<cute::tuple<int, int, int>>, cutlass::gemm::collective::CollectiveMma<"
            f"cute::tuple<cute::C<{m}>, cute::C<{n}>, cute::C<{k}>>, float>>>(void)")
    assert kernel_times.short_name(name) == label
    gated = name.replace("CollectiveMma<", "exmoe::sm90::GatedMainloop<cutlass::gemm::collective::CollectiveMma<")
    assert kernel_times.short_name(gated) == "cutlass_grouped_gemm<gated GEMM1>"
