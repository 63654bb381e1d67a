"""One view of the arrays users pass: NumPy, CuPy and PyTorch, without copying.

``TensorRef.of(x)`` reads pointer, shape, strides (in elements), dtype name and device from a
NumPy array, a CuPy array, a torch tensor, or anything with ``__cuda_array_interface__``.
The validator checks those; the Python fallbacks compute on ``raw()`` (a NumPy/CuPy view of the
same memory) with ``load_f32``/``store``. bfloat16 is handled as uint16 bits, so NumPy without
ml_dtypes and CuPy without bfloat16 support still work.
"""
from __future__ import annotations

import operator
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.ma  # noqa: F401  (numpy imports it lazily, at the first np.ma: here, not in a call that
#                  a fork may cut short while it holds that import's lock: _kind_of)

from .errors import is_integer

# numpy's dtype.byteorder mark of the byte order that is not this machine's
_NON_NATIVE = ">" if sys.byteorder == "little" else "<"

_NP_NAMES = {"float32", "float16", "bfloat16", "int32", "int64", "float64", "uint16", "int16",
             "int8", "uint8", "bool", "uint32", "uint64"}


_NAME_CACHE: dict = {}


def _dtype_name(dt) -> str:
    """'float32', 'bfloat16', ... for a NumPy/CuPy/torch dtype (cached: dtype.name is slow)."""
    try:
        return _NAME_CACHE[dt]
    except (KeyError, TypeError):
        pass
    name = getattr(dt, "name", None) or str(dt)
    name = name.replace("torch.", "")
    name = {"half": "float16", "float": "float32", "double": "float64"}.get(name, name)
    if getattr(dt, "byteorder", "=") == _NON_NATIVE:
        name += " (non-native byte order)"  # matches no manifest dtype: refused, never misread
    try:
        _NAME_CACHE[dt] = name
    except TypeError:
        pass
    return name


_KINDS: dict = {}          # type -> 'torch' | 'fake' | 'numpy' | 'cupy' | 'bits16' | 'other'
_TORCH_DTYPES: dict = {}   # torch dtype -> (name, itemsize)


def _kind_of(x) -> str:
    """Which library ``x`` comes from, remembered per type (TensorRef.of runs on every call)."""
    t = type(x)
    mod = t.__module__
    torch = sys.modules.get("torch")
    if issubclass(t, Bits16):
        kind = "bits16"
    elif mod.startswith("torch") or (torch is not None and isinstance(getattr(torch, "Tensor", None), type)
                                     and issubclass(t, torch.Tensor)):
        # (a subclass of torch.Tensor defined elsewhere, as engines tag their weights: a tensor)
        # a FakeTensor (what torch.compile and FakeTensorMode trace with) has no memory: its own
        # kind, refused by TensorRef.of before its data pointer is read (torch warns on that read)
        fake = sys.modules.get("torch._subclasses.fake_tensor")
        kind = "fake" if fake is not None and issubclass(t, fake.FakeTensor) else "torch"
    elif issubclass(t, (np.matrix, np.ma.MaskedArray)):
        # refused, not misread: a matrix's * is a matrix product and its rows stay 2-D; a masked
        # array's mask would be dropped (the kernels read every element)
        kind = "other"
    elif issubclass(t, np.ndarray):
        kind = "numpy"
    elif mod.startswith("cupy"):
        kind = "cupy"
    else:
        kind = "other"
    _KINDS[t] = kind
    return kind


def data_ptr(x) -> int:
    """The address of a NumPy/CuPy array's or torch tensor's first element."""
    kind = _KINDS.get(type(x)) or _kind_of(x)
    if kind == "torch":
        return x.data_ptr()
    if kind == "numpy":
        return x.__array_interface__["data"][0]
    if kind == "cupy":
        return x.data.ptr
    return TensorRef.of(x).ptr


def get_xp(arr):
    """numpy or cupy, whichever owns ``arr``."""
    mod = type(arr).__module__
    if mod.startswith("cupy"):
        import cupy
        return cupy
    return np


def bf16_bits_to_f32(xp, bits):
    """float32 values of bfloat16 stored as uint16 bits (exact)."""
    return (bits.astype(xp.uint32) << 16).view(xp.float32)


