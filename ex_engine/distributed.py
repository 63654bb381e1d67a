"""Expert parallelism (EP) over NCCL: each GPU holds a slice of an MoE layer's experts.

    from ex_engine.distributed import init_from_env, ExpertParallelMoE
    rank, world_size, local_rank = init_from_env()        # under torchrun: NCCL process group
    moe = ExpertParallelMoE.from_global(w13, w2)           # keeps this rank's experts only
    out = moe(hidden_states, topk_weights, topk_ids)       # local experts + all-reduce (sum)

The scheme (all-reduce form). The G routed experts of a layer are split into ``world_size``
contiguous blocks, one per rank (``expert_partition``; when G is not divisible by the world
size the first G % N ranks hold one expert more). Every rank sees the same tokens and the same
routing (hidden_states (T, H), topk_weights (T, K), topk_ids (T, K) of GLOBAL expert ids, as a
tensor-parallel attention block leaves them, replicated). Each rank computes

    out_r[t] = sum over k with topk_ids[t,k] owned by r of
               topk_weights[t,k] * w2[e] @ (silu(g) * u),  [g; u] = w13[e] @ hidden_states[t]

with ``moe_fused_gemm`` on its local weights and an expert map (global id -> local id, -1 for
an expert of another rank: those slots are skipped inside the kernel and cost no GEMM work),
and the ranks sum their outputs with one NCCL all-reduce: sum_r out_r = out, the layer's full
output, since every (t, k) slot is owned by exactly one rank. Sources: vLLM's expert-parallel
FusedMoE (``vllm/model_executor/layers/fused_moe/layer.py``: ``determine_expert_map``, the
``expert_map`` argument of ``fused_experts`` and the all-reduce of the partial outputs);
GShard, Lepikhin et al. 2020, "GShard: Scaling Giant Models with Conditional Computation and
Automatic Sharding" (experts sharded over devices, one group of experts per device).

Numerics: each rank's out_r is rounded to the activation dtype (bf16/fp16) before the
all-reduce, and NCCL sums in that dtype, so the EP result differs from the single-GPU factor by
a few roundings of partial sums (well inside the factor's bf16 tolerance of 1e-2; see
docs/expert-parallel.md).

Importing this module needs no torch; torch (and torch.distributed) are imported when a
function that needs them is called. The expert map and partition functions are plain NumPy.
``ExpertParallelMoE.forward_local`` works on NumPy (Python fallback), CuPy and torch arrays,
which is how a single process can simulate the ranks; ``forward`` with world_size > 1 needs
torch tensors and an initialised process group: CUDA tensors with NCCL, or CPU tensors with
gloo (the Python fallback on each rank, as ``examples/ep_moe.py --device cpu`` runs it).
"""
from __future__ import annotations

import os
import re
from typing import NamedTuple

import numpy as np

from .arrays import Bits16, TensorRef
from .errors import (ArgumentError, DeviceError, DTypeError, FactorError, LayoutError, ShapeError,
                     is_integer)

__all__ = ["DistInfo", "init_from_env", "shutdown", "expert_partition", "expert_owner",
           "make_expert_map", "ExpertParallelMoE", "disable_nvlink_multicast", "registry_for_device"]


# ---------------------------------------------------------------------------------------------
# process group
# ---------------------------------------------------------------------------------------------
class DistInfo(NamedTuple):
    """What ``init_from_env`` found: this process's rank, the world size, its local rank (the
    CUDA device it uses)."""
    rank: int
    world_size: int
    local_rank: int


def disable_nvlink_multicast() -> None:
    """Keep NVLink multicast (NVLS) off in NCCL and in torch's symmetric memory.

    Sets NCCL_NVLS_ENABLE=0 unless already set, and TORCH_SYMM_MEM_DISABLE_MULTICAST=1. Must
    run before the process group (and NCCL) is initialised; ``init_from_env`` calls it."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"


def _env_int(name: str, default: int | None) -> int | None:
    """The environment variable ``name`` as an int (``default`` when unset or empty). Only ASCII
    decimal digits with an optional sign (and blanks around) count: int() also took '1_6' (16)
    and other scripts' digits, so a mistyped WORLD_SIZE waited for ranks that never come."""
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    if not re.fullmatch(r"\s*[+-]?[0-9]+\s*", v, flags=re.ASCII):
        raise ArgumentError("init_from_env", name, "environment variable", "an integer", repr(v))
    return int(v)


