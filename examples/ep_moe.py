#!/usr/bin/env python3
"""Expert-parallel MoE layer over N GPUs (moe_fused_gemm + NCCL all-reduce): check and benchmark.

Launch one process per GPU with torchrun (a plain ``python3 examples/ep_moe.py`` is a world of 1):

  torchrun --standalone --nproc_per_node=2 examples/ep_moe.py --check --tokens 64 4096
  torchrun --standalone --nproc_per_node=2 examples/ep_moe.py --bench --json ep_bench.json
  torchrun --standalone --nproc_per_node=1 examples/ep_moe.py --bench --json ep_bench_1gpu.json

Every rank builds the same layer from a seed on its GPU (torch generator, one seed per model:
router (E, H) fp32 and experts w13 (E, 2I, H), w2 (E, H, I) drawn N(0, 0.02) in bf16,
hidden_states N(0, 1)), checks that the ranks really hold the same values (checksums; rank 0's
are broadcast if not), routes with ex_engine's topk_softmax on the router logits (or random
distinct ids with --routing random), and keeps its experts only (ExpertParallelMoE: E/N
experts, the first E % N ranks one more).

--check  every rank computes the expert-parallel output (its experts, then the all-reduce);
         rank 0 also computes the single-GPU factor with all experts (no expert map) and a
         float64 torch reference, and compares ||ep - ref|| / ||ref|| against the factor's
         tolerance (bf16: 1e-2); outputs are poisoned with NaN first (NaN never passes), and
         the ranks must hold bit-identical results. PASS/FAIL per case; exit status 1 on a FAIL.
--bench  per layer and token count: the expert-parallel step (local factor + all-reduce), the
         local factor alone (every rank; the slowest decides), the all-reduce alone (T*H*2
         bytes; algorithm bandwidth = bytes / time, bus bandwidth = that * 2(N-1)/N as
         nccl-tests), useful TFLOP/s (2*T*K*3*H*I / time) and the speedup over one GPU running
         the factor with all experts (timed on rank 0). Timed by CUDA-graph replay when the
         step (with its NCCL all-reduce) can be captured, else eagerly with CUDA events; the
         mode is reported. --json PATH (rank 0) writes everything.

NVLink multicast stays off (NCCL_NVLS_ENABLE=0 unless set, TORCH_SYMM_MEM_DISABLE_MULTICAST=1).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
import zlib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")            # before torch/NCCL: no NVLink multicast
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

try:  # --help works without PyTorch; a run needs it
    import torch  # noqa: E402
    import torch.distributed as dist  # noqa: E402
except ImportError:
    torch = dist = None

from ex_engine import FactorError, FactorRegistry, moe_fused_gemm, set_default_registry, topk_softmax  # noqa: E402
from ex_engine.distributed import (ExpertParallelMoE, expert_owner, expert_partition,  # noqa: E402
                                   init_from_env, shutdown)
from ex_engine.hardware import Hardware  # noqa: E402
from ex_engine.verify import ROW_SLACK, row_error  # noqa: E402
from ex_engine._scripts import exit_quietly_on_broken_pipe  # noqa: E402
from ex_engine.moe_layer import load_models_or_exit, output_file_problem, report_problems  # noqa: E402

MODELS = load_models_or_exit("ep_moe")
PATH_NAMES = {"plugin": "{plugin}", "kernel_fallback": "{plugin}'s kernel_fallback",
              "python_fallback": "the Python fallback"}
DEFAULT_MODELS = ["qwen3-30b-a3b", "mixtral-8x7b"]
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16} if torch else {}


class Ctx:
    """This process's place in the job: rank, world size, device, the registry, a logger."""

    def __init__(self, rank: int, world: int, local_rank: int, reg: FactorRegistry, cuda: bool = True):
        self.rank, self.world, self.local_rank, self.reg, self.cuda = rank, world, local_rank, reg, cuda
        self.device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
        self.distributed = dist.is_available() and dist.is_initialized()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)

    # ---- small collectives (eager; every rank calls them in the same order) --------------------
    def all_true(self, flag: bool) -> bool:
        """True on every rank iff ``flag`` is True on every rank."""
        if not self.distributed or self.world == 1:
            return bool(flag)
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def gather(self, value: float) -> list:
        """[value of rank 0, value of rank 1, ...] on every rank."""
        if not self.distributed or self.world == 1:
            return [float(value)]
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        out = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(out, t)
        return [float(o.item()) for o in out]

    def barrier(self) -> None:
        if self.distributed and self.world > 1:
            if self.cuda:
                dist.barrier(device_ids=[self.local_rank])
            else:
                dist.barrier()

    def same_everywhere(self, tensors) -> bool:
        """Whether every rank holds bit-identical ``tensors`` (per-row int64 sums of the bits)."""
        if not self.distributed or self.world == 1:
            return True
        sums = []
        for t in tensors:
            bits = t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])
            sums.append(bits.reshape(bits.shape[0], -1).sum(dim=1, dtype=torch.int64))
        v = torch.cat(sums)
        lo, hi = v.clone(), v.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        return bool(torch.equal(lo, hi))

    def broadcast(self, tensors) -> None:
        for t in tensors:
            dist.broadcast(t, src=0)


