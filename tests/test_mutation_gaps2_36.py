"""Tests that kill mutants which survived the CPU suite (session 36, mutation round 2 by a helper:
trust.py, the plugin loading of registry.py, the transformers integration, distributed.py, tuning.py,
hardware.py, arrays.py, _paths.py, abi.py and cli.py). Each test names the mutant it kills
(file:line and the mutation) in its docstring."""
import json
import os

import numpy as np
import pytest

from ex_engine import FactorError, FactorRegistry, trust
from tests.conftest import build_plugin


# ------------------------------------------------------------------------------ trust: lock files
def test_read_lock_refuses_a_digest_that_is_not_64_hex_digits(tmp_path):
    """trust.py:219, the digest pattern [0-9a-fA-F]{64} loosened to {1,64}: a lock entry of a
    few hex digits is no SHA-256 (and `ex-engine lock --output` would overwrite such a JSON file
    as if it were a lock file)."""
    lock = tmp_path / "ex_engine.lock"
    lock.write_text(json.dumps({"host_scale.so": "abc123"}), encoding="utf-8")
    with pytest.raises(FactorError, match="expected a SHA-256 digest"):
        trust.read_lock(lock)
    lock.write_text(json.dumps({"host_scale.so": "a" * 63}), encoding="utf-8")
    with pytest.raises(FactorError, match="expected a SHA-256 digest"):
        trust.read_lock(lock)


def test_a_lock_with_upper_case_digests_matches(tmp_path):
    """trust.py:222, read_lock's digests not lower-cased (``v.lower()`` -> ``v``): a lock file
    whose digests are written in upper case (as sha256sum -b | tr does, or by hand) refused every
    library although each digest matches."""
    build_plugin(tmp_path)
    digests = trust.lock_digests(tmp_path)
    (tmp_path / "up.lock").write_text(json.dumps({k: v.upper() for k, v in digests.items()}), encoding="utf-8")
    assert trust.read_lock(tmp_path / "up.lock") == digests
    reg = FactorRegistry.load(tmp_path, hardware="h200", lock=tmp_path / "up.lock")
    p = reg.plugins[0]
    assert p.status == "ready", p.reason
    assert any(c.name == "sha256 lock" and c.ok and not c.warn for c in p.checks)


# ------------------------------------------------------------------------------ trust: the probe
def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, killed and waiting to be reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_probe_kills_what_a_library_started_in_its_child(tmp_path, monkeypatch):
    """trust.py:373, run_reporting_child's ``os.killpg(proc.pid, SIGKILL)`` -> ``proc.kill()``
    (the child alone): a library whose constructor forks a process left it running after the
    probe (every probed load of such a library leaked one). The probe's child runs in a session
    of its own so that all it started is killed with it."""
    import shutil
    import subprocess
    import time
    from ex_engine.hardware import Hardware
    if shutil.which("gcc") is None:
        pytest.skip("gcc not available")
    src = tmp_path / "forker.c"
    src.write_text(r"""
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
__attribute__((constructor)) static void start(void) {
    const char* where = getenv("EXT_MUT_PIDFILE");
    if (!where) return;
    pid_t pid = fork();
    if (pid == 0) {
        FILE* f = fopen(where, "w");
        if (f) { fprintf(f, "%d\n", (int)getpid()); fclose(f); }
        sleep(30);
        _exit(0);
    }
}
""")
    lib = tmp_path / "forker.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    pidfile = tmp_path / "pid"
    monkeypatch.setenv("EXT_MUT_PIDFILE", str(pidfile))
    ok, detail = trust.probe_library(lib, Hardware.from_profile("h200"), timeout=10)
    assert ok, detail                       # no ex_abi_version: the in-process checks say so
    deadline = time.time() + 5
    while not (pidfile.exists() and pidfile.read_text(encoding="utf-8").strip()) and time.time() < deadline:
        time.sleep(0.02)
    pid = int(pidfile.read_text(encoding="utf-8"))
    try:
        deadline = time.time() + 3
        while _alive(pid) and time.time() < deadline:
            time.sleep(0.02)
        assert not _alive(pid), "the process the library's constructor forked outlived the probe"
    finally:
        if _alive(pid):
            os.kill(pid, 9)


