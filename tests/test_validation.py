"""Arguments are checked against the manifest before any C call, with clear messages."""
import numpy as np
import pytest

from ex_engine import (ArgumentError, DeviceError, DTypeError, FactorRegistry, LayoutError,
                       ShapeError, moe_fused_gemm, topk_softmax)
from ex_engine.errors import DeviceSideError, FactorNotFoundError


class FakeDeviceArray:
    """Looks like a CUDA array (never dereferenced: validation fails before any call)."""

    def __init__(self, shape, typestr="<f4", ptr=0x7F0000000000):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, False),
                                         "strides": None, "version": 3}


@pytest.fixture(scope="module")
def reg(tmp_path_factory):
    return FactorRegistry.load(tmp_path_factory.mktemp("empty"), hardware="h200")


def moe_args(T=3, H=16, E=4, I=8, K=2, dtype=np.float16):
    rng = np.random.default_rng()
    return dict(hidden_states=rng.standard_normal((T, H)).astype(dtype),
                w13=rng.standard_normal((E, 2 * I, H)).astype(dtype),
                w2=rng.standard_normal((E, H, I)).astype(dtype),
                topk_weights=np.full((T, K), 0.5, np.float32),
                topk_ids=np.tile(np.arange(K, dtype=np.int32), (T, 1)))


def test_wrong_dtype_names_factor_argument_rule_and_values(reg):
    a = moe_args()
    a["topk_ids"] = a["topk_ids"].astype(np.int64)
    with pytest.raises(DTypeError) as e:
        moe_fused_gemm(**a, registry=reg)
    assert str(e.value) == "moe_fused_gemm: argument 'topk_ids': dtype: expected int32, got int64"


def test_weights_of_another_dtype_than_hidden_states(reg):
    a = moe_args()
    a["w2"] = a["w2"].astype(np.float32)
    with pytest.raises(DTypeError, match="argument 'w2': dtype: expected float16 or bfloat16, got float32"):
        moe_fused_gemm(**a, registry=reg)


def test_shape_relation(reg):
    a = moe_args(I=8)
    a["w2"] = a["w2"][:, :, :7].copy()
    with pytest.raises(ShapeError, match=r"argument 'w2': shape\[2\] = I: expected 8 \(I=8 from w13\), got 7"):
        moe_fused_gemm(**a, registry=reg)


def test_odd_w13_rows(reg):
    a = moe_args()
    a["w13"] = a["w13"][:, :15].copy()
    with pytest.raises(ShapeError, match=r"w13.*shape\[1\] = 2\*I.*expected a multiple of 2, got 15"):
        moe_fused_gemm(**a, registry=reg)


def test_wrong_rank(reg):
    a = moe_args()
    a["topk_ids"] = a["topk_ids"].reshape(-1)
    with pytest.raises(ShapeError, match=r"topk_ids': rank: expected 2 dims \('T', 'K'\), got 1 dims"):
        moe_fused_gemm(**a, registry=reg)


def test_non_contiguous(reg):
    a = moe_args()
    a["w2"] = np.asfortranarray(a["w2"])
    with pytest.raises(LayoutError, match="argument 'w2': layout: expected C-contiguous"):
        moe_fused_gemm(**a, registry=reg)


def test_misaligned_pointer(reg):
    buf = np.zeros(3 * 8 * 4 + 1, np.uint8)
    logits = np.frombuffer(buf.data, np.float32, 24, offset=1).reshape(3, 8)  # address odd
    with pytest.raises(LayoutError, match="router_logits': alignment: expected address a multiple of 4"):
        topk_softmax(logits, 2, registry=reg)


def test_host_and_device_arrays_mixed(reg):
    a = moe_args()
    a["w13"] = FakeDeviceArray(a["w13"].shape, "<f2")
    with pytest.raises(DeviceError, match="argument 'w13': device: expected host memory, got cuda:0"):
        moe_fused_gemm(**a, registry=reg)


def test_unknown_and_mistyped_parameters(reg):
    x = np.ones((2, 8), np.float32)
    with pytest.raises(ArgumentError, match="unknown parameter"):
        reg.dispatch("topk_softmax", {"router_logits": x, "topk_weights": np.empty((2, 2), np.float32),
                                      "topk_ids": np.empty((2, 2), np.int32)}, {"renorm": True})
    with pytest.raises(ArgumentError, match="renormalize': type: expected a bool \\(or 0/1\\), got 'yes'"):
        topk_softmax(x, 2, "yes", registry=reg)


def test_missing_required_argument(reg):
    a = moe_args()
    with pytest.raises(ArgumentError, match="argument 'w2': required: expected an array, got None"):
        reg.dispatch("moe_fused_gemm", {**a, "w2": None, "out": np.empty((3, 16), np.float16)})


def test_not_an_array(reg):
    with pytest.raises(DTypeError, match="argument 'router_logits': type: expected a NumPy/CuPy array or a torch tensor, got list"):
        topk_softmax([[1.0, 2.0]], 1, registry=reg)


def test_unknown_factor(reg):
    with pytest.raises(FactorNotFoundError, match="no factor named 'nope'"):
        reg.dispatch("nope", {})