def _import_torch_distributed(fn: str):
    """(torch, torch.distributed), or FactorError naming ``fn`` with an install hint."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        raise FactorError(f"{fn}: needs PyTorch (torch.distributed), which is not installed "
                          f"({exc}); install it, e.g. pip install -e '.[hf]'") from exc
    return torch, dist


def _check_backend(dist, backend):
    """backend stripped and lower-cased (None: torch's default), or ArgumentError naming
    init_from_env's 'backend': not a str, or a name torch.distributed does not know (torch
    raised its own ValueError or AssertionError, naming no argument, and only where a process
    group was created)."""
    if backend is None:
        return None
    known = [b for b in getattr(getattr(dist, "Backend", None), "backend_list", ()) or () if b != "undefined"]
    if not isinstance(backend, str):
        raise ArgumentError("init_from_env", "backend", "type", "a str such as 'nccl' or 'gloo'",
                            type(backend).__name__)
    name = backend.strip().lower()
    parts = [p.split(":", 1)[-1].strip() for p in name.split(",")]
    if not name or (known and any(p not in known for p in parts)):
        raise ArgumentError("init_from_env", "backend", "a torch.distributed backend",
                            f"one of {known} (or 'device:backend,...', e.g. 'cpu:gloo,cuda:nccl')",
                            repr(backend))
    return name


def init_from_env(backend: str = "nccl") -> DistInfo:
    """Initialise torch.distributed from torchrun's environment and pick this rank's GPU.

    Reads RANK, WORLD_SIZE and LOCAL_RANK (set by ``torchrun``); where CUDA is available calls
    ``torch.cuda.set_device(LOCAL_RANK)`` (and makes it CuPy's current device, so a registry
    loaded afterwards serves this GPU), except with backend "gloo" alone, a CPU process group
    (no GPU is bound, so more CPU ranks than GPUs can run on a GPU host; "cpu:gloo,cuda:nccl"
    binds); then ``torch.distributed.init_process_group(backend)`` (the rendezvous comes from
    MASTER_ADDR/MASTER_PORT, also set by torchrun). NVLink multicast is switched off first
    (``disable_nvlink_multicast``). Without RANK and WORLD_SIZE (a plain ``python script.py``)
    no process group is created: rank 0 of a world of 1 on LOCAL_RANK (default 0). If the
    process group already exists, it is used as it is.

    Returns DistInfo(rank, world_size, local_rank). Raises ArgumentError for a backend that is
    not a str naming torch.distributed backends (None: torch's default), a malformed
    variable, a negative LOCAL_RANK, one of RANK and WORLD_SIZE set without the other (where no
    process group exists yet), or (a GPU bound) a LOCAL_RANK with no such CUDA device, or none
    in a job of several processes (every rank would take GPU 0); FactorError (with an install
    hint) when torch is not installed; torch's own errors for a failed rendezvous.
    """
    disable_nvlink_multicast()
    local_rank = _env_int("LOCAL_RANK", None)
    if local_rank is not None and local_rank < 0:
        raise ArgumentError("init_from_env", "LOCAL_RANK", "environment variable", "an integer >= 0", local_rank)
    torch, dist = _import_torch_distributed("init_from_env")
    name = _check_backend(dist, backend)
    cpu_only = name == "gloo"   # a CPU process group
    group = dist.is_available() and dist.is_initialized()
    rank, world = _env_int("RANK", None), _env_int("WORLD_SIZE", None)
    binds = not cpu_only and torch.cuda.is_available()
    several = dist.get_world_size() > 1 if group else (world is not None and world > 1)
    if binds and local_rank is None and several:   # else every rank of the job would take GPU 0
        raise ArgumentError("init_from_env", "LOCAL_RANK", "environment variable",
                            "set in a job of several processes that binds a GPU, to this rank's GPU "
                            "on its host (torchrun sets it; a launcher that does not must)", "unset")
    local_rank = local_rank or 0
    if binds:
        n = torch.cuda.device_count()
        if not 0 <= local_rank < n:
            raise ArgumentError("init_from_env", "LOCAL_RANK", "a CUDA device of this host",
                                f"0 <= LOCAL_RANK < {n}", local_rank)
        torch.cuda.set_device(local_rank)
        try:                       # CuPy's current device too: a registry loaded now is this GPU's
            import cupy
            cupy.cuda.Device(local_rank).use()
        except ImportError:
            pass
    if group:
        return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank)
    if (rank is None) != (world is None):   # half of torchrun's environment: not a 1-process job
        missing, present = ("WORLD_SIZE", "RANK") if world is None else ("RANK", "WORLD_SIZE")
        raise ArgumentError("init_from_env", missing, "environment variable",
                            f"set together with {present} (torchrun sets both)", "unset")
    if rank is None:
        return DistInfo(0, 1, local_rank)
    if world < 1:
        raise ArgumentError("init_from_env", "WORLD_SIZE", "a process count", "WORLD_SIZE >= 1", world)
    if not 0 <= rank < world:
        raise ArgumentError("init_from_env", "RANK", "0 <= RANK < WORLD_SIZE",
                            f"0 <= RANK < {world}", rank)
    kwargs = {}
    if name == "nccl" and torch.cuda.is_available():
        kwargs["device_id"] = torch.device("cuda", local_rank)   # binds the communicator eagerly
    try:
        dist.init_process_group(name, rank=rank, world_size=world, **kwargs)
    except TypeError:                                             # torch without device_id=
        dist.init_process_group(name, rank=rank, world_size=world)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank)


def shutdown() -> None:
    """Destroy the default process group if one exists (end of a torchrun script). Raises
    FactorError (with an install hint) when torch is not installed."""
    _, dist = _import_torch_distributed("shutdown")
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


_registries: dict = {}


def registry_for_device(device: int):
    """The FactorRegistry for CUDA device ``device`` (-1: the host): ex_engine's process-wide
    default registry when it is that device's, else one loaded from factors/ for it (cached).
    A registry dispatches plugins on one device only; under torchrun each rank uses its own.
    device: an int >= -1 (NumPy integers count). Raises ArgumentError for anything else;
    hardware.NoDeviceError (a FactorError) naming the index when there is no such CUDA device
    (it says how many CuPy sees, or that there is no CuPy/GPU at all); FactorError when the
    factor folder cannot be loaded."""
    from .hardware import Hardware
    from .ops import default_registry
    if not is_integer(device) or device < -1:
        raise ArgumentError("registry_for_device", "device", "a CUDA device index",
                            "an int >= 0, or -1 for the host", repr(device))
    device = int(device)
    reg = default_registry()
    if device < 0 or (reg.hardware.live and reg.hardware.device_id == device):
        return reg
    if device not in _registries:
        from .registry import FactorRegistry
        _registries[device] = FactorRegistry.load(hardware=Hardware.from_device(device))
    return _registries[device]


# ---------------------------------------------------------------------------------------------
# partition and expert map (NumPy only)
# ---------------------------------------------------------------------------------------------
_NO_RANK = object()   # expert_owner takes no rank; None is a wrong rank, not a missing one


def _check_partition_args(fn: str, num_experts, world_size, rank=_NO_RANK) -> None:
    """Raise ArgumentError naming ``fn`` (the function the user called) and the argument unless
    num_experts, world_size (and rank, when the function takes one) are ints in range."""
    for name, v in (("num_experts", num_experts), ("world_size", world_size)) + \
            ((("rank", rank),) if rank is not _NO_RANK else ()):
        if not is_integer(v):
            raise ArgumentError(fn, name, "type", "an int", type(v).__name__)
    if num_experts < 1:
        raise ArgumentError(fn, "num_experts", "num_experts >= 1", ">= 1", num_experts)
    if world_size < 1:
        raise ArgumentError(fn, "world_size", "world_size >= 1", ">= 1", world_size)
    if rank is not _NO_RANK and not 0 <= rank < world_size:
        raise ArgumentError(fn, "rank", "0 <= rank < world_size", f"0 <= rank < {world_size}", rank)


def expert_partition(num_experts: int, world_size: int, rank: int) -> tuple[int, int]:
    """(first, count): rank ``rank`` owns global experts first .. first+count-1.

    Contiguous blocks in rank order; every rank gets num_experts // world_size experts and the
    first num_experts % world_size ranks one more (vLLM's ``determine_expert_map``). count is 0
    on the ranks beyond num_experts when world_size > num_experts.
    Raises ArgumentError naming the argument: num_experts < 1, world_size < 1, rank outside
    [0, world_size), a non-integer.
    """
    _check_partition_args("expert_partition", num_experts, world_size, rank)
    base, extra = divmod(int(num_experts), int(world_size))
    rank = int(rank)                    # a NumPy integer in, plain ints out
    count = base + (1 if rank < extra else 0)
    first = rank * base + min(rank, extra)
    return first, count


def expert_owner(num_experts: int, world_size: int) -> np.ndarray:
    """(num_experts,) int32: the rank that owns each global expert (``expert_partition``).
    Raises ArgumentError naming the argument: num_experts < 1, world_size < 1, a non-integer."""
    _check_partition_args("expert_owner", num_experts, world_size)
    owner = np.empty(num_experts, np.int32)
    for r in range(world_size):
        first, count = expert_partition(num_experts, world_size, r)
        owner[first:first + count] = r
    return owner


def make_expert_map(num_experts: int, world_size: int, rank: int) -> np.ndarray:
    """(num_experts,) int32, C-contiguous: global expert id -> local id on ``rank``, or -1.

    map[first + j] = j for the rank's experts (j < count, see ``expert_partition``), -1 for every
    expert held by another rank. This is the ``expert_map`` argument of ``moe_fused_gemm``
    (moved to the weights' device) and the same convention as vLLM's ``expert_map``.
    Raises ArgumentError as ``expert_partition`` (naming make_expert_map).
    """
    _check_partition_args("make_expert_map", num_experts, world_size, rank)
    first, count = expert_partition(num_experts, world_size, rank)
    m = np.full(num_experts, -1, np.int32)
    m[first:first + count] = np.arange(count, dtype=np.int32)
    return m


# ---------------------------------------------------------------------------------------------
# array helpers (NumPy, CuPy, Bits16, torch), no torch import unless the array is torch's
# ---------------------------------------------------------------------------------------------
def _kind(x) -> str:
    """'torch', 'cupy' or 'numpy' (a Bits16 by the array it wraps): arrays.TensorRef's kinds."""
    return TensorRef.of(x).kind


def _slice_experts(w, first: int, count: int, copy: bool):
    """w[first:first+count] (a view, or a contiguous copy when ``copy``) for any array kind."""
    if isinstance(w, Bits16):
        return Bits16(_slice_experts(w.bits, first, count, copy), w.dtype)
    part = w[first:first + count]
    if not copy:
        return part
    if _kind(w) == "torch":
        import torch
        return part.detach().clone(memory_format=torch.contiguous_format)
    return part.copy()


def _map_like(expert_map: np.ndarray, like):
    """The int32 expert map as an array of ``like``'s library and device."""
    kind = _kind(like)
    if kind == "torch":
        import torch
        return torch.from_numpy(expert_map).to(like.device)
    if kind == "cupy":
        import cupy
        dev = (like.bits if isinstance(like, Bits16) else like).device
        with dev:
            return cupy.asarray(expert_map)
    return expert_map.copy()


def _zero(out) -> None:
    if isinstance(out, Bits16):
        out.bits[...] = 0
    elif _kind(out) == "torch":
        out.zero_()
    else:
        out[...] = 0


# ---------------------------------------------------------------------------------------------
# the layer
# ---------------------------------------------------------------------------------------------
def _both_or_neither(fn: str, rank, world_size) -> None:
    """Raise ArgumentError unless rank and world_size are both given or both None (then both
    come from torch.distributed: one alone would mix a caller's rank with another world)."""
    if (rank is None) != (world_size is None):
        given, missing = ("rank", "world_size") if world_size is None else ("world_size", "rank")
        raise ArgumentError(fn, missing, f"given with {given}",
                            "both rank and world_size, or neither (from torch.distributed)", f"{given} only")


def _rank_in_group(dist, group, fn: str) -> tuple[int, int]:
    """(rank, size) of this process in ``group`` (None: the default group). ArgumentError naming
    'group' for an object torch.distributed does not know as a group (torch's ValueError said
    only that it is not registered) and for a group without this process (torch gives rank -1 and
    size -1 there, which was reported as a bad world_size the caller never gave)."""
    try:
        r, n = dist.get_rank(group), dist.get_world_size(group)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ArgumentError(fn, "group", "a torch.distributed process group", "None or a group of "
                            "torch.distributed.new_group", f"{group!r} ({exc})") from None
    if r < 0:
        raise ArgumentError(fn, "group", "a process group this process belongs to",
                            "a group with this process in it", f"a group without it (this is rank "
                            f"{dist.get_rank()} of the world of {dist.get_world_size()})")
    return r, n


class ExpertParallelMoE:
    """This rank's experts of one MoE layer, and the expert-parallel forward.

    Holds w13 (E_local, 2I, H) and w2 (E_local, H, I) -- global experts first .. first+E_local-1
    of the layer's G (``expert_partition(G, world_size, rank)``) -- and ``expert_map`` (G,)
    int32 on the weights' device (``make_expert_map``). Weights are float16 or bfloat16: torch
    tensors (CUDA for the NCCL path), CuPy arrays (bf16 as ``Bits16``) or NumPy arrays (Python
    fallback; bf16 as ml_dtypes.bfloat16 or Bits16).

    Construct from the global weights with ``from_global`` or from this rank's slices with the
    constructor. rank/world_size default to torch.distributed's (of ``group``) when it is
    initialised, else 0 / 1; give them explicitly to simulate a rank in one process (then only
    ``forward_local`` may be used, unless the process group matches).

    Attributes: num_experts (G), rank, world_size, first, count (E_local), w13, w2, expert_map,
    H, I, group, registry.
    """

    def __init__(self, w13, w2, num_experts: int, *, rank: int | None = None,
                 world_size: int | None = None, group=None, registry=None,
                 _fn: str = "ExpertParallelMoE"):
        """w13: (E_local, 2I, H), w2: (E_local, H, I): this rank's experts, E_local =
        expert_partition(num_experts, world_size, rank)[1]; same dtype (float16/bfloat16), same
        library and device, contiguous. num_experts: G, the layer's global expert count.
        group: a torch.distributed process group (default: the world). registry: the
        FactorRegistry for moe_fused_gemm (default: ``registry_for_device`` of the weights'
        device: the process-wide one when it serves that GPU).

        Raises ArgumentError / ShapeError / DTypeError / DeviceError / LayoutError naming the
        argument (fn 'ExpertParallelMoE'; 'ExpertParallelMoE.from_global' through it).
        """
        fn = _fn
        _both_or_neither(fn, rank, world_size)
        if rank is None or world_size is None:
            r, n = self._dist_rank_world(group, fn)
            rank = r if rank is None else rank
            world_size = n if world_size is None else world_size
        _check_partition_args(fn, num_experts, world_size, rank)
        self.num_experts, self.rank, self.world_size = int(num_experts), int(rank), int(world_size)
        self.first, self.count = expert_partition(self.num_experts, self.world_size, self.rank)
        r13, r2 = TensorRef.of(w13, "w13", fn), TensorRef.of(w2, "w2", fn)
        if len(r13.shape) != 3:
            raise ShapeError(fn, "w13", "rank", "(E_local, 2I, H)", r13.shape)
        if len(r2.shape) != 3:
            raise ShapeError(fn, "w2", "rank", "(E_local, H, I)", r2.shape)
        E_l, I2, H = r13.shape
        if E_l != self.count:
            raise ShapeError(fn, "w13", f"experts of rank {self.rank} of {self.world_size} "
                             f"(global {self.first}..{self.first + self.count - 1} of {self.num_experts})",
                             f"w13.shape[0] == {self.count}", E_l)
        if I2 % 2 or I2 == 0:
            raise ShapeError(fn, "w13", "shape[1] == 2I, I >= 1", "an even positive number", I2)
        I = I2 // 2
        if tuple(r2.shape) != (self.count, H, I):
            raise ShapeError(fn, "w2", "shape", (self.count, H, I), tuple(r2.shape))
        if r13.dtype not in ("float16", "bfloat16"):
            raise DTypeError(fn, "w13", "dtype", "float16 or bfloat16", r13.dtype)
        if r2.dtype != r13.dtype:
            raise DTypeError(fn, "w2", "same dtype as w13", r13.dtype, r2.dtype)
        if r13.kind != r2.kind or r13.device != r2.device:
            raise DeviceError(fn, "w2", "same library and device as w13",
                              f"{r13.kind} on device {r13.device}", f"{r2.kind} on device {r2.device}")
        for name, ref in (("w13", r13), ("w2", r2)):
            if not ref.is_contiguous():
                raise LayoutError(fn, name, "contiguous", "C-contiguous", f"strides {ref.strides}")
        self.w13, self.w2, self.H, self.I = w13, w2, H, I
        self.dtype, self.kind, self.device = r13.dtype, r13.kind, r13.device
        self.group = group
        from .ops import resolve_registry
        self.registry = resolve_registry(registry) if registry is not None else registry_for_device(self.device)
        self.expert_map = _map_like(make_expert_map(self.num_experts, self.world_size, self.rank), w13)
        # the rank that owns every expert calls the factor without a map (identical result)
        self._map_arg = None if self.count == self.num_experts else self.expert_map
        self._checked_world = None    # the default process group _check_group last passed in

    @classmethod
    def from_global(cls, w13, w2, *, rank: int | None = None, world_size: int | None = None,
                    group=None, registry=None, copy: bool = True) -> "ExpertParallelMoE":
        """Take this rank's experts out of the global weights w13 (G, 2I, H), w2 (G, H, I).

        copy=True (default) keeps contiguous copies of the slices, so the global tensors can be
        freed; copy=False keeps views (the slice of a contiguous tensor along dim 0 is contiguous).
        copy must be a bool. Other arguments as the constructor. Raises ShapeError for
        non-3-D weights or a w2 that is not (G, H, I) for w13 (G, 2I, H) (the shapes as given,
        before slicing), ArgumentError for a non-bool copy or a bad rank/world_size, and the
        constructor's errors otherwise, all naming 'ExpertParallelMoE.from_global'.
        """
        fn = "ExpertParallelMoE.from_global"
        if not isinstance(copy, (bool, np.bool_)):
            raise ArgumentError(fn, "copy", "type", "True or False", repr(copy))
        r13, r2 = TensorRef.of(w13, "w13", fn), TensorRef.of(w2, "w2", fn)
        if len(r13.shape) != 3:
            raise ShapeError(fn, "w13", "rank", "(G, 2I, H)", r13.shape)
        G, I2, H = r13.shape
        if I2 % 2 or I2 == 0:
            raise ShapeError(fn, "w13", "shape[1] == 2I, I >= 1", "an even positive number", I2)
        if tuple(r2.shape) != (G, H, I2 // 2):
            raise ShapeError(fn, "w2", "shape (G, H, I) for w13 (G, 2I, H)", (G, H, I2 // 2),
                             tuple(r2.shape))
        _both_or_neither(fn, rank, world_size)
        if rank is None:
            r, n = cls._dist_rank_world(group, fn)
            rank = r if rank is None else rank
            world_size = n if world_size is None else world_size
        _check_partition_args(fn, G, world_size, rank)
        first, count = expert_partition(G, world_size, rank)
        return cls(_slice_experts(w13, first, count, bool(copy)), _slice_experts(w2, first, count, bool(copy)),
                   G, rank=rank, world_size=world_size, group=group, registry=registry, _fn=fn)

    @staticmethod
    def _dist_rank_world(group, fn: str) -> tuple[int, int]:
        """(rank, world size) of this process in ``group`` (None: the world) when
        torch.distributed is initialised, else (0, 1). Raises ArgumentError naming 'group' (and
        ``fn``) for a group this process is not a member of, or an object that is no group."""
        try:
            import torch.distributed as dist
        except ImportError:
            return 0, 1
        if dist.is_available() and dist.is_initialized():
            return _rank_in_group(dist, group, fn)
        return 0, 1

    def __repr__(self) -> str:
        held = (f"experts {self.first}..{self.first + self.count - 1}" if self.count else "no experts")
        return (f"ExpertParallelMoE(rank {self.rank}/{self.world_size}: {held} of {self.num_experts}, "
                f"H={self.H}, I={self.I}, {self.dtype}, {self.kind})")

    # ---- compute ------------------------------------------------------------------------------
    def forward_local(self, hidden_states, topk_weights, topk_ids, *, out=None, router_logits=None):
        """This rank's contribution: out_r[t] = sum over the (t, k) slots whose expert this rank
        owns of topk_weights[t,k] * w2[e] @ (silu(g) * u) (the rest contribute 0).

        hidden_states: (T, H), the weights' dtype. topk_weights: (T, K) float32. topk_ids:
        (T, K) int32 GLOBAL ids in [0, G), 1 <= K <= G. router_logits: optional (T, G) float32,
        float16 or bfloat16 (unused by the math). out: optional (T, H) of the weights' dtype, fully
        written (zeros for tokens with no local expert); allocated if None. All on the weights'
        library/device, contiguous. No host synchronisation, no collective: capturable.
        Returns out. Raises the factor's ArgumentError subclasses (naming the argument) and
        DeviceError / ShapeError from here for a mismatch with the layer.
        """
        ref = TensorRef.of(hidden_states, "hidden_states", "ExpertParallelMoE")
        if len(ref.shape) != 2 or ref.shape[1] != self.H:
            raise ShapeError("ExpertParallelMoE", "hidden_states", "shape", f"(T, {self.H})", ref.shape)
        if ref.kind != self.kind or ref.device != self.device:
            raise DeviceError("ExpertParallelMoE", "hidden_states", "same library and device as the weights",
                              f"{self.kind} on device {self.device}", f"{ref.kind} on device {ref.device}")
        from .ops import _empty, moe_fused_gemm
        if out is None:   # ops' allocator: same library and device
            out = _empty(ref, ref.shape, ref.dtype, "ExpertParallelMoE", "hidden_states")
        if self.count == 0:            # a rank with no experts (world_size > G): contributes 0
            self._check_without_experts(hidden_states, topk_weights, topk_ids, out, router_logits)
            _zero(out)
            return out
        if self._map_arg is None:
            return moe_fused_gemm(hidden_states, self.w13, self.w2, topk_weights, topk_ids,
                                  router_logits=router_logits, out=out, registry=self.registry)
        return moe_fused_gemm(hidden_states, self.w13, self.w2, topk_weights, topk_ids,
                              router_logits=router_logits, expert_map=self._map_arg, out=out,
                              registry=self.registry)

    def _check_without_experts(self, hidden_states, topk_weights, topk_ids, out, router_logits):
        """The factor's argument checks for a rank that holds no expert (nothing to launch):
        its manifest binds the caller's arrays with a one-expert stand-in for w13/w2 (no
        memory), so a bad dtype, shape, layout or device raises here as on the other ranks, and
        so does an out that shares memory with another argument or is read-only.
        topk_ids' values are checked on the ranks that own experts (check_device_errors)."""
        from .arrays import TensorRef
        from .registry import check_writes
        m = self.registry.manifest("moe_fused_gemm")

        def stand_in(shape):
            return TensorRef.without_memory(self.kind, shape, self.dtype, 2, self.device)
        arrays = {"hidden_states": hidden_states, "out": out, "topk_weights": topk_weights,
                  "topk_ids": topk_ids, "router_logits": router_logits, "expert_map": self._map_arg}
        refs = {k: TensorRef.of(v, k, "ExpertParallelMoE") for k, v in arrays.items() if v is not None}
        given = dict(refs)                  # the caller's arrays (the stand-ins have no memory)
        refs["w13"] = stand_in((1, 2 * self.I, self.H))
        refs["w2"] = stand_in((1, self.H, self.I))
        *_, device = m.bind(refs)
        check_writes("moe_fused_gemm", m, given, device=device)   # out=hidden_states, read-only out

    def forward(self, hidden_states, topk_weights, topk_ids, *, out=None, router_logits=None):
        """The layer's full routed-expert output on every rank: forward_local, then an NCCL
        all-reduce (sum) of out over the group, on torch's current stream (ProcessGroupNCCL
        orders its stream after it and it after the collective). With world_size 1: forward_local
        alone. No host synchronisation after the first call: capturable in a CUDA graph (after one
        eager call, which creates the NCCL communicator and the factor's workspace). The first call
        (and the first in a new process group) checks once, with one all-reduce of ten integers
        read back on the host, that every rank of the group built this layer (the same G, H, I
        and dtype) for its own rank and size; if not, every rank raises FactorError.

        Arguments and shapes as ``forward_local``; hidden_states/topk_*: identical on every rank.
        Returns out (T, H). Raises FactorError when world_size > 1 and the tensors are not torch
        tensors (CUDA with NCCL; CPU tensors work with a gloo group, through the Python fallback:
        a test path), DeviceError naming 'out' for an out that is not a torch tensor then,
        torch.distributed is not initialised, its group's rank/size differ from
        this layer's (a simulated rank: use forward_local) or another rank's do from its layer's,
        or the ranks' layers differ in G, H, I or dtype.
        """
        if self.world_size > 1:
            self._check_group(hidden_states)
            if out is not None:
                self._check_out_for_all_reduce(out)
        out = self.forward_local(hidden_states, topk_weights, topk_ids, out=out,
                                 router_logits=router_logits)
        if self.world_size > 1:
            import torch.distributed as dist
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out

    __call__ = forward

    @staticmethod
    def _check_out_for_all_reduce(out) -> None:
        """DeviceError naming 'out' unless it is a torch tensor: torch.distributed all-reduces
        torch tensors only (the factor takes a NumPy out beside torch CPU tensors, and the
        all-reduce then raised torch's TypeError after the local compute)."""
        import torch
        if not isinstance(out, torch.Tensor):
            got = TensorRef.of(out, "out", "ExpertParallelMoE.forward").kind
            raise DeviceError("ExpertParallelMoE.forward", "out", "all-reduced by torch.distributed",
                              "a torch tensor, like the weights", f"a {got} array")

    def _check_group(self, hidden_states) -> None:
        """FactorError unless this layer can all-reduce: torch weights, torch.distributed
        initialised, the group's rank and size this layer's, and every rank of the group holding
        a slice of the same layer (G, H, I, dtype). Checked again whenever the default process
        group is not the one of the last check (after shutdown() and a new init_from_env(), say),
        else only the cheap is-initialised test runs. The full check is one all-reduce of ten
        integers over the group, read back on the host: every rank learns whether any rank's
        layer is wrong, so all raise together (a rank raising alone left the others in the
        layer's all-reduce), and layers of different G, which summed partial outputs of
        different partitions into a silently wrong layer, or different H, I or dtype, which
        crashed gloo or left NCCL waiting, are refused."""
        if self.kind != "torch":
            raise FactorError(f"ExpertParallelMoE.forward: world_size {self.world_size} needs torch "
                              f"tensors (the all-reduce is torch.distributed's: NCCL on CUDA tensors, "
                              f"gloo on CPU ones); the weights are {self.kind} arrays (use forward_local "
                              f"to simulate a rank)")
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            raise FactorError("ExpertParallelMoE.forward: torch.distributed is not initialised "
                              "(call ex_engine.distributed.init_from_env() under torchrun, or use "
                              "forward_local to simulate a rank); after shutdown() a layer needs a "
                              "process group again")
        world = dist.group.WORLD
        if self._checked_world is world:   # every call after the first (host time)
            return
        import torch
        r, n = _rank_in_group(dist, self.group, "ExpertParallelMoE.forward")
        names = ("num_experts", "H", "I", "dtype")
        mine = [int((r, n) != (self.rank, self.world_size)), self.num_experts, self.H, self.I,
                int(self.dtype == "bfloat16")]
        both = torch.tensor(mine + [-v for v in mine], dtype=torch.int64).to(self.w13.device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        got = both.tolist()
        hi, lo = got[:5], [-v for v in got[5:]]
        if mine[0]:
            raise FactorError(f"ExpertParallelMoE.forward: the layer was built for rank {self.rank} of "
                              f"{self.world_size}, the process group is rank {r} of {n} (use "
                              f"forward_local to simulate a rank)")
        if hi[0]:
            raise FactorError("ExpertParallelMoE.forward: another rank's layer was built for a rank or "
                              "world size other than its own in the process group (its error says which); "
                              "no rank all-reduces")
        dtypes = ("float16", "bfloat16")
        differ = [f"{name} from {dtypes[a] if name == 'dtype' else a} to {dtypes[b] if name == 'dtype' else b}"
                  for name, a, b in zip(names, lo[1:], hi[1:]) if a != b]
        if differ:
            raise FactorError(f"ExpertParallelMoE.forward: the ranks of the process group hold slices of "
                              f"different layers ({', '.join(differ)} across the ranks; this rank: "
                              f"num_experts {self.num_experts}, H {self.H}, I {self.I}, {self.dtype}): "
                              f"every rank must build the same layer (from_global of the same global "
                              f"weights, or num_experts = the layer's G on every rank)")
        self._checked_world = world