def f32_to_bf16_bits(xp, values):
    """uint16 bits of the bfloat16 nearest to each float32 (ties to even; NaN stays NaN)."""
    f = xp.ascontiguousarray(values, dtype=xp.float32)
    b = f.view(xp.uint32)
    rounded = (b + xp.uint32(0x7FFF) + ((b >> 16) & xp.uint32(1))) >> 16
    return xp.where(xp.isnan(f), xp.uint32(0x7FC0), rounded).astype(xp.uint16)


def round_to_dtype(xp, values, dtype: str):
    """float32 values rounded to ``dtype`` and back (what storing then loading would give)."""
    if dtype == "bfloat16":
        return bf16_bits_to_f32(xp, f32_to_bf16_bits(xp, values))
    if dtype == "float16":
        return values.astype(xp.float16).astype(xp.float32)
    return values.astype(xp.float32)


class Bits16:
    """A uint16 NumPy/CuPy array tagged as bfloat16 (or float16): how to pass bf16 data from a
    library that has no bf16 dtype (CuPy without ml_dtypes support). ``as_bfloat16(bits)``.
    A torch tensor is refused (DTypeError): torch has both dtypes, so its tensors need no tag."""

    def __init__(self, bits, dtype: str = "bfloat16", _caller: str = "Bits16"):
        from .errors import ArgumentError, DTypeError   # (errors imports nothing of ours: no cycle)
        dt = getattr(bits, "dtype", None)
        if _kind_of(bits) in ("torch", "fake"):   # torch has both dtypes: the ops take such tensors as they are
            raise DTypeError(_caller, "bits", "library", "a NumPy or CuPy 2-byte integer array (uint16 or "
                             "int16 bit patterns)", f"a torch tensor of dtype {dt} (a torch tensor needs no "
                             "tag: pass it as torch.bfloat16 or torch.float16, e.g. bits.view(torch.bfloat16))")
        # NumPy/CuPy dtypes have a kind; torch's have none (is_floating_point instead): a torch
        # float16/bfloat16 tensor had passed as bit patterns
        kind = getattr(dt, "kind", None)
        if kind is None:
            kind = "f" if getattr(dt, "is_floating_point", False) or getattr(dt, "is_complex", False) else "i"
        if dt is None or getattr(dt, "itemsize", 0) != 2 or kind not in "ui":
            # a float16 array here would be reinterpreted bit for bit (its values lost)
            got = type(bits).__name__ if dt is None else f"{type(bits).__name__} of dtype {dt}"
            if str(dt).replace("torch.", "") in ("bfloat16", "float16"):   # a 16-bit float array needs no tag
                got += " (an array of that dtype needs no tag: pass it as it is)"
            raise DTypeError(_caller, "bits", "dtype", "a 2-byte integer array (uint16 or int16 "
                             "bit patterns)", got)
        if getattr(dt, "byteorder", "=") == _NON_NATIVE:
            raise DTypeError(_caller, "bits", "byte order", "bit patterns in native byte order",
                             f"dtype {dt.str}")
        if dtype not in ("bfloat16", "float16"):
            raise ArgumentError(_caller, "dtype", "tag", "'bfloat16' or 'float16'", repr(dtype))
        self.bits, self.dtype = bits, dtype

    @property
    def shape(self):
        """The shape of the wrapped bit array (one 16-bit element per value)."""
        return self.bits.shape


def as_bfloat16(bits) -> Bits16:
    """Tag a uint16 array of bfloat16 bit patterns so ex_engine treats it as bfloat16.
    Raises DTypeError (a FactorError and a TypeError) naming the argument 'bits' for anything
    else: float values would be reinterpreted bit for bit."""
    return Bits16(bits, "bfloat16", _caller="as_bfloat16")


