#!/usr/bin/env python3
"""moe_fused_gemm against the torch._grouped_mm pipeline and the Python fallback, side by side.

For each model of manifests/moe_models.yaml and each T, in one process on one GPU: builds the
layer (weights N(0, 0.02), bf16 by default), draws several independently routed input sets
(softmax of N(0,1) logits, top-K, renormalised per the model), checks every implementation's
output against a float32 reference (relative error <= REL_TOL, 1e-2, for each: METHOD's bf16
range), then times CUDA-graph replays that rotate over the sets. Each set has its own copy of
w13 and w2 (--shared-weights: one copy for all, as the tables before 2026-12-05 were measured),
so that no call reads weights the previous call left in L2. Checked before timing: the first
set's eager call (its output poisoned with NaN first); after timing, every set's output from one
replay of a CUDA graph of one call per set (outputs poisoned before the replay; ours writes into
out= buffers allocated before the capture, so an unwritten element fails; the gmm peer allocates
its own, which the graph's other temporaries may share, so only a wrong value fails): a failing
set drops that implementation's time from the row.
Prints time, TFLOP/s, GB/s, ratio to the floor and to the peer; writes JSON.

Floor (../shared/PERF.md, beside the checkout): max(FLOPs / 787 TFLOP/s, bytes / 4.23 TB/s); FLOPs = 2*T*K*3*H*I; bytes = the
distinct experts hit * 3*H*I*2 + activations in and out + routing. Column 'x here': the same
ratio against the ceilings measured at the start of the run with the same timer (a bf16 matmul of
8192^3 and a 2 GiB copy, _timing.ceilings), so that both sides of the ratio see the same clocks.
Every graph is replayed for --warm-ms (200) before it is timed: the card leaves its top clock
within ~0.1 s of sustained tensor-core work (RESULTS.md, "Sustained load").

    python3 benchmarks/bench_moe.py [--models all] [--tokens 1 8 64 512 4096 16384] [--json F]
    python3 benchmarks/table_moe.py F; python3 benchmarks/plot_moe.py F      # its table, its chart

Needs PyTorch with a CUDA GPU, numpy, and the built plugins (`make`: factors/moe_fused_gemm*.so,
or --factors); --help needs none of them. Every argument is checked before any work. Exit
status: 0 every row timed; 1 a row failed its check (not timed); 2 bad arguments, or what it
needs is missing.
"""
from __future__ import annotations

import argparse
import runpy
import sys
import time
from pathlib import Path
from statistics import median

try:
    import torch
except ImportError:  # --help works without it; a run says it needs it
    torch = None

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# standard library only, loaded by path: --help answers where the package (numpy) does not import
_scripts = runpy.run_path(str(ROOT / "ex_engine" / "_scripts.py"))
exit_quietly_on_broken_pipe = _scripts["exit_quietly_on_broken_pipe"]
try:
    from ex_engine import FactorRegistry, moe_fused_gemm  # noqa: E402
    from ex_engine.moe_layer import (case_problems, load_models_or_exit, models_help,  # noqa: E402
                                     output_file_problem, report_problems)
    NO_PACKAGE = ""
except ImportError as exc:  # numpy missing: a run says so in one line
    FactorRegistry = None
    NO_PACKAGE = f"needs numpy, PyTorch and a CUDA GPU (the ex_engine package does not import: {exc})"
from _timing import ceilings, graph_outputs, graph_us, host_us, run_meta, write_json  # noqa: E402

PEAK_TFLOPS, PEAK_GBS = 787.0, 4230.0
REL_TOL = 1e-2   # every implementation's check: bf16 operands land between 1e-3 and 1e-2 (METHOD)


def check_passes(err) -> bool:
    """Whether a relative error ``err`` (rel()) passes the check before timing: <= REL_TOL, the
    same for ours, the gmm peer and the fallback (NaN, inf never pass)."""
    return err <= REL_TOL


