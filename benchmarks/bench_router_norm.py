#!/usr/bin/env python3
"""topk_softmax and fused_add_rmsnorm against PyTorch eager and torch.compile, side by side.

In one process on one GPU, bf16 (router logits fp32 as engines produce them), for each shape:
checks our output against the PyTorch one, then times (a) eager calls, per call, as an engine
calling from Python sees them (launch and host overhead included: median over many calls,
synchronised every call) and (b) CUDA-graph replay (>= 20 calls captured, rotating over up to 64
input sets of 256 MB together where 64 reach it, so that the 60 MB L2 serves nothing; the small
shapes' 64 sets fit in L2 (rmsnorm T = 1: 2.6 MB, topk T = 1: 37 KB, topk T = 4096 E = 64: 84 MB,
partly), rows bound by their launches; device time per call). The checks: fused_add_rmsnorm's x
and residual against PyTorch's (relative 1e-2), topk_softmax's ids equal to torch.topk's but on
rows of tied logits (at most T/1000 of them) and its weights within 1e-5 on the rows whose ids
agree; a failed check stops the run.
Prints µs and the fraction of the copy bandwidth (bytes that must be read and written once).

    python3 benchmarks/bench_router_norm.py [--json F] [--only topk|rmsnorm] [--no-torch]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

try:
    import torch
except ImportError:  # --help works without it; a run says it needs it
    torch = None

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ex_engine import FactorRegistry, fused_add_rmsnorm, topk_softmax  # noqa: E402
from ex_engine.moe_layer import output_file_problem, report_problems  # noqa: E402
from _timing import graph_us, host_us, run_meta, write_json  # noqa: E402

COPY_GBS = 4230.0


def torch_rmsnorm(x, residual, weight, eps):
    r = (x.float() + residual.float()).to(x.dtype)
    residual.copy_(r)
    rf = r.float()
    y = rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    x.copy_(y.to(x.dtype))
    return x, residual


def torch_topk(logits, k, renormalize):
    p = torch.softmax(logits.float(), dim=-1)
    w, ids = torch.topk(p, k, dim=-1)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w, ids.to(torch.int32)


def eager_us(fn, reps=200):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e6)
    ts.sort()
    return ts[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="write the run's date, device and commit, and every row, here")
    ap.add_argument("--only", choices=("topk", "rmsnorm"), default=None, help="one op only")
    ap.add_argument("--no-torch", action="store_true",
                    help="time ex_engine only, not the PyTorch eager / torch.compile peers (PyTorch is "
                         "still needed: it makes the inputs and times the calls)")
    args = ap.parse_args()
    if report_problems("bench_router_norm", [output_file_problem("--json", args.json, (".json",))]):
        return 2
    if torch is None or not torch.cuda.is_available():
        print("bench_router_norm: needs PyTorch and a CUDA GPU (README: 'On a GPU machine')", file=sys.stderr)
        return 2
    reg = FactorRegistry.load()
    compiled_norm = torch.compile(torch_rmsnorm)
    compiled_topk = torch.compile(torch_topk)
    rows = []
    print(f"{'op':<18}{'shape':<22}{'impl':<15}{'eager µs':>10}{'graph µs':>10}{'% copy':>8}{'host µs':>9}", flush=True)
    norm_shapes = [(1, 4096), (4096, 2048), (4096, 7168), (16384, 4096), (16384, 7168)]
    topk_shapes = [(1, 128, 8), (4096, 64, 8), (4096, 128, 8), (16384, 128, 8), (16384, 384, 8)]
    for T, H in ([] if args.only == "topk" else norm_shapes):
        print(f"[rmsnorm T={T} H={H}] ...", file=sys.stderr, flush=True)
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        r = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        w = (1 + 0.1 * torch.randn(H, device="cuda")).to(torch.bfloat16)
        x2, r2 = x.clone(), r.clone()
        fused_add_rmsnorm(x, r, w, 1e-6, registry=reg)
        torch_rmsnorm(x2, r2, w, 1e-6)
        err = float((x.float() - x2.float()).norm() / x2.float().norm())
        err_r = float((r.float() - r2.float()).norm() / r2.float().norm())
        assert reg.last_path["fused_add_rmsnorm"] == "plugin", reg.last_path
        assert err <= 1e-2 and err_r <= 1e-2, f"fused_add_rmsnorm T={T} H={H}: rel err x {err:.2e}, residual {err_r:.2e}"
        nbytes = 4 * T * H * 2 + H * 2
        nsets = min(64, max(1, -(-256 * 2**20 // nbytes)))  # >= 256 MB in all (L2 is 60 MB)
        sets = [(x, r)] + [(torch.randn_like(x), torch.randn_like(r)) for _ in range(nsets - 1)]
        impls = {"ex_engine": lambda a, b: fused_add_rmsnorm(a, b, w, 1e-6, registry=reg),
                 "torch eager": lambda a, b: torch_rmsnorm(a, b, w, 1e-6),
                 "torch.compile": lambda a, b: compiled_norm(a, b, w, 1e-6)}
        for name, f in impls.items():
            if args.no_torch and name != "ex_engine":
                continue
            fn = (lambda f=f: f(x, r))
            e = eager_us(fn)
            g = graph_us([(lambda f=f, a=a, b=b: f(a, b)) for a, b in sets], calls=20)
            h = host_us(fn, reps=500) if name == "ex_engine" and T == 1 else None
            rows.append({"op": "fused_add_rmsnorm", "T": T, "H": H, "impl": name, "eager_us": e,
                         "graph_us": g, "copy_frac": nbytes / g / 1e3 / COPY_GBS, "host_us": h, "rel_err": err})
            print(f"{'fused_add_rmsnorm':<18}{f'T={T} H={H}':<22}{name:<15}{e:>10.1f}{g:>10.1f}"
                  f"{100 * nbytes / g / 1e3 / COPY_GBS:>7.0f}%{(f'{h:>9.1f}' if h else ''):>9}", flush=True)
    for T, E, K in ([] if args.only == "rmsnorm" else topk_shapes):
        print(f"[topk T={T} E={E}] ...", file=sys.stderr, flush=True)
        logits = torch.randn(T, E, device="cuda")
        w, ids = topk_softmax(logits, K, True, registry=reg)
        w2, ids2 = torch_topk(logits, K, True)
        assert reg.last_path["topk_softmax"] == "plugin"
        same = bool((ids == ids2).all())
        agree = ~(ids != ids2).any(dim=1)
        differ = int((~agree).sum())  # rows whose ids differ from torch.topk's (tied logits)
        werr = float((w[agree] - w2[agree]).norm() / w2[agree].norm()) if bool(agree.any()) else float("nan")
        assert differ <= max(1, T // 1000) and werr <= 1e-5, \
            f"topk_softmax T={T} E={E}: {differ} rows' ids differ from torch.topk's, weights rel err {werr:.2e}"
        nbytes = T * E * 4 + T * K * 8
        nsets = max(1, -(-256 * 2**20 // nbytes))
        sets = [logits] + [torch.randn_like(logits) for _ in range(min(nsets, 64) - 1)]
        impls = {"ex_engine": lambda lg: topk_softmax(lg, K, True, registry=reg),
                 "torch eager": lambda lg: torch_topk(lg, K, True),
                 "torch.compile": lambda lg: compiled_topk(lg, K, True)}
        for name, f in impls.items():
            if args.no_torch and name != "ex_engine":
                continue
            fn = (lambda f=f: f(logits))
            e = eager_us(fn)
            g = graph_us([(lambda f=f, lg=lg: f(lg)) for lg in sets], calls=20)
            h = host_us(fn, reps=500) if name == "ex_engine" and T == 1 else None
            target = max(2 * nbytes / COPY_GBS / 1e3, 8.0)
            rows.append({"op": "topk_softmax", "T": T, "E": E, "K": K, "impl": name, "eager_us": e,
                         "graph_us": g, "target_us": target, "ids_equal_torch": same, "ids_rows_differ": differ, "host_us": h})
            print(f"{'topk_softmax':<18}{f'T={T} E={E} K={K}':<22}{name:<15}{e:>10.1f}{g:>10.1f}"
                  f"{'':>8}{(f'{h:>9.1f}' if h else ''):>9}  target {target:.1f}", flush=True)
    if args.json:
        write_json(args.json, {"meta": run_meta(), "rows": rows})


if __name__ == "__main__":
    from ex_engine.cli import exit_quietly_on_broken_pipe
    exit_quietly_on_broken_pipe(main)