def _refuse_torch(x, name: str, factor: str = "ex_engine"):
    """Raise the named error for a torch tensor a kernel cannot read as it is: no memory behind
    it (meta: DeviceError), not one strided block (sparse, mkldnn, nested: TensorLayoutError, a
    LayoutError and a DTypeError), or a negation/conjugation that torch applies lazily (its
    memory holds the values before it: a kernel would read those; DTypeError)."""
    from .errors import DeviceError, DTypeError, TensorLayoutError
    if x.is_meta:
        raise DeviceError(factor, name, "device", "a tensor on cuda or the CPU (memory a "
                          "kernel can read)", "a tensor on meta (no memory)")
    # a layout rule: a LayoutError (TensorLayoutError, also a DTypeError as it was before)
    if x.is_nested:
        raise TensorLayoutError(factor, name, "layout", "a dense (strided) torch tensor",
                                "a nested tensor")
    if x.layout is not sys.modules["torch"].strided:
        raise TensorLayoutError(factor, name, "layout", "a dense (strided) torch tensor",
                                f"layout {str(x.layout).replace('torch.', '')}")
    raise DTypeError(factor, name, "view", "a tensor whose memory holds its values (call "
                     ".resolve_neg() / .resolve_conj() first)",
                     "a negated view" if x.is_neg() else "a conjugated view")


_CUPY_RUNTIME: list = []   # [cupy.cuda.runtime or None], filled on first use (_cai_device)
_CUPY_IMPORT: list = []    # [whether cupy imports], filled on first use (_cupy_importable)


def no_cupy_error(factor: str, name: str, x):
    """The DeviceError for a device array ``x`` (argument ``name`` of ``factor``) where CuPy
    cannot be imported: outputs, the Python fallbacks' views of device memory and the device's
    streams all come from CuPy."""
    from .errors import DeviceError
    return DeviceError(factor, name, "device", "CuPy installed, to serve an array in device memory "
                       "(pip install -e '.[gpu]': cupy-cuda13x, or cupy-cuda12x for CUDA 12)",
                       f"a {type(x).__name__} in device memory, and CuPy cannot be imported")


def _cupy_importable() -> bool:
    """Whether CuPy can be imported (asked once per process)."""
    if not _CUPY_IMPORT:
        try:
            import cupy  # noqa: F401
            _CUPY_IMPORT.append(True)
        except Exception:   # not installed, or an install that fails to import: it serves nothing
            _CUPY_IMPORT.append(False)
    return _CUPY_IMPORT[0]


def _cai_device(x, ptr: int) -> int:
    """The CUDA device ordinal of an object known only by its ``__cuda_array_interface__``
    (the interface itself does not say): the object's ``device.id`` (CuPy-like) or
    ``device.index`` (torch-like) where it has one, else what the CUDA runtime says of the
    pointer (cupy.cuda.runtime.pointerGetAttributes), else 0 (no CuPy, a pointer the runtime
    does not know, or no GPU: an array on another device is then taken as on device 0)."""
    dev = getattr(x, "device", None)
    for attr in ("id", "index"):
        v = getattr(dev, attr, None)
        if is_integer(v) and v >= 0:
            return int(v)   # (a NumPy integer too)
    if not _CUPY_RUNTIME:
        try:
            from cupy.cuda import runtime
        except Exception:   # not installed, or no CUDA library to load
            runtime = None
        _CUPY_RUNTIME.append(runtime)
    runtime = _CUPY_RUNTIME[0]
    if runtime is not None and ptr:
        try:
            attrs = runtime.pointerGetAttributes(ptr)
            if attrs.type in (2, 3) and attrs.device >= 0:   # cudaMemoryTypeDevice, Managed
                return int(attrs.device)
        except Exception:
            pass
    return 0


def _refuse_empty_elements(name: str, factor: str, dtype) -> None:
    """Raise DTypeError for an array whose elements take no bytes (NumPy's 'V0'): no kernel or
    fallback can read it, and its strides cannot be counted in elements."""
    from .errors import DTypeError
    raise DTypeError(factor, name, "dtype", "elements of at least one byte", f"{dtype} (0-byte elements)")