def test_the_probe_never_calls_a_library_of_another_abi_major(tmp_path):
    """trust.py:253 (the probe's child), ``if version >> 16 != abi.ABI_VERSION_MAJOR: return
    "other ABI"`` dropped: the child called ex_get_factor of a library built against another
    ABI (its struct layout may differ). A library whose ex_abi_version only its constructor sets
    (the file cannot say it before opening) to major 9, and whose ex_get_factor would crash:
    the probe passes it on without calling it, and the in-process check refuses it by its ABI
    (the mutant reported a crash in ex_get_factor instead)."""
    import shutil
    import subprocess
    from tests.conftest import ROOT
    if shutil.which("gcc") is None:
        pytest.skip("gcc not available")
    src = tmp_path / "abi9.c"
    src.write_text(r"""
#include "ex_engine.h"
EX_EXPORT uint32_t ex_abi_version;
__attribute__((constructor)) static void set_abi(void) { ex_abi_version = 9u << 16; }
EX_EXPORT ex_factor_t* ex_get_factor(const ex_hardware_t* hw) {
    (void)hw;
    *(volatile int*)0 = 1;
    return 0;
}
""")
    subprocess.run(["gcc", "-shared", "-fPIC", "-fvisibility=hidden", f"-I{ROOT / 'include'}",
                    "-o", str(tmp_path / "abi9.so"), str(src)], check=True)
    reg = FactorRegistry.load(tmp_path, hardware="h200", probe="subprocess")
    p = reg.plugins[0]
    probe = next(c for c in p.checks if c.name == "probe (child process)")
    assert probe.ok and "of another ABI major" in probe.detail, probe.detail
    assert p.status == "rejected" and p.reason.startswith("abi version:") and "9.0" in p.reason, p.reason


# ------------------------------------------------------------------------------ _paths: reading files
def test_read_chunks_refuses_a_file_that_grows_past_its_limit_while_read(tmp_path):
    """_paths.py:83, ``if n > limit`` (a file that grows past the limit while read) dropped:
    the size checked before reading no longer bounds what is read (a library being rewritten,
    a log appended to), so the limit that keeps the registry's memory in check did not hold."""
    from ex_engine import _paths
    f = tmp_path / "grows.so"
    f.write_bytes(b"x" * 10)
    chunks = _paths.read_chunks(f, limit=20, size=8)
    assert next(chunks) == b"x" * 8
    with open(f, "ab") as fh:
        fh.write(b"y" * 30)
    with pytest.raises(_paths.FileRefused, match="it grew while read"):
        for _ in chunks:
            pass


# ------------------------------------------------------------------------------ registry: tuning vs hardware
def _tuning(**changes):
    t = {"threads_per_block": 256, "items_per_thread": 1, "vec_size": 4, "shared_mem_bytes": 0,
         "num_warps": 8, "num_stages": 1}
    t.update(changes)
    return t


def _failed(t, hw=None, elem=2):
    from ex_engine.hardware import Hardware
    from ex_engine.registry import check_tuning
    return [c.name for c in check_tuning(t, hw or Hardware.from_profile("h200"), elem) if not c.ok]


def test_check_tuning_passes_a_good_tuning():
    """The control of the next test (registry.py:110/120/123/126/128 mutants): a tuning inside
    every limit, and vec_size at the 16-byte limit itself, passes every check."""
    assert _failed(_tuning()) == []
    assert _failed(_tuning(vec_size=8)) == []          # 8 * 2 B = 16 B: the limit itself


