"""dispatch's short path (a call whose signature matches a checked one): it runs the plugin on
the new pointers with the same results, and everything that can differ between two such calls
(alignment, overlap with a written array, a misspelt name, writability, the plugin chosen,
declines and errors of the C call) is still caught, by the full checks and with their errors.
On the CPU with the tests' host plugin (host_scale.c) and NumPy arrays; the GPU tests run the
same path on torch tensors and CuPy arrays."""
import numpy as np
import pytest

from ex_engine import FactorRegistry, KernelError
from ex_engine.arrays import TensorRef
from ex_engine.errors import ArgumentError, DTypeError, LayoutError
from tests.conftest import build_plugin
from tests.test_dispatch_trust import ws_plugin


def host_reg(folder, **defines):
    build_plugin(folder, defines=defines or None)
    reg = FactorRegistry.load(folder, hardware="h200")
    assert reg.get("host_scale") is not None, reg.plugins[0].reason
    return reg


def args(n=7, alpha=2.5, seed=0):
    x = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    return {"x": x, "out": np.full(n, np.nan, np.float32), "alpha": np.array([alpha], np.float32)}


class FullSpy:
    """Counts the calls that went through the full checks."""

    def __init__(self, reg, monkeypatch):
        self.n = 0
        full = reg._dispatch_full

        def spy(*a, **kw):
            self.n += 1
            return full(*a, **kw)
        monkeypatch.setattr(reg, "_dispatch_full", spy)


def test_the_second_call_takes_the_short_path_with_new_pointers(tmp_path, monkeypatch):
    reg = host_reg(tmp_path)
    spy = FullSpy(reg, monkeypatch)
    for seed in range(4):   # fresh arrays every call: other pointers, the same signature
        a = args(seed=seed, alpha=1.5 + seed)
        assert reg.dispatch("host_scale", a) == "plugin"
        np.testing.assert_allclose(a["out"], (1.5 + seed) * a["x"], rtol=1e-6)
    assert spy.n == 1
    assert reg.stats()["host_scale"]["plugin"] == 4
    assert reg.last_path["host_scale"] == "plugin"
    a = args(n=9)                      # another shape: checked in full, then short again
    reg.dispatch("host_scale", a)
    reg.dispatch("host_scale", args(n=9))
    assert spy.n == 2
    np.testing.assert_allclose(a["out"], 2.5 * a["x"], rtol=1e-6)


def test_a_written_array_overlapping_another_is_refused_on_the_short_path(tmp_path, monkeypatch):
    reg = host_reg(tmp_path)
    reg.dispatch("host_scale", args())
    a = args()
    a["out"] = a["x"]                  # same signature as the checked call, out is x
    with pytest.raises(LayoutError, match="out.*overlaps 'x'"):
        reg.dispatch("host_scale", a)
    buf = np.zeros(14, np.float32)
    buf[:7] = np.arange(7)
    with pytest.raises(LayoutError, match="out.*overlaps 'x'"):   # three elements shared
        reg.dispatch("host_scale", {"x": buf[:7], "out": buf[4:11], "alpha": np.array([3.0], np.float32)})
    spy = FullSpy(reg, monkeypatch)
    for _ in range(2):                 # views of one buffer side by side: allowed
        assert reg.dispatch("host_scale", {"x": buf[:7], "out": buf[7:], "alpha": np.array([3.0], np.float32)}) \
            == "plugin"
    np.testing.assert_allclose(buf[7:], 3.0 * np.arange(7))
    assert spy.n == 0
    assert reg.stats()["host_scale"]["errors"] == 2


def test_misaligned_read_only_and_misspelt_still_raise_after_a_valid_call(tmp_path):
    reg = host_reg(tmp_path)
    reg.dispatch("host_scale", args())
    a = args()
    raw = np.zeros(8 * 4 + 2, np.uint8)
    x = np.frombuffer(raw.data, np.float32, count=7, offset=2 + (-raw.ctypes.data) % 4)
    a["x"] = x                         # same dtype, shape, strides; not 4-byte aligned
    with pytest.raises(LayoutError, match="alignment"):
        reg.dispatch("host_scale", a)
    a = args()
    a["out"].flags.writeable = False
    with pytest.raises(LayoutError, match="writable"):
        reg.dispatch("host_scale", a)
    a = args()
    a["alhpa"] = None                  # a None value under a misspelt name
    with pytest.raises(ArgumentError, match="alhpa"):
        reg.dispatch("host_scale", a)
    assert reg.stats()["host_scale"]["errors"] == 3
    a = args()
    assert reg.dispatch("host_scale", a) == "plugin"   # and the short path still serves
    np.testing.assert_allclose(a["out"], 2.5 * a["x"], rtol=1e-6)