def routing(T, E, K, renormalize, skew, gen, balanced=False):
    """(topk_weights (T, K) fp32, topk_ids (T, K) int32): the top K of softmax(N(0, 1) logits),
    with ``skew`` a few hot experts lifted by 2.5. ``balanced`` (T * K a multiple of E): every
    expert gets exactly T * K / E slots (token t takes experts perm[(t' * K + j) % E], j < K, t'
    a shuffled position, perm a random order of the experts), each with its softmax weight: the
    routing under which no expert's rows leave a part-filled tile beyond what T * K / E does."""
    dev = gen.device   # the generator's (the GPU in a run; tests draw on the CPU)
    logits = torch.randn(T, E, device=dev, generator=gen)
    if skew:  # a few hot experts take most tokens
        logits[:, : max(1, E // 16)] += 2.5
    p = torch.softmax(logits, dim=-1)
    if balanced:
        pos = torch.randperm(T, device=dev, generator=gen)
        perm = torch.randperm(E, device=dev, generator=gen)
        ids = perm[(pos[:, None] * K + torch.arange(K, device=dev)[None, :]) % E]
        w = torch.gather(p, 1, ids)
    else:
        w, ids = torch.topk(p, K, dim=-1)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w.float().contiguous(), ids.to(torch.int32).contiguous()


def layer_weights(s, dt, gen):
    """w13 (E, 2I, H) and w2 (E, H, I) of model shape ``s``: N(0, 0.02) in dtype ``dt`` (../shared/PERF.md)."""
    w13 = (torch.randn(s.E, 2 * s.I, s.H, device="cuda", generator=gen) * 0.02).to(dt)
    w2 = (torch.randn(s.E, s.H, s.I, device="cuda", generator=gen) * 0.02).to(dt)
    return w13, w2


def input_sets(s, T, n, w13, w2, dt, gen, skew=False, balanced=False):
    """``n`` independently routed calls of the layer: (hidden_states (T, H) N(0, 1) in ``dt``,
    w13, w2, topk_weights (T, K) fp32, topk_ids (T, K) int32), drawn in that order (routing())."""
    sets = []
    for _ in range(n):
        x = torch.randn(T, s.H, device="cuda", generator=gen).to(dt)
        w, ids = routing(T, s.E, s.K, s.renormalize, skew, gen, balanced)
        sets.append((x, w13, w2, w, ids))
    return sets


def gmm_pipeline(x, w13, w2, w, ids):
    """../shared/PERF.md's `gmm` peer: argsort by expert, grouped_mm w13, silu*up, grouped_mm w2, index_add."""
    T, H = x.shape
    E, I2, _ = w13.shape
    I = I2 // 2
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # int32 end offsets per expert, computed on the device (graph-capturable, unlike bincount)
    offs = torch.searchsorted(flat[order], torch.arange(E, device=x.device, dtype=flat.dtype),
                              right=True).to(torch.int32)
    tok = order // ids.shape[1]
    xs = x.index_select(0, tok)
    gu = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
    act = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
    y = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)
    out = torch.zeros(T, H, device=x.device, dtype=torch.float32)
    out.index_add_(0, tok, y.float() * w.reshape(-1)[order, None])
    return out.to(x.dtype)


def reference(x, w13, w2, w, ids):
    """float32 per-expert loop (no TF32), activation not rounded."""
    T, H = x.shape
    E, I2, _ = w13.shape
    I = I2 // 2
    out = torch.zeros(T, H, device=x.device, dtype=torch.float32)
    xf = x.float()
    for e in torch.unique(ids).tolist():
        t, k = torch.nonzero(ids == e, as_tuple=True)
        gu = xf[t] @ w13[e].float().T
        act = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
        out.index_add_(0, t, (act @ w2[e].float().T) * w[t, k, None])
    return out


def rel(out, ref):
    o = out.float()
    if torch.isnan(o).any():
        return float("inf")
    return float((o - ref).norm() / ref.norm())


def graph_errors(fn, sets, refs, out_arg=False):
    """rel() of each set's output from one replay of a CUDA graph of ``fn(*set)`` for every set
    in ``sets``, against ``refs`` (one float32 reference per set): the check of what graph replay
    computes, on every set the timed graphs rotate over, not only the first set's eager call.
    The outputs are filled with NaN before the replay. With ``out_arg`` each call writes into
    ``fn(*set, out=buffer)``, a buffer like the set's first tensor allocated before the capture,
    so that an element the call leaves unwritten reads NaN and fails; without it (a callable
    that allocates its output) the graph's pool may have given that memory to another call's
    temporary first (graph_outputs), so an unwritten element fails only by its wrong value."""
    if out_arg:
        bufs = [torch.empty_like(a[0]) for a in sets]
        fns = [lambda a=a, o=o: fn(*a, out=o) for a, o in zip(sets, bufs)]
    else:
        fns = [lambda a=a: fn(*a) for a in sets]
    return [rel(out, r) for out, r in zip(graph_outputs(fns), refs)]


def graph_failure(errs) -> str | None:
    """None where every error in ``errs`` (graph_errors(), one per set) passes check_passes(),
    else which sets failed and by how much (NaN, an unwritten element, reads 'inf')."""
    bad = [f"set {k} rel err {e:.2e}" for k, e in enumerate(errs) if not check_passes(e)]
    return f"{', '.join(bad)} > {REL_TOL:g}" if bad else None


def weight_copies(w13, w2, n_sets, wanted, model):
    """The copies of (w13, w2) for input sets 1..n_sets-1 (set 0 keeps the layer's own), or []
    where ``wanted`` is False, there is one set, or the copies would not leave a quarter of the
    GPU's free memory (said on stderr: the rows then share one copy of the weights)."""
    if not wanted or n_sets == 1:
        return []
    need = (n_sets - 1) * (w13.nbytes + w2.nbytes)
    free, _ = torch.cuda.mem_get_info()
    if need > 0.75 * free:
        print(f"# {model}: {n_sets - 1} more copies of the weights ({need / 2**30:.1f} GiB) do not fit "
              f"in {free / 2**30:.1f} GiB free with room to spare: its sets share one copy",
              file=sys.stderr, flush=True)
        return []
    return [(w13.clone(), w2.clone()) for _ in range(n_sets - 1)]


def eager_time_us(fn, args, reps):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / reps


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_scripts["HelpFormatter"])
    listed = models_help(all_ok=True) if FactorRegistry else "see manifests/moe_models.yaml (listing them needs numpy)"
    ap.add_argument("--models", nargs="+", default=["all"], metavar="MODEL",
                    help=f"models of manifests/moe_models.yaml, or all (alone: every model): {listed}")
    ap.add_argument("--tokens", type=_scripts["integer"], nargs="+", default=[1, 8, 64, 512, 4096, 16384], metavar="T",
                    help="token counts T, each >= 1")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="activation and weight dtype")
    ap.add_argument("--sets", type=_scripts["integer"], default=4,
                    help="independently routed input sets rotated through each graph (>= 1)")
    ap.add_argument("--skew", action="store_true",
                    help="also time skewed routing (a few hot experts take most tokens) at T = 64 and "
                         "T = 4096 for every model, whatever --tokens says")
    ap.add_argument("--balanced", action="store_true",
                    help="also time balanced routing (every expert exactly T*K/E slots: the case in "
                         "which experts' rows pad tiles least; a diagnostic, not a model's routing) "
                         "at each T of --tokens where E divides T*K")
    ap.add_argument("--fallback-max-t", type=_scripts["integer"], default=64,
                    help="time the Python fallback (eager: one warm-up call, whose output is checked "
                         "against the reference, then the median of 5) at each T up to this")
    copies = ap.add_mutually_exclusive_group()
    copies.add_argument("--weight-copies", dest="weight_copies", action="store_true", default=True,
                        help="the default: each input set has its own copy of w13 and w2 (memory: "
                             "--sets times the layer; where they do not fit in the GPU's free memory "
                             "with room to spare, the row shares one copy and says so), so that no "
                             "call reads weights that the previous call left in L2")
    copies.add_argument("--shared-weights", dest="weight_copies", action="store_false",
                        help="the sets share one copy of the weights and differ in hidden_states and "
                             "routing (the tables before 2026-12-05): a layer a few times L2, granite's "
                             "189 MB, then has part of its weights served from L2 (granite T = 1 read "
                             "2.4-4.3%% faster, RESULTS.md)")
    ap.add_argument("--json", default=None, metavar="FILE",
                    help="write the run's meta and every row here, after each row (a run cut short "
                         "keeps what it measured); not written by default")
    ap.add_argument("--warm-ms", type=_scripts["number"], default=200.0,
                    help="replay each graph this many ms before timing it, 0..60000: rows are timed "
                         "at the clocks of sustained load, which the card reaches within ~0.1 s")
    ap.add_argument("--factors", default=None, metavar="FOLDER",
                    help="folder of plugin libraries to load, e.g. an older build to compare "
                         "(default: factors/)")
    args = ap.parse_args()
    if NO_PACKAGE:
        print(f"bench_moe: {NO_PACKAGE}", file=sys.stderr)
        return 2
    models = load_models_or_exit("bench_moe")
    names = sorted(models) if args.models == ["all"] else args.models
    # every argument checked before any work (a mistake found after a row would lose it)
    problems = case_problems(models, args.models, args.tokens, args.factors, all_ok=True)
    if args.sets < 1:
        problems.append(f"--sets: expected >= 1, got {args.sets}")
    if args.fallback_max_t < 0:
        problems.append(f"--fallback-max-t: expected T >= 0 (0: the fallback at no T), got {args.fallback_max_t}")
    if not 0 <= args.warm_ms <= 60000:
        problems.append(f"--warm-ms: expected 0..60000 ms, got {args.warm_ms}")
    problems.append(output_file_problem("--json", args.json, (".json",)))
    if report_problems("bench_moe", problems):
        return 2
    if torch is None or not torch.cuda.is_available():
        print("bench_moe: needs PyTorch and a CUDA GPU (README: 'On a GPU machine')", file=sys.stderr)
        return 2
    dt = getattr(torch, args.dtype)
    reg = FactorRegistry.load(args.factors)
    if reg.get("moe_fused_gemm") is None:
        print("bench_moe: no ready moe_fused_gemm plugin in "
              f"{args.factors or 'factors/'}: {[(p.path.name, p.reason) for p in reg.plugins]}", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    print("measuring the card's ceilings here (matmul, copy, write) ...", file=sys.stderr, flush=True)
    here = ceilings(args.warm_ms)
    plugin = reg.get("moe_fused_gemm")
    meta = run_meta(dtype=args.dtype, sets=args.sets, plugin=plugin.path.name,
                    plugin_sha256=plugin.sha256, weight_copies=args.weight_copies,
                    factors=str(args.factors or "factors/"), warm_ms=args.warm_ms,
                    ceilings_perf_md={"matmul_tflops": PEAK_TFLOPS, "copy_gbs": PEAK_GBS},
                    ceilings_here=here)
    rows = []

    def save():  # after every row: a run cut short still leaves what it measured
        if args.json:
            write_json(args.json, {"meta": meta, "rows": rows})

    gmm_said = False   # the gmm peer's capture failure was printed once
    # a balanced row right after its uniform row (the same weights, the same clocks' minute)
    cases = [(m, T, r) for m in names for T in args.tokens
             for r in ("uniform", "balanced") if r == "uniform" or (args.balanced and T * models[m].K % models[m].E == 0)]
    if args.skew:
        cases += [(m, T, "skewed") for m in names for T in (64, 4096)]
    hdr = (f"{'model':<22}{'T':>6} {'route':<6}{'floor':>9}{'ours':>9}{'x floor':>8}{'x here':>7}{'TFLOP/s':>8}"
           f"{'GB/s':>7}{'gmm':>9}{'gmm/ours':>9}{'fallbk':>10}{'err':>9}")
    print(f"# {meta}", flush=True)
    print(hdr)
    cur_model, layer = None, None
    for i, (m, T, route) in enumerate(cases):
        s, skew = models[m], route == "skewed"
        print(f"[{i + 1}/{len(cases)}] {m} T={T}{'' if route == 'uniform' else ' ' + route} ...",
              file=sys.stderr, flush=True)
        if m != cur_model:
            layer = sets = refs = w13 = w2 = None   # the last model's weights and copies freed
            torch.cuda.empty_cache()
            layer, cur_model = layer_weights(s, dt, gen), m
            layer = (layer, weight_copies(*layer, args.sets, args.weight_copies, m))
        (w13, w2), own = layer
        sets = input_sets(s, T, args.sets, w13, w2, dt, gen, skew, route == "balanced")
        sets = [a if k == 0 or not own else (a[0], *own[k - 1], a[3], a[4]) for k, a in enumerate(sets)]
        hit = sum(int(torch.unique(a[4]).numel()) for a in sets) / args.sets
        flops = 2.0 * T * s.K * 3 * s.H * s.I
        bytes_ = hit * 3 * s.H * s.I * 2 + 2 * T * s.H * 2 + T * s.K * 8
        floor = max(flops / PEAK_TFLOPS / 1e6, bytes_ / PEAK_GBS / 1e3)
        floor_here = max(flops / here["matmul_tflops"] / 1e6, bytes_ / here["copy_gbs"] / 1e3)
        ours = lambda x, w13, w2, w, ids, out=None: moe_fused_gemm(x, w13, w2, w, ids, out=out, registry=reg)
        refs = [reference(*a) for a in sets]
        ref = refs[0]
        poisoned = torch.full_like(sets[0][0], float("nan"))   # every element must be written
        err = rel(moe_fused_gemm(*sets[0], out=poisoned, registry=reg), ref)
        err_g = rel(gmm_pipeline(*sets[0]), ref)
        row = {"model": m, "T": T, "skewed": skew, "routing": route, "H": s.H, "I": s.I, "E": s.E, "K": s.K,
               "weight_copies": bool(own),
               "experts_hit": hit, "flops": flops, "bytes": bytes_, "floor_us": floor, "floor_here_us": floor_here,
               "err_ours": err, "err_gmm": err_g, "path": reg.last_path.get("moe_fused_gemm")}
        if not check_passes(err):   # (NaN never passes)
            row["error"] = f"ours rel err {err:.2e} > {REL_TOL:g}: not timed"
            print(f"{m:<22}{T:>6} FAILED CHECK: rel err {err:.3e}", flush=True)
            rows.append(row)
            save()
            continue
        row["ours_us"] = graph_us([lambda a=a: ours(*a) for a in sets], warm_ms=args.warm_ms)
        row["err_ours_graph"] = graph_errors(ours, sets, refs, out_arg=True)
        if graph_failure(row["err_ours_graph"]):
            row["error"] = f"ours in graph replay: {graph_failure(row['err_ours_graph'])}: time dropped"
            del row["ours_us"]
            print(f"{m:<22}{T:>6} FAILED CHECK: {row['error']}", flush=True)
            rows.append(row)
            save()
            continue
        row["gmm_us"] = None
        if not check_passes(err_g):
            row["gmm_skipped"] = f"gmm rel err {err_g:.2e} > {REL_TOL:g}: not timed"
        else:
            try:
                row["gmm_us"] = graph_us([lambda a=a: gmm_pipeline(*a) for a in sets], warm_ms=args.warm_ms)
                row["err_gmm_graph"] = graph_errors(gmm_pipeline, sets, refs)
                if graph_failure(row["err_gmm_graph"]):
                    row["gmm_skipped"] = f"gmm in graph replay: {graph_failure(row['err_gmm_graph'])}: time dropped"
                    row["gmm_us"] = None
            except RuntimeError as exc:
                # torch 2.11's _grouped_mm in float16 copies to the host (not graph-capturable):
                # the peer gets no time rather than an eager one beside our graph-replay time
                torch.cuda.synchronize()
                row["gmm_skipped"] = "not CUDA-graph capturable: " + str(exc).splitlines()[0][:160]
                if not gmm_said:
                    print(f"# gmm peer: {row['gmm_skipped']} (its columns read '-')", flush=True)
                    gmm_said = True
        if T <= args.fallback_max_t:
            reg_fb = FactorRegistry(hardware=reg.hardware)  # no plugins: Python fallback
            fb = lambda *a: moe_fused_gemm(*a, registry=reg_fb)
            err_fb = rel(fb(*sets[0]), ref)   # the warm-up call (CuPy compiles its kernels), checked
            if check_passes(err_fb):
                row["fallback_us"] = median(eager_time_us(fb, sets[0], 1) for _ in range(5))
            else:
                row["fallback_skipped"] = f"fallback rel err {err_fb:.2e} > {REL_TOL:g}: not timed"
        if T == 1:
            row["host_us"] = host_us(lambda: ours(*sets[0]))
        row["x_floor"] = row["ours_us"] / floor
        row["x_floor_here"] = row["ours_us"] / floor_here
        row["tflops"] = flops / row["ours_us"] / 1e6
        row["gbs"] = bytes_ / row["ours_us"] / 1e3
        row["gmm_over_ours"] = (row["gmm_us"] / row["ours_us"]) if row["gmm_us"] else None
        rows.append(row)
        g = f"{row['gmm_us']:>9.1f}{row['gmm_over_ours']:>9.2f}" if row["gmm_us"] else f"{'-':>9}{'-':>9}"
        fb = f"{row['fallback_us']:>10.0f}" if "fallback_us" in row else f"{'-':>10}"
        print(f"{m:<22}{T:>6} {route[:4]:<6}{floor:>9.1f}{row['ours_us']:>9.1f}"
              f"{row['x_floor']:>8.2f}{row['x_floor_here']:>7.2f}{row['tflops']:>8.1f}{row['gbs']:>7.0f}{g}{fb}{err:>9.1e}", flush=True)
        if "host_us" in row:
            print(f"{'':<28}host time of one eager call: {row['host_us']:.1f} µs", flush=True)
        save()
    bad = [r for r in rows if "error" in r]
    print(f"# {len(rows) - len(bad)} timed, {len(bad)} failed checks")
    return 1 if bad else 0


if __name__ == "__main__":
    exit_quietly_on_broken_pipe(main)