def test_errors_are_counted(reg):
    before = reg.stats().get("moe_fused_gemm", {}).get("errors", 0)
    a = moe_args()
    a["topk_weights"] = a["topk_weights"].astype(np.float16)
    with pytest.raises(DTypeError):
        moe_fused_gemm(**a, registry=reg)
    assert reg.stats()["moe_fused_gemm"]["errors"] == before + 1


@pytest.mark.parametrize("top_k", [0, -1, 2.0, "4", None, True, np.array(2.0), np.array([2])])
def test_top_k_must_be_a_positive_int(reg, top_k):
    lg = np.random.default_rng().standard_normal((3, 8)).astype(np.float32)
    with pytest.raises(ArgumentError, match="topk_softmax: argument 'top_k'.*expected an int >= 1"):
        topk_softmax(lg, top_k, registry=reg)


def test_top_k_must_match_the_outputs_given(reg):
    """Outputs of another width than top_k are an error (they once silently gave top-2 for
    top_k = 8) naming the output whose width disagrees (it once named top_k, with the output's
    width as 'expected' and top_k as 'got')."""
    lg = np.random.default_rng().standard_normal((3, 16)).astype(np.float32)
    w, ids = np.empty((3, 2), np.float32), np.empty((3, 2), np.int32)
    with pytest.raises(ShapeError, match=r"^topk_softmax: argument 'topk_weights': shape\[1\] = K: "
                                         r"expected top_k = 8 columns, got 2 \(its shape \(3, 2\)\)$"):
        topk_softmax(lg, 8, topk_weights=w, topk_ids=ids, registry=reg)
    with pytest.raises(ShapeError, match="^topk_softmax: argument 'topk_ids': .*expected top_k = 8 "):
        topk_softmax(lg, 8, topk_ids=ids, registry=reg)
    with pytest.raises(ShapeError, match="^topk_softmax: argument 'topk_weights': .*expected top_k = 2 "
                                         r"columns, got 3 \(its shape \(3, 3\)\)"):
        topk_softmax(lg, 2, topk_weights=np.empty((3, 3), np.float32), topk_ids=ids, registry=reg)
    w2, i2 = topk_softmax(lg, np.int64(2), topk_weights=w, topk_ids=ids, renormalize=np.True_, registry=reg)
    assert w2 is w and i2 is ids and np.allclose(w.sum(axis=1), 1.0, atol=1e-6)


@pytest.mark.parametrize("eps", [0.0, -10.0, float("nan"), float("inf"), True, "1e-6", [1e-6]])
def test_rmsnorm_eps_must_be_a_positive_number(reg, eps):
    from ex_engine import fused_add_rmsnorm
    x = np.ones((2, 8), np.float32)
    with pytest.raises(ArgumentError, match="fused_add_rmsnorm: argument 'eps'"):
        fused_add_rmsnorm(x, np.zeros_like(x), np.ones(8, np.float32), eps=eps, registry=reg)
    assert (x == 1).all()  # nothing ran


def test_read_only_output_and_misspelt_argument(reg):
    """A read-only NumPy output is refused before the call (NumPy's flag is a promise); an
    array name the manifest does not know is an error, not silently dropped."""
    x, residual, w = np.ones((2, 8), np.float32), np.zeros((2, 8), np.float32), np.ones(8, np.float32)
    residual.flags.writeable = False
    from ex_engine import fused_add_rmsnorm
    with pytest.raises(LayoutError, match="argument 'residual': writable: expected a writable array"):
        fused_add_rmsnorm(x, residual, w, registry=reg)
    assert (x == 1).all()
    a = moe_args()
    with pytest.raises(ArgumentError, match="argument 'expert_mapp': unknown argument"):
        reg.dispatch("moe_fused_gemm", {**a, "out": np.empty_like(a["hidden_states"]),
                                        "expert_mapp": np.arange(4, dtype=np.int32)})


def test_an_output_that_shares_memory_with_another_argument_is_refused(reg):
    """x is residual, out is hidden_states, two outputs in one buffer: refused before the call
    (the kernels treat them as distinct arrays; the result would be silently wrong), on the
    first call of a shape and on the cached path alike; row views of one wider buffer that
    share no byte (x = buf[:, :H], residual = buf[:, H:]) are accepted."""
    from ex_engine import fused_add_rmsnorm
    w = np.ones(8, np.float32)
    for _ in range(2):                                   # first call, then the bind cache's path
        x, residual = np.ones((2, 8), np.float32), np.zeros((2, 8), np.float32)
        fused_add_rmsnorm(x, residual, w, registry=reg)  # distinct arrays: fine
        with pytest.raises(LayoutError, match="argument 'x': memory: .* sharing no memory with "
                                              "'residual', got one that overlaps 'residual'"):
            fused_add_rmsnorm(x, x, w, registry=reg)
        buf = np.ones((2, 24), np.float32)
        with pytest.raises(LayoutError, match="overlaps 'residual'"):
            fused_add_rmsnorm(buf[:, :8], buf[:, 4:12], w, registry=reg)   # half of each row shared
        before = buf.copy()
        fused_add_rmsnorm(buf[:, :8], buf[:, 8:16], w, registry=reg)      # interleaved, disjoint
        assert (buf[:, 16:] == before[:, 16:]).all()
        b = np.ones((5, 16), np.float32)                 # weight inside x's span, sharing no byte
        fused_add_rmsnorm(b[:4, :8], np.zeros((4, 8), np.float32), b[1, 8:], registry=reg)
        flat = np.ones(64, np.float32)                   # rows of stride 7 and 9 in one buffer, disjoint
        x2 = np.lib.stride_tricks.as_strided(flat, (2, 3), (7 * 4, 4))
        r2 = np.lib.stride_tricks.as_strided(flat[3:], (2, 3), (9 * 4, 4))
        assert not np.shares_memory(x2, r2)
        fused_add_rmsnorm(x2, r2, np.ones(3, np.float32), registry=reg)
    a = moe_args()
    with pytest.raises(LayoutError, match="argument 'out': memory: .*overlaps 'hidden_states'"):
        moe_fused_gemm(**a, out=a["hidden_states"], registry=reg)
    both = np.zeros((2, 3, 2), np.float32)               # topk_weights and topk_ids in one buffer
    with pytest.raises(LayoutError, match="overlaps"):
        topk_softmax(np.ones((3, 4), np.float32), 2, topk_weights=both[0],
                     topk_ids=both[0].view(np.int32), registry=reg)