@pytest.mark.parametrize("changes,check", [
    # registry.py:110, ``1 <= tpb <= max`` -> ``tpb <= max``: a block of no threads passed
    ({"threads_per_block": 0, "num_warps": 0}, "threads_per_block <= max_threads_per_block"),
    # registry.py:120, ``0 <= smem <= optin`` -> ``smem <= optin``: negative shared memory passed
    ({"shared_mem_bytes": -1}, "shared_mem_bytes <= shared_mem_per_block_optin"),
    # registry.py:123, `` and vb <= 16`` dropped: a 32-byte vector of 2-byte elements passed
    ({"vec_size": 16}, "vec_size * element bytes <= 16"),
    # registry.py:126, items_per_thread ``>= 1`` -> ``>= 0``
    ({"items_per_thread": 0}, "items_per_thread >= 1"),
    # registry.py:128, num_stages ``>= 1`` -> ``>= 0``
    ({"num_stages": 0}, "num_stages >= 1"),
])
def test_check_tuning_refuses_each_value_just_outside_its_limit(changes, check):
    """registry.py:110/120/123/126/128 (check_tuning's lower and upper bounds loosened: tpb 0,
    negative shared memory, a vector wider than 16 bytes, items_per_thread 0, num_stages 0):
    the suite only tried a tuning whose threads_per_block was too large. Each value just outside
    its range fails exactly its own check."""
    assert _failed(_tuning(**changes)) == [check]


# ------------------------------------------------------------------------------ registry: what a library may claim
def test_the_last_reserved_id_is_refused_to_a_third_party_factor(tmp_path):
    """registry.py:1200, ``p.factor_id > abi.FACTOR_BUILTIN_LAST`` -> ``>=``: id 1023 (the last
    of ex_engine's reserved ids 0-1023) was given to a third-party library; 1024, the first
    third-party id, loads."""
    from ex_engine import abi
    build_plugin(tmp_path / "last", defines={"FACTOR_ID": abi.FACTOR_BUILTIN_LAST})
    p = FactorRegistry.load(tmp_path / "last", hardware="h200").plugins[0]
    assert p.status == "rejected" and p.reason.startswith("factor id: ") and "reserved range" in p.reason, p.reason
    build_plugin(tmp_path / "first", defines={"FACTOR_ID": abi.FACTOR_BUILTIN_LAST + 1})
    p = FactorRegistry.load(tmp_path / "first", hardware="h200").plugins[0]
    assert p.status == "ready", p.reason


def test_the_fallback_import_probe_skips_a_module_already_imported(tmp_path):
    """registry.py:1235, `` and mod not in sys.modules`` dropped: a fallback module this
    process has imported already (it ran here without ending it) was imported again in a child
    process on every probed load (a child start per plugin for nothing)."""
    import importlib
    importlib.import_module("tests.plugins.host_scale_fallback")
    build_plugin(tmp_path)
    p = FactorRegistry.load(tmp_path, hardware="h200", probe="subprocess").plugins[0]
    assert p.status == "ready", p.reason
    assert not any(c.name == "python fallback probe (child process)" for c in p.checks), \
        [c.name for c in p.checks]


def test_a_host_factor_library_that_carries_gpu_code_is_refused(tmp_path):
    """registry.py:1210, the "memory" check (a manifest saying memory: host for a library with
    GPU code) made always true: a CUDA library would be handed host pointers. The shipped
    fused_add_rmsnorm.so, beside a copy of its manifest that says memory: host, is refused."""
    import shutil
    from tests.conftest import ROOT
    lib = ROOT / "factors" / "fused_add_rmsnorm.so"
    if not lib.exists():
        pytest.skip("factors/fused_add_rmsnorm.so not built")
    shutil.copy(lib, tmp_path / "fused_add_rmsnorm.so")
    text = (ROOT / "manifests" / "fused_add_rmsnorm.yaml").read_text(encoding="utf-8")
    assert "\nmemory: device" in text or "\nmemory:" not in text
    text = text.replace("\nmemory: device", "") + "\nmemory: host\n"
    (tmp_path / "fused_add_rmsnorm.yaml").write_text(text, encoding="utf-8")
    p = FactorRegistry.load(tmp_path, hardware="h200").plugins[0]
    assert p.status == "rejected" and p.reason.startswith("memory: ") and "GPU code" in p.reason, p.reason


def test_a_higher_version_wins_over_a_higher_priority(tmp_path):
    """registry.py:1317, the sort key's ``q.version_key(), q.priority`` swapped: priority
    decided before version. The rule is version first, then priority (README, _win_rule); the
    suite's cases never set the two against each other."""
    build_plugin(tmp_path, "a_new", defines={"VERSION": '"2.0.0"', "PRIORITY": 0})
    build_plugin(tmp_path, "b_loud", defines={"VERSION": '"1.0.0"', "PRIORITY": 9})
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    assert reg.get("host_scale").path.stem == "a_new"
    loser = next(p for p in reg.plugins if p.path.stem == "b_loud")
    assert loser.status == "shadowed" and "higher version wins: 2.0.0 over 1.0.0" in loser.reason