@pytest.mark.parametrize("behaviour,path", [(1, "kernel_fallback"), (2, "python_fallback")])
def test_declines_take_the_same_paths_on_the_short_path(tmp_path, behaviour, path, monkeypatch):
    reg = host_reg(tmp_path, BEHAVIOUR=behaviour)
    spy = FullSpy(reg, monkeypatch)
    for seed in range(3):
        a = args(seed=seed)
        assert reg.dispatch("host_scale", a) == path
        want = (2.0 if behaviour == 1 else 2.5) * a["x"]   # kernel_fallback doubles, alpha unread
        np.testing.assert_allclose(a["out"], want, rtol=1e-6)
    assert spy.n == 1
    assert reg.stats()["host_scale"][path] == 3


def test_a_kernel_error_is_raised_and_counted_on_every_call(tmp_path):
    reg = host_reg(tmp_path, BEHAVIOUR=3)
    for _ in range(3):
        with pytest.raises(KernelError, match="N must be even"):
            reg.dispatch("host_scale", args())
    assert reg.stats()["host_scale"]["errors"] == 3


def test_the_workspace_is_reused_and_grown_on_the_short_path(tmp_path, monkeypatch):
    reg = ws_plugin(tmp_path)
    spy = FullSpy(reg, monkeypatch)
    for n in (7, 7, 7, 5000, 5000):
        a = args(n=n, alpha=1.25)
        assert reg.dispatch("host_scale_ws", a) == "plugin"
        np.testing.assert_allclose(a["out"], 1.25 * a["x"], rtol=1e-6)
    assert spy.n == 2
    bufs = list(reg._workspaces.values())
    assert len(bufs) == 1 and bufs[0].nbytes >= 256 + 4 * 5000
    a = args(n=7, alpha=-1.0)          # the plugin flags a negative alpha in the status word
    reg.dispatch("host_scale_ws", a)
    with pytest.raises(Exception, match="alpha was negative"):
        reg.check_device_errors()


def test_another_plugin_chosen_or_tuning_changed_goes_through_the_full_path(tmp_path, monkeypatch):
    build_plugin(tmp_path, "host_scale_b", defines={"BEHAVIOUR": 1})   # declines; kernel_fallback: 2x
    reg = host_reg(tmp_path)
    first = next(p for p in reg.plugins if p.path.name == "host_scale.so")
    other = next(p for p in reg.plugins if p.path.name == "host_scale_b.so")
    reg._chosen["host_scale"] = first
    reg.dispatch("host_scale", args())
    spy = FullSpy(reg, monkeypatch)
    reg._chosen["host_scale"] = other  # as if the registry had chosen the other library
    for _ in range(2):
        a = args()
        reg.dispatch("host_scale", a)
        np.testing.assert_allclose(a["out"], 2.0 * a["x"], rtol=1e-6)
    assert spy.n == 1 and reg.last_path["host_scale"] == "kernel_fallback"
    reg._chosen["host_scale"] = first
    reg.dispatch("host_scale", args())
    assert spy.n == 2                  # the entry names the plugin it was checked against
    reg.dispatch("host_scale", args())
    assert spy.n == 2
    reg.set_tuning("host_scale", None)
    reg.dispatch("host_scale", args())
    assert spy.n == 3


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")   # np.matrix
def test_an_unhashable_parameter_or_an_odd_array_takes_the_full_path(tmp_path):
    from ex_engine.registry import _fast_key
    a = args()
    assert _fast_key("f", a, None) is not None
    assert _fast_key("f", a, {"eps": [1.0]}) is None
    assert _fast_key("f", a, {"eps": 1e-6}) != _fast_key("f", a, {"eps": 1e-5})
    assert _fast_key("f", a, {"flag": True})[0] != _fast_key("f", a, {"flag": 1})[0]
    assert _fast_key("f", [a["x"]], None) is None
    assert _fast_key("f", {"x": np.matrix([[1.0]])}, None) is None
    ro = a["x"].copy()
    ro.flags.writeable = False
    assert _fast_key("f", {"x": ro}, None)[0] != _fast_key("f", {"x": a["x"]}, None)[0]