def test_as_bfloat16_takes_bit_patterns_only():
    """float16 (or float32) values handed to as_bfloat16 would be reinterpreted bit for bit."""
    from ex_engine.arrays import as_bfloat16
    assert as_bfloat16(np.zeros(4, np.uint16)).dtype == "bfloat16"
    for bad in (np.zeros(4, np.float16), np.zeros(4, np.float32)):
        with pytest.raises(TypeError, match="expected a 2-byte integer array .* got ndarray of dtype"):
            as_bfloat16(bad)
    # a real float16 / bfloat16 array needs no tag: the refusal says so
    with pytest.raises(TypeError, match="of dtype float16 \\(an array of that dtype needs no tag: pass it as it is\\)"):
        as_bfloat16(np.zeros(4, np.float16))
    ml_dtypes = pytest.importorskip("ml_dtypes")
    with pytest.raises(TypeError, match="of dtype bfloat16 \\(an array of that dtype needs no tag"):
        as_bfloat16(np.zeros(4, ml_dtypes.bfloat16))


def test_as_bfloat16_refusal_is_the_projects_argument_error_naming_bits():
    """as_bfloat16 (README's way to pass CuPy bf16) raised a plain TypeError naming no argument;
    now a DTypeError (a FactorError, still a TypeError for old callers) naming 'bits' and the
    dtype expected and got; Bits16's own refusals name their argument as well."""
    from ex_engine.arrays import Bits16, as_bfloat16
    from ex_engine.errors import ArgumentError, DTypeError, FactorError
    with pytest.raises(DTypeError) as e:
        as_bfloat16(np.zeros(3, np.float32))
    assert isinstance(e.value, FactorError) and isinstance(e.value, TypeError)
    assert (e.value.factor, e.value.argument, e.value.got) == ("as_bfloat16", "bits", "ndarray of dtype float32")
    assert str(e.value) == ("as_bfloat16: argument 'bits': dtype: expected a 2-byte integer array "
                            "(uint16 or int16 bit patterns), got ndarray of dtype float32")
    with pytest.raises(DTypeError, match="as_bfloat16: argument 'bits': .* got list"):
        as_bfloat16([1, 2, 3])
    with pytest.raises(DTypeError, match="as_bfloat16: argument 'bits': byte order: .* got dtype >u2"):
        as_bfloat16(np.zeros(3, ">u2"))
    with pytest.raises(DTypeError, match="Bits16: argument 'bits': dtype"):
        Bits16(np.zeros(3, np.float16), "float16")
    with pytest.raises(ArgumentError, match="Bits16: argument 'dtype': tag: expected 'bfloat16' or "
                                            "'float16', got 'float32'"):
        Bits16(np.zeros(3, np.uint16), "float32")


def test_bits16_float16_tag_byte_order_and_array_parameters(reg):
    """Bits16(..., 'float16') computes on the values its bits are; other tags and non-native byte
    orders are refused; a 0-d array parameter (unhashable) is checked and accepted, not a raw
    TypeError; a misspelt name passed as None is refused also on a cached call."""
    from ex_engine import fused_add_rmsnorm
    from ex_engine.arrays import Bits16
    vals = np.array([[1.0, 2.0, 0.5, 0.0]], np.float16)
    w16, ids16 = topk_softmax(Bits16(vals.view(np.uint16), "float16"), 2, registry=reg)
    w, ids = topk_softmax(vals, 2, registry=reg)
    assert (ids16 == ids).all() and np.allclose(w16, w) and abs(w16[0, 0] - 0.5793) < 1e-3
    with pytest.raises(ValueError, match="expected 'bfloat16' or 'float16', got 'float32'"):
        Bits16(np.zeros(4, np.uint16), "float32")
    with pytest.raises(TypeError, match="native byte order"):
        Bits16(np.zeros(4, ">u2"))
    with pytest.raises(DTypeError, match="non-native byte order"):
        topk_softmax(np.ones((2, 8), ">f4"), 2, registry=reg)
    x, r, g = np.ones((2, 8), np.float32), np.zeros((2, 8), np.float32), np.ones(8, np.float32)
    fused_add_rmsnorm(x, r, g, eps=np.array(1e-6), registry=reg)
    assert np.allclose(x, 1.0, atol=1e-3)
    a = dict(moe_args(), out=np.empty((3, 16), np.float16))
    reg.dispatch("moe_fused_gemm", a)
    with pytest.raises(ArgumentError, match="argument 'expert_mapp': unknown argument"):
        reg.dispatch("moe_fused_gemm", {**a, "expert_mapp": None})   # same signature: cached