# ---------------------------------------------------------------------------------------------
# the layer, built identically on every rank
# ---------------------------------------------------------------------------------------------
def model_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def build_weights(ctx: Ctx, shape, seed: int, dtype):
    """(router (E, H) fp32, w13 (E, 2I, H), w2 (E, H, I)) drawn N(0, 0.02) on this GPU."""
    g = torch.Generator(device=ctx.device).manual_seed(model_seed(seed, shape.model))
    router = torch.empty(shape.E, shape.H, dtype=torch.float32, device=ctx.device).normal_(0, 0.02, generator=g)
    w13 = torch.empty(shape.E, 2 * shape.I, shape.H, dtype=dtype, device=ctx.device)
    w2 = torch.empty(shape.E, shape.H, shape.I, dtype=dtype, device=ctx.device)
    for e in range(shape.E):              # one expert at a time: small fp32 temporaries
        w13[e].normal_(0, 0.02, generator=g)
        w2[e].normal_(0, 0.02, generator=g)
    return router, w13, w2


def build_inputs(ctx: Ctx, shape, T: int, seed: int, dtype, router, routing: str):
    """(hidden_states (T, H), topk_weights (T, K) fp32, topk_ids (T, K) int32), same on every rank."""
    g = torch.Generator(device=ctx.device).manual_seed(model_seed(seed, f"{shape.model}/T={T}"))
    x = torch.empty(T, shape.H, dtype=dtype, device=ctx.device).normal_(0, 1, generator=g)
    if routing == "router":
        logits = x.float() @ router.T                                   # (T, E) fp32
        w, ids = topk_softmax(logits, shape.K, shape.renormalize, registry=ctx.reg)
    else:
        ids = torch.rand(T, shape.E, generator=g, device=ctx.device).argsort(dim=1)[:, :shape.K]
        ids = ids.to(torch.int32).contiguous()
        w = torch.rand(T, shape.K, generator=g, device=ctx.device) + 0.1
        w = (w / w.sum(dim=1, keepdim=True)).contiguous()
    return x, w, ids


def reference_f64(x, w13, w2, w, ids):
    """out[t] = sum_k w[t,k] * w2[e] @ (silu(g) * u), [g; u] = w13[e] @ x[t], in float64 (torch)."""
    T, H = x.shape
    I = w2.shape[2]
    out = torch.zeros(T, H, dtype=torch.float64, device=x.device)
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        xt = x[tok].double()
        gu = xt @ w13[e].double().T
        act = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
        y = act @ w2[e].double().T
        out.index_add_(0, tok, w[tok, slot].double()[:, None] * y)
    return out


def rel_err(out, ref) -> float:
    """The larger of ||out - ref|| / ||ref|| and the worst token row's error over ROW_SLACK
    (ex_engine.verify.row_error: one token that lost a rank's slots fails too), in float64; inf
    if out has a NaN or ref is zero; 0 when empty."""
    o = out.double()
    if o.numel() == 0:
        return 0.0
    if bool(torch.isnan(o).any()):
        return math.inf
    r = ref.double()
    den = float(r.norm())
    if not den > 0:
        return math.inf
    return max(float((o - r).norm()) / den, row_error(torch, o, r)[0] / ROW_SLACK)


