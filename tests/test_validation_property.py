"""Property test of the validator: random shapes, dtypes, strides and places for every built-in
manifest; ``Manifest.bind`` must accept exactly the calls an independent oracle (plain rules,
written here from the factor contracts, not from manifest.py) calls valid.

No C call: bind is called directly on NumPy arrays (bf16 as Bits16 or ml_dtypes.bfloat16) and
on fake device arrays (``__cuda_array_interface__`` only, never dereferenced).
"""
from math import prod

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from ex_engine import FactorError, FactorRegistry
from ex_engine.arrays import Bits16, TensorRef
from tests.test_validation import FakeDeviceArray

F3 = ["float32", "float16", "bfloat16"]
F2 = ["float16", "bfloat16"]

# The contracts, restated as plain data: argument -> (symbolic shape, allowed dtypes).
CONTRACTS = {
    "topk_softmax": dict(
        args={"router_logits": (("T", "E"), F3), "topk_weights": (("T", "K"), ["float32"]),
              "topk_ids": (("T", "K"), ["int32"])},
        optional=set(), row_strided=set(), same_dtype={},
        ok_sizes=lambda s, present: 1 <= s["K"] <= s["E"],
        params=lambda d: {"renormalize": d.draw(st.booleans())}),
    "fused_add_rmsnorm": dict(
        args={"x": (("T", "H"), F3), "residual": (("T", "H"), F3), "weight": (("H",), F3)},
        optional=set(), row_strided={"x", "residual"}, same_dtype={"residual": "x", "weight": "x"},
        ok_sizes=lambda s, present: s["H"] >= 1,
        params=lambda d: {"eps": d.draw(st.floats(1e-8, 1e-2))}),
    "moe_fused_gemm": dict(
        args={"hidden_states": (("T", "H"), F2), "out": (("T", "H"), F2),
              "router_logits": (("T", "G"), F3), "w13": (("E", "2I", "H"), F2),
              "w2": (("E", "H", "I"), F2), "topk_weights": (("T", "K"), ["float32"]),
              "topk_ids": (("T", "K"), ["int32"]), "expert_map": (("G",), ["int32"])},
        optional={"router_logits", "expert_map"}, row_strided=set(),
        same_dtype={"out": "hidden_states", "w13": "hidden_states", "w2": "hidden_states"},
        # G (global experts) is E unless an array gives it; without an expert_map it must be E
        ok_sizes=lambda s, present: (1 <= s["K"] <= s.get("G", s["E"]) and s["E"] >= 1 and s["H"] >= 1 and s["I"] >= 1
                                     and ("expert_map" in present or s.get("G", s["E"]) == s["E"])),
        params=lambda d: {}),
}
DTYPES = ["float32", "float16", "bf16_bits", "bf16_ml", "int32", "int64", "float64", "uint16"]
LAYOUTS = ["contiguous", "transposed", "strided", "padded", "reversed", "misaligned",
           "fractional", "device"]


# ------------------------------------------------------------------------------ building arrays
def np_dtype(d):
    return np.dtype({"bf16_bits": np.uint16, "bf16_ml": ml_dtypes.bfloat16}.get(d, d))


def as_choice(dtype: str) -> str:
    """The generator's dtype choice for a contract dtype name."""
    return {"bfloat16": "bf16_bits"}.get(dtype, dtype)


def build(shape, d: str, layout: str):
    """An array of ``shape`` with dtype choice ``d`` laid out as ``layout`` says."""
    dt = np_dtype(d)
    shape = tuple(shape)
    n = prod(shape)
    if layout == "device" and d not in ("bf16_bits", "bf16_ml"):
        return FakeDeviceArray(shape, dt.str, ptr=0x7F0000000000)
    if layout == "transposed" and len(shape) >= 2:
        a = np.zeros(shape[::-1], dt).T
    elif layout == "strided" and shape:
        a = np.zeros((2 * shape[0],) + shape[1:], dt)[::2]
    elif layout == "padded" and shape:
        a = np.zeros(shape[:-1] + (shape[-1] + 3,), dt)[..., :shape[-1]]
    elif layout == "reversed" and shape:
        a = np.zeros(shape, dt)[::-1]
    elif layout == "misaligned":
        buf = np.zeros(n * dt.itemsize + 32, np.uint8)
        off = (-buf.__array_interface__["data"][0]) % 16 + 1
        a = np.frombuffer(buf, dt, count=n, offset=off).reshape(shape)
    elif layout == "fractional" and len(shape) == 2 and shape[0] >= 2:
        row = shape[1] * dt.itemsize + 1
        buf = np.zeros(row * shape[0] + 32, np.uint8)
        a = np.ndarray(shape, dt, buffer=buf, strides=(row, dt.itemsize))
    else:
        a = np.zeros(shape, dt)
    return Bits16(a) if d == "bf16_bits" else a