def test_router_logits_of_another_width_than_the_expert_map_is_the_argument_named(reg):
    """G comes from expert_map when one is given (it defines the global experts), so router_logits
    of another width is the argument named, with where G came from (it named expert_map, the
    array the computation reads, with G taken from router_logits, which it never reads)."""
    a = moe_args(E=4)
    em = np.array([0, 1, 2, 3, -1, -1], np.int32)
    with pytest.raises(ShapeError, match=r"argument 'router_logits': shape\[1\] = G: expected 6 "
                                         r"\(G=6 from expert_map\), got 5"):
        moe_fused_gemm(**a, router_logits=np.zeros((3, 5), np.float32), expert_map=em, registry=reg)
    out = moe_fused_gemm(**a, router_logits=np.zeros((3, 6), np.float32), expert_map=em, registry=reg)
    assert out.shape == (3, 16) and np.isfinite(out.astype(np.float32)).all()


def test_lock_warn_needs_a_lock(tmp_path):
    from ex_engine import FactorError
    with pytest.raises(FactorError, match="lock_mode='warn': expected together with lock="):
        FactorRegistry.load(tmp_path, hardware="h200", lock_mode="warn")


def test_router_logits_wider_than_the_experts_asks_for_the_map_and_a_folder_loads_once(reg, tmp_path):
    """router_logits over more (or fewer) experts than w13 holds without an expert_map: the
    error names router_logits, the G it expected and why (G = E since no expert_map was given:
    under expert parallelism, the map is what is missing). It named expert_map, an argument the
    caller never passed, and for a width below K the correct topk_weights."""
    a = moe_args(E=4)
    for width in (5, 1):
        with pytest.raises(ShapeError, match=rf"argument 'router_logits': shape\[1\] = G: expected 4 "
                                             rf"\(G=4 from w13, as E: expert_map not given\), got {width}"):
            moe_fused_gemm(**a, router_logits=np.zeros((3, width), np.float32), registry=reg)
    from tests.conftest import build_plugin
    build_plugin(tmp_path)
    r = FactorRegistry.load(tmp_path, hardware="h200")
    again = r.load_folder(tmp_path)
    assert len(r.plugins) == 1 and again[0] is r.plugins[0] and r.get("host_scale").status == "ready"


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")   # np.asmatrix's own warning
def test_registry_and_dispatch_arguments_of_the_wrong_kind_are_named(tmp_path):
    """Each gives a FactorError naming the argument (they gave a raw TypeError/ValueError/
    AttributeError, or were accepted and made every later step fail)."""
    from ex_engine.errors import FactorError
    cases = [(dict(prefer=["x"]), "prefer: expected a mapping"),
             (dict(lock=123), "lock: expected a lock file path"),
             (dict(lock=""), "lock: expected a lock file path"),
             (dict(probe_timeout=-1), "probe_timeout: expected a number of seconds > 0"),
             (dict(probe_timeout=float("inf")), "probe_timeout: expected a number of seconds > 0"),
             (dict(manifests_dir=tmp_path / "nowhere"), "manifests_dir '.*nowhere': does not exist")]
    for kw, msg in cases:
        with pytest.raises(FactorError, match=msg):
            FactorRegistry.load(tmp_path, hardware="h200", **kw)
    with pytest.raises(FactorError, match="folder: expected a directory path, got int 5"):
        FactorRegistry.load(5, hardware="h200")
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    with pytest.raises(ArgumentError, match="topk_softmax: argument 'arrays': type: expected a dict"):
        reg.dispatch("topk_softmax", [1, 2])
    with pytest.raises(DTypeError, match="^topk_softmax: argument 'router_logits': type: expected a NumPy"):
        reg.dispatch("topk_softmax", {"router_logits": [1.0, 2.0]}, {"top_k": 1})
    x = np.random.default_rng().random((4, 8)).astype(np.float32)
    with pytest.raises(DTypeError, match="argument 'x': type: .* got matrix"):   # its * is a matmul
        from ex_engine import fused_add_rmsnorm
        fused_add_rmsnorm(np.asmatrix(x), np.asmatrix(x.copy()), np.ones(8, np.float32), registry=reg)
    # a masked array's mask would be dropped (a new-user trial: topk_softmax picked a masked expert)
    masked = np.ma.masked_array(x, mask=np.zeros(x.shape, bool))
    with pytest.raises(DTypeError, match="argument 'router_logits': type: .* got MaskedArray"):
        topk_softmax(masked, 2, registry=reg)
    for v in (1, np.int64(1), np.bool_(True), True):            # a bool, whatever integer type says it
        topk_softmax(x, 2, renormalize=v, registry=reg)
    for v in (2, 1.0, "1"):
        with pytest.raises(ArgumentError, match="argument 'renormalize': type: expected a bool"):
            topk_softmax(x, 2, renormalize=v, registry=reg)