# ---------------------------------------------------------------------------------------------
# --check
# ---------------------------------------------------------------------------------------------
def check_case(ctx: Ctx, shape, T, w13, w2, ep, inputs, tol: float) -> dict:
    x, w, ids = inputs
    dtype = x.dtype
    out = torch.full((T, shape.H), float("nan"), dtype=dtype, device=ctx.device)   # poisoned
    ep.forward(x, w, ids, out=out)
    ctx.sync()
    ranks_agree = ctx.same_everywhere([out])
    res = {"model": shape.model, "tokens": T, "world_size": ctx.world, "ranks_agree": ranks_agree}
    device_error = None
    try:
        ctx.reg.check_device_errors()
    except Exception as exc:       # a kernel flagged bad input (DeviceSideError)
        device_error = str(exc)
    ok = ranks_agree and device_error is None
    if ctx.rank == 0:
        ref = torch.full((T, shape.H), float("nan"), dtype=dtype, device=ctx.device)
        moe_fused_gemm(x, w13, w2, w, ids, out=ref, registry=ctx.reg)      # one GPU, all experts
        ref64 = reference_f64(x, w13, w2, w, ids)
        res["rel_err_vs_factor"] = rel_err(out, ref)
        res["rel_err_vs_float64"] = rel_err(out, ref64)
        res["factor_rel_err_vs_float64"] = rel_err(ref, ref64)
        res["tolerance"] = tol
        ok = ok and res["rel_err_vs_factor"] < tol and res["rel_err_vs_float64"] < tol \
            and res["factor_rel_err_vs_float64"] < tol
        del ref, ref64
    res["device_error"] = device_error
    res["ok"] = ctx.all_true(ok)
    ctx.log(f"[ep_moe] check {shape.model} T={T} world={ctx.world}: "
            f"ep vs the factor on one {'GPU' if ctx.device.type == 'cuda' else 'process'} "
            f"{res.get('rel_err_vs_factor', float('nan')):.2e}, "
            f"ep vs float64 {res.get('rel_err_vs_float64', float('nan')):.2e} "
            f"(the factor alone vs float64 {res.get('factor_rel_err_vs_float64', float('nan')):.2e}; "
            f"tol {tol:g}); ranks {'agree' if ranks_agree else 'DIFFER'}"
            f"{'; device error: ' + device_error if device_error else ''}: "
            f"{'PASS' if res['ok'] else 'FAIL'}")
    return res


