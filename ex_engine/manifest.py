"""Factor manifests (manifests/<name>.yaml): each factor's contract, and the validator.

A manifest names the kernel's output, input and aux inputs in ABI order, each with a symbolic
shape ("T", "2*I"), allowed dtypes and a role; the order of dims[]; where each dim comes from
(a size of an array's shape, or its dim_sources entry: a dtype code, a user parameter, a row
stride, a tuned choice, a default_dim; read only where no present array gives the size, so a
size that a required array gives has none); user parameters ({type: float | int |
bool, default, gt: a lower bound a float must exceed}); constraints between sizes; the Python
fallback; tolerances (DEFAULT_TOLERANCE for a dtype not named) and test shapes.
``Manifest.bind`` checks a call's arrays against it and returns the dims to pass, raising an
ArgumentError subclass that names the factor, the argument, the rule, what was expected and
what came.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import operator
import os
import re
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from . import _paths, _yaml, abi
from ._yaml import brief, unknown_keys
from .errors import (ArgumentError, DeviceError, DTypeError, FactorError, LayoutError,
                     ShapeError, one_line)
from .trust import sha256_hex

_F32_TINY = 1.1754943508222875e-38   # float32's smallest normal number (numpy.finfo(float32).tiny)
_F32_MAX = 3.4028234663852886e38     # float32's largest finite number


def bool_like(v) -> bool:
    """True/False, 0/1 as Python's, NumPy's or torch's integers (0-d), or a NumPy or torch bool
    scalar (0-d): what a bool parameter takes (not a string, a float, a 0-d float array or
    tensor, nor an array or tensor of one element and a rank above 0, which NumPy refuses and
    torch's __index__ took: torch.tensor([[1]]), torch.tensor([True]))."""
    if getattr(getattr(v, "dtype", None), "kind", None) == "b" and getattr(v, "shape", None) == ():
        return bool(v in (0, 1))
    if isinstance(v, (str, bytes)):
        return False
    shape = getattr(v, "shape", ())
    if not isinstance(shape, tuple) or shape != ():   # (torch.Size is a tuple; () for 0-d)
        return False
    try:
        return operator.index(v) in (0, 1)
    except (TypeError, ValueError, RuntimeError):   # a float, an array of several elements
        return False


def _to_f32(v: float) -> float:
    """``v`` rounded to float32 (to nearest even; inf beyond float32's range), as a float."""
    try:
        return struct.unpack("<f", struct.pack("<f", v))[0]
    except OverflowError:   # struct refuses to round what lies beyond float32's range
        return float("inf") if v > 0 else float("-inf")


def _is_int(v) -> bool:
    """An int, not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def fallback_problem(fn) -> str:
    """Why ``fn`` cannot serve as a Python fallback, called as ``fn(arrays, sizes, params)``
    ('' if it can): not callable; a signature that does not take three positional arguments
    (``os:system`` takes one); a signature Python cannot read (some builtins: nothing says what
    it takes); or one whose arrays, sizes and params would not each reach a named parameter
    (``builtins:print``, a bare ``*args``: it passed, and a call returned 'python_fallback' with
    the outputs unwritten)."""
    if not callable(fn):
        return f"expected a callable fn(arrays, sizes, params), got {type(fn).__name__} {brief(fn)}"
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return (f"expected a callable fn(arrays, sizes, params), got {brief(fn)}, whose signature "
                "cannot be read (a builtin?): nothing says it takes the arrays, sizes and params")
    try:
        sig.bind(None, None, None)
    except TypeError:
        return f"expected a callable fn(arrays, sizes, params), got one with signature {sig}"
    named = [q for q in sig.parameters.values() if q.kind in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD)]
    if len(named) < 3:
        rest = next((q.name for q in sig.parameters.values() if q.kind == q.VAR_POSITIONAL), "args")
        lost = ("arrays, sizes and params", "sizes and params", "params")[len(named)]
        return (f"expected a callable fn(arrays, sizes, params), got {brief(fn)} with signature "
                f"{sig}: its {lost} would go to *{rest}, not to a parameter of that name (a "
                "function that takes anything is no fallback: it need not write the outputs)")
    return ""


DEFAULT_TOLERANCE = 1e-5   # verify's relative tolerance for a dtype the manifest's tolerance omits
_FALLBACK = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")

_TERM = re.compile(r"^\s*(?:(\d+)\s*\*\s*)?([A-Za-z_]\w*)\s*(?:\*\s*(\d+))?\s*$")
_RSQRT = re.compile(r"^\s*1\s*/\s*sqrt\(\s*(\w+)\s*\)\s*$")   # as verify reads a `values` scalar
_CONSTRAINT = re.compile(r"^\s*(\w+)\s*(<=|<|==|>=|>)\s*(\w+)\s*$")


def _dim_problem(expr) -> str:
    """What is wrong with a shape entry ('' if nothing): a constant must be an integer >= 0, a
    symbol's coefficient an integer >= 1 on one side of it ('0*N' made bind divide by zero,
    '-3' failed every call with "expected -3", '2*I*3' was read as 2*I)."""
    if isinstance(expr, bool) or not isinstance(expr, (int, str)):
        return f"expected entries N, SYM or N*SYM, got {_got(expr)}"
    if isinstance(expr, int):
        return "" if expr >= 0 else f"expected a size >= 0, got {expr}"
    m = _TERM.match(expr)
    if not m:
        return f"expected N, SYM or N*SYM (N an integer >= 1), got {brief(expr)}"
    if m.group(1) and m.group(3):
        return f"expected N, SYM or N*SYM (one coefficient), got {brief(expr)}"
    if int(m.group(1) or m.group(3) or 1) < 1:
        return f"expected a coefficient >= 1 in {brief(expr)} (a size times 0 is no size)"
    return ""


def _parse_dim(expr):
    """(coefficient, symbol) of a shape entry: 5 -> (5, None); 'T' -> (1, 'T'); '2*I' -> (2, 'I').
    Raises FactorError for what _dim_problem refuses (so bind never divides by 0)."""
    problem = _dim_problem(expr)
    if problem:
        raise FactorError(f"shape entry: {problem}")
    if isinstance(expr, int):
        return expr, None
    m = _TERM.match(expr)
    return int(m.group(1) or m.group(3) or 1), m.group(2)


# ---- the raw YAML mapping's keys and types, checked before anything reads it --------------
# (unknown keys were ignored: `falback:` left the factor without a fallback, `tolerence:` used
# the default tolerance; booleans went through bool(), so `optional: "false"` made a required
# array optional and the kernel got NULL; `id: 0.7` was int()'d to 0)
TOP_KEYS = ("name", "id", "summary", "math", "memory", "dims", "output", "input", "aux", "params",
            "dim_sources", "constraints", "fallback", "tolerance", "test_shapes", "device_flags")
ARRAY_KEYS = ("name", "role", "shape", "dtype", "optional", "same_dtype_as", "row_strided",
              "same_as_output", "absent_requires", "values")
PARAM_KEYS = ("type", "default", "gt", "float32")
SOURCE_KEYS = ("dtype_of", "row_stride_of", "param", "default_dim", "tuned", "range", "options",
               "encode")
VALUES_KEYS = ("normal", "uniform", "ids_below", "distinct")
NOT_MANIFESTS = ("moe_models.yaml",)   # files of a manifests folder load_all does not read
_ID_MAX = 2 ** 31 - 1     # the ABI's factor_id is an int32_t


def _got(v) -> str:
    """``v`` of a manifest's YAML for an error message: its type and a bounded repr (brief);
    null for None (YAML's ``key:`` with no value, or ``key: null``)."""
    return "null" if v is None else f"{type(v).__name__} {brief(v)}"


def _array_problem(where: str, d) -> str:
    """What is wrong with one array entry's raw mapping ('' if nothing)."""
    if not isinstance(d, dict):
        return f"{where}: expected a mapping {{name, shape, dtype, ...}}, got {_got(d)}"
    label = f"{where} ({d['name']})" if isinstance(d.get("name"), str) else where
    problem = unknown_keys(f"{label}: ", d, ARRAY_KEYS)
    if problem:
        return problem
    for k in ("optional", "row_strided", "same_as_output"):
        if k in d and not isinstance(d[k], bool):
            return f"{label}: {k}: expected true or false, got {_got(d[k])}"
    for k in ("name", "role", "same_dtype_as", "absent_requires"):
        if k in d and not (isinstance(d[k], str) and d[k]) and not (k == "same_dtype_as" and d[k] is None):
            return f"{label}: {k}: expected a non-empty string, got {_got(d[k])}"
    for k, what in (("shape", "a list of sizes ([T, H], [N], [E, 2*I, H])"),
                    ("dtype", "a list of dtypes ([float32] or [float16, bfloat16])")):
        if k in d and not isinstance(d[k], list):
            return f"{label}: {k}: expected {what}, got {_got(d[k])}"
    if "dtype" in d and not all(isinstance(t, str) for t in d["dtype"]):
        return f"{label}: dtype: expected a list of dtype names, got {_got(d['dtype'])}"
    for i, e in enumerate(d.get("shape") or []):
        problem = _dim_problem(e)
        if problem:
            return f"{label}: shape[{i}]: {problem}"
    if "values" in d:
        v = d["values"]
        if not isinstance(v, dict):
            return f"{label}: values: expected a mapping ({{normal: STD}}, {{uniform: [LO, HI]}}, " \
                   f"{{ids_below: SYM, distinct: true}}), got {_got(v)}"
        problem = unknown_keys(f"{label}: values: ", v, VALUES_KEYS)
        if problem:
            return problem
        if "distinct" in v and not isinstance(v["distinct"], bool):
            return f"{label}: values: distinct: expected true or false, got {_got(v['distinct'])}"
        if "uniform" in v and not (isinstance(v["uniform"], list) and len(v["uniform"]) == 2):
            return f"{label}: values: uniform: expected [LO, HI], got {_got(v['uniform'])}"
    return ""


def raw_problem(d: dict) -> str:
    """What is wrong with a manifest's parsed mapping ``d`` before its fields are read ('' if
    nothing): an unknown key (at the top, in an array entry, a params, dim_sources or values
    entry), a field of the wrong type (a bool that is not true/false, an id that is not an
    integer, a scalar where a list belongs, null for a list or mapping: a field left out is
    not given, a field given as null is refused)."""
    problem = unknown_keys("", d, TOP_KEYS)
    if problem:
        return problem
    for k in ("name", "dims", "output", "input"):
        if k not in d:
            return f"{k}: missing; expected the manifest's {k}"
    if not (isinstance(d["name"], str) and d["name"]):
        return f"name: expected a non-empty string, got {_got(d['name'])}"
    if "id" not in d:
        return "id: missing; expected the factor id (an integer)"
    if not _is_int(d["id"]) or not -_ID_MAX - 1 <= d["id"] <= _ID_MAX:   # (the registry judges its value)
        return f"id: expected an integer (the factor id, an int32_t), got {_got(d['id'])}"
    if d["id"] < 0:   # (a manifest of id: -5 loaded; only a library claiming it was refused)
        return (f"id: expected an integer >= 0 (the factor id; include/ex_engine.h: never negative), "
                f"got {d['id']}")
    for k in ("summary", "math"):   # text for readers: null is none
        if d.get(k) is not None and not isinstance(d[k], str):
            return f"{k}: expected a string, got {_got(d[k])}"
    if "memory" in d and d["memory"] not in ("device", "host"):   # (it was str()'d: a list became
        return f"memory: expected 'device' or 'host', got {_got(d['memory'])}"   # its repr, null 'None')
    if not (isinstance(d["dims"], list) and all(isinstance(x, str) and x for x in d["dims"])):
        return f"dims: expected a list of size names ([T, H, dtype]), got {_got(d['dims'])}"
    twice = sorted({x for x in d["dims"] if d["dims"].count(x) > 1})
    if twice:   # the kernel would get one size in two slots and read the next one's off by one
        return f"dims: expected each size once, got {twice[0]!r} {d['dims'].count(twice[0])} times"
    for k in ("output", "input"):
        problem = _array_problem(k, d[k])
        if problem:
            return problem
    # a list or mapping field given as null (`aux:` with its entries commented out) is refused
    # like any other wrong type: `aux: null` failed with "TypeError: 'NoneType' object is not
    # iterable", and `params: null` read as no parameters
    if "aux" in d:
        aux = d["aux"]
        if not isinstance(aux, list):
            return f"aux: expected a list of array entries, got {_got(aux)}"
        for i, a in enumerate(aux):
            problem = _array_problem(f"aux[{i}]", a)
            if problem:
                return problem
    for k, what in (("params", "name -> {type, default, ...}"), ("dim_sources", "dim -> {source: ...}"),
                    ("tolerance", "dtype -> relative error"), ("device_flags", "bit -> meaning")):
        if k in d and not isinstance(d[k], dict):
            return f"{k}: expected a mapping {what}, got {_got(d[k])}"
    for k, spec in (d.get("params") or {}).items():
        if isinstance(spec, dict):
            problem = unknown_keys(f"params: {k}: ", spec, PARAM_KEYS)
            if problem:
                return problem
    for k, src in (d.get("dim_sources") or {}).items():
        if isinstance(src, dict):
            problem = unknown_keys(f"dim_sources: {k}: ", src, SOURCE_KEYS)
            if problem:
                return problem
            if "encode" in src and src["encode"] != "f64_bits":
                return f"dim_sources: {k}: encode: expected f64_bits, got {_got(src['encode'])}"
    for k, what in (("constraints", "constraints (['K <= E'])"),
                    ("test_shapes", "test shapes ([{T: 3, H: 64}])")):
        if k in d and not isinstance(d[k], list):
            return f"{k}: expected a list of {what}, got {_got(d[k])}"
    if not all(isinstance(c, str) for c in d.get("constraints") or []):
        return f"constraints: expected a list of strings ('K <= E'), got {_got(d['constraints'])}"
    bits: set = set()
    for b, text in (d.get("device_flags") or {}).items():
        if isinstance(b, str) and b.isdecimal():   # a quoted key ("0": ...) is the same bit
            b = int(b)
        if not _is_int(b) or not 0 <= b < 32:
            return f"device_flags: {brief(b)}: expected a bit number 0..31 of the workspace's int32"
        if not isinstance(text, str):              # (it was str()'d, a list became its repr)
            return f"device_flags: {b}: expected the meaning of the bit (a string), got {_got(text)}"
        if b in bits:                              # 0 and "0": one bit given twice
            return f"device_flags: bit {b} given twice (as {b} and as '{b}'); expected one meaning per bit"
        bits.add(b)
    return ""


def _param_type(spec) -> str:
    """A ``params`` entry's type ('float' where it names none, as _param_value reads it)."""
    return spec.get("type", "float") if isinstance(spec, dict) else ""


def _param_spec_problem(spec) -> str:
    """What is wrong with one ``params`` entry's spec ('' if nothing): its form, a type other
    than float, int or bool, and a key its type does not use (``gt`` bounds floats and ints,
    ``float32`` applies to floats: on an int or a bool they were ignored without a word)."""
    if not isinstance(spec, dict):
        return f"expected {{type: float | int | bool, default: ...}}, got {_got(spec)}"
    typ = _param_type(spec)
    if typ not in ("float", "int", "bool"):
        return f"type: expected float, int or bool, got {_got(typ)}"
    if "float32" in spec:
        if typ != "float":
            return f"float32: expected no float32 on {'an int' if typ == 'int' else 'a bool'} parameter (it applies to float ones)"
        if not isinstance(spec["float32"], bool):
            return f"float32: expected true or false, got {_got(spec['float32'])}"
    if "gt" in spec:
        gt = spec["gt"]
        if typ == "bool":
            return "gt: expected no gt on a bool parameter (it bounds float and int ones)"
        if isinstance(gt, bool) or not isinstance(gt, (int, float)) or not _finite(gt):
            return f"gt: expected a finite number (the bound the value must exceed), got {_got(gt)}"
    return ""


def _finite(x) -> bool:
    """An int or float within float's finite range (10**400 is not)."""
    try:
        return abs(float(x)) < float("inf")
    except OverflowError:
        return False


@dataclass
class TensorSpec:
    """One array of the kernel call (output, input or an aux input)."""
    name: str
    role: str                      # output | input | inout | workspace
    shape: list = field(default_factory=list)
    dtypes: list = field(default_factory=list)
    optional: bool = False
    same_dtype_as: str | None = None
    row_strided: bool = False      # rows may be spaced wider than the last dim (a view)
    same_as_output: bool = False   # input and output are one array (in place)
    absent_requires: str | None = None  # optional array: a constraint ("G == E") that must hold
                                   # when it is not given
    values: dict | None = None     # how `verify` draws test inputs: {normal: STD}, {uniform: [LO, HI]},
                                   # {ids_below: SYM, distinct: true}; default N(0, 1) / ints in [0, 8)
    parsed: list = field(default_factory=list)

    @classmethod
    def from_yaml(cls, d: dict, role: str) -> "TensorSpec":
        """The spec of one array entry of a manifest (``role`` unless the entry names its own).
        Raises KeyError for an entry without a name (Manifest.load reports it as malformed)."""
        # an in-place input may omit its name: it is the output's (Manifest.load copies it)
        name = d.get("name", "") if d.get("same_as_output") else d["name"]
        spec = cls(name=name, role=d.get("role", role), shape=list(d.get("shape", [])),
                   dtypes=list(d.get("dtype", [])), optional=d.get("optional", False),
                   same_dtype_as=d.get("same_dtype_as"), row_strided=d.get("row_strided", False),
                   same_as_output=d.get("same_as_output", False), values=d.get("values"),
                   absent_requires=d.get("absent_requires"))
        spec.parsed = [_parse_dim(e) for e in spec.shape]
        return spec


@dataclass
class Manifest:
    """A factor's contract, loaded from YAML. See manifests/moe_fused_gemm.yaml for an example."""
    name: str
    id: int
    summary: str
    math: str
    dims: list
    output: TensorSpec
    input: TensorSpec
    aux: list
    params: dict
    dim_sources: dict
    constraints: list
    fallback: str | None
    tolerance: dict
    test_shapes: list
    device_flags: dict = field(default_factory=dict)
    memory: str = "device"         # 'device': kernels take CUDA pointers; 'host': CPU pointers
    path: str = ""
    sha256: str = ""            # of the file's bytes as loaded ('' when built from parsed data only)

    @classmethod
    def load(cls, path, data=None, raw: bytes | None = None) -> "Manifest":
        """Read and check a manifest file (``data``: its contents already parsed, as load_all
        has them, from the bytes ``raw``). Raises FactorError naming the file and the field."""
        path = Path(path)
        if data is None:
            raw = read_manifest_bytes(path)
        try:
            if data is None:
                d = _yaml.load(raw.decode(), name=path)
            else:
                d = data
            if not isinstance(d, dict):   # None for an empty file (or one of comments only)
                raise FactorError("empty: expected a factor manifest (name, id, dims, output, input, ...)"
                                  if d is None else f"expected a mapping (name, id, dims, ...), got "
                                  f"{type(d).__name__}")
            problem = raw_problem(d)
            if problem:
                raise FactorError(problem)
            m = cls(name=d["name"], id=d["id"], summary=d.get("summary") or "",
                    math=d.get("math") or "", dims=list(d["dims"]),
                    output=TensorSpec.from_yaml(d["output"], "output"),
                    input=TensorSpec.from_yaml(d["input"], "input"),
                    aux=[TensorSpec.from_yaml(a, "input") for a in d.get("aux", [])],
                    params=dict(d.get("params") or {}), dim_sources=dict(d.get("dim_sources") or {}),
                    constraints=list(d.get("constraints") or []), fallback=d.get("fallback"),
                    tolerance=dict(d.get("tolerance") or {}),
                    test_shapes=list(d.get("test_shapes") or []),
                    device_flags={int(k): str(v) for k, v in (d.get("device_flags") or {}).items()},
                    memory=str(d.get("memory", "device")),
                    path=str(path))
        except (KeyError, TypeError, ValueError, OSError, yaml.YAMLError) as exc:
            raise FactorError(f"manifest {path}: malformed ({type(exc).__name__}: {one_line(exc)})") from exc
        except FactorError as exc:  # a field's own check (a shape entry, say): name the file
            raise FactorError(f"manifest {path}: {exc}") from exc
        for k, spec in m.params.items():
            problem = _param_spec_problem(spec)
            if problem:
                raise FactorError(f"manifest {path}: params: {k}: {problem}")
        if m.memory not in ("device", "host"):
            raise FactorError(f"manifest {path}: memory: expected 'device' or 'host', got {_got(m.memory)}")
        problem = m._structure_problem() or m._fields_problem()
        if problem:
            raise FactorError(f"manifest {path}: {problem}")
        if raw is not None:
            m.sha256 = sha256_hex(raw)
        if m.input.same_as_output:
            m.input = TensorSpec(**{**m.output.__dict__, "role": "input", "same_as_output": True})
        m._constraints = [_CONSTRAINT.match(c) for c in m.constraints]
        m._absent = [(t, _CONSTRAINT.match(t.absent_requires)) for t in m.aux if t.absent_requires]
        # bind checks inputs first, outputs last: the sizes come from what the caller computes
        # with, so a wrongly sized output is the argument an error names. An output that is
        # also the input (in place: input same_as_output, fused_add_rmsnorm's x) is an input
        # here, checked where the input stands in ABI order (first): its sizes are the ones the
        # others are held to (x (4, H) with residual (5, H) names residual, T from x). Among the
        # inputs the required ones come first, then optional ones that define a size when given
        # (an absent_requires entry: moe_fused_gemm's expert_map fixes G), then the other
        # optional ones (router_logits, which the computation does not read, is checked against
        # that G)
        in_place = m.input.same_as_output
        m._bind_order = sorted(range(len(m.tensors)), key=lambda i: (
            m.tensors[i].role == "output" and not in_place, m.tensors[i].optional,
            not m.tensors[i].absent_requires))
        if not all(m._constraints) or not all(c for _, c in m._absent):
            raise FactorError(f"manifest {path}: constraint not of the form 'A <= B': {m.constraints}")
        return m

    def _structure_problem(self) -> str:
        """What in the manifest's cross-references is wrong ('' if nothing): every dim has a size
        or a source, every source names an existing array, parameter or size, no size that a
        required array's shape gives has a source (it would never be read), constraints
        compare known sizes, dtypes and roles are known ones (checked at load, so that a broken
        manifest refuses its plugin there instead of failing every call)."""
        arrays = self.tensors
        names = {t.name for t in arrays}
        syms = self.shape_symbols
        # one name, one array: bind looks arrays up by name, so a second 'out' (or an aux named
        # like the input) was handed the first one's array and the kernel got the wrong memory
        where: dict = {}
        labelled = [("output", self.output), ("input", self.input),
                    *((f"aux[{i}]", a) for i, a in enumerate(self.aux))]
        for label, t in labelled:
            if t.same_as_output:       # the in-place input is the output, by its name
                continue
            if t.name in where:
                return (f"{label}: name: {t.name!r} names {where[t.name]} already; expected each "
                        "array named once")
            where[t.name] = label
        # a parameter shares the namespace of the call's arguments and of a test shape's sizes
        sizes = self.size_names
        for k in self.params:
            if k in where:
                return (f"params: {k}: named like the array {where[k]}; expected a name no array, "
                        "size or dim uses")
            if k in sizes:
                return (f"params: {k}: named like the size {k} of the arrays' shapes; expected a "
                        "name no array, size or dim uses")
            src = self.dim_sources.get(k)
            if k in self.dims and not (isinstance(src, dict) and src.get("param") == k):
                if src is None:   # the dim has no source at all: the source is what is missing
                    return (f"dim_sources: {k}: expected a source for the dim {k} (e.g. {{param: {k}}}: "
                            f"the parameter of that name), got " + ("null" if k in self.dim_sources else "no entry"))
                if isinstance(src, dict) and "param" in src:   # the dim takes another parameter
                    return (f"dim_sources: {k}: param: expected the parameter {k!r} (a dim named like a "
                            f"parameter takes that parameter's value), got {_got(src['param'])}")
                return (f"params: {k}: named like the dim {k}, whose value comes from {brief(src)}; "
                        f"expected a name no array, size or dim uses (a dim may take a parameter's value: "
                        f"dim_sources: {{{k}: {{param: {k}}}}})")
        # the kernel's first two pointers have their roles by their place in the ABI (void*
        # output, const void* input): output: {role: input} turned off the checks of what the
        # kernel writes (a read-only array given as out was written: SIGSEGV)
        for label, t in (("output", self.output), ("input", self.input)):
            if t.role != label:
                return (f"{label}: role: expected {label} (the kernel's {label} pointer; other roles "
                        f"belong to aux entries), got {_got(t.role)}")
        for t in arrays:
            if t.role not in ("input", "output", "inout", "workspace"):
                return f"{t.name}: role: expected input, output, inout or workspace, got {_got(t.role)}"
            bad = [d for d in t.dtypes if d not in abi.DTYPE_CODES]
            if bad:
                return f"{t.name}: dtype: expected some of {sorted(abi.DTYPE_CODES)}, got {bad}"
            if t.same_dtype_as is not None and t.same_dtype_as not in names:
                return f"{t.name}: same_dtype_as: expected an array of the manifest, got {_got(t.same_dtype_as)}"
        problem = self._dtype_problem()
        if problem:
            return problem
        kinds = {"dtype_of": names, "row_stride_of": names, "param": set(self.params),
                 "default_dim": syms, "tuned": None}
        for d, src in self.dim_sources.items():
            given = [k for k in kinds if k in src] if isinstance(src, dict) else []
            if not given:
                return f"dim_sources: {d}: expected one of {sorted(kinds)}, got {_got(src)}"
            kind = given[0]
            # one source a dim: _dim_value reads the first it finds and the rest were ignored
            # without a word ({dtype_of: x, tuned: 3} listed a tuned dim no table could fill;
            # {param: a, range: [0, 3]} bounded nothing); range and options qualify tuned only,
            # encode param only
            if len(given) > 1:
                return (f"dim_sources: {d}: expected one source (a dim takes one value), got "
                        f"{' and '.join(given)}")
            for extra, owner in (("range", "tuned"), ("options", "tuned"), ("encode", "param")):
                if extra in src and kind != owner:
                    return (f"dim_sources: {d}: {extra}: expected it only with {owner}, got it with "
                            f"{kind} (where it is never read)")
            if kinds[kind] is not None and (not isinstance(src[kind], str) or src[kind] not in kinds[kind]):
                return f"dim_sources: {d}: {kind}: expected one of {sorted(kinds[kind])}, got {_got(src[kind])}"
            # a float reaches the kernel as an int64 dim: only as its bits (encode: f64_bits);
            # without it bind passed int(2.5) = 2, and the kernel computed with 2 without a word
            if (kind == "param" and "encode" not in src
                    and _param_type(self.params.get(src["param"])) == "float"):
                return (f"dim_sources: {d}: param {src['param']}: expected encode: f64_bits for a float "
                        "parameter (the kernel receives a dim as an int64: a float travels as the bits of "
                        "its double), got no encode, which would cut it to an integer")
        # a size that a required array's shape gives reaches the kernel as bind measures it: a
        # source on it ({N: {dtype_of: x}}, or a default_dim) is never read, and the kernel got
        # the size, not the dtype code. A size only optional arrays (or a workspace) give takes
        # its source where those are absent
        fixed: dict = {}   # size -> the first required array whose shape holds it
        for t in arrays:
            for _, sym in t.parsed if not t.optional and t.role != "workspace" else ():
                if sym is not None:
                    fixed.setdefault(sym, t.name)
        for d, src in self.dim_sources.items():
            if d in fixed:
                return (f"dim_sources: {d}: expected a source only for a dim that no required array's "
                        f"shape gives; got {brief(src)} for {d}, a size of the required array "
                        f"{fixed[d]}'s shape, so it is never read (the kernel receives the size)")
        for d in self.tuned_dims:
            src = self.dim_sources[d]
            if "range" in src:
                r = src["range"]
                if not (isinstance(r, list) and len(r) == 2 and all(_is_int(v) for v in r) and r[0] <= r[1]):
                    return f"dim_sources: {d}: range: expected [LOWEST, HIGHEST] (integers), got {_got(r)}"
            if "options" in src:
                o = src["options"]
                if not (isinstance(o, list) and o and all(_is_int(v) for v in o)):
                    return f"dim_sources: {d}: options: expected a non-empty list of integers, got {_got(o)}"
            if not _is_int(src["tuned"]):
                return f"dim_sources: {d}: tuned: expected the default value (an integer), got {_got(src['tuned'])}"
            allowed = self.tuned_allowed(d)
            if not allowed[0](src["tuned"]):
                return f"dim_sources: {d}: tuned: the default {src['tuned']} is outside {allowed[1]}"
        for d in self.dims:
            if d not in syms and d not in self.dim_sources:
                return f"dims: {d}: expected a size of an array's shape or a dim_sources entry, got neither"
        # every size of a shape reaches the kernel: as a dim, or equal by a constraint ("M == N",
        # "S == 1") to a dim that bind always knows (a size of a required array, or one with a
        # default_dim) or to a number. One that does not (out: [M] beside a kernel that learns
        # only N) let a call whose out is shorter than x pass bind, and the kernel wrote past
        # out's end. A tie through a dim bind may not know (a param, a tuned choice, a size of an
        # optional array only) is no tie: bind skips a constraint with an unknown side. A
        # workspace's shape is not checked by bind (workspace_size sizes it): not counted
        known = (set(fixed) | {d for d, src in self.dim_sources.items()
                               if isinstance(src, dict) and "default_dim" in src}) & set(self.dims)
        equal = [m.group(1, 3) for m in (_CONSTRAINT.match(c) for c in self.constraints if isinstance(c, str))
                 if m and m.group(2) == "=="]

        def tied(sym) -> bool:
            return sym in self.dims or any(y in known or y.isdecimal() for a, b in equal
                                           for x, y in ((a, b), (b, a)) if x == sym)
        for label, t in labelled:
            if t.role == "workspace" or t.same_as_output:
                continue
            for _, sym in t.parsed:
                if sym is not None and not tied(sym):
                    example = next(iter(sorted(known)), None)
                    how = (f"one of dims {self.dims}, or equal by a constraint to a dim every call gives "
                           f"(such as '{sym} == {example}') or to a number"
                           if example else f"one of dims {self.dims}, or equal to a number by a constraint")
                    return (f"{label} ({t.name}): shape: size {sym}: expected a size the kernel receives "
                            f"({how}), got a size no dim passes: the kernel could not know it, and an "
                            f"array of another {sym} would be read or written past its end")
        unused = [k for k in self.dim_sources if k not in self.dims]
        if unused:   # a source whose size is never passed: a misspelt dim, or one left out of dims
            return (f"dim_sources: {brief(unused[0])}: expected one of dims {self.dims} (a size the "
                    "kernel receives), got a name dims does not list")
        known = syms | set(self.dim_sources)
        for text in self.constraints + [t.absent_requires for t in self.aux if t.absent_requires]:
            m = _CONSTRAINT.match(str(text))
            unknown = [s for s in (m.groups()[::2] if m else []) if not s.isdecimal() and s not in known]
            if unknown:
                return f"constraint {brief(text)}: {unknown[0]} is no size of the manifest's arrays"
        return ""

    def _dtype_problem(self) -> str:
        """What leaves the kernel unsure of an array's dtype ('' if nothing): an array (but a
        workspace, or the in-place input, which is the output) with no dtype (no `dtype:` key,
        or []: any dtype reached the kernel), and a required array allowed several dtypes whose
        dtype no dim tells the kernel: a dim_sources entry ``dtype_of`` it, or of a required
        array it is tied to by same_dtype_as (in either direction; bind checks the two are
        equal), such as fused_add_rmsnorm's weight (same_dtype_as x, whose dtype is dim
        `dtype`), or a tie to a required array of a single dtype (which fixes it). Without one a float16 call ran a kernel written for float32 (a heap overflow).
        An optional array is not held to the second rule: a dim source cannot name one (it is
        absent in some calls), so a kernel must not read an optional array of several dtypes
        (moe_fused_gemm's router_logits is not read)."""
        arrays = [t for t in self.tensors if t.role != "workspace" and not t.same_as_output]
        for t in arrays:
            if not t.dtypes:
                return (f"{t.name}: dtype: expected a non-empty list of the dtypes the kernel takes "
                        "([float32] or [float16, bfloat16]), got none: any dtype would reach the kernel")
        required = {t.name: t for t in arrays if not t.optional}
        group = {n: n for n in required}   # same_dtype_as ties among required arrays (union-find)

        def root(n):
            while group[n] != n:
                n = group[n]
            return n
        for t in required.values():
            if t.same_dtype_as in required:
                group[root(t.name)] = root(t.same_dtype_as)
        # a group is told its dtype by a dim, or fixed by a member allowed a single dtype
        told = {root(src["dtype_of"]) for src in self.dim_sources.values()
                if isinstance(src, dict) and src.get("dtype_of") in required}
        told |= {root(n) for n, t in required.items() if len(set(t.dtypes)) == 1}
        for t in required.values():
            if len(set(t.dtypes)) > 1 and root(t.name) not in told:
                return (f"{t.name}: dtype: {t.dtypes} allows several dtypes, but no dim tells the kernel "
                        f"which one a call passes; expected a dim_sources entry {{<dim>: {{dtype_of: "
                        f"{t.name}}}}} (the dim listed in dims), or same_dtype_as a required array that "
                        "has one, or a single dtype")
        return ""

    def _fields_problem(self) -> str:
        """What in the fields only ``verify`` and the fallback read is wrong ('' if nothing),
        checked at load so that a plugin is not ready with a manifest every verify case (or
        every call that falls back) would fail on: ``fallback`` is 'module:function';
        ``tolerance`` maps known dtypes to numbers > 0 (a dtype it omits gets
        DEFAULT_TOLERANCE, which verify's table marks); each ``test_shapes`` entry gives every
        size of the required arrays as an integer >= 0 and parameters of their declared type."""
        for k, spec in self.params.items():   # a default of the wrong type ('false' for a
            if "default" not in spec:           # bool) failed every call using it; a parameter
                continue                        # without one is required of every call
            try:
                self._param_value(k, spec, spec["default"], in_manifest=True)
            except ArgumentError as exc:
                return f"params: {exc.argument}: default: expected {exc.expected}, got {exc.got}"
        if self.fallback is not None and not (isinstance(self.fallback, str) and _FALLBACK.match(self.fallback)):
            return f"fallback: expected 'module:function' (e.g. ex_engine.fallbacks:topk_softmax), got {_got(self.fallback)}"
        for dt, tol in self.tolerance.items():
            if dt not in abi.DTYPE_CODES:
                return f"tolerance: {dt}: expected a dtype, one of {sorted(abi.DTYPE_CODES)}"
            if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 < tol < float("inf"):
                return (f"tolerance: {dt}: expected a relative error > 0 (e.g. 1.0e-5), got "
                        f"{_got(tol)}")
        needed = sorted({sym for t in self.tensors if not t.optional and t.role != "workspace"
                         for _, sym in t.parsed if sym is not None})
        for label, t in [("output", self.output), ("input", self.input),
                         *((f"aux[{i}]", a) for i, a in enumerate(self.aux))]:
            problem = self._values_problem(t, set(needed) if not t.optional else self.shape_symbols)
            if problem:
                return f"{label} ({t.name}): values: {problem}"
        for i, case in enumerate(self.test_shapes):
            if not isinstance(case, dict):
                return f"test_shapes[{i}]: expected a mapping {{size: integer, parameter: value}}, got {_got(case)}"
            for k, v in case.items():
                if k in self.params:
                    continue
                if k not in self.size_names:
                    return (f"test_shapes[{i}]: {k}: expected a size ({', '.join(sorted(self.size_names))}) "
                            f"or a parameter ({', '.join(sorted(self.params)) or 'none'})")
                if not _is_int(v) or v < 0:
                    return f"test_shapes[{i}]: {k}: expected an integer >= 0, got {_got(v)}"
            missing = [k for k in needed if k not in case]
            if missing:
                return f"test_shapes[{i}]: expected every size of the required arrays ({', '.join(needed)}), " \
                       f"got no {', '.join(missing)}"
            try:
                self.param_values({k: v for k, v in case.items() if k in self.params})
            except ArgumentError as exc:
                return f"test_shapes[{i}]: {exc.argument}: expected {exc.expected}, got {exc.got}"
            # the manifest's own constraints (a shape K > E made every verify case fail on bind),
            # checked as bind checks them
            sizes = {k: v for k, v in case.items() if k not in self.params}
            self._default_dims(sizes)
            for text in self.constraints:
                m = _CONSTRAINT.match(str(text))
                if not m:
                    continue     # load reports it
                try:
                    self._check_constraint(m, sizes, None, text)
                except ShapeError as exc:
                    return f"test_shapes[{i}]: expected sizes that keep the constraint '{text}', got {exc.got}"
        return ""

    @staticmethod
    def _values_problem(t, known) -> str:
        """What is wrong with array spec ``t``'s ``values`` ('' if nothing), as verify draws
        them: one of normal / uniform / ids_below; a number or size written SYM or 1/sqrt(SYM)
        with SYM in ``known`` (the sizes every test shape gives: 'normal: 1/sqrt(Q)' and
        'uniform: [a, b]' loaded and failed every verify case with KeyError); integers LO < HI
        for an integer array; ids_below a size or an integer >= 1; distinct with ids_below."""
        v = t.values
        if not v:
            return ""
        kinds = [k for k in ("normal", "uniform", "ids_below") if k in v]
        if len(kinds) > 1:
            return f"expected one of normal, uniform and ids_below, got {' and '.join(kinds)}"
        if "distinct" in v and "ids_below" not in v:
            return "distinct: expected it only with ids_below (distinct ids per row)"
        ints = any(d.startswith(("int", "uint")) for d in t.dtypes)

        def scalar(x, what, rsqrt=True):
            if isinstance(x, str):
                m = _RSQRT.match(x) if rsqrt else None
                sym = m.group(1) if m else x.strip()
                if sym in known:
                    return ""
                forms = "SYM or 1/sqrt(SYM)" if rsqrt else "SYM"
                return (f"{what}: expected a number or {forms} with SYM a size every test shape gives "
                        f"({', '.join(sorted(known)) or 'none'}), got {_got(x)}")
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not _finite(x):
                return f"{what}: expected a finite number or a size, got {_got(x)}"
            return ""

        if "normal" in v and t.dtypes and all(d.startswith(("int", "uint")) for d in t.dtypes):
            return "normal: expected uniform or ids_below for an integer array (normal draws floats)"
        if "normal" in v:
            problem = scalar(v["normal"], "normal")
            if problem:
                return problem
            if not isinstance(v["normal"], str) and v["normal"] < 0:
                return f"normal: expected a standard deviation >= 0, got {_got(v['normal'])}"
        if "uniform" in v:
            lo, hi = v["uniform"]
            if ints:
                if not (_is_int(lo) and _is_int(hi) and lo < hi):
                    return (f"uniform: expected integers [LO, HI] with LO < HI for an integer array "
                            f"({'/'.join(t.dtypes)}), got {_got(v['uniform'])}")
            for x, what in ((lo, "uniform[0]"), (hi, "uniform[1]")):
                problem = scalar(x, what)
                if problem:
                    return problem
            if not isinstance(lo, str) and not isinstance(hi, str) and not lo <= hi:
                return f"uniform: expected [LO, HI] with LO <= HI, got {_got(v['uniform'])}"
        if "ids_below" in v:
            n = v["ids_below"]
            problem = scalar(n, "ids_below", rsqrt=False)
            if problem:
                return problem
            if not isinstance(n, str) and not (_is_int(n) and n >= 1):
                return f"ids_below: expected a size or an integer >= 1, got {_got(n)}"
        return ""

    def tolerance_for(self, dtype: str) -> tuple:
        """(verify's relative tolerance for ``dtype``, whether it is DEFAULT_TOLERANCE because
        the manifest's tolerance does not name the dtype)."""
        if dtype in self.tolerance:
            return float(self.tolerance[dtype]), False
        return DEFAULT_TOLERANCE, True

    # ------------------------------------------------------------------------------------
    @property
    def tensors(self) -> list:
        """Every array spec in ABI order: output, input, aux[0], aux[1], ..."""
        return [self.output, self.input, *self.aux]

    @property
    def user_tensors(self) -> list:
        """Array specs the caller provides (no workspace; an in-place input counted once)."""
        return [t for t in self.tensors if t.role != "workspace" and not t.same_as_output]

    @functools.cached_property
    def user_names(self) -> frozenset:
        """Names of user_tensors (computed once)."""
        return frozenset(t.name for t in self.user_tensors)

    @functools.cached_property
    def shape_symbols(self) -> frozenset:
        """The size symbols of the arrays' shapes (T, H, E, ...)."""
        return frozenset(sym for t in self.tensors for _, sym in t.parsed if sym is not None)

    @functools.cached_property
    def size_names(self) -> frozenset:
        """Sizes a call binds (the symbols of the arrays' shapes and the dims that default to
        one of them, e.g. G): what a tuning table's key may name, besides T."""
        return self.shape_symbols | {d for d, src in self.dim_sources.items()
                                     if isinstance(src, dict) and "default_dim" in src}

    @functools.cached_property
    def written_names(self) -> tuple:
        """Arrays the factor writes, in ABI order (output and inout roles; an in-place input is
        its output)."""
        return tuple(t.name for t in self.tensors
                     if t.role in ("output", "inout") and not t.same_as_output)

    @property
    def tuned_dims(self) -> list:
        """Dims whose source is ``{tuned: DEFAULT}`` (a tuning table fills them)."""
        return [d for d, src in self.dim_sources.items() if isinstance(src, dict) and "tuned" in src]

    def tuned_allowed(self, dim: str) -> tuple:
        """(predicate, text) of the values tuned dim ``dim`` takes: its dim_sources entry's
        ``range: [LO, HI]`` (inclusive) and/or ``options: [...]``; any integer when it gives
        neither (text '')."""
        src = self.dim_sources.get(dim) or {}
        rng, opts = src.get("range"), src.get("options")
        texts = ([f"the range {rng[0]}..{rng[1]}"] if rng else []) + ([f"the options {opts}"] if opts else [])
        return ((lambda v: (not rng or rng[0] <= v <= rng[1]) and (not opts or v in opts)),
                " and ".join(texts))

    @property
    def workspace_index(self) -> int | None:
        """Index into aux of the workspace, or None."""
        for i, a in enumerate(self.aux):
            if a.role == "workspace":
                return i
        return None

    def fallback_fn(self):
        """The Python fallback callable named by 'module:function', or None. Raises FactorError
        naming the manifest if it cannot be imported, is not callable or cannot be called as
        ``fn(arrays, sizes, params)`` (fallback_problem).

        A module whose import raises is reported so, whatever it raises: an Exception, and also
        SystemExit (``sys.exit(3)`` at import time ended the whole program, list-factors with
        status 3 and no output) or another BaseException but KeyboardInterrupt (Ctrl-C stays
        Ctrl-C): "cannot be loaded (SystemExit: 3 while importing module 'm' ...)". What
        cannot be caught in this process is a module that ends it outright (``os._exit(7)``, a
        crash in an extension module): FactorRegistry.load(probe="subprocess") (list-factors
        and verify by default, ``run moe --probe``) imports such a module in a child process
        first and refuses the plugin if the child dies; without the probe it ends the caller."""
        if not self.fallback:
            return None
        mod, _, fn = self.fallback.partition(":")
        fresh = mod not in sys.modules   # its code runs in this call (a BaseException is its own)
        try:
            f = getattr(importlib.import_module(mod), fn)
        except Exception as exc:  # ImportError, AttributeError, or the module's own error
            raise FactorError(f"manifest {self.path}: fallback {self.fallback!r} cannot be loaded "
                              f"({type(exc).__name__}: {exc})") from None
        except BaseException as exc:   # sys.exit() at import time, say: no reason to end the caller
            if isinstance(exc, (KeyboardInterrupt, GeneratorExit)) or not fresh:
                raise                      # Ctrl-C, or a signal's exception arriving here: not the module's
            what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            raise FactorError(f"manifest {self.path}: fallback {self.fallback!r} cannot be loaded "
                              f"({what} while importing module {mod!r}: the "
                              "module ended its own import; a fallback module must not exit)") from None
        if self.__dict__.get("_fallback_checked") is not f:   # the signature read once per function
            problem = fallback_problem(f)
            if problem:
                raise FactorError(f"manifest {self.path}: fallback: {self.fallback!r}: {problem}")
            self._fallback_checked = f
        return f

    def param_values(self, params: dict) -> dict:
        """User parameters with defaults filled in and types checked.

        params: a mapping of parameter name -> value ({} for all defaults). Raises
        ArgumentError naming the factor and 'params' for another type, and naming the parameter
        for an unknown name, a value of the wrong type, or a parameter without a default that
        ``params`` does not give (a required one)."""
        if not isinstance(params, dict):
            raise ArgumentError(self.name, "params", "type", "a mapping of parameter name -> value",
                                f"{type(params).__name__} {brief(params)}")   # (Python's None, not YAML's null)
        out = {}
        for k in params:
            if k not in self.params:
                raise ArgumentError(self.name, k, "unknown parameter",
                                    f"one of {sorted(self.params)}", brief(k))
        for k, spec in self.params.items():
            if k not in params and "default" not in spec:
                raise ArgumentError(self.name, k, "required", "a value (the manifest gives no default)",
                                    "none given")
            out[k] = self._param_value(k, spec, params[k] if k in params else spec["default"])
        return out

    def _param_value(self, k: str, spec: dict, v, in_manifest: bool = False):
        """Parameter ``k``'s value ``v`` checked against its ``spec`` (type, gt, float32) and
        converted (bool, int or float); raises ArgumentError naming the parameter. A bool
        parameter takes 0 and 1 too, which a call's message says; ``in_manifest`` (the
        manifest's default, written in YAML, whose bools are true and false) says "a bool"."""
        typ = _param_type(spec)
        if typ == "bool":
            if not bool_like(v):
                raise ArgumentError(self.name, k, "type", "a bool" if in_manifest else "a bool (or 0/1)",
                                    brief(v))
            v = bool(v)
        elif typ == "int":
            # Python's or NumPy's integers (not bools); passed to the kernel as an int64
            is_bool = isinstance(v, bool) or getattr(getattr(v, "dtype", None), "kind", "") == "b"
            if is_bool or not hasattr(v, "__index__") or getattr(v, "shape", ()) != ():
                raise ArgumentError(self.name, k, "type", "an int", brief(v))
            v = operator.index(v)
            if not -2 ** 63 <= v < 2 ** 63:
                raise ArgumentError(self.name, k, "value", "an int in the int64 range", brief(v))
            if "gt" in spec and not v > spec["gt"]:   # (ignored for ints before)
                raise ArgumentError(self.name, k, "value", f"an int > {spec['gt']}", brief(v))
        else:
            if isinstance(v, (str, bytes, bool)):  # float('1e-6') would parse it; True is no eps
                raise ArgumentError(self.name, k, "type", "a number", brief(v))
            try:
                v = float(v)
            except (TypeError, ValueError, RuntimeError):   # RuntimeError: a tensor of several
                raise ArgumentError(self.name, k, "type", "a number", brief(v)) from None
            except OverflowError:   # an int beyond float's range (10**400)
                raise ArgumentError(self.name, k, "value", "a finite number", brief(v)) from None
            if "gt" in spec and not float(spec["gt"]) < v < float("inf"):  # NaN fails too
                raise ArgumentError(self.name, k, "value", f"a finite number > {spec['gt']}", brief(v))
            # float32: the factor computes with it in float32 (fused_add_rmsnorm's eps = 1e-60
            # passed 'gt: 0' and was 0 there: an all-zero row divided by zero; 1e39 was inf)
            if spec.get("float32") and v != 0 and not _F32_TINY <= abs(_to_f32(v)) <= _F32_MAX:
                zero = "" if float(spec.get("gt", -1)) >= 0 else "0, or "
                raise ArgumentError(self.name, k, "value", f"a number that rounds to a normal float32 "
                                    f"({zero}a magnitude from {_F32_TINY:.9g} to {_F32_MAX:.9g}): "
                                    "the factor computes with it in float32", brief(v))
        return v

    def bind(self, arrays: dict, params: dict | None = None, tuned=None):
        """Check ``arrays`` (name -> TensorRef or None) against this contract.

        ``tuned(factor, dim, sizes, default) -> int`` gives the dims whose source is
        ``{tuned: DEFAULT}`` (a registry passes its TuningTable.value); None: DEFAULT.
        Returns (refs in ABI order, dims list, sizes dict, param values, device).
        Raises DTypeError, ShapeError, LayoutError, DeviceError or ArgumentError.
        """
        name = self.name
        pvals = self.param_values(params or {})
        sizes: dict = {}
        origin: dict = {}           # size symbol -> the argument whose shape fixed it
        tensors = self.tensors
        refs = [None] * len(tensors)
        device = None
        early = False
        for i in self._bind_order:
            spec = tensors[i]
            if spec.role == "workspace":
                continue
            if not early and spec.optional and not spec.absent_requires and spec.role != "output":
                # before the other optional arrays: an absent array's "A == B" fixes A now (no
                # expert_map: G = E), so router_logits of another width is the argument named
                early = True
                self._absent_equalities(arrays, sizes, origin)
            ref = arrays.get(self.output.name) if spec.same_as_output else arrays.get(spec.name)
            if ref is None:
                if spec.optional:
                    continue
                raise ArgumentError(name, spec.name, "required", "an array", "None")
            refs[i] = ref
            if spec.same_as_output:
                continue
            if spec.dtypes and ref.dtype not in spec.dtypes:
                raise DTypeError(name, spec.name, "dtype", " or ".join(spec.dtypes), ref.dtype)
            if len(ref.shape) != len(spec.parsed):
                raise ShapeError(name, spec.name, "rank",
                                 f"{len(spec.parsed)} dims {tuple(spec.shape)}",
                                 f"{len(ref.shape)} dims {ref.shape}")
            for axis, ((coef, sym), actual) in enumerate(zip(spec.parsed, ref.shape)):
                if sym is None:
                    want = coef
                elif sym in sizes:
                    want = coef * sizes[sym]
                else:
                    if actual % coef:
                        raise ShapeError(name, spec.name, f"shape[{axis}] = {spec.shape[axis]}",
                                         f"a multiple of {coef}", actual)
                    sizes[sym] = actual // coef
                    origin[sym] = spec.name
                    continue
                if actual != want:
                    where = f" ({sym}={sizes[sym]} from {origin[sym]})" if sym else ""
                    raise ShapeError(name, spec.name, f"shape[{axis}] = {spec.shape[axis]}",
                                     f"{want}{where}", actual)
            self._check_layout(spec, ref)
            if device is None:
                device = ref.device
            elif ref.device != device:
                place = lambda d: "host memory" if d < 0 else f"cuda:{d}"
                raise DeviceError(name, spec.name, "device", place(device), place(ref.device))
        for spec, ref in zip(self.tensors, refs):
            if ref is not None and spec.same_dtype_as and not spec.same_as_output:
                other = arrays.get(spec.same_dtype_as)
                if other is not None and other.dtype != ref.dtype:
                    raise DTypeError(name, spec.name, f"same dtype as {spec.same_dtype_as}",
                                     other.dtype, ref.dtype)
        self._default_dims(sizes, origin)
        for text, m in zip(self.constraints, self._constraints):
            self._check_constraint(m, sizes, None, text, origin)
        for spec, m in self._absent:
            if arrays.get(spec.name) is None:
                self._check_constraint(m, sizes, spec.name, f"{spec.absent_requires} when {spec.name} "
                                       "is not given", origin)
        dims = [self._dim_value(d, sizes, pvals, arrays, tuned) for d in self.dims]
        return refs, dims, sizes, pvals, (-1 if device is None else device)

    def _default_dims(self, sizes: dict, origin: dict | None = None) -> None:
        """A size no given array fixes (its array is optional and absent) takes the size its
        dim source names as ``default_dim`` (moe_fused_gemm: G = E without an expert_map)."""
        for d, src in self.dim_sources.items():
            if isinstance(src, dict) and d not in sizes and src.get("default_dim") in sizes:
                sizes[d] = sizes[src["default_dim"]]
                if origin is not None:
                    origin[d] = f"{origin.get(src['default_dim'], src['default_dim'])}, as {src['default_dim']}"

    def _absent_equalities(self, arrays, sizes, origin) -> None:
        """For each absent optional array whose absent_requires is ``A == B`` with B known and
        A not: A = B, its origin saying why."""
        for spec, m in self._absent:
            a, op, b = m.groups()
            if (arrays.get(spec.name) is None and op == "==" and a in self.shape_symbols
                    and a not in sizes and b in sizes):
                sizes[a] = sizes[b]
                origin[a] = f"{origin.get(b, b)}, as {b}: {spec.name} not given"

    def _check_constraint(self, m, sizes, arg, text, origin=None):
        """Raise ShapeError if the sizes break ``A op B``; it names ``arg``, else the argument
        whose shape fixed the constraint's size, and says where each size came from."""
        a, op, b = m.groups()
        va = sizes.get(a, int(a) if a.isdecimal() else None)
        vb = sizes.get(b, int(b) if b.isdecimal() else None)
        if va is None or vb is None:
            return
        ok = {"<=": va <= vb, "<": va < vb, "==": va == vb, ">=": va >= vb, ">": va > vb}[op]
        if not ok:
            origin = origin or {}
            syms = [s for s in (a, b) if not s.isdecimal()]
            arg = arg or origin.get(syms[0], syms[0])
            got = ", ".join(f"{s}={sizes[s]}" + (f" (from {origin[s]})" if s in origin else "") for s in syms)
            raise ShapeError(self.name, arg, text, f"{a} {op} {b}", got)

    def _check_layout(self, spec, ref):
        if any(isinstance(s, float) for s in ref.strides):
            raise LayoutError(self.name, spec.name, "strides", "whole elements", ref.strides)
        if ref.size == 0:
            ok = True        # an empty array (T = 0) has no layout; NumPy gives it zero strides
        elif spec.row_strided and len(ref.shape) == 2:
            ok = (ref.strides[1] == 1 or ref.shape[1] <= 1) and \
                 (ref.strides[0] >= ref.shape[1] or ref.shape[0] <= 1)
            expected = f"unit stride in the last dim and row stride >= {ref.shape[1]}"
        else:
            ok = ref.is_contiguous()
            expected = None
        if not ok:
            expected = expected or f"C-contiguous strides {ref.contiguous_strides()}"
            raise LayoutError(self.name, spec.name, "layout", expected, f"strides {ref.strides}")
        self.check_alignment(spec.name, ref)

    def check_alignment(self, name: str, ref) -> None:
        """Raise LayoutError unless ref's address is a multiple of its element size."""
        if ref.itemsize < 1:     # (numpy's 'V0'): no element to align, nothing a kernel can read
            raise LayoutError(self.name, name, "element size", "at least 1 byte", ref.itemsize)
        if ref.ptr % ref.itemsize:
            raise LayoutError(self.name, name, "alignment",
                              f"address a multiple of {ref.itemsize}", hex(ref.ptr))

    def _dim_value(self, d, sizes, pvals, arrays, tuned=None) -> int:
        if d in sizes:
            return sizes[d]
        src = self.dim_sources.get(d)
        if src is None:
            raise FactorError(f"manifest {self.path}: dim '{d}' has no size and no dim_source")
        if "dtype_of" in src:
            return abi.DTYPE_CODES[arrays[src["dtype_of"]].dtype]
        if "param" in src:
            v = pvals[src["param"]]
            if src.get("encode") == "f64_bits":
                return struct.unpack("<q", struct.pack("<d", float(v)))[0]
            return int(v)
        if "tuned" in src:            # a launch choice kept as data (manifests/tuning/)
            default = int(src["tuned"])
            return tuned(self.name, d, sizes, default) if tuned is not None else default
        if "default_dim" in src:      # reached only when neither this size nor its default is known
            raise FactorError(f"manifest {self.path}: dim '{d}': default_dim {brief(src['default_dim'])} "
                              "is not a size of any array")
        if "row_stride_of" in src:
            ref = arrays[src["row_stride_of"]]
            return int(ref.strides[0]) if len(ref.shape) == 2 and ref.shape[0] > 1 else int(ref.shape[-1])
        raise FactorError(f"manifest {self.path}: dim '{d}': unknown source {src}")


def read_manifest_bytes(path: Path) -> bytes:
    """The bytes of the manifest file ``path``. Raises FactorError naming it: "not readable
    (permission denied)" for a file this process may not read (chmod 000: it was reported as
    "malformed (PermissionError: ...)", as if its contents were wrong), "not readable
    (<OSError>: ...)" for another read error (a folder of that name, a dangling link or a
    loop), as an unreadable tuning file is; "not a regular file" for a FIFO or a device (a FIFO
    blocked the read forever, /dev/zero filled memory) and the file's size for one over
    _paths.TEXT_FILE_LIMIT, before reading it."""
    try:
        return _paths.read_small(path)
    except _paths.FileRefused as exc:
        raise FactorError(f"manifest {path}: {exc}") from None
    except PermissionError as exc:
        raise FactorError(f"manifest {path}: not readable (permission denied)") from exc
    except OSError as exc:
        raise FactorError(f"manifest {path}: not readable ({type(exc).__name__}: {one_line(exc)})") from exc


def why_not_found(path, name: str) -> str:
    """Why the file ``path`` (<name>.yaml in a manifests folder) gave no manifest named
    ``name`` although it is there ('' if it is not a readable file, or gave nothing to say):
    empty, not a mapping, no name field, or a name field that differs. A file read_manifest_bytes
    refuses (a FIFO, one over the size limit) is not read: '' (load_all reported it)."""
    path = Path(path)
    try:
        if not path.is_file():
            return ""
        d = _yaml.load(_paths.read_small(path).decode(), name=path)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return ""   # load_all reported it already
    if d is None:
        return f"manifest {path}: empty: expected the manifest of '{name}' (name, id, dims, ...)"
    if not isinstance(d, dict):
        return f"manifest {path}: expected a mapping (name, id, dims, ...), got {type(d).__name__}"
    if "name" not in d:
        return f"manifest {path}: no name field: expected name: {name}"
    if d["name"] != name:
        return (f"manifest {path}: names {brief(d['name'])}, the library {name!r}: the manifest must "
                "name its factor as the library does")
    return ""


def load_all(folder, errors: dict | None = None, notes: list | None = None) -> dict:
    """name -> Manifest for every *.yaml in ``folder`` that is a factor manifest.

    The folder's own files that are not manifests are not read: its hardware/ and tuning/
    subfolders (only *.yaml directly in ``folder`` is), and NOT_MANIFESTS (moe_models.yaml, the
    model list, which moe_layer.load_models reads and checks; a corrupt one was reported as a
    malformed manifest, and one with name and id keys would have been loaded as one).

    A file that cannot be read or checked raises FactorError naming it, unless ``errors`` is
    given: then errors[file stem] = the message and the other files still load (a registry
    rejects only the plugins that need the broken manifest). A stray file that names a factor
    whose own <name>.yaml is there (see _one_claim) is such an error too, unless ``notes`` is
    given: then its message is appended there (it blocks no factor of its stem's name), as is a
    note for a file that is empty or one scalar (a mapping or list of other keys is some other
    file, passed over).

    folder: a str or os.PathLike (ArgumentError otherwise). A folder that does not exist (or
    is not a directory) raises FactorError naming it, unless ``errors`` is given: then the
    answer is {} (the registry's mode: it names the missing manifest of each plugin)."""
    if not isinstance(folder, (str, os.PathLike)):
        raise ArgumentError("load_all", "folder", "type", "a folder path (str or os.PathLike)",
                            f"{type(folder).__name__} {folder!r}")
    if not Path(folder).is_dir():
        if errors is not None:
            return {}
        raise FactorError(f"load_all: manifest folder '{folder}': "
                          + ("not a directory" if Path(folder).exists() else "does not exist"))
    claims: dict = {}   # factor name -> every Manifest that names it, by file name
    for p in sorted(Path(folder).glob("*.yaml")):
        if p.name in NOT_MANIFESTS:   # the model list: moe_layer reads it, by its own rules
            continue
        try:
            raw = read_manifest_bytes(p)
            try:
                d = _yaml.load(raw.decode(), name=p)
            except (UnicodeDecodeError, yaml.YAMLError) as exc:
                raise FactorError(f"manifest {p}: malformed ({type(exc).__name__}: {one_line(exc)})") from exc
            if isinstance(d, dict) and "name" in d and ("dims" in d or "id" in d):
                m = Manifest.load(p, d, raw)  # a factor manifest (one missing a key is named)
                claims.setdefault(m.name, []).append(m)
            elif notes is not None and not isinstance(d, (dict, list)):
                # empty, or one scalar (a clobbered file): no manifest, and nothing else either; a
                # plugin of its stem names it in its reason (why_not_found), the notes name it here
                notes.append(f"manifest {p}: empty: expected a factor manifest (name, id, dims, ...); "
                             "not used" if d is None else
                             f"manifest {p}: expected a mapping (name, id, dims, ...), got "
                             f"{type(d).__name__}; not used")
        except FactorError as exc:
            if errors is None:
                raise
            errors[p.stem] = str(exc)
    out = {}
    for name, ms in claims.items():
        m, problems = _one_claim(name, ms, errors or {})
        if notes is not None:   # the strays' notes (keyed by their stems), not the refusal of name
            notes.extend(v for k, v in problems.items() if k != name)
            problems = {k: v for k, v in problems.items() if k == name}
        if problems and errors is None:
            raise FactorError(next(iter(problems.values())))
        if errors is not None:
            errors.update(problems)
        if m is not None:
            out[name] = m
    return out


def load_search_path(folders, errors: dict, notes: list) -> dict:
    """name -> Manifest from the folders of a search path, in order (the registry's
    EX_ENGINE_MANIFESTS): for each factor name, a file named <name>.yaml in any folder is
    preferred to a file of another name that names it (a copy whose name: was not edited yet),
    the first folder's among equals; the others that name it are notes. A malformed file, or
    a name refused in one folder (load_all), hides the manifests of that name in later folders
    (an override that does not load is reported, not replaced by the next folder's file).
    errors (file stem or name -> message) and notes are filled as load_all fills them."""
    pool, errs = [], {}   # (folder index, name, Manifest); stem or name -> (folder index, message)
    for i, d in enumerate(folders):
        e: dict = {}
        for name, m in load_all(d, e, notes).items():
            pool.append((i, name, m))
        for k, v in e.items():
            errs.setdefault(k, (i, v))
    out = {}
    for name in dict.fromkeys(n for _, n, _ in pool):
        cands = [(i, m) for i, n, m in pool if n == name]
        own = [(i, m) for i, m in cands if Path(m.path).stem == name]
        i, m = (own or cands)[0]
        if errs.get(name, (i,))[0] < i:
            continue   # an earlier folder's <name>.yaml is malformed, or refused: its error stands
        out[name] = m
        notes.extend(f"manifest {o.path}: names '{name}', as {m.path} does: that file is the factor's "
                     "manifest, this one is not used (a stray copy? rename it or remove it)"
                     for _, o in cands if o is not m and Path(o.path).stem != name)
    errors.update((k, v) for k, (_, v) in errs.items() if k not in out)
    notes.extend(_misnamed_notes(out))
    return out


def _misnamed_notes(out: dict) -> list:
    """Notes on the manifests ``out`` (name -> Manifest) uses that look like a mistake (a fresh
    user's trial: an override topk_softmax.yaml whose name: read 'other' was used, silently, as
    factor other's manifest, with topk_softmax's own id, while the shipped topk_softmax.yaml
    stayed in force): a file named after one factor that names another factor, and two factors
    that declare the same id (a library is checked against its own factor's id only)."""
    found, by_id = [], {}
    for name, m in out.items():
        by_id.setdefault(m.id, []).append(m)
        stem = Path(m.path).stem
        if stem != name and stem in out:
            found.append(f"manifest {m.path}: named after factor '{stem}' but it names '{name}': used as "
                         f"'{name}''s manifest, not as an override of '{stem}', whose manifest is "
                         f"{out[stem].path} (rename the file or correct its name:)")
    for fid, ms in by_id.items():
        if len(ms) > 1:
            listed = ", ".join(f"'{m.name}' ({m.path})" for m in ms)
            found.append(f"manifests of {listed} all declare id {fid}: a factor's id must be its own "
                         "(a library of one of them that says that id is checked against its own "
                         "manifest only; give each factor its own id)")
    return found


def _one_claim(name: str, ms: list, errors: dict) -> tuple:
    """(the Manifest of factor ``name`` or None, {file stem or name: message}) from every file
    ``ms`` of one folder that names it; ``errors``: the folder's malformed files by stem.

    The file whose stem is the name (<name>.yaml) is the factor's manifest; another file that
    names it (an author's stray copy, its dims edited, say) is set aside with a note. Where
    none of several files is <name>.yaml, or <name>.yaml is there but malformed, no file is
    used: which one describes the library cannot be told (its dims' order decides what the
    kernel reads), so the factor's plugins are refused with a message naming the files."""
    own = [m for m in ms if Path(m.path).stem == name]
    others = [m for m in ms if Path(m.path).stem != name]
    if len(own) == 1:
        return own[0], {Path(o.path).stem: f"manifest {o.path}: names '{name}', as {own[0].path} "
                        f"does: that file ({name}.yaml) is the factor's manifest, this one is "
                        "not used (a stray copy? rename it or remove it)" for o in others}
    if name in errors:   # <name>.yaml is malformed: its error is the factor's, not a stray's file
        return None, {Path(o.path).stem: f"manifest {o.path}: names '{name}', whose own file "
                      f"{name}.yaml is malformed or not readable (see its note): not used in its "
                      "place" for o in others}
    if len(ms) == 1:     # the only file naming it, under another name: used
        return ms[0], {}
    files = " and ".join(str(m.path) for m in ms)
    return None, {name: f"manifests {files} all name '{name}' and none is {name}.yaml: which one "
                  "describes the library cannot be told (their dims may differ), so none is used "
                  f"and the factor's plugins are refused; keep one, named {name}.yaml"}