def test_a_registry_argument_that_is_no_registry_is_named(reg):
    from ex_engine.errors import FactorError
    from ex_engine.distributed import ExpertParallelMoE
    x = np.ones((2, 4), np.float32)
    with pytest.raises(FactorError, match="registry: expected a FactorRegistry or None, got str 'x'"):
        topk_softmax(x, 2, registry="x")
    a = moe_args()
    with pytest.raises(FactorError, match="registry: expected a FactorRegistry or None, got dict"):
        moe_fused_gemm(**a, registry={})
    with pytest.raises(FactorError, match="registry: expected a FactorRegistry"):
        ExpertParallelMoE.from_global(a["w13"], a["w2"], rank=0, world_size=1, registry="x")


def test_run_moe_checks_its_arguments(reg):
    from ex_engine.errors import FactorError
    from ex_engine.moe_layer import run_moe
    for kw, msg in (({"tokens": -1}, "tokens: expected an int >= 1"),
                    ({"tokens": 0}, "tokens: expected an int >= 1"), ({"tokens": 2.5}, "tokens"),
                    ({"tokens": 1, "seed": -1}, "seed: expected an int >= 0"),
                    ({"tokens": 1, "repeat": 0}, "repeat: expected an int >= 1"),
                    ({"tokens": 1, "dtype": "foo"}, "dtype: expected 'bfloat16' or 'float16'")):
        with pytest.raises(FactorError, match=f"run_moe: {msg}"):
            run_moe("qwen3-30b-a3b", registry=reg, echo=lambda *a: None, **kw)


def test_a_size_or_the_workspace_passed_as_an_argument_is_named_as_such(reg):
    """dispatch(..., {"G": 4}) said 'argument G: type: expected a NumPy/CuPy array' (G is a size
    taken from the shapes, not an argument), and a workspace array 'unknown argument' without
    saying that the runtime supplies it."""
    a = dict(moe_args(), out=np.empty((3, 16), np.float16))
    with pytest.raises(ArgumentError, match="argument 'G': unknown argument: a size, taken from the arrays' shapes"):
        reg.dispatch("moe_fused_gemm", {**a, "G": 4})
    with pytest.raises(ArgumentError, match="argument 'workspace': unknown argument: the runtime supplies"):
        reg.dispatch("moe_fused_gemm", {**a, "workspace": np.zeros(256, np.uint8)})
    with pytest.raises(DTypeError, match="argument 'hidden_states': type: expected a NumPy/CuPy array"):
        reg.dispatch("moe_fused_gemm", {**a, "hidden_states": [1.0, 2.0]})


def test_an_absent_requires_with_a_number_on_the_left_still_holds(tmp_path):
    """'1 == N' when an optional array is absent: the early G = E step must not set a size
    named '1' (it made the constraint always true)."""
    from ex_engine.manifest import Manifest
    from ex_engine.arrays import TensorRef
    from tests.conftest import ROOT
    text = (ROOT / "tests" / "plugins" / "host_scale.yaml").read_text(encoding="utf-8").replace(
        "  - {name: alpha, shape: [1], dtype: [float32], role: input}",
        "  - {name: alpha, shape: [1], dtype: [float32], role: input}\n"
        "  - {name: g, shape: [N], dtype: [float32], role: input, optional: true, absent_requires: \"1 == N\"}\n"
        "  - {name: h, shape: [N], dtype: [float32], role: input, optional: true}")
    (tmp_path / "m.yaml").write_text(text, encoding="utf-8")
    m = Manifest.load(tmp_path / "m.yaml")
    refs = {k: TensorRef.of(np.zeros(n, np.float32), k) for k, n in (("x", 7), ("out", 7), ("alpha", 1), ("h", 7))}
    with pytest.raises(ShapeError, match="1 == N when g is not given"):
        m.bind(refs, {})


def test_an_unknown_argument_is_counted_and_raised_without_a_chained_type_error(reg):
    a = dict(moe_args(), out=np.empty((3, 16), np.float16))
    before = reg.stats().get("moe_fused_gemm", {}).get("errors", 0)
    with pytest.raises(ArgumentError) as e:
        reg.dispatch("moe_fused_gemm", {**a, "G": 4})
    assert e.value.__cause__ is None and e.value.__suppress_context__
    assert reg.stats()["moe_fused_gemm"]["errors"] == before + 1


def test_path_arguments_of_load_and_its_helpers_are_named(tmp_path):
    """load(manifests_dir=3), load_folder(3) and load_library(None) gave a raw TypeError
    ('expected str, bytes or os.PathLike object'): each is a FactorError naming the argument."""
    from ex_engine.errors import FactorError
    for value in (3, ["m"], b"x"[0]):
        with pytest.raises(FactorError, match=rf"^manifests_dir: expected a directory path or None, "
                                              rf"got {type(value).__name__} "):
            FactorRegistry.load(tmp_path, hardware="h200", manifests_dir=value)
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    with pytest.raises(FactorError, match="^folder: expected a directory path, got int 3"):
        reg.load_folder(3)
    with pytest.raises(FactorError, match="^path: expected a library file path, got NoneType None"):
        reg.load_library(None)
    assert reg.plugins == []