# ------------------------------------------------------------------------------ distributed
@pytest.fixture(scope="module")
def empty_reg(tmp_path_factory):
    """A registry with no plugins: every call takes the Python fallback."""
    return FactorRegistry.load(tmp_path_factory.mktemp("empty"), hardware="h200")


def test_expert_parallel_layer_refuses_strided_weights(empty_reg):
    """distributed.py:380, the constructor's contiguity check of w13 / w2 dropped: a strided
    view of the weights was accepted (the factor reads them as contiguous blocks)."""
    from ex_engine import LayoutError
    from ex_engine.distributed import ExpertParallelMoE
    w13 = np.zeros((2, 8, 16), np.float16)[:, :, ::2]       # (2, 8, 8), strided
    w2 = np.zeros((2, 8, 4), np.float16)
    assert not w13.flags.c_contiguous
    with pytest.raises(LayoutError, match="argument 'w13'"):
        ExpertParallelMoE(w13, w2, 2, rank=0, world_size=1, registry=empty_reg)
    w13 = np.zeros((2, 8, 8), np.float16)
    w2 = np.zeros((2, 8, 8), np.float16)[:, :, ::2]         # (2, 8, 4), strided
    with pytest.raises(LayoutError, match="argument 'w2'"):
        ExpertParallelMoE(w13, w2, 2, rank=0, world_size=1, registry=empty_reg)


def test_expert_parallel_layer_refuses_an_odd_gate_up_dim(empty_reg):
    """distributed.py:367, the constructor's ``I2 % 2 or I2 == 0`` -> ``I2 == 0``: a w13 of 3
    rows per expert (no [gate; up] split) was taken as I = 1 (from_global checks it on its own,
    the constructor did not)."""
    from ex_engine import ShapeError
    from ex_engine.distributed import ExpertParallelMoE
    with pytest.raises(ShapeError, match="argument 'w13'"):
        ExpertParallelMoE(np.zeros((1, 3, 4), np.float16), np.zeros((1, 4, 1), np.float16), 1,
                          rank=0, world_size=1, registry=empty_reg)


def test_init_from_env_refuses_a_rank_outside_the_world(monkeypatch):
    """distributed.py:150, ``not 0 <= rank < world`` -> ``not 0 <= rank``: RANK=2 of WORLD_SIZE=2
    went on to the rendezvous (which waits for a rank that cannot join, or fails with
    torch's message) instead of an ArgumentError naming RANK."""
    pytest.importorskip("torch")
    from ex_engine import ArgumentError
    from ex_engine.distributed import init_from_env
    for v in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ArgumentError, match="'RANK'"):
        init_from_env(backend="gloo")