# ---------------------------------------------------------------------------------------------
# --bench
# ---------------------------------------------------------------------------------------------
def time_us(ctx: Ctx, fn, calls: int, replays: int, graph: bool, collective: bool):
    """(µs per call on this rank, 'graph' or 'eager', capture error or None).

    fn runs 3 times on a side stream first (the factor's workspace, the NCCL communicator),
    then ``calls`` calls are captured in one CUDA graph that is replayed ``replays`` times
    (median); if capture fails (on any rank, when ``collective``), ``calls`` eager calls are
    timed ``replays`` times with CUDA events instead. Every rank must make the same sequence of
    collective calls, so with ``collective`` all ranks call this together. On the CPU (--device
    cpu, a smoke test): host time of eager calls."""
    if not ctx.cuda:
        for _ in range(2):
            fn()
        if collective:
            ctx.barrier()
        times = []
        for _ in range(max(1, replays // 4)):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - t0) * 1e6 / calls)
        times.sort()
        return times[len(times) // 2], "host", None
    s = torch.cuda.Stream(device=ctx.device)
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g, err = None, None
    if graph:
        try:
            g = torch.cuda.CUDAGraph()
            # thread_local: ProcessGroupNCCL's watchdog thread may query events meanwhile
            with torch.cuda.graph(g, stream=s, capture_error_mode="thread_local"):
                for _ in range(calls):
                    fn()
        except Exception as exc:        # e.g. a collective that cannot be captured here
            g, err = None, f"{type(exc).__name__}: {exc}"
            torch.cuda.synchronize()
    if collective and graph:
        if not ctx.all_true(g is not None):
            g = None
            err = err or "capture failed on another rank"
    if collective:
        ctx.barrier()
    run = g.replay if g is not None else (lambda: [fn() for _ in range(calls)])
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / calls)
    times.sort()
    del g
    return times[len(times) // 2], ("graph" if err is None and graph else "eager"), err


def bench_case(ctx: Ctx, shape, T, w13, w2, ep, inputs, args) -> dict:
    x, w, ids = inputs
    graph = not args.no_graph and ctx.cuda
    calls = args.calls or (10 if T <= 512 else 3)
    out = torch.empty(T, shape.H, dtype=x.dtype, device=ctx.device)
    # who serves how many (t, k) slots: the load balance behind the local times
    owner = torch.from_numpy(expert_owner(shape.E, ctx.world)).to(ctx.device)
    slots = [int((owner[ids.long()] == r).sum()) for r in range(ctx.world)]
    total, mode, err = time_us(ctx, lambda: ep.forward(x, w, ids, out=out), calls, args.replays,
                               graph, collective=True)
    totals = ctx.gather(total)
    local, lmode, _ = time_us(ctx, lambda: ep.forward_local(x, w, ids, out=out), calls, args.replays,
                              graph, collective=False)
    locals_ = ctx.gather(local)
    nbytes = T * shape.H * x.element_size()
    ar = None
    if ctx.world > 1:
        buf = torch.zeros(T, shape.H, dtype=x.dtype, device=ctx.device)
        ar_t, _, _ = time_us(ctx, lambda: dist.all_reduce(buf), calls, args.replays, graph, collective=True)
        ar = max(ctx.gather(ar_t))
        del buf
    world1 = 0.0
    if ctx.rank == 0:              # one GPU, all experts, no map, no collective (others wait)
        ref_out = torch.empty_like(out)
        world1, _, _ = time_us(ctx, lambda: moe_fused_gemm(x, w13, w2, w, ids, out=ref_out, registry=ctx.reg),
                               calls, args.replays, graph, collective=False)
        del ref_out
    world1 = ctx.gather(world1)[0]
    t_total = max(totals)
    flops = 2.0 * T * shape.K * 3 * shape.H * shape.I
    res = {
        "model": shape.model, "tokens": T, "world_size": ctx.world, "timing": mode,
        "capture_error": err, "calls_per_graph": calls,
        "experts_per_rank": [expert_partition(shape.E, ctx.world, r)[1] for r in range(ctx.world)],
        "slots_per_rank": slots,
        "total_us": t_total, "total_us_per_rank": totals,
        "local_us": max(locals_), "local_us_per_rank": locals_, "local_timing": lmode,
        "allreduce_us": ar, "allreduce_bytes": nbytes,
        "allreduce_algbw_GBps": (nbytes / ar / 1e3) if ar else None,
        "allreduce_busbw_GBps": (nbytes / ar / 1e3 * 2 * (ctx.world - 1) / ctx.world) if ar else None,
        "useful_tflops": flops / t_total / 1e6,
        "world1_us": world1, "speedup_vs_world1": world1 / t_total if t_total > 0 else None,
    }
    ar_txt = (f"all-reduce {ar:.1f} µs ({nbytes / 1e6:.2f} MB, algbw {res['allreduce_algbw_GBps']:.1f} "
              f"GB/s, busbw {res['allreduce_busbw_GBps']:.1f} GB/s)") if ar else "no all-reduce (world 1)"
    ctx.log(f"[ep_moe] bench {shape.model} T={T} world={ctx.world} ({mode}): total {t_total:.1f} µs, "
            f"local {res['local_us']:.1f} µs (per rank {', '.join(f'{v:.1f}' for v in locals_)}), {ar_txt}; "
            f"{res['useful_tflops']:.1f} TFLOP/s; 1 {'GPU' if ctx.device.type == 'cuda' else 'process'} "
            f"{world1:.1f} µs -> speedup "
            f"{res['speedup_vs_world1']:.2f}x" + (f"; capture failed: {err}" if err else ""))
    return res


# ---------------------------------------------------------------------------------------------
def token_count(v: str) -> int:
    """argparse type: a token count T >= 1 (a word or 0 get the same message)."""
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer T >= 1, got {v!r}")
    return n


def served(reg, before: dict, factor: str = "moe_fused_gemm"):
    """(what served ``factor``'s calls since ``before`` (a reg.stats()), {path: calls}): the
    plugin's name and version where it served them all, else each path that served with its
    count ('the Python fallback' for CPU tensors, or where no plugin is ready)."""
    after = reg.stats().get(factor, {})
    counts = {k: after.get(k, 0) - before.get(factor, {}).get(k, 0) for k in PATH_NAMES}
    counts = {k: n for k, n in counts.items() if n}
    p = reg.get(factor)
    name = lambda k: PATH_NAMES[k].format(plugin=f"{p.path.name} {p.version}" if p else "no plugin")
    if len(counts) == 1:
        return name(next(iter(counts))), counts
    return ", ".join(f"{name(k)} ({n} calls)" for k, n in counts.items()) or "no call", counts


def run_model(ctx: Ctx, name: str, args, results: dict) -> None:
    shape = MODELS[name]
    if args.tiny:
        shape = dataclasses.replace(shape, H=64, I=32, E=min(shape.E, 16), K=min(shape.K, 4))
    dtype = TORCH_DTYPES[args.dtype]
    t0 = time.perf_counter()
    router, w13, w2 = build_weights(ctx, shape, args.seed, dtype)
    same = ctx.same_everywhere([router, w13, w2])
    if not same:      # the generator gave different values on different GPUs: use rank 0's
        ctx.log(f"[ep_moe] {name}: weights differ between ranks; broadcasting rank 0's")
        ctx.broadcast([router, w13, w2])
    # this rank's experts: views on rank 0 (which keeps the global weights for the 1-GPU
    # reference), copies elsewhere (the global weights are freed there)
    ep = ExpertParallelMoE.from_global(w13, w2, registry=ctx.reg, copy=ctx.rank != 0)
    if ctx.rank != 0:
        w13 = w2 = None
        if ctx.cuda:
            torch.cuda.empty_cache()
    tol = ctx.reg.manifest("moe_fused_gemm").tolerance.get(args.dtype, 1e-2)
    ctx.log(f"[ep_moe] {name}: H={shape.H} I={shape.I} E={shape.E} K={shape.K} {args.dtype}, "
            f"{ctx.world} rank(s), experts per rank "
            f"{[expert_partition(shape.E, ctx.world, r)[1] for r in range(ctx.world)]}; "
            f"built in {time.perf_counter() - t0:.1f} s (weights identical on all ranks: "
            f"{'yes' if same else 'no, broadcast'})")
    for T in args.tokens:
        inputs = build_inputs(ctx, shape, T, args.seed, dtype, router, args.routing)
        if not ctx.same_everywhere(list(inputs)):
            ctx.log(f"[ep_moe] {name} T={T}: inputs differ between ranks; broadcasting rank 0's")
            ctx.broadcast(list(inputs))
        if args.check:
            results["check"].append(check_case(ctx, shape, T, w13, w2, ep, inputs, tol))
        if args.bench:
            results["bench"].append(bench_case(ctx, shape, T, w13, w2, ep, inputs, args))
        del inputs
    del ep, router, w13, w2
    if ctx.cuda:
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description="Expert-parallel MoE layer (ex_engine moe_fused_gemm with an expert map + NCCL "
                    "all-reduce) over the GPUs of a torchrun job: check against one GPU and float64, "
                    "and benchmark.",
        epilog="Launch: torchrun --standalone --nproc_per_node=N examples/ep_moe.py --check --bench")
    ap.add_argument("--check", action="store_true",
                    help="compare the expert-parallel output with the 1-GPU factor and a float64 "
                         "reference (default when neither --check nor --bench is given)")
    ap.add_argument("--bench", action="store_true",
                    help="time the expert-parallel step, the local factor, the all-reduce and 1 GPU")
    ap.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=sorted(MODELS),
                    metavar="MODEL", help=f"models of manifests/moe_models.yaml (default: "
                                          f"{' '.join(DEFAULT_MODELS)}; any of {', '.join(sorted(MODELS))})")
    ap.add_argument("--tokens", nargs="+", type=token_count, default=[64, 4096], metavar="T",
                    help="token counts, each >= 1 (default: 64 4096)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"],   # TORCH_DTYPES' keys
                    help="activation and weight dtype (default bfloat16)")
    ap.add_argument("--routing", default="router", choices=["router", "random"],
                    help="router: topk_softmax of the router logits (default); random: distinct "
                         "random ids, random positive weights summing to 1")
    ap.add_argument("--seed", type=int, default=0, help="base seed; each model gets its own (default 0)")
    ap.add_argument("--replays", type=int, default=20, help="timed replays per measurement (median; default 20)")
    ap.add_argument("--calls", type=int, default=0,
                    help="calls per captured graph (default: 10 for T <= 512, else 3)")
    ap.add_argument("--no-graph", action="store_true", help="time eagerly with CUDA events, no CUDA graph")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the results here (rank 0)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cuda (default): one GPU per rank, NCCL; cpu: a smoke test of this script "
                         "without GPUs (gloo, torch CPU tensors, the Python fallback), with --tiny only")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny layers (H 64, I 32, at most 16 experts, at most top-4): a smoke test")
    args = ap.parse_args(argv)
    problems = [output_file_problem("--json", args.json, (".json",))]
    if args.replays < 1:
        problems.append(f"--replays: expected >= 1, got {args.replays}")
    if args.calls < 0:
        problems.append(f"--calls: expected >= 0 (0: the default), got {args.calls}")
    if args.device == "cpu" and not args.tiny:   # minutes per model on the Python fallback
        problems.append("--device cpu: expected with --tiny (a smoke test); full-size layers run on the "
                        "Python fallback on the CPU for minutes per model")
    if torch is None:
        problems.append("needs PyTorch (torchrun, torch.distributed), which is not installed; "
                        "install it, e.g. pip install -e '.[hf]'")
    if report_problems("ep_moe", problems):
        return 2
    if not (args.check or args.bench):
        args.check = True
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("ep_moe: needs CUDA GPUs (one process per GPU under torchrun), or --device cpu --tiny",
              file=sys.stderr)
        return 2
    try:   # a malformed or half-set torchrun environment: one line, not a traceback
        rank, world, local_rank = init_from_env(backend="nccl" if cuda else "gloo")
    except FactorError as exc:           # ArgumentError included
        report_problems("ep_moe", [str(exc)])
        return 2
    reg = FactorRegistry.load(hardware=Hardware.from_device(local_rank) if cuda else None)
    set_default_registry(reg)
    ctx = Ctx(rank, world, local_rank, reg, cuda)
    p = reg.get("moe_fused_gemm")
    nccl = None                          # a gloo (CPU) run uses no NCCL: none reported
    if cuda:
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:
            pass
    info = {"torch": torch.__version__, "nccl": nccl, "world_size": world,
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
            # what serves: CPU tensors take the Python fallback whatever plugin is loaded (the
            # header's guess; after the run, what served by the registry's counts)
            "moe_fused_gemm": (f"{p.path.name} {p.version}" if p else "the Python fallback") if cuda
            else "the Python fallback (CPU tensors)",
            "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"),
            "routing": args.routing, "dtype": args.dtype, "seed": args.seed, "device": args.device,
            "tiny": args.tiny}
    comm = (f"NCCL {info['nccl']}, " if cuda else "gloo, ")
    ctx.log(f"[ep_moe] world {world} ({info['gpus'][0] if info['gpus'] else args.device}), torch {info['torch']}, "
            f"{comm}moe_fused_gemm {info['moe_fused_gemm']}, NCCL_NVLS_ENABLE="
            f"{info['NCCL_NVLS_ENABLE']}; models {args.models}, T {args.tokens}")
    if p is None and cuda:
        ctx.log("[ep_moe] warning: no moe_fused_gemm plugin is ready; the Python fallback serves (slow)")
    results = {"info": info, "check": [], "bench": []}
    t0 = time.perf_counter()
    before = reg.stats()
    for name in args.models:
        run_model(ctx, name, args, results)
    results["seconds"] = time.perf_counter() - t0
    info["moe_fused_gemm"], info["moe_fused_gemm_calls"] = served(reg, before)   # rank 0's calls
    ctx.log(f"[ep_moe] moe_fused_gemm served by {info['moe_fused_gemm']} (rank 0)")
    results["ok"] = all(c["ok"] for c in results["check"])
    if args.check:
        n, n_fail = len(results["check"]), sum(not c["ok"] for c in results["check"])
        ctx.log(f"[ep_moe] check: {n - n_fail} of {n} cases passed" +
                (f", {n_fail} FAILED" if n_fail else ""))
    ctx.log(f"[ep_moe] done in {results['seconds']:.1f} s")
    if args.json and rank == 0:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
        ctx.log(f"[ep_moe] wrote {args.json}")
    ok = ctx.all_true(results["ok"])
    shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    exit_quietly_on_broken_pipe(main)   # Ctrl-C, out of memory, `| head`: one line, no traceback