def test_registry_setters_refuse_what_would_fail_every_later_call(tmp_path):
    """set_default_registry("x"), set_fallback(name, 5) and set_tuning(name, 5) were accepted
    and made the next call fail with a raw AttributeError / "'int' object is not callable";
    unknown factor names were accepted silently. Each is refused at the setter, naming it."""
    import ex_engine
    from ex_engine import ops
    from ex_engine.errors import FactorError
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    saved = ops._default
    try:
        for bad in ("x", 5, object()):
            with pytest.raises(FactorError, match=r"^registry: expected a FactorRegistry or None, got "):
                ex_engine.set_default_registry(bad)
        assert ops._default is saved
        ex_engine.set_default_registry(reg)
        assert ex_engine.default_registry() is reg
    finally:
        ops._default = saved
    for setter in (reg.set_fallback, reg.set_tuning):
        with pytest.raises(FactorNotFoundError, match="no factor named 'nope': known are "):
            setter("nope", lambda *a: None)
    with pytest.raises(FactorError, match=r"^set_fallback: fn: expected a callable fn\(arrays, sizes, "
                                          r"params\), got int 5"):
        reg.set_fallback("topk_softmax", 5)
    import os
    with pytest.raises(FactorError, match=r"^set_fallback: fn: .* got one with signature \(command\)"):
        reg.set_fallback("topk_softmax", os.system)
    with pytest.raises(FactorError, match=r"^set_tuning: fn: expected a callable fn\(sizes\) -> int or "
                                          r"None, got int 5"):
        reg.set_tuning("moe_fused_gemm", 5)
    with pytest.raises(FactorError, match="^set_tuning: topk_softmax: expected a factor with tuned dims"):
        reg.set_tuning("topk_softmax", lambda sizes: 1)
    x = np.random.default_rng().standard_normal((4, 8)).astype(np.float32)
    assert topk_softmax(x, 2, registry=reg)[0].shape == (4, 2)   # nothing was set
    reg.set_tuning("topk_softmax", None)                          # None: always fine,
    for setter in (reg.set_fallback, reg.set_tuning):             # also for a name not known
        setter("nope", None)                                      # (yet): cleanup code


def test_a_fallback_that_raises_is_named_and_counted_as_an_error(tmp_path):
    """A fallback that raised gave the caller its raw TypeError, and stats() stayed {}: the
    call is a FactorError naming the factor and the fallback, counted in 'errors' (what
    stats() documents); a FactorError of its own passes as it is (counted too), and a
    return value that is not None or a Counter of flag texts is named."""
    from ex_engine.errors import FactorError
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    x = np.random.default_rng().standard_normal((4, 8)).astype(np.float32)

    def broken(arrays, sizes, params):
        raise TypeError("system() takes at most 1 argument")

    reg.set_fallback("topk_softmax", broken)
    for n in (1, 2):   # the second call takes the same path: still named, still counted
        with pytest.raises(FactorError, match=r"^topk_softmax: the Python fallback set with set_fallback "
                                              r"\(.*broken\) raised TypeError: system\(\) takes"):
            topk_softmax(x, 2, registry=reg)
        assert reg.stats()["topk_softmax"]["errors"] == n, reg.stats()

    def own(arrays, sizes, params):
        raise ShapeError("topk_softmax", "router_logits", "rule", "this", "that")

    reg.set_fallback("topk_softmax", own)
    with pytest.raises(ShapeError, match="^topk_softmax: argument 'router_logits': rule"):
        topk_softmax(x, 2, registry=reg)
    reg.set_fallback("topk_softmax", lambda arrays, sizes, params: 5)
    with pytest.raises(FactorError, match=r"^topk_softmax: the Python fallback set with set_fallback "
                                          r"\(.*<lambda>\) returned int 5; expected None, a Counter"):
        topk_softmax(x, 2, registry=reg)
    assert reg.stats()["topk_softmax"] == {"plugin": 0, "kernel_fallback": 0, "python_fallback": 0,
                                           "errors": 4}

    def oom(arrays, sizes, params):   # out of memory stays a MemoryError (the CLI's handler, and
        raise MemoryError("no room")  # callers catching CuPy's OutOfMemoryError, rely on it)

    reg.set_fallback("topk_softmax", oom)
    with pytest.raises(MemoryError, match="no room"):
        topk_softmax(x, 2, registry=reg)
    assert reg.stats()["topk_softmax"]["errors"] == 5
    from ex_engine import fallbacks   # (it must write its outputs: unwritten ones are an error)
    reg.set_fallback("topk_softmax", lambda arrays, sizes, params: fallbacks.topk_softmax(
        arrays, sizes, params) or ["a flag"])                         # a list of texts
    topk_softmax(x, 2, registry=reg)
    with pytest.raises(DeviceSideError, match="topk_softmax: a flag in 1 slot"):
        reg.check_device_errors()
    for bad in ({"a flag": "x"}, {"a flag": -3}, {"a flag": 1.5}, {3: 1}):   # counts are slots
        reg.set_fallback("topk_softmax", lambda arrays, sizes, params, b=bad: b)
        with pytest.raises(FactorError, match=r"returned dict .*; expected None, a Counter \{flag text: slots"):
            topk_softmax(x, 2, registry=reg)
    reg.set_fallback("topk_softmax", None)                        # the manifest's again
    topk_softmax(x, 2, registry=reg)
    assert reg.stats()["topk_softmax"]["python_fallback"] == 2   # the list's call, and this one
    assert reg.stats()["topk_softmax"]["errors"] == 9