def test_what_is_remembered_is_what_was_checked(tmp_path):
    """The short path's entry is filed under the checked descriptions, not under a second look
    at the arrays: a parameter whose hash changes an array's dtype mid-call (as another thread
    flipping a flag could) leaves no unchecked signature behind."""
    build_plugin(tmp_path)
    text = (tmp_path / "host_scale.yaml").read_text(encoding="utf-8") + "params: {eps: {type: float, default: 1.0}}\n"
    (tmp_path / "host_scale.yaml").write_text(text, encoding="utf-8")
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    assert reg.get("host_scale") is not None, reg.plugins[0].reason

    class Eps(float):
        hook = None

        def __hash__(self):
            if Eps.hook:
                Eps.hook()
                Eps.hook = None
            return float.__hash__(self)

    TensorRef.of(np.zeros(1, np.int32))   # int32's name known: the short path's key is read whole
    a = args()
    a["x"] = a["x"].view(np.int32)
    Eps.hook = lambda: setattr(a["x"], "dtype", np.float32)
    reg.dispatch("host_scale", a, {"eps": Eps(1.0)})   # the key read int32, the checks float32
    assert Eps.hook is None
    b = args()
    b["x"] = np.arange(1, 8, dtype=np.int32)
    with pytest.raises(DTypeError, match="x"):
        reg.dispatch("host_scale", b, {"eps": Eps(1.0)})


def test_a_tensorref_given_is_keyed_on_all_its_fields(tmp_path):
    reg = host_reg(tmp_path)
    a = args()
    ref = TensorRef.of(a["x"], "x")
    reg.dispatch("host_scale", {**a, "x": ref})
    bad = TensorRef.of(a["x"], "x")
    bad.contiguous = False             # says it is not contiguous: refused, as on a first call
    with pytest.raises(LayoutError, match="layout"):
        reg.dispatch("host_scale", {**a, "x": bad})


def test_the_workspace_size_is_asked_on_every_call(tmp_path):
    """A library loaded again may answer workspace_size differently (the Hopper plugin reads its
    settings at load): the short path asks on every call, as the full path does, and grows."""
    from ex_engine import abi
    reg = ws_plugin(tmp_path)
    for _ in range(2):
        reg.dispatch("host_scale_ws", args(n=7))
    plugin = reg.get("host_scale_ws")
    before = list(reg._workspaces.values())[0].nbytes
    bigger = abi.ffi.callback("int64_t(const int64_t *, int)", lambda dims, n: 1 << 20)
    plugin.factor.workspace_size = bigger
    a = args(n=7, alpha=0.5)
    reg.dispatch("host_scale_ws", a)
    np.testing.assert_allclose(a["out"], 0.5 * a["x"], rtol=1e-6)
    assert before < (1 << 20) <= max(b.nbytes for b in reg._workspaces.values())


def test_params_not_a_dict_and_int_parameters(tmp_path):
    build_plugin(tmp_path)
    text = (tmp_path / "host_scale.yaml").read_text(encoding="utf-8") + "params: {steps: {type: int, default: 1}}\n"
    (tmp_path / "host_scale.yaml").write_text(text, encoding="utf-8")
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    with pytest.raises(ArgumentError, match="params.*dict"):
        reg.dispatch("host_scale", args(), [("steps", 2)])
    for ok in (3, np.int64(3), np.int32(-2)):
        assert reg.dispatch("host_scale", args(), {"steps": ok}) == "plugin"
    for bad, why in ((2 ** 63, "int64 range"), (True, "an int"), (np.bool_(True), "an int"),
                     (2.0, "an int"), (np.array([2]), "an int")):
        with pytest.raises(ArgumentError, match=why):
            reg.dispatch("host_scale", args(), {"steps": bad})
    assert reg.stats()["host_scale"]["errors"] == 6
