"""Tuned launch choices as data (manifests/tuning/*.yaml, ex_engine/tuning.py)."""
import re
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from ex_engine import FactorRegistry
from ex_engine.arrays import TensorRef
from ex_engine.errors import FactorError
from ex_engine.tuning import TuningTable, TuningWarning, tuning_dir

H200 = SimpleNamespace(name="NVIDIA H200", multiprocessor_count=132, live=True)


def write(tmp_path, body, name="dev.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(body), encoding="utf-8")
    return tmp_path


TABLE = {"device": "NVIDIA H200", "multiprocessor_count": 132,
         "moe_fused_gemm": {"dim": "config", "key": ["H", "I", "G", "K"],
                            "values": {"tiny": 0, "decode": 1, "mid": 2, "prefill": 3, "grouped": 4},
                            "shapes": [{"H": 64, "I": 32, "G": 8, "K": 2, "model": "toy",
                                        "by_T": [[1, "tiny", 5.0, 6.0], [64, "mid"], [4096, 4]]}]}}


def test_lookup_takes_the_largest_tuned_T_not_above_the_call(tmp_path):
    t = TuningTable.for_hardware(H200, write(tmp_path, TABLE))
    v = lambda T: t.value("moe_fused_gemm", "config", {"H": 64, "I": 32, "G": 8, "K": 2, "T": T}, -1)
    assert [v(T) for T in (0, 1, 63, 64, 4095, 4096, 10 ** 6)] == [-1, 0, 0, 2, 2, 4, 4]  # T=0: below every row


def test_untuned_shape_warns_once_and_uses_the_default(tmp_path):
    t = TuningTable.for_hardware(H200, write(tmp_path, TABLE))
    sizes = {"H": 128, "I": 32, "G": 8, "K": 2, "T": 5}
    with pytest.warns(TuningWarning, match=r"no tuned config for H=128, I=32, G=8, K=2 .*tune_moe.py"):
        assert t.value("moe_fused_gemm", "config", sizes, -1) == -1
    with warnings.catch_warnings():
        warnings.simplefilter("error")               # the second call of that shape is quiet
        assert t.value("moe_fused_gemm", "config", {**sizes, "T": 9}, -1) == -1


def test_no_file_for_this_device_or_no_gpu(tmp_path):
    other = SimpleNamespace(name="NVIDIA A100-SXM4-80GB", multiprocessor_count=108, live=False)
    t = TuningTable.for_hardware(other, write(tmp_path, TABLE))
    with warnings.catch_warnings():
        warnings.simplefilter("error")               # no live GPU: no warning, the default
        assert t.value("moe_fused_gemm", "config", {"H": 64, "I": 32, "G": 8, "K": 2, "T": 1}, -1) == -1
    fewer_sms = SimpleNamespace(name="NVIDIA H200", multiprocessor_count=66, live=True)
    assert TuningTable.for_hardware(fewer_sms, write(tmp_path, TABLE)).factors == {}


def _mt(**over):
    return {**TABLE, "moe_fused_gemm": {**TABLE["moe_fused_gemm"], **over}}


SHAPE = {"H": 64, "I": 32, "G": 8, "K": 2}


@pytest.mark.parametrize("body,why", [
    (_mt(shapes=[{**SHAPE, "by_T": [[1, "huge"]]}]), r"shapes\[0\].by_T\[0\]: choice 'huge' not in values"),
    (_mt(shapes=[{**SHAPE, "by_T": [[1, "tiny"], [8, 99]]}]), r"shapes\[0\].by_T\[1\]: choice 99"),
    (_mt(shapes=[{**SHAPE, "by_T": [[64]]}]), r"shapes\[0\].by_T\[0\]: expected a row \[T, configuration, its µs, "
                                             r"auto's µs\] \(the µs optional\), got \[64\]"),
    (_mt(shapes=[{**SHAPE, "by_T": [[1, "tiny"], 7]}]), r"shapes\[0\].by_T\[1\]: expected a row"),
    (_mt(shapes=[{**SHAPE, "by_T": [[-1, "tiny"]]}]), "by_T T"),
    (_mt(shapes=[{**SHAPE, "by_T": [[1.5, "tiny"]]}]), "by_T T"),
    (_mt(shapes=[{**SHAPE, "by_T": [[1, "tiny"]]}] * 2), "listed twice"),
    (_mt(values=["tiny"]), "values"),
    (_mt(values={"tiny": 0, "broken": -5}), "values.broken"),   # below -1: no kernel takes it
    (_mt(key=["H", "I", "GG", "K"]), r"shapes\[0\]: no 'GG', a size the key"),
    (_mt(key="HIGK"), "key: expected a non-empty list"),
    (_mt(key=[]), "key: expected a non-empty list"),
    ({**TABLE, "notes": "hello"}, "top-level key 'notes': expected a factor's table"),
    ({**{k: v for k, v in TABLE.items() if k != "moe_fused_gemm"},
      "moe_fused_gemm": {k: v for k, v in TABLE["moe_fused_gemm"].items() if k != "shapes"}}, "shapes"),
    ({**TABLE, "multiprocessor_count": "lots"}, "multiprocessor_count"),
    ({k: v for k, v in TABLE.items() if k != "device"}, "device: expected the name"),   # never matched silently
    ({**TABLE, "device": True}, "device: expected the name"),   # (a number is a name: 4090)
    ({**TABLE, "device": ["NVIDIA H200"]}, "device: expected the name"),
    ([1, 2, 3], "expected a mapping"),
])
def test_malformed_file_is_reported_and_skipped(tmp_path, body, why):
    with pytest.warns(TuningWarning, match=f"tuning file .*{why}.*skipped"):
        t = TuningTable.for_hardware(H200, write(tmp_path, body))
    assert t.factors == {} and len(t.problems) == 1 and why.split()[0].replace("\\", "") in t.problems[0]


def test_unreadable_files_and_folders_named_yaml_are_skipped(tmp_path):
    (tmp_path / "a_dangling.yaml").symlink_to(tmp_path / "nowhere")
    (tmp_path / "b_folder.yaml").mkdir()
    (tmp_path / "c_binary.yaml").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.warns(TuningWarning) as caught:
        t = TuningTable.for_hardware(H200, write(tmp_path, TABLE, "z_good.yaml"))
    says = [str(w.message) for w in caught]
    assert sum("not readable" in m for m in says) == 2 and sum("malformed" in m for m in says) == 1, says
    assert "moe_fused_gemm" in t.factors and len(t.problems) == 3, t.problems
    assert len(t.unreadable) == 2 and t.malformed == [str(tmp_path / "c_binary.yaml")], (t.unreadable, t.malformed)
    assert all("\n" not in p for p in t.problems)


def test_which_file_serves_and_which_are_passed_over(tmp_path):
    """Of two files for this device the first by name serves and the other is named; files
    for this GPU's name in other case or another SM count are named too; .yml is read."""
    write(tmp_path, TABLE, "h200.bak.yaml")
    write(tmp_path, TABLE, "h200.yaml")
    write(tmp_path, {**TABLE, "device": "nvidia h200"}, "lower.yml")
    write(tmp_path, {**TABLE, "multiprocessor_count": 114}, "pcie.yaml")
    write(tmp_path, {**TABLE, "device": "NVIDIA A100-SXM4-80GB"}, "a100.yaml")
    t = TuningTable.for_hardware(H200, tmp_path)
    assert t.path.endswith("h200.bak.yaml") and not t.problems
    r = "\n".join(t.remarks)
    assert len(t.remarks) == 3, r
    assert "h200.yaml: also for NVIDIA H200;" in r and "h200.bak.yaml (first by name) is used" in r
    assert "lower.yml: device 'nvidia h200' is not this GPU's name 'NVIDIA H200'" in r
    assert "pcie.yaml: for NVIDIA H200 with 114 SMs; this one has 132: not used" in r
    assert "a100" not in r                                  # another GPU's file: nothing to say


def test_unreadable_yaml_is_reported_and_skipped(tmp_path):
    (tmp_path / "bad.yaml").write_text("device: [unclosed\n")
    with pytest.warns(TuningWarning, match=r"tuning file .*bad.yaml: not readable YAML"):
        t = TuningTable.for_hardware(H200, write(tmp_path, TABLE, "z_good.yaml"))
    assert "moe_fused_gemm" in t.factors        # the good file further on still serves


def _registry_with_tuning(tmp_path, body):
    import shutil
    from ex_engine import _paths
    shutil.copytree(_paths.manifests_dir(), tmp_path / "m", ignore=shutil.ignore_patterns("tuning"))
    (tmp_path / "m" / "tuning").mkdir()
    (tmp_path / "m" / "tuning" / "h200.yaml").write_text(yaml.safe_dump(body), encoding="utf-8")
    (tmp_path / "none").mkdir()
    return FactorRegistry.load(tmp_path / "none", hardware="h200", manifests_dir=tmp_path / "m")


def test_registry_keeps_working_with_a_broken_tuning_file(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")               # reported once: a note, not also a warning
        reg = _registry_with_tuning(tmp_path, ["not a table"])
    notes = [n for n in reg.notes if n.startswith("tuning:")]
    assert len(notes) == 1 and "expected a mapping" in notes[0] and "skipped" in notes[0], reg.notes
    assert reg.tuning.factors == {}
    # a call on a live GPU then names the skipped file instead of "no file for this device"
    reg.tuning.warn = True
    with pytest.warns(TuningWarning, match=r"h200.yaml: expected a mapping.*kernel's default"):
        reg.tuning.value("moe_fused_gemm", "config", {"H": 64, "I": 32, "G": 8, "K": 2, "T": 1}, -1)


@pytest.mark.parametrize("body,why", [
    ({**{k: v for k, v in TABLE.items() if k != "moe_fused_gemm"}, "moe_fused_gem": TABLE["moe_fused_gemm"]},
     "moe_fused_gem: no factor of that name has a manifest"),
    (_mt(dim="confg"), "dim: expected one of moe_fused_gemm's tuned dims ['config'], got 'confg'"),
    (_mt(key=["H", "I", "GG", "K"], shapes=[{"H": 64, "I": 32, "GG": 8, "K": 2, "by_T": [[1, "tiny"]]}]),
     "key: ['GG'] no size of moe_fused_gemm's calls"),
])
def test_a_table_that_can_never_apply_is_noted(tmp_path, body, why):
    """A misspelt factor, dim or key parses but never matches a call: the registry says so."""
    reg = _registry_with_tuning(tmp_path, body)
    notes = [n for n in reg.notes if n.startswith("tuning:")]
    assert len(notes) == 1 and why in notes[0] and "never used" in notes[0], reg.notes
    good = _registry_with_tuning(tmp_path / "good", TABLE)
    assert not [n for n in good.notes if n.startswith("tuning:")], good.notes


def test_a_table_for_a_plugin_with_its_manifest_beside_it_is_checked_against_that_manifest(tmp_path):
    """A plugin's manifest may sit beside its library instead of in the manifests folder: its
    table is checked against that one once the plugin has loaded (not called unknown)."""
    from tests.conftest import build_plugin
    table = {"dim": "N", "key": ["N"], "values": {"a": 0}, "shapes": [{"N": 7, "by_T": [[1, "a"]]}]}
    reg = _registry_with_tuning(tmp_path, {**TABLE, "host_scale": table})
    assert any("host_scale: no factor of that name has a manifest" in n for n in reg.notes), reg.notes
    build_plugin(tmp_path / "plugins")
    reg.load_folder(tmp_path / "plugins")
    notes = [n for n in reg.notes if "host_scale" in n and n.startswith("tuning:")]
    assert notes == [f"tuning: tuning file {tmp_path / 'm' / 'tuning' / 'h200.yaml'}: host_scale: dim: expected "
                     "one of host_scale's tuned dims [], got 'N'; its table is never used"], reg.notes


def test_registry_passes_the_tuned_config_as_dims7(tmp_path):
    (tmp_path / "none").mkdir()
    reg = FactorRegistry.load(tmp_path / "none", hardware="h200")
    reg.tuning = TuningTable.for_hardware(H200, write(tmp_path, TABLE))
    m = reg.manifest("moe_fused_gemm")
    arrays = {"hidden_states": np.zeros((64, 64), np.float16), "out": np.zeros((64, 64), np.float16),
              "w13": np.zeros((8, 64, 64), np.float16), "w2": np.zeros((8, 64, 32), np.float16),
              "topk_weights": np.zeros((64, 2), np.float32), "topk_ids": np.zeros((64, 2), np.int32)}
    refs = {k: TensorRef.of(v, k) for k, v in arrays.items()}
    _, dims, _, _, _ = m.bind(refs, None, reg.tuning.value)
    assert dims[6:] == [8, 2]                        # G = E = 8, config 'mid' for T = 64
    _, dims, _, _, _ = m.bind(refs)                  # no table: the manifest's default
    assert dims[7] == -1
    reg.set_tuning("moe_fused_gemm", lambda sizes: 3)   # the tuner's override
    assert reg.tuning.value("moe_fused_gemm", "config", {}, -1) == 3
    reg.set_tuning("moe_fused_gemm", lambda sizes: np.int64(5))
    assert reg.tuning.value("moe_fused_gemm", "config", {}, -1) == 5
    for bad in (2.5, True, "mid32", None):              # never truncated or coerced quietly
        reg.set_tuning("moe_fused_gemm", lambda sizes, v=bad: v)
        with pytest.raises(FactorError, match="expected an integer"):
            reg.tuning.value("moe_fused_gemm", "config", {}, -1)
    reg.set_tuning("moe_fused_gemm", None)


def test_shipped_tuning_files_parse():
    for p in sorted(tuning_dir().glob("*.yaml")):
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
        hw = SimpleNamespace(name=data["device"], multiprocessor_count=data["multiprocessor_count"],
                             live=False)
        t = TuningTable.for_hardware(hw, tuning_dir())
        assert "moe_fused_gemm" in t.factors and t.factors["moe_fused_gemm"].table, p
        from ex_engine.manifest import load_all
        assert t.unused(load_all(tuning_dir().parent)) == [], p       # every table applies


@pytest.mark.gpu
@pytest.mark.parametrize("config", [-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
@pytest.mark.parametrize("T,H,G,I,K", [(1, 2048, 128, 768, 8), (300, 512, 40, 256, 6), (4096, 1024, 16, 512, 2)])
def test_every_forced_config_is_correct_on_the_gpu(config, T, H, G, I, K):
    """What the tuner times: each tile configuration, forced through dims[7], on the plugin."""
    import cupy
    from ex_engine import moe_fused_gemm
    from tests.conftest import ROOT
    from tests.test_expert_map import _case, _poison, _reference, _rel
    reg = FactorRegistry.load(ROOT / "factors")
    reg.set_tuning("moe_fused_gemm", lambda sizes: config)
    x, w13, w2, w, ids = _case(cupy, T, H, G, I, K, "bfloat16", seed=config + 7)
    out = _poison(cupy, x)
    moe_fused_gemm(x, w13, w2, w, ids, out=out, registry=reg)
    assert reg.last_path["moe_fused_gemm"] == "plugin"
    assert _rel(cupy, out, _reference(cupy, x, w13, w2, w, ids, None, G)) < 1e-2
    reg.check_device_errors()


def test_config_values_agree_with_the_kernel():
    """The tuner's names (benchmarks/tune_moe.py), the shipped tuning files and the kernel's
    accepted range of dims[7] (kTileConfig* in factors/moe_fused_gemm.cuh) agree: a value the
    kernel does not know runs on its own choice there (and made builds before 2026-11-29's
    mid32 refuse the call), so a name the tuner records must be one the kernel launches."""
    import re
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    src = (root / "factors" / "moe_fused_gemm.cuh").read_text(encoding="utf-8")
    consts = {m[0]: int(m[1]) for m in re.findall(r"\b(kTileConfig\w+)\s*=\s*(-?\d+)", src)}
    lo, hi = consts["kTileConfigAuto"], consts["kTileConfigMax"]
    sys.path.insert(0, str(root / "benchmarks"))
    try:
        import tune_moe                      # imports without torch (a run needs it)
    finally:
        sys.path.remove(str(root / "benchmarks"))
    assert sorted(tune_moe.VALUES.values()) == list(range(lo, hi + 1)), (tune_moe.VALUES, lo, hi)
    for name, v in tune_moe.CONFIGS.items():
        assert consts.get("kTileConfig" + "".join(w.capitalize() for w in name.split("_"))) == v, name
    for p in sorted(tuning_dir().glob("*.yaml")):
        table = yaml.safe_load(p.read_text(encoding="utf-8"))["moe_fused_gemm"]
        assert table["values"] == tune_moe.VALUES, p


def test_tuning_values_outside_what_the_manifest_allows_refuse_the_table(tmp_path):
    """A choice value >= -1 was taken whatever it was: bogus: 99 used in a by_T row reached the
    kernel. moe_fused_gemm's manifest gives config's range [-1, 12]; a table with a value
    outside is refused with a note naming the file, the value and the allowed ones, and its
    shapes run on the default (the rest of the registry works)."""
    import copy
    body = copy.deepcopy(TABLE)
    body["moe_fused_gemm"]["values"]["bogus"] = 99
    body["moe_fused_gemm"]["shapes"][0]["by_T"].append([256, "bogus"])
    reg = _registry_with_tuning(tmp_path, body)
    notes = [n for n in reg.notes if "bogus" in n]
    assert len(notes) == 1 and notes[0] == (
        f"tuning: tuning file {tmp_path / 'm' / 'tuning' / 'h200.yaml'}: moe_fused_gemm: values: bogus: 99 "
        f"outside what {tmp_path / 'm' / 'moe_fused_gemm.yaml'} allows for config (the range -1..12); "
        "its table is never used"), reg.notes
    sizes = {"H": 64, "I": 32, "G": 8, "K": 2}
    with pytest.warns(TuningWarning) if reg.tuning.warn else warnings.catch_warnings():
        assert reg.tuning.value("moe_fused_gemm", "config", {**sizes, "T": 300}, -1) == -1
        assert reg.tuning.value("moe_fused_gemm", "config", {**sizes, "T": 64}, -1) == -1
    reg.tuning.warn = True   # on a live GPU: the warning says why, not 'no tuned config ... Run the tuner'
    with pytest.warns(TuningWarning, match=r"running on the kernel's default choice of config: tuning file "
                                           r".*values: bogus: 99 outside") as rec:
        reg.tuning.value("moe_fused_gemm", "config", {**sizes, "T": 512}, -1)
    assert "Run benchmarks/tune_moe.py" not in str(rec[0].message)
    body["moe_fused_gemm"]["shapes"][0]["by_T"].pop()   # bogus no longer used by a row: the
    unused = _registry_with_tuning(tmp_path / "unused", body)   # table stays in use
    assert not [n for n in unused.notes if "never used" in n], unused.notes
    assert unused.tuning.value("moe_fused_gemm", "config", {**sizes, "T": 64}, -1) == 2
    good = _registry_with_tuning(tmp_path / "good", TABLE)      # the same table without bogus
    assert good.tuning.value("moe_fused_gemm", "config", {**sizes, "T": 64}, -1) == 2
    assert not [n for n in good.notes if "never used" in n], good.notes


def test_a_manifest_tuned_range_or_options_is_checked_at_load(tmp_path):
    """range / options of a tuned dim must be integers (and hold the default), named at load;
    options restrict a tuning table as a range does."""
    from ex_engine.manifest import Manifest
    from ex_engine import _paths
    src = (_paths.manifests_dir() / "moe_fused_gemm.yaml").read_text(encoding="utf-8")
    assert "config: {tuned: -1, range: [-1, 12]}" in src
    for entry, needle in (("{tuned: -1, range: [8, -1]}", "config: range: expected [LOWEST, HIGHEST]"),
                          ("{tuned: -1, range: [0, x]}", "config: range: expected [LOWEST, HIGHEST]"),
                          ("{tuned: -1, options: []}", "config: options: expected a non-empty list"),
                          ("{tuned: 13, range: [-1, 12]}", "config: tuned: the default 13 is outside the range -1..12"),
                          ("{tuned: x}", "config: tuned: expected the default value")):
        p = tmp_path / "moe_fused_gemm.yaml"
        p.write_text(src.replace("config: {tuned: -1, range: [-1, 12]}", f"config: {entry}"), encoding="utf-8")
        with pytest.raises(FactorError, match="^" + re.escape(f"manifest {p}: dim_sources: {needle}")):
            Manifest.load(p)
    p.write_text(src.replace("config: {tuned: -1, range: [-1, 12]}", "config: {tuned: -1, options: [-1, 0, 2]}"), encoding="utf-8")
    m = Manifest.load(p)
    (tmp_path / "t").mkdir()
    t = TuningTable.for_hardware(H200, write(tmp_path / "t", TABLE))
    msgs = t.check({"moe_fused_gemm": m})
    used = sorted({v for _, vs in t.factors["moe_fused_gemm"].table.values() for v in vs} - {-1, 0, 2})
    assert used, "TABLE's rows use no value outside the options: the check below would say nothing"
    names = {v: k for k, v in t.factors["moe_fused_gemm"].values.items()}
    assert len(msgs) == 1 and "values: " + ", ".join(f"{names[v]}: {v}" for v in sorted(used)) in msgs[0], msgs
    assert "(the options [-1, 0, 2])" in msgs[0] and set(t.refused) == {"moe_fused_gemm"}


def small_moe_inputs(rng):
    """hidden_states (64, 64), w13 (8, 64, 64), w2 (8, 64, 32) float16, topk_weights (64, 2) and
    topk_ids (64, 2: token t on experts t % 8 and (t + 1) % 8): a T = 64 call the fallback runs fast."""
    T, H, E, I, K = 64, 64, 8, 32, 2
    x = rng.standard_normal((T, H)).astype(np.float16)
    w13 = (rng.standard_normal((E, 2 * I, H)) * 0.1).astype(np.float16)
    w2 = (rng.standard_normal((E, H, I)) * 0.1).astype(np.float16)
    w = np.full((T, K), 0.5, np.float32)
    ids = np.stack([np.arange(T) % E, (np.arange(T) + 1) % E], 1).astype(np.int32)
    return x, w13, w2, w, ids


def test_calls_bind_again_when_a_table_is_set_aside_later(tmp_path):
    """A call remembers its dims (the tuned one included) in the registry's caches; when a
    later load makes the tuning table be set aside (a manifest found then limits the values),
    the caches are dropped, so the next call binds again and runs on the default."""
    import numpy as np
    from ex_engine import moe_fused_gemm
    reg = _registry_with_tuning(tmp_path, TABLE)
    seen = []                                 # the tuned values bind() asked for
    value = reg.tuning.value
    reg.tuning.value = lambda *a, **k: seen.append(value(*a, **k)) or seen[-1]
    x, w13, w2, w, ids = small_moe_inputs(np.random.default_rng())
    for _ in range(2):
        moe_fused_gemm(x, w13, w2, w, ids, registry=reg)
    assert seen == [2], seen                  # the T = 64 row ('mid'); the second call from the cache
    # as if a load had found a manifest that allows fewer values (this registry's own copy)
    reg.manifests["moe_fused_gemm"].dim_sources["config"] = {"tuned": -1, "options": [-1, 0]}
    reg._note_unused_tuning()                 # what each load does
    assert set(reg.tuning.refused) == {"moe_fused_gemm"}
    for _ in range(2):
        moe_fused_gemm(x, w13, w2, w, ids, registry=reg)
    assert seen == [2, -1], seen              # bound again: the default; then from the cache
    reg._note_unused_tuning()                 # nothing changed: the caches stay
    moe_fused_gemm(x, w13, w2, w, ids, registry=reg)
    assert seen == [2, -1], seen


def test_a_numeric_device_name_matches_a_numeric_profile_name(tmp_path):
    """A profile may be named 4090 (YAML reads a number, the profile takes it as '4090'); the
    tuning file written for it says device: 4090 too, and is used (it was skipped as malformed)."""
    hw = SimpleNamespace(name="4090", multiprocessor_count=132, live=False)
    t = TuningTable.for_hardware(hw, write(tmp_path, {**TABLE, "device": 4090}))
    assert t.path is not None and not t.problems, t.problems
    assert t.value("moe_fused_gemm", "config", {"H": 64, "I": 32, "G": 8, "K": 2, "T": 64}, -1) == 2


def test_for_hardware_takes_a_profile_name_and_refuses_other_types(tmp_path):
    """for_hardware('h200') raised AttributeError ('str' has no attribute 'name')."""
    from ex_engine.hardware import Hardware
    name = Hardware.from_profile("h200").name
    folder = write(tmp_path, {**TABLE, "device": name})
    assert set(TuningTable.for_hardware("h200", folder).factors) == {"moe_fused_gemm"}
    with pytest.raises(FactorError, match=r"TuningTable.for_hardware: argument 'hardware': type: .*got int"):
        TuningTable.for_hardware(3, folder)
    with pytest.raises(FactorError, match=r"no such profile"):
        TuningTable.for_hardware("no-such-gpu", folder)


def test_override_refuses_a_non_callable_when_set(tmp_path):
    """override(f, 3) was accepted and failed at the next dispatch ('int' object is not callable)."""
    t = TuningTable.for_hardware(H200, write(tmp_path, TABLE))
    with pytest.raises(FactorError, match=r"TuningTable.override: argument 'fn': type: expected a callable.*int 3"):
        t.override("moe_fused_gemm", 3)
    with pytest.raises(FactorError, match=r"TuningTable.override: argument 'factor'"):
        t.override(None, lambda s: 1)
    t.override("moe_fused_gemm", lambda s: 2)
    assert t.value("moe_fused_gemm", "config", {"H": 64, "I": 32, "G": 8, "K": 2, "T": 1}, -1) == 2
    t.override("moe_fused_gemm", None)


def test_a_tuning_override_outside_the_manifests_range_is_refused_by_name(tmp_path):
    """set_tuning's fn returning 99 for moe_fused_gemm's config (range -1..12) was passed to the
    kernel silently: the call is refused, naming the factor, the dim, the allowed values and
    the value, and counted; a value in range still runs, once per signature (the bind cache)."""
    from ex_engine import ArgumentError, moe_fused_gemm
    (tmp_path / "none").mkdir()
    reg = FactorRegistry.load(tmp_path / "none", hardware="h200")    # Python fallback: binds too
    T, H, E, I, K = 2, 8, 2, 4, 1
    args = (np.zeros((T, H), np.float16), np.zeros((E, 2 * I, H), np.float16),
            np.zeros((E, H, I), np.float16), np.ones((T, K), np.float32), np.zeros((T, K), np.int32))
    reg.set_tuning("moe_fused_gemm", lambda sizes: 99)
    for _ in range(2):     # also on the second call (no signature was remembered)
        with pytest.raises(ArgumentError, match=r"^moe_fused_gemm: argument 'config': tuned dim .*: "
                                                r"expected a value in the range -1\.\.12, got 99$"):
            moe_fused_gemm(*args, registry=reg)
    assert reg.stats()["moe_fused_gemm"]["errors"] == 2
    calls = []
    reg.set_tuning("moe_fused_gemm", lambda sizes: calls.append(1) or 8)
    for _ in range(3):
        assert moe_fused_gemm(*args, registry=reg).shape == (T, H)
    assert len(calls) == 1 and reg.stats()["moe_fused_gemm"]["python_fallback"] == 3
    reg.set_tuning("moe_fused_gemm", None)


def test_a_malformed_file_for_this_device_is_said_to_be_set_aside_not_missing(tmp_path, capsys, monkeypatch):
    """With a malformed table list-factors' header said 'tuning: no file for NVIDIA H200 (132
    SMs)' although the file is there (a note below said why): it names the file, set aside."""
    from ex_engine.cli import main
    folder = tmp_path / "m"
    import shutil
    from tests.conftest import ROOT
    shutil.copytree(ROOT / "manifests", folder)
    write(folder / "tuning", _mt(shapes=[{**SHAPE, "by_T": [[64]]}]), "h200.yaml")
    monkeypatch.setenv("EX_ENGINE_MANIFESTS", str(folder))
    assert main(["list-factors", "--dir", str(tmp_path), "--hardware", "h200", "--no-probe"]) == 1   # none ready
    out = capsys.readouterr().out
    assert f"tuning: {folder / 'tuning' / 'h200.yaml'} (for NVIDIA H200) set aside as malformed" in out, out
    assert "no file for" not in out, out
    t = TuningTable.for_hardware(H200, folder / "tuning", report=False)
    assert t.set_aside == [str(folder / "tuning" / "h200.yaml")]
    with pytest.warns(TuningWarning, match="this device's file set aside as malformed"):
        t.value("moe_fused_gemm", "config", {**SHAPE, "T": 1}, -1)


def test_a_numeric_device_that_matches_no_gpu_is_noted(tmp_path):
    """device: 5 (a number, no GPU's name) was passed over without a word."""
    t = TuningTable.for_hardware(H200, write(tmp_path, {**TABLE, "device": 5}), report=False)
    assert t.path is None and not t.problems
    assert len(t.remarks) == 1 and "device: 5 is a number; expected the name of the GPU" in t.remarks[0], t.remarks
    assert "'NVIDIA H200'" in t.remarks[0]
    t = TuningTable.for_hardware(H200, write(tmp_path, {**TABLE, "device": "NVIDIA A100"}), report=False)
    assert not t.remarks   # a file for another GPU, by name: not this one's business


def test_two_names_for_one_code_keep_the_table_with_a_remark(tmp_path):
    """Two names for one configuration code set the whole table aside (every shape then ran on
    the kernels' defaults), though an alias (smallest: 0 beside tiny: 0) is harmless. The table
    is kept and its rows run; a remark names the pair, so that a slip (tiny: 1 beside decode: 1)
    is still seen."""
    body = _mt(values={**TABLE["moe_fused_gemm"]["values"], "smallest": 0})
    t = TuningTable.for_hardware(H200, write(tmp_path, body))
    assert "moe_fused_gemm" in t.factors and not t.problems
    assert t.value("moe_fused_gemm", "config", {"H": 64, "I": 32, "G": 8, "K": 2, "T": 64}, -1) == 2
    assert any("moe_fused_gemm: values: 'smallest' and 'tiny' both give 0: rows naming either run "
               "configuration 0" in r for r in t.remarks), t.remarks


@pytest.mark.parametrize("old,new,why", [
    ("  dim: config\n", "  dim: config\n  kee: 1\n",
     "moe_fused_gemm: malformed (ValueError: unknown key 'kee' (did you mean 'key'?); expected some of "
     "dim, key, values, shapes)"),
    ("    G: 40\n", "    G: 40\n    Z: 3\n",
     "moe_fused_gemm: malformed (ValueError: shapes[0]: unknown key 'Z'; expected some of H, I, G, K, "
     "model, by_T (a size of the entry must be in the file's key, ['H', 'I', 'G', 'K']: Z is not))"),
    ("    G: 40\n", "    G: 40\n    z: 3\n",
     "moe_fused_gemm: malformed (ValueError: shapes[0]: unknown key 'z'; expected some of H, I, G, K, "
     "model, by_T)"),
    # a key shortened by hand: the entries' K is what is unknown, and the message names the key
    ("  key: [H, I, G, K]\n", "  key: [H, I, G]\n",
     "moe_fused_gemm: malformed (ValueError: shapes[0]: unknown key 'K'; expected some of H, I, G, "
     "model, by_T (a size of the entry must be in the file's key, ['H', 'I', 'G']: K is not))"),
])
def test_an_unknown_key_inside_a_table_or_a_shape_entry_sets_the_file_aside(tmp_path, monkeypatch, old, new, why):
    """`kee: 1` in the moe_fused_gemm table, or `Z: 3` in a shapes entry, of a copy of the shipped
    h200.yaml gave no note (only an unknown top-level key did): now the same note, naming the
    file and the key. The shipped file's entries (key sizes, model, by_T) still load."""
    import shutil
    from ex_engine import _paths
    shutil.copytree(_paths.manifests_dir(), tmp_path / "m")
    (tmp_path / "none").mkdir()
    monkeypatch.setenv("EX_ENGINE_MANIFESTS", str(tmp_path / "m"))
    path = tmp_path / "m" / "tuning" / "h200.yaml"
    assert FactorRegistry.load(tmp_path / "none", hardware="h200").tuning.path == str(path)
    text = path.read_text(encoding="utf-8")
    assert old in text
    path.write_text(text.replace(old, new, 1), encoding="utf-8")
    reg = FactorRegistry.load(tmp_path / "none", hardware="h200")
    notes = [n for n in reg.notes if n.startswith("tuning:")]
    assert len(notes) == 1 and notes[0].startswith(f"tuning: tuning file {path}: {why}"), reg.notes
    assert notes[0].endswith("; skipped") and reg.tuning.factors == {}, notes