class _CAI:
    """A bare __cuda_array_interface__ (never dereferenced: validation fails before any call)."""

    def __init__(self, shape, strides=None, typestr="<f4", ptr=0x7F0000001000, readonly=False):
        self.__cuda_array_interface__ = {"shape": shape, "strides": strides, "typestr": typestr,
                                         "data": (ptr, readonly), "version": 3}


def test_cuda_array_interface_strides_device_and_read_only_flag(reg):
    """A __cuda_array_interface__'s byte strides that are no whole number of elements were
    rounded down (10 bytes of float32 read as 2 elements), its device was always 0, and its
    read-only flag was ignored (a read-only output was written)."""
    from ex_engine.arrays import TensorRef
    r = TensorRef.of(_CAI((2, 2), (10, 4)))
    assert r.strides == (2.5, 1)
    with pytest.raises(LayoutError, match="topk_softmax: argument 'router_logits': strides: expected "
                                          "whole elements"):
        topk_softmax(_CAI((2, 2), (10, 4)), 1, topk_weights=_CAI((2, 1), ptr=0x7F0000100000),
                     topk_ids=_CAI((2, 1), typestr="<i4", ptr=0x7F0000200000), registry=reg)
    assert TensorRef.of(_CAI((2, 2), (8, 4))).strides == (2, 1)
    # the device, where the object tells it (CuPy's device.id, torch's device.index)
    for attr in ("id", "index"):
        x = _CAI((2, 2))
        x.device = type("Dev", (), {attr: 3})()
        assert TensorRef.of(x).device == 3
        x.device = type("Dev", (), {attr: np.int64(2)})()    # a NumPy integer had been ignored
        assert TensorRef.of(x).device == 2
    assert TensorRef.of(_CAI((2, 2))).device == 0      # no GPU, nothing says: 0 (documented)
    # read-only outputs are refused, given as arrays or as TensorRefs (ops.topk_softmax's)
    lg = _CAI((2, 4))
    ro_w = _CAI((2, 1), ptr=0x7F0000100000, readonly=True)
    ro_i = _CAI((2, 1), typestr="<i4", ptr=0x7F0000200000, readonly=True)
    assert TensorRef.of(ro_w).readonly and not TensorRef.of(lg).readonly
    with pytest.raises(LayoutError, match="topk_softmax: argument 'topk_weights': writable: expected a "
                                          "writable array"):
        topk_softmax(lg, 1, topk_weights=ro_w, topk_ids=_CAI((2, 1), typestr="<i4", ptr=0x7F0000200000),
                     registry=reg)
    with pytest.raises(LayoutError, match="argument 'topk_ids': writable"):
        reg.dispatch("topk_softmax", {"router_logits": lg, "topk_weights": _CAI((2, 1), ptr=0x7F0000100000),
                                      "topk_ids": ro_i})
    from ex_engine.registry import check_writes
    refs = {"router_logits": TensorRef.of(lg), "topk_weights": TensorRef.of(ro_w),
            "topk_ids": TensorRef.of(ro_i)}
    with pytest.raises(LayoutError, match="argument 'topk_weights': writable"):
        check_writes("topk_softmax", reg.manifest("topk_softmax"), refs, device=0)


def test_an_argument_that_is_no_array_names_the_function_called(reg):
    """The typed functions describe some arguments themselves (TensorRef.of): a bad one was
    reported as "ex_engine: argument 'hidden_states' ..." instead of naming the function."""
    from ex_engine.arrays import TensorRef
    a = moe_args()
    with pytest.raises(DTypeError, match="^moe_fused_gemm: argument 'hidden_states': type: "):
        moe_fused_gemm(None, a["w13"], a["w2"], a["topk_weights"], a["topk_ids"], registry=reg)
    lg = np.zeros((3, 8), np.float32)
    with pytest.raises(DTypeError, match="^topk_softmax: argument 'router_logits': type: "):
        topk_softmax(lg.tolist(), 2, registry=reg)
    with pytest.raises(DTypeError, match="^topk_softmax: argument 'topk_weights': type: "):
        topk_softmax(lg, 2, topk_weights=[[0.0, 0.0]] * 3, topk_ids=np.empty((3, 2), np.int32),
                     registry=reg)
    with pytest.raises(DTypeError, match="^topk_softmax: argument 'topk_ids': type: "):
        topk_softmax(lg, 2, topk_weights=np.empty((3, 2), np.float32), topk_ids="ids", registry=reg)
    with pytest.raises(DTypeError, match="^ex_engine: argument 'array': type: "):
        TensorRef.of(None)    # no function named: the package's own name, as before