# ------------------------------------------------------------------------------ the oracle
def describe(x) -> dict:
    """dtype name, shape, byte strides, item size, address and place of an argument."""
    if isinstance(x, FakeDeviceArray):
        cai = x.__cuda_array_interface__
        dt = np.dtype(cai["typestr"])
        shape = tuple(cai["shape"])
        strides = tuple(dt.itemsize * prod(shape[i + 1:]) for i in range(len(shape)))
        return dict(dtype=dt.name, shape=shape, strides=strides, itemsize=dt.itemsize,
                    addr=cai["data"][0], device=0)
    name = None
    if isinstance(x, Bits16):
        x, name = x.bits, "bfloat16"
    elif x.dtype == ml_dtypes.bfloat16:
        name = "bfloat16"
    return dict(dtype=name or x.dtype.name, shape=x.shape, strides=x.strides, itemsize=x.itemsize,
                addr=x.__array_interface__["data"][0], device=-1)


def oracle(contract: dict, arrays: dict) -> list:
    """Every rule the call breaks (empty: valid)."""
    broken, sizes = [], {}
    info = {k: describe(v) for k, v in arrays.items() if v is not None}
    for name, (sym, dtypes) in contract["args"].items():
        if name not in info:
            if name not in contract["optional"]:
                broken.append(f"{name}: missing")
            continue
        a = info[name]
        if a["dtype"] not in dtypes:
            broken.append(f"{name}: dtype {a['dtype']} not in {dtypes}")
        if len(a["shape"]) != len(sym):
            broken.append(f"{name}: rank {len(a['shape'])} != {len(sym)}")
            continue
        for n, s in zip(a["shape"], sym):
            coef, key = (2, s[1:]) if s.startswith("2") else (1, s)
            if n % coef:
                broken.append(f"{name}: {n} not a multiple of {coef}")
            sizes.setdefault(key, set()).add(n // coef)
        isz = a["itemsize"]
        if any(b % isz for b in a["strides"]):
            broken.append(f"{name}: stride not whole elements")
        elif prod(a["shape"]) > 0:
            el = [b // isz for b in a["strides"]]
            shp = a["shape"]
            if name in contract["row_strided"]:
                ok = (shp[1] <= 1 or el[1] == 1) and (shp[0] <= 1 or el[0] >= shp[1])
            else:
                ok = all(n <= 1 or e == prod(shp[i + 1:]) for i, (n, e) in enumerate(zip(shp, el)))
            if not ok:
                broken.append(f"{name}: layout")
        if a["addr"] % isz:
            broken.append(f"{name}: misaligned")
    for key, vals in sizes.items():
        if len(vals) > 1:
            broken.append(f"{key}: inconsistent {sorted(vals)}")
    if not broken and not contract["ok_sizes"]({k: v.pop() for k, v in sizes.items()}, set(info)):
        broken.append("size constraint")
    for name, other in contract["same_dtype"].items():
        if name in info and other in info and info[name]["dtype"] != info[other]["dtype"]:
            broken.append(f"{name}: dtype differs from {other}")
    if len({a["device"] for a in info.values()}) > 1:
        broken.append("arrays in different places")
    return broken


# ------------------------------------------------------------------------------ the property
@pytest.fixture(scope="module")
def reg(tmp_path_factory):
    return FactorRegistry.load(tmp_path_factory.mktemp("none"), hardware="h200")


@st.composite
def calls(draw, name):
    """(arrays, params) of a random, mostly near-valid call of factor ``name``."""
    c = CONTRACTS[name]
    sizes = {"T": draw(st.integers(0, 4)), "E": draw(st.integers(1, 6)), "H": draw(st.integers(1, 5)),
             "I": draw(st.integers(1, 4))}
    sizes["G"] = sizes["E"]                                  # global experts (expert_map)
    if "expert_map" in c["args"] and draw(st.booleans()):
        sizes["G"] = draw(st.integers(1, 8))
    sizes["K"] = draw(st.integers(1, min(sizes["E"], sizes["G"])))
    # Hypothesis favours 0 and the bounds, so rare mutations trigger on a middle value: the
    # simplest (shrunk) example is then the unmutated, valid call.
    if draw(st.integers(0, 9)) == 5:       # now and then a size that breaks a constraint
        sizes[draw(st.sampled_from(["K", "H", "I", "E"]))] = draw(st.integers(0, 7))
    main = draw(st.sampled_from(next(iter(c["args"].values()))[1]))
    n_args, arrays = len(c["args"]), {}
    for arg, (sym, dtypes) in c["args"].items():
        if arg in c["optional"] and draw(st.booleans()):
            arrays[arg] = None
            continue
        shape = [2 * sizes[s[1:]] if s.startswith("2") else sizes[s] for s in sym]
        dtype = as_choice(main if main in dtypes else dtypes[0])
        if dtype == "bf16_bits" and draw(st.booleans()):
            dtype = "bf16_ml"
        layout = "contiguous"
        # about one argument per call is changed in one way (most such changes break a rule)
        if draw(st.integers(0, n_args)) == n_args // 2 + 1:
            kind = draw(st.sampled_from(["dtype", "size", "rank", "layout", "layout", "missing"]))
            if kind == "dtype":
                dtype = draw(st.sampled_from(DTYPES))
            elif kind == "size" and shape:
                shape[draw(st.integers(0, len(shape) - 1))] += draw(st.sampled_from([-1, 1]))
                shape = [max(s, 0) for s in shape]
            elif kind == "rank":
                shape = shape[:-1] if draw(st.booleans()) and shape else shape + [1]
            elif kind == "layout":
                layout = draw(st.sampled_from(LAYOUTS))
            elif kind == "missing":
                arrays[arg] = None
                continue
        arrays[arg] = build(shape, dtype, layout)
    return arrays, c["params"](_Drawer(draw))


class _Drawer:
    """Gives the params lambdas a ``.draw`` like st.data()'s."""

    def __init__(self, draw):
        self.draw = draw


@pytest.mark.parametrize("name", sorted(CONTRACTS))
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_validator_agrees_with_the_oracle(reg, name, data):
    arrays, params = data.draw(calls(name))
    broken = oracle(CONTRACTS[name], arrays)
    note(f"oracle: {broken or 'valid'}")
    note("arrays: " + ", ".join(f"{k}={describe(v) if v is not None else None}" for k, v in arrays.items()))
    refs = {k: TensorRef.of(v, k) for k, v in arrays.items() if v is not None}
    try:
        reg.manifest(name).bind(refs, params)
        accepted, err = True, None
    except FactorError as exc:      # anything else (KeyError, IndexError, ...) fails the test
        accepted, err = False, exc
    assert accepted == (not broken), f"bind {'accepted' if accepted else f'refused ({err})'}, oracle: {broken or 'valid'}"


def test_the_generator_makes_both_valid_and_invalid_calls(reg):
    """The property above is only as good as its inputs: both outcomes must be common."""
    outcomes = {name: [] for name in CONTRACTS}

    @settings(max_examples=300, deadline=None, database=None, derandomize=True)
    @given(data=st.data())
    def sample(data):
        name = data.draw(st.sampled_from(sorted(CONTRACTS)))
        arrays, _ = data.draw(calls(name))
        outcomes[name].append(not oracle(CONTRACTS[name], arrays))

    sample()
    for name, res in outcomes.items():
        if len(res) >= 30:
            assert 0.15 < sum(res) / len(res) < 0.85, (name, sum(res), len(res))