def test_forward_refuses_a_process_group_of_another_rank_or_size(tmp_path, empty_reg):
    """distributed.py:534, _check_group's ``(r, n) != (self.rank, self.world_size)`` check
    dropped: a layer built for rank 0 of 2 ran its all-reduce in a group of one process and
    returned rank 0's partial output as the layer's (half the experts missing), silently."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from ex_engine.distributed import ExpertParallelMoE
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("torch.distributed unavailable or already initialised")
    G, H, I, T = 4, 8, 4, 3
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(G, 2 * I, H, generator=gen).to(torch.bfloat16)
    w2 = torch.randn(G, H, I, generator=gen).to(torch.bfloat16)
    layer = ExpertParallelMoE.from_global(w13, w2, rank=0, world_size=2, registry=empty_reg)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    w = torch.full((T, 2), 0.5)
    ids = torch.tensor([[0, 3], [1, 2], [3, 0]], dtype=torch.int32)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        with pytest.raises(FactorError, match="built for rank 0 of 2, the process group is rank 0 of 1"):
            layer(x, w, ids)
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------ transformers integration
def _hf():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from ex_engine.integrations import transformers as hf
    from tests.test_integrations import tiny_model
    return hf, tiny_model


def test_a_subclass_of_a_supported_block_is_found_along_the_mro():
    """transformers.py:170, the adapter matched on ``cls.__name__`` along the MRO -> only on
    the module's own class name: a model whose MoE blocks subclass Qwen3MoeSparseMoeBlock (as a
    fork or a quantisation wrapper defines them) was 'no sparse-MoE block'."""
    hf, tiny_model = _hf()
    m = tiny_model("qwen3_moe")
    blocks = hf.find_moe_blocks(m)
    assert len(blocks) == 2
    for _, blk, _ in blocks:
        blk.__class__ = type("MyQwen3Block", (type(blk),), {})
    found = hf.find_moe_blocks(m)
    assert [(type(b).__name__, a.family) for _, b, a in found] == [("MyQwen3Block", "qwen3_moe")] * 2


@pytest.mark.parametrize("change,message", [
    # transformers.py:248: a router bias (the factor has none) dropped from the checks
    (lambda blk: setattr(blk.gate, "bias", __import__("torch").nn.Parameter(
        __import__("torch").zeros(blk.gate.weight.shape[0], dtype=blk.gate.weight.dtype))),
     "router bias is not supported"),
    # transformers.py:253: an activation other than SiLU accepted
    (lambda blk: setattr(blk.experts, "config", type("C", (), {"hidden_act": "gelu"})()),
     "hidden_act: expected 'silu'"),
    # transformers.py:259: experts stored transposed accepted as (E, 2I, H)
    (lambda blk: setattr(blk.experts, "is_transposed", True), "stored transposed"),
    # transformers.py:274: ``1 <= K <= E`` -> ``K <= E``: top_k 0 accepted
    (lambda blk: setattr(blk.gate, "top_k", 0), "top_k: expected 1.."),
], ids=["router_bias", "activation", "transposed", "top_k_0"])
def test_blocks_the_factors_cannot_serve_are_refused(change, message, empty_reg):
    """transformers.py:248/253/259/274 (_check_block's refusals of a router bias, another
    activation, transposed experts and top_k 0, each dropped in turn): the patched model would
    have computed something else than the stock one, without a word. Nothing is patched."""
    hf, tiny_model = _hf()
    m = tiny_model("qwen3_moe")
    for _, blk, _ in hf.find_moe_blocks(m):
        change(blk)
    with pytest.raises(hf.UnsupportedModelError, match=message):
        hf.patch_moe(m, registry=empty_reg)
    assert all("forward" not in vars(mod) for mod in m.modules())


def test_a_model_on_the_meta_device_is_refused(empty_reg):
    """transformers.py:514, ``elif d.type != "cpu": raise`` dropped: a model on the meta device
    (no memory: weights not loaded yet) was patched, its first call failing inside a factor."""
    hf, tiny_model = _hf()
    m = tiny_model("qwen3_moe", device="meta")
    with pytest.raises(hf.UnsupportedModelError, match="expected a CUDA device or the CPU"):
        hf.patch_moe(m, registry=empty_reg)


def test_patched_experts_return_the_dtype_of_their_input(empty_reg):
    """transformers.py:362, the cast of the factor's output back to hidden_states' dtype
    dropped: float32 activations into bf16 experts came back bf16 (the stock experts return
    their input's dtype)."""
    hf, tiny_model = _hf()
    import torch
    m = tiny_model("qwen3_moe")
    (_, blk, _), *_ = hf.find_moe_blocks(m)
    x = torch.randn(3, blk.gate.weight.shape[1], generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
    w = torch.full((3, 2), 0.5)
    with hf.patch_moe(m, registry=empty_reg), torch.no_grad():
        out = blk.experts(x, ids, w)
    assert out.dtype == torch.float32 and out.shape == x.shape


# ------------------------------------------------------------------------------ tuning
def _tuning_file(tmp_path, **over):
    from tests.test_tuning import H200, _mt, write
    from ex_engine.tuning import TuningTable, TuningWarning
    with pytest.warns(TuningWarning) if over.pop("_bad", False) else _no_warning():
        return TuningTable.for_hardware(H200, write(tmp_path, _mt(**over)))


class _no_warning:
    def __enter__(self):
        import warnings
        self._cm = warnings.catch_warnings()
        self._cm.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)


def test_a_tuning_table_with_two_rows_of_one_T_is_malformed(tmp_path):
    """tuning.py:132, the "distinct T" test of a shape's rows made always false: two rows at
    T = 64 naming different choices were both kept and bisect picked one of them by accident."""
    from tests.test_tuning import SHAPE
    t = _tuning_file(tmp_path, shapes=[{**SHAPE, "by_T": [[64, "mid"], [64, "tiny"]]}], _bad=True)
    assert t.factors == {} and len(t.problems) == 1 and "distinct T" in t.problems[0], t.problems


@pytest.mark.parametrize("row", [[True, "tiny"], [1, True]], ids=["T", "choice"])
def test_a_tuning_table_refuses_booleans_for_integers(tmp_path, row):
    """tuning.py:70, _int's ``isinstance(v, bool) or`` dropped: a YAML `true` (a typo'd row)
    was read as T = 1 or as configuration 1."""
    from tests.test_tuning import SHAPE
    t = _tuning_file(tmp_path, shapes=[{**SHAPE, "by_T": [row]}], _bad=True)
    assert t.factors == {} and len(t.problems) == 1, t.problems


def test_a_tuning_table_serves_only_the_dim_it_names(tmp_path):
    """tuning.py:413, `` and ft.dim == dim`` dropped from TuningTable.value: a table written for
    moe_fused_gemm's dim 'config' answered a lookup of another dim of that factor (a manifest
    with two tuned dims got config's choices for both)."""
    from tests.test_tuning import SHAPE
    t = _tuning_file(tmp_path, shapes=[{**SHAPE, "by_T": [[1, "mid"]]}])
    sizes = {**SHAPE, "T": 8}
    assert t.value("moe_fused_gemm", "config", sizes, -1) == 2
    from ex_engine.tuning import TuningWarning
    with pytest.warns(TuningWarning, match="no tuned other_dim"):   # (H200 here is live: it warns)
        assert t.value("moe_fused_gemm", "other_dim", sizes, -7) == -7


# ------------------------------------------------------------------------------ arrays
def test_f32_to_bf16_keeps_every_nan_a_nan():
    """arrays.py:110, the NaN case of f32_to_bf16_bits dropped (``xp.isnan(f)`` -> all False):
    rounding a NaN's bits carried into the exponent, so a NaN whose payload sits in the low bits
    became +inf (0x7F800001) or -0.0 (0x7FFFFFFF) in bfloat16."""
    from ex_engine.arrays import bf16_bits_to_f32, f32_to_bf16_bits
    bits = np.array([0x7F800001, 0x7FFFFFFF, 0xFF800001, 0x7FC00000], np.uint32)
    out = f32_to_bf16_bits(np, bits.view(np.float32))
    assert np.isnan(bf16_bits_to_f32(np, out)).all(), [hex(int(b)) for b in out]


@pytest.mark.parametrize("shape,byte_strides", [((3, 4), (24, 6)), ((3, 4), (30, 4)), ((2, 3, 4), (60, 20, 6))],
                         ids=["2d_inner", "2d_outer", "3d_inner"])
def test_a_byte_stride_that_is_no_whole_element_stays_fractional(shape, byte_strides):
    """arrays.py:327/328 (TensorRef._from_buffer: the 2-D test ``s0 % isz or s1 % isz`` ->
    ``s0 % isz``, and the N-D ``any(...)`` -> ``all(...)``): a float32 view whose byte stride is
    6 (1.5 elements) was floored to a whole element, so the validator (which refuses fractional
    strides) let the kernel read misaligned, wrong elements."""
    from ex_engine.arrays import TensorRef
    buf = np.zeros(64, np.float32)
    x = np.lib.stride_tricks.as_strided(buf, shape=shape, strides=byte_strides)
    s = TensorRef.of(x).strides
    assert s == tuple(b / 4 for b in byte_strides), s
    assert any(v != int(v) for v in s)


def test_an_empty_array_is_contiguous_whatever_its_strides():
    """arrays.py:360, ``if self.size == 0: return True`` dropped: an empty array described by
    __cuda_array_interface__ with strides a contiguous one would not have (libraries give an
    empty view the strides of what it was cut from) was called non-contiguous and refused."""
    from ex_engine.arrays import TensorRef
    ref = TensorRef(None, "cai", 0, (0, 3), (7, 5), "float32", 4, 0)
    assert ref.is_contiguous()
    assert not TensorRef(None, "cai", 0, (2, 3), (7, 5), "float32", 4, 0).is_contiguous()


# ------------------------------------------------------------------------------ _paths
def test_empty_entries_of_a_search_path_are_dropped(tmp_path):
    """_paths.py:116, `` if part`` dropped from search_path: an empty entry ('a::b', a trailing
    ':' as shell scripts leave in EX_ENGINE_MANIFESTS=$X:$EX_ENGINE_MANIFESTS) became Path(''),
    the current folder, searched for manifests nobody meant."""
    from pathlib import Path
    from ex_engine import _paths
    a, b = tmp_path / "a", tmp_path / "b"
    assert _paths.search_path(f"{a}{os.pathsep}{os.pathsep}{b}{os.pathsep}") == [a, b]
    assert _paths.search_path(os.pathsep) == []
    a.mkdir()
    usable, notes = _paths.usable_folders(f"{a}{os.pathsep}", "manifests_dir")
    assert usable == [a] and notes == [] and Path("") not in usable


# ------------------------------------------------------------------------------ abi
def test_abi_dlopen_opens_the_file_named_not_one_found_on_the_library_path(tmp_path, monkeypatch):
    """abi.py:119, ``str(Path(path).absolute())`` -> ``str(path)``: a bare file name
    ('host_scale.so', as a listing of '.' gives) went to dlopen as is, which searches
    LD_LIBRARY_PATH and the system folders for it instead of opening the file in the current
    folder (another file than the one whose bytes were checked, or none)."""
    from ex_engine import abi
    build_plugin(tmp_path)
    monkeypatch.chdir(tmp_path)
    lib = abi.dlopen("host_scale.so")
    assert int(lib.ex_abi_version) >> 16 == abi.ABI_VERSION_MAJOR


# ------------------------------------------------------------------------------ cli
@pytest.mark.parametrize("item", ["host_scale=", "=host_scale.so"])
def test_cli_prefer_needs_a_name_and_a_file(item):
    """cli.py:90, ``not sep or not name or not lib`` -> ``not sep``: `--prefer host_scale=`
    became prefer={'host_scale': ''}, which the registry ignores (an empty choice prefers
    nothing) without a word; `--prefer =x.so` named no factor."""
    from ex_engine.cli import _prefer
    with pytest.raises(FactorError, match="expected NAME=FILE"):
        _prefer([item])
    assert _prefer(["host_scale=host_scale.so"]) == {"host_scale": "host_scale.so"}


# ------------------------------------------------------------------------------ hardware
def test_to_c_keeps_a_long_device_name_nul_terminated():
    """hardware.py:150, ``self.name.encode()[:255]`` -> ``[:256]``: a 300-character device name
    filled all 256 bytes of ex_hardware_t.name, leaving no NUL: a plugin's strlen/strcmp of
    hw->name read past the field."""
    import dataclasses
    from ex_engine import abi
    from ex_engine.hardware import Hardware
    hw = dataclasses.replace(Hardware.from_profile("h200"), name="N" * 300)
    c = hw.to_c(abi.ffi)
    assert c.name[255] == b"\0"
    assert abi.ffi.string(c.name) == b"N" * 255


def test_a_hardware_profile_with_an_unknown_key_is_refused(tmp_path):
    """hardware.py:219, ``if problem: raise`` (unknown keys of a profile) dropped: a misspelt
    field beside the right ones (``warpsize: 64`` meant to change warp_size) was ignored, and the
    profile loaded with the value it was meant to override."""
    import yaml
    from tests.conftest import ROOT
    from ex_engine.hardware import Hardware
    data = yaml.safe_load((ROOT / "manifests" / "hardware" / "h200.yaml").read_text(encoding="utf-8"))
    data["warpsize"] = 64
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    with pytest.raises(FactorError, match="warpsize"):
        Hardware.from_profile(str(path))