def test_rmsnorm_refuses_a_torch_leaf_that_requires_grad_under_grad_mode(reg, monkeypatch):
    """fused_add_rmsnorm writes x and residual in place and records no autograd graph: a leaf
    that requires grad under grad mode (torch refuses in-place ops on one) was written silently.
    A stand-in for torch, so that this runs where torch is not installed."""
    import sys
    import types
    from ex_engine import fused_add_rmsnorm
    grad = {"on": True}
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(is_grad_enabled=lambda: grad["on"],
                                                                    is_inference_mode_enabled=lambda: False))

    class Leaf:
        requires_grad, is_leaf = True, True

        def is_inference(self):   # (a normal tensor's answer: the inference-tensor check passes)
            return False
    Leaf.__module__ = "torch"
    w = np.ones(8, np.float32)
    for name, args in (("x", (Leaf(), np.zeros((2, 8), np.float32))),
                       ("residual", (np.zeros((2, 8), np.float32), Leaf()))):
        with pytest.raises(ArgumentError, match=f"^fused_add_rmsnorm: argument '{name}': autograd: "
                                                "expected a tensor it may write in place .*got a leaf "
                                                "tensor with requires_grad=True"):
            fused_add_rmsnorm(*args, w, registry=reg)
    grad["on"] = False          # under no_grad: not this check's business (the stand-in fails later)
    with pytest.raises(Exception) as e:
        fused_add_rmsnorm(Leaf(), np.zeros((2, 8), np.float32), w, registry=reg)
    assert "autograd" not in str(e.value)


def test_a_factor_name_that_is_no_str_is_the_argument_name(reg):
    """reg.manifest(['x']) and reg.get(['x']) raised a bare TypeError (unhashable), and
    reg.manifest(None) said "no factor named 'None'": an ArgumentError naming 'name'."""
    for bad in (["x"], None, 3):
        for fn, caller in ((reg.manifest, "manifest"), (reg.get, "get")):
            with pytest.raises(ArgumentError, match=f"^{caller}: argument 'name': type: expected a factor "
                                                    "name \\(str\\), got "):
                fn(bad)
        with pytest.raises(ArgumentError, match="^dispatch: argument 'name': type: "):
            reg.dispatch(bad, {})
    with pytest.raises(ArgumentError, match="^set_fallback: argument 'name'"):
        reg.set_fallback(["x"], lambda a, s, p: None)
    for fn in (None, lambda sizes: -1):   # (with None it named TuningTable.override)
        with pytest.raises(ArgumentError, match="^set_tuning: argument 'name'"):
            reg.set_tuning(["x"], fn)
    reg.set_fallback("fused_add_rmsnorm", lambda a, s, p: None)
    with pytest.raises(ArgumentError, match="^set_fallback: argument 'name'"):
        reg.set_fallback(["x"], None)    # (a bare TypeError once a fallback had been set)
    reg.set_fallback("fused_add_rmsnorm", None)
    with pytest.raises(FactorNotFoundError, match="no factor named 'nope'"):
        reg.manifest("nope")
    assert reg.get("nope") is None


def test_public_docstrings_say_what_they_raise():
    """Docstrings the audit found without their errors (or missing on public properties)."""
    from ex_engine import default_registry
    from ex_engine.arrays import Bits16, TensorRef
    for fn in (FactorRegistry.dispatch, FactorRegistry.load, FactorRegistry, default_registry,
               FactorRegistry.release_workspaces, FactorRegistry.call_plugin):
        assert "Raises" in fn.__doc__, fn
    for word in ("FactorNotFoundError", "KernelError", "DeviceError", "no path took the call"):
        assert word in " ".join(FactorRegistry.dispatch.__doc__.split()), word
    for word in ("lock_mode", "probe", "verify", "timeout", "prefer", "manifests_dir", "hardware"):
        assert word in FactorRegistry.__doc__ and word in FactorRegistry.load.__doc__, word
    doc = " ".join(FactorRegistry.check_device_errors.__doc__.split())
    assert "outside [0, G)" in doc and "outside [-1, E)" in doc
    from ex_engine import fused_add_rmsnorm
    assert "normal float32" in fused_add_rmsnorm.__doc__ and "1e-60" in fused_add_rmsnorm.__doc__
    for prop in (Bits16.shape, TensorRef.on_device, TensorRef.size):
        assert prop.__doc__, prop
    docs = {f.__name__: " ".join(f.__doc__.split()) for f in (topk_softmax, moe_fused_gemm, fused_add_rmsnorm)}
    assert all("inference op" in d for d in docs.values())
    assert "NaN logits rank last" not in docs["topk_softmax"] and "ranks as -inf" in docs["topk_softmax"]
    assert "propagates" in docs["moe_fused_gemm"] and "hidden_states' shape (T, H) and dtype" in docs["moe_fused_gemm"]


def test_zero_byte_elements_are_refused_not_divided_by(reg):
    """A NumPy 'V0' array (elements of no bytes), or a __cuda_array_interface__ saying so, is a
    DTypeError naming the argument: its byte strides cannot be counted in elements (it raised a
    bare ZeroDivisionError)."""
    from ex_engine.arrays import TensorRef
    from ex_engine.errors import DTypeError
    x = np.zeros(3, dtype="V0")
    with pytest.raises(DTypeError, match=r"argument 'x'.*at least one byte"):
        reg.dispatch("fused_add_rmsnorm", {"x": x, "residual": x, "weight": x}, {"eps": 1e-6})

    class Cai:
        __cuda_array_interface__ = {"shape": (3,), "typestr": "|V0", "data": (4096, False),
                                    "version": 3, "strides": None}
    with pytest.raises(DTypeError, match=r"argument 'hidden_states'.*at least one byte"):
        TensorRef.of(Cai(), "hidden_states", "moe_fused_gemm")