@dataclass
class TensorRef:
    """Pointer, shape, strides (elements), dtype name and device of a user's array.

    device is -1 for host memory, else the CUDA device ordinal (for a 'cai' object: see
    _cai_device; 0 where neither the object nor the CUDA runtime says). kind is 'numpy',
    'cupy', 'torch' or 'cai' (any object with __cuda_array_interface__). strides are floats
    where a byte stride is not a whole number of elements (the validator raises LayoutError).
    readonly: the array's library marks it read-only (__cuda_array_interface__'s data[1]; a
    read-only NumPy array is read from its flags instead): the runtime refuses to write it.
    """
    obj: Any
    kind: str
    ptr: int
    shape: tuple
    strides: tuple
    dtype: str
    itemsize: int
    device: int
    contiguous: bool | None = None   # as the array's library reports it; None: compute
    readonly: bool = False

    @classmethod
    def of(cls, x, name: str = "array", factor: str = "ex_engine") -> "TensorRef":
        """Describe ``x``. Raises DTypeError (a FactorError and a TypeError) naming ``factor``
        (the function or factor called) and the argument ``name`` for anything that is not an
        array (also a torch tensor a kernel cannot read as it is: DeviceError for meta and for a
        FakeTensor; for a sparse, mkldnn or nested one errors.TensorLayoutError, a LayoutError
        that is also a DTypeError)."""
        kind = _KINDS.get(type(x))
        if kind is None:
            kind = _kind_of(x)
        if kind == "fake":
            from .errors import DeviceError
            raise DeviceError(factor, name, "memory", "an array with memory behind its data pointer",
                              f"a torch FakeTensor of shape {tuple(x.shape)} (no memory: what "
                              "torch.compile and FakeTensorMode trace with)")
        if kind == "torch":
            if (x.is_meta or x.layout is not sys.modules["torch"].strided or x.is_nested
                    or x.is_neg() or x.is_conj()):
                _refuse_torch(x, name, factor)
            info = _TORCH_DTYPES.get(x.dtype)
            if info is None:
                info = _TORCH_DTYPES[x.dtype] = (_dtype_name(x.dtype), x.element_size())
            return cls(x, "torch", x.data_ptr(), tuple(x.shape), x.stride(), info[0], info[1],
                       x.get_device(), x.is_contiguous())  # -1: CPU
        if kind in ("numpy", "cupy") and x.itemsize < 1:
            _refuse_empty_elements(name, factor, x.dtype)
        if kind == "numpy":
            return cls._from_buffer(x, "numpy", x.__array_interface__["data"][0], -1)
        if kind == "bits16":
            inner = cls.of(x.bits, name, factor)
            inner.obj, inner.dtype = x, x.dtype
            return inner
        if kind == "cupy":
            return cls._from_buffer(x, "cupy", x.data.ptr, x.device.id)
        cai = getattr(x, "__cuda_array_interface__", None)
        if cai is not None:
            try:
                dt = np.dtype(cai["typestr"])
                shape = tuple(operator.index(n) for n in cai["shape"])
                isz = dt.itemsize
                raw = cai.get("strides")
                raw = None if raw is None else tuple(operator.index(b) for b in raw)
                ptr, readonly = operator.index(cai["data"][0]), bool(cai["data"][1])
                if raw is not None and len(raw) != len(shape):   # (zip in is_contiguous stopped short)
                    raise ValueError(f"strides {raw} for shape {shape}: expected one per dim")
                if any(n < 0 for n in shape):
                    raise ValueError(f"shape {shape}: expected sizes >= 0")
            except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
                # a producer's malformed interface: named, not NumPy's or Python's error from in here
                # (a KeyError, a TypeError of np.dtype or of None[0]; a user's trial, session 59)
                from .errors import DTypeError
                raise DTypeError(factor, name, "type", "an object whose __cuda_array_interface__ (a dict) "
                                 "has typestr (a NumPy type string), shape (ints), data (pointer, "
                                 "read-only) and, optionally, strides (ints, bytes; or None)",
                                 f"a {type(x).__name__} whose interface failed: {type(exc).__name__}: "
                                 f"{exc}") from None
            if isz < 1:
                _refuse_empty_elements(name, factor, dt)
            if raw is None:
                strides = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
            else:   # bytes -> elements; a fraction (not a whole element) is refused by the validator
                strides = tuple(s / isz if s % isz else s // isz for s in raw)
            return cls(x, "cai", ptr, shape, strides, _dtype_name(dt), isz, _cai_device(x, ptr),
                       readonly=readonly)
        from .errors import DTypeError     # a FactorError (and a TypeError), naming the argument
        raise DTypeError(factor, name, "type", "a NumPy/CuPy array or a torch tensor",
                         type(x).__name__)

    @classmethod
    def _from_buffer(cls, x, kind, ptr, device):
        isz = x.itemsize
        bs = x.strides
        if len(bs) == 2:        # the common case, without generators (host overhead)
            s0, s1 = bs
            strides = (s0 / isz, s1 / isz) if s0 % isz or s1 % isz else (s0 // isz, s1 // isz)
        elif any(s % isz for s in bs):
            strides = tuple(s / isz for s in bs)  # fractional: rejected by the validator
        else:
            strides = tuple(s // isz for s in bs)
        return cls(x, kind, ptr, x.shape, strides, _dtype_name(x.dtype), isz, device,
                   x.flags.c_contiguous)

    @property
    def on_device(self) -> bool:
        """True for device memory (device >= 0), False for host memory (device -1)."""
        return self.device >= 0

    @property
    def size(self) -> int:
        """The number of elements: the product of shape (1 for a 0-d array, 0 if any dim is 0)."""
        n = 1
        for s in self.shape:
            n *= s
        return n

    @classmethod
    def without_memory(cls, kind: str, shape, dtype: str, itemsize: int, device: int) -> "TensorRef":
        """A C-contiguous array of ``shape`` with no memory behind it (no object, pointer 0):
        what a manifest binds in place of an array that is not there (an output not allocated
        yet, the experts a rank does not hold), so that the other arguments' checks run."""
        ref = cls(None, kind, 0, tuple(shape), (), dtype, itemsize, device, True)
        ref.strides = ref.contiguous_strides()
        return ref

    def contiguous_strides(self) -> tuple:
        """The strides (elements) a C-contiguous array of this shape has."""
        out, acc = [], 1
        for s in reversed(self.shape):
            out.append(acc)
            acc *= s
        return tuple(reversed(out))

    def is_contiguous(self) -> bool:
        """C-contiguous (size-1 dimensions may have any stride; an empty array always is)."""
        if self.contiguous is not None:
            return self.contiguous
        if self.size == 0:
            return True
        return all(st == cs or sh == 1
                   for sh, st, cs in zip(self.shape, self.strides, self.contiguous_strides()))

    # ---- computing on the same memory (used by the Python fallbacks) ----------------------
    def raw(self):
        """A NumPy/CuPy array over the same memory; bfloat16 appears as uint16 bits."""
        x = self.obj
        if isinstance(x, Bits16):  # bfloat16 as its bits; float16 as the values the bits are
            xp = get_xp(x.bits)
            return x.bits.view(xp.uint16 if x.dtype == "bfloat16" else xp.float16)
        if self.kind == "torch":
            import torch
            x = x.detach()   # same memory; numpy()/__cuda_array_interface__ refuse requires_grad
            if self.dtype == "bfloat16":
                x = x.view(torch.int16)
            if self.on_device:
                import cupy
                a = cupy.asarray(x)
            else:
                a = x.numpy()
            return a.view(a.dtype.str.replace("i2", "u2")) if self.dtype == "bfloat16" else a
        if self.kind == "cai":
            import cupy
            x = cupy.asarray(x)
        if self.dtype == "bfloat16":
            return x.view(get_xp(x).uint16)
        return x

    def xp(self):
        """The array module (numpy or cupy) that computes on this array."""
        if self.on_device:
            import cupy
            return cupy
        return np

    def load_f32(self):
        """float32 copy of the values (exact for 16-bit inputs)."""
        a, xp = self.raw(), self.xp()
        if self.dtype == "bfloat16":
            return bf16_bits_to_f32(xp, a)
        return a.astype(xp.float32)

    def store(self, values) -> None:
        """Write float/int ``values`` (same shape) into this array, rounding to its dtype."""
        a, xp = self.raw(), self.xp()
        if self.dtype == "bfloat16":
            a[...] = f32_to_bf16_bits(xp, values)
        else:
            a[...] = values.astype(a.dtype) if hasattr(values, "astype") else values
