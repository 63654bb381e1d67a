#!/usr/bin/env python3
"""Greedy generation with a Hugging Face transformers MoE model, stock vs served by ex_engine.

Builds a model from a real config's dimensions with weights randomly initialised by transformers
itself (nothing is downloaded), a few layers and a small vocabulary, in bf16:

  qwen3    Qwen3-30B-A3B:  H 2048, 32 heads (4 KV, head_dim 128), 128 experts, top-8, I 768,
           norm_topk_prob true; 4 layers
  olmoe    OLMoE-1B-7B:    H 2048, 16 heads, 64 experts, top-8, I 1024, no renormalisation; 4 layers
  mixtral  Mixtral-8x7B:   H 4096, 32 heads (8 KV), 8 experts, top-2, I 14336; 2 layers

then greedily decodes --tokens tokens after a random prompt with a StaticCache, once per variant:

  stock_eager       transformers' expert loop (experts_implementation="eager"): the reference
  stock_grouped_mm  experts_implementation="grouped_mm" (the default of transformers 5.x)
  stock_batched_mm  experts_implementation="batched_mm" (what generate() switches to for decode on GPU)
  ex_engine         patch_moe(model): router -> topk_softmax, experts -> moe_fused_gemm (eager steps)
  ex_engine_graph   the same, one decode step captured in a CUDA graph and replayed
  stock_grouped_mm_graph  (--stock-graph) grouped_mm under a CUDA graph, for comparison

and prints, per variant, whether its tokens equal the reference's, the largest logit difference
along the reference's tokens (teacher-forced when the tokens differ), the step and logit gap of a
flipped token, and the decode time per token. Usage:

  python3 examples/hf_moe_generate.py --model all --json out.json
  python3 examples/hf_moe_generate.py --model qwen3 --tiny --device cpu     # smoke test, no GPU
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ex_engine._scripts import HelpFormatter, exit_quietly_on_broken_pipe  # noqa: E402
from ex_engine.moe_layer import output_file_problem, report_problems  # noqa: E402

try:  # --help works without PyTorch; a run needs it (and transformers)
    import torch  # noqa: E402
except ImportError:
    torch = None

MODELS = {
    "qwen3": dict(family="qwen3_moe", label="Qwen3-30B-A3B", layers=4, H=2048, heads=32, kv_heads=4,
                  head_dim=128, E=128, K=8, I=768, renormalize=True, rope_theta=1e6, eps=1e-6),
    "olmoe": dict(family="olmoe", label="OLMoE-1B-7B", layers=4, H=2048, heads=16, kv_heads=16,
                  head_dim=128, E=64, K=8, I=1024, renormalize=False, rope_theta=1e4, eps=1e-5),
    "mixtral": dict(family="mixtral", label="Mixtral-8x7B", layers=2, H=4096, heads=32, kv_heads=8,
                    head_dim=128, E=8, K=2, I=14336, renormalize=True, rope_theta=1e6, eps=1e-5),
}
TINY = dict(layers=2, H=64, heads=4, kv_heads=2, head_dim=16, I=32)


def params_text(n: int) -> str:
    """A parameter count in a unit that shows it: '30.53 B', '2.46 M', '123,456' (a tiny model's
    count read '0.00 B')."""
    if n >= 1e9:
        return f"{n / 1e9:.2f} B"
    return f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n:,}"


def log(msg: str) -> None:
    print(msg, flush=True)


def build(name: str, vocab: int, device: str, tiny: bool, layers: int | None, seed: int):
    """(model, spec): a bf16 causal LM of ``name``'s dimensions, initialised by transformers."""
    import transformers
    s = dict(MODELS[name])
    if tiny:
        s.update(TINY, E=min(s["E"], 8), K=min(s["K"], 2))
    if layers:
        s["layers"] = layers
    common = dict(vocab_size=vocab, hidden_size=s["H"], num_hidden_layers=s["layers"],
                  num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
                  num_experts_per_tok=s["K"], rms_norm_eps=s["eps"], max_position_embeddings=4096,
                  rope_parameters={"rope_type": "default", "rope_theta": s["rope_theta"]},
                  bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    if s["family"] == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, intermediate_size=6144 if not tiny else 128,
                                          moe_intermediate_size=s["I"], num_experts=s["E"],
                                          norm_topk_prob=s["renormalize"])
        cls = transformers.Qwen3MoeForCausalLM
    elif s["family"] == "olmoe":
        cfg = transformers.OlmoeConfig(**common, intermediate_size=s["I"], num_experts=s["E"],
                                       norm_topk_prob=s["renormalize"])
        cls = transformers.OlmoeForCausalLM
    else:
        cfg = transformers.MixtralConfig(**common, intermediate_size=s["I"], num_local_experts=s["E"])
        cls = transformers.MixtralForCausalLM
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls._from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval()
    model.set_experts_implementation("eager")
    return model, s


def decode(model, prompt, n: int, graph: bool = False, force=None):
    """Greedy decode ``n`` tokens after ``prompt`` (1, P) with a StaticCache.

    Returns (tokens list, logits (n, V) float32 for the positions that chose each token,
    ms per token over steps 3..n-1 (the first steps include warm-ups and the graph capture)).
    force: feed these tokens instead of the argmax (teacher forcing)."""
    from ex_engine.integrations.transformers import StaticDecoder
    dev = prompt.device
    d = StaticDecoder(model, batch_size=1, max_len=prompt.shape[1] + n + 1, graph=graph)
    cuda = dev.type == "cuda"
    logits = d.prefill(prompt)
    rows, toks = [], []
    t0 = None
    for i in range(n):
        rows.append(logits[0].float())
        tok = logits.argmax(-1) if force is None else force[i].view(1).to(dev)
        toks.append(tok)
        if i == min(3, n - 1):
            if cuda:
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
        if i < n - 1:
            logits = d.step(tok)
    if cuda:
        torch.cuda.synchronize(dev)
    steps = (n - 1) - min(3, n - 1)
    ms = (time.perf_counter() - t0) * 1e3 / steps if steps > 0 else float("nan")
    del d
    return torch.cat(toks).tolist(), torch.stack(rows), ms


def compare(ref_toks, ref_logits, toks, logits, model, prompt, graph, tol):
    """Tokens equal?  Largest logit difference along the reference's tokens (a teacher-forced
    pass when the tokens differ), the first flip's step and the reference's logit gap there."""
    out = {"tokens_equal": toks == ref_toks}
    if toks != ref_toks:
        s = next(i for i, (a, b) in enumerate(zip(ref_toks, toks)) if a != b)
        row = ref_logits[s]
        out["first_flip"] = {"step": s, "reference_token": ref_toks[s], "token": toks[s],
                             "reference_logit_gap": float(row[ref_toks[s]] - row[toks[s]]),
                             "reference_top2_gap": float(row.topk(2).values[0] - row.topk(2).values[1])}
        _, logits, _ = decode(model, prompt, len(ref_toks), graph=graph,
                              force=torch.tensor(ref_toks))
        out["teacher_forced"] = True
    diff = (logits - ref_logits).abs()
    per_step = diff.max(-1).values
    out["max_logit_diff"] = float(per_step.max())
    out["mean_logit_diff"] = float(diff.mean())
    out["steps_over_tolerance"] = [int(i) for i in torch.nonzero(per_step > tol).flatten()]
    if "first_flip" in out:
        f = out["first_flip"]
        f["gap_within_tolerance"] = abs(f["reference_logit_gap"]) <= tol
    return out


def run_model(name: str, args) -> dict:
    from ex_engine import default_registry
    from ex_engine.integrations.transformers import patch_moe
    dev = torch.device(args.device)
    t = time.perf_counter()
    model, s = build(name, args.vocab, args.device, args.tiny, args.layers, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"[{name}] {s['label']} dims: H {s['H']}, E {s['E']}, top-{s['K']}, I {s['I']}, {s['layers']} layers, "
        f"vocab {args.vocab}, bf16, {params_text(n_params)} params on {dev} "
        f"(built in {time.perf_counter() - t:.1f} s)")
    g = torch.Generator().manual_seed(args.seed + 1)
    prompt = torch.randint(0, args.vocab, (1, args.prompt_len), generator=g).to(dev)
    res = {"label": s["label"], "dims": {k: s[k] for k in ("H", "E", "K", "I", "layers", "renormalize")},
           "vocab": args.vocab, "params": n_params, "tokens": args.tokens, "prompt_len": args.prompt_len,
           "variants": {}}
    cuda = dev.type == "cuda"

    def record(key, toks, logits, ms, extra=None):
        v = {"ms_per_token": ms}
        if key != "stock_eager":
            v.update(compare(ref[0], ref[1], toks, logits, model, prompt,
                             key.endswith("graph"), tol if key.startswith("stock") else tol_ex))
        v.update(extra or {})
        res["variants"][key] = v
        line = f"[{name}] {key:<24s} {ms:8.2f} ms/token"
        if key != "stock_eager":
            line += (f"  tokens {'equal' if v['tokens_equal'] else 'DIFFER'}"
                     f"  max|dlogit| {v['max_logit_diff']:.4g}")
            if "first_flip" in v:
                f = v["first_flip"]
                line += (f"  (first flip at step {f['step']}: reference logit gap {f['reference_logit_gap']:.4g}"
                         f", {'within' if f['gap_within_tolerance'] else 'OVER'} tolerance)")
            if v["steps_over_tolerance"]:
                line += f"  steps over tolerance: {v['steps_over_tolerance']}"
        log(line)

    # reference: transformers' own expert loop
    model.set_experts_implementation("eager")
    ref = decode(model, prompt, args.tokens)
    scale = float(ref[1].abs().max())
    tol = args.rtol * scale
    res["logit_scale"], res["tolerance"] = scale, tol
    log(f"[{name}] tolerance: {args.rtol} x max|logit| ({scale:.4g}) = {tol:.4g}")
    record("stock_eager", *ref)
    for impl in ("grouped_mm", "batched_mm"):
        try:
            model.set_experts_implementation(impl)
            record(f"stock_{impl}", *decode(model, prompt, args.tokens))
        except Exception as exc:  # an implementation this torch/GPU lacks
            res["variants"][f"stock_{impl}"] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"[{name}] stock_{impl}: not run: {type(exc).__name__}: {exc}")
    model.set_experts_implementation("eager")
    # the noise floor: how far transformers' own implementations are from each other
    floor = max([x["max_logit_diff"] for k, x in res["variants"].items() if "max_logit_diff" in x] or [0.0])
    tol_ex = max(tol, 2 * floor)
    res["stock_noise_floor"], res["tolerance_ex_engine"] = floor, tol_ex
    log(f"[{name}] stock implementations differ by up to {floor:.4g}: ex_engine tolerance "
        f"max({tol:.4g}, 2 x {floor:.4g}) = {tol_ex:.4g}")

    reg = default_registry()
    before = {k: dict(v) for k, v in reg.stats().items()}
    t = time.perf_counter()
    handle = patch_moe(model, registry=reg)
    log(f"[{name}] patched {len(handle.blocks)} MoE blocks ({', '.join(handle.families)}), "
        f"repacked {handle.repacked_bytes} bytes, warm-up included: {time.perf_counter() - t:.2f} s")
    try:
        ex_run = decode(model, prompt, args.tokens)
        record("ex_engine", *ex_run)
        after = handle.stats()
        paths = {k: {p: after[k].get(p, 0) - before.get(k, {}).get(p, 0)
                     for p in ("plugin", "kernel_fallback", "python_fallback", "errors")} for k in after}
        res["variants"]["ex_engine"]["paths"] = paths
        log(f"[{name}] ex_engine paths: {paths}")
        if cuda and not args.no_graph:
            toks, logits, ms = decode(model, prompt, args.tokens, graph=True)
            same = {"tokens_equal_to_ex_engine": toks == ex_run[0],
                    "max_logit_diff_to_ex_engine": float((logits - ex_run[1]).abs().max())
                    if toks == ex_run[0] else None}
            record("ex_engine_graph", toks, logits, ms, same)
            log(f"[{name}] ex_engine_graph vs ex_engine eager: tokens "
                f"{'equal' if same['tokens_equal_to_ex_engine'] else 'DIFFER'}, max|dlogit| "
                f"{same['max_logit_diff_to_ex_engine']}")
        if cuda:
            reg.check_device_errors()
    finally:
        handle.undo()
    if cuda and args.stock_graph:
        try:
            model.set_experts_implementation("grouped_mm")
            record("stock_grouped_mm_graph", *decode(model, prompt, args.tokens, graph=True))
        except Exception as exc:
            res["variants"]["stock_grouped_mm_graph"] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"[{name}] stock_grouped_mm_graph: not run: {type(exc).__name__}: {exc}")
        model.set_experts_implementation("eager")

    v = res["variants"]
    ex = v["ex_engine"]
    ok = (ex["tokens_equal"] or ex.get("first_flip", {}).get("gap_within_tolerance", False)) \
        and not ex["steps_over_tolerance"]
    if "ex_engine_graph" in v:
        gv = v["ex_engine_graph"]
        ok = ok and (gv["tokens_equal"] or gv.get("first_flip", {}).get("gap_within_tolerance", False)) \
            and not gv["steps_over_tolerance"]
    res["ok"] = bool(ok)
    base = v["stock_eager"]["ms_per_token"]
    fastest_stock = min(x["ms_per_token"] for k, x in v.items() if k.startswith("stock") and "ms_per_token" in x)
    best = v.get("ex_engine_graph", ex)["ms_per_token"]
    res["speedup_vs_stock_eager"] = base / best
    res["speedup_vs_fastest_stock"] = fastest_stock / best
    log(f"[{name}] summary: {'OK' if ok else 'MISMATCH'}; ex_engine tokens "
        f"{'equal' if ex['tokens_equal'] else 'differ'}, max|dlogit| {ex['max_logit_diff']:.4g} "
        f"(tolerance {tol_ex:.4g}); {best:.2f} ms/token vs stock eager {base:.2f} "
        f"({base / best:.1f}x), fastest stock {fastest_stock:.2f} ({fastest_stock / best:.2f}x)")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--model", default="all", choices=[*MODELS, "all"],
                    help="the model whose config is built (see above), or all of them in turn")
    ap.add_argument("--tokens", type=int, default=64,
                    help="tokens to generate, >= 5: the first 4 steps are warm-ups, not timed")
    ap.add_argument("--prompt-len", type=int, default=16, help="tokens of the random prompt (>= 1)")
    ap.add_argument("--vocab", type=int, default=4096,
                    help="vocabulary size of the built model (>= 2)")
    ap.add_argument("--layers", type=int, default=None,
                    help="override the number of layers (>= 1; default: the model's, above; 2 with --tiny)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and the prompt")
    ap.add_argument("--rtol", type=float, default=2e-2,
                    help="logit tolerance as a fraction of the largest |logit| (default 0.02)")
    ap.add_argument("--device", default=None,
                    help="cpu or cuda[:N] (default: cuda where a GPU is visible; without one, cpu "
                         "with --tiny, else an error: full-size models on the CPU take many GB and minutes)")
    ap.add_argument("--tiny", action="store_true", help="tiny dimensions (a CPU smoke test)")
    ap.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph variant")
    ap.add_argument("--stock-graph", action="store_true",
                    help="also capture stock grouped_mm in a CUDA graph (run last per model)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    problems = [output_file_problem("--json", args.json, (".json",))]
    if args.tokens < 5:
        problems.append(f"--tokens: expected >= 5 (the first 4 steps are warm-ups, not timed), got {args.tokens}")
    if args.prompt_len < 1:
        problems.append(f"--prompt-len: expected >= 1, got {args.prompt_len}")
    if args.vocab < 2:
        problems.append(f"--vocab: expected >= 2, got {args.vocab}")
    if args.layers is not None and args.layers < 1:
        problems.append(f"--layers: expected >= 1, got {args.layers}")
    if not 0 < args.rtol < float("inf"):
        problems.append(f"--rtol: expected a finite fraction > 0, got {args.rtol}")
    if args.device is None:
        if torch is not None and torch.cuda.is_available():
            args.device = "cuda"
        elif args.tiny:
            args.device = "cpu"
        else:
            args.device = "cpu"    # named in the message below; nothing runs
            problems.append("needs a CUDA GPU for full-size models (none visible): use --tiny "
                            "--device cpu for a smoke test, or --device cpu to run them on the CPU anyway")
    elif not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        problems.append(f"--device: expected cpu or cuda[:N], got {args.device!r}")
    try:
        import transformers  # noqa: F401
    except ImportError:
        transformers = None
    if torch is None or transformers is None:   # reported with every argument problem, not after its fix
        problems.append("needs PyTorch and transformers: pip install -e '.[hf]'")
        report_problems("hf_moe_generate", problems)
        return 2
    if args.device.startswith("cuda") and not any(problems):
        index = int(args.device.partition(":")[2] or 0)
        if not (torch.cuda.is_available() and index < torch.cuda.device_count()):
            problems.append(f"--device {args.device}: no such CUDA device here "
                            f"({torch.cuda.device_count()} visible); use --device cpu --tiny for a smoke test")
    if report_problems("hf_moe_generate", problems):
        return 2
    names = list(MODELS) if args.model == "all" else [args.model]
    info = {"torch": torch.__version__, "transformers": transformers.__version__, "device": args.device}
    if args.device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    elif args.stock_graph:   # run_model times it only on CUDA: say so rather than drop it silently
        log(f"[hf_moe] note: --stock-graph needs a CUDA device (a CUDA graph), got --device "
            f"{args.device}: stock_grouped_mm_graph is not run")
    from ex_engine import default_registry
    reg = default_registry()
    # the ready plugin of each factor (None: the Python fallback serves); what served the calls
    # is each model's "paths" (calls per path), since a CPU tensor takes the fallback anyway
    info["factors"] = {n: (f"{p.path.name} {p.version}" if p else None)
                       for n in ("topk_softmax", "moe_fused_gemm") for p in [reg.get(n)]}
    info["registry_note"] = reg.no_gpu_note
    log(f"[hf_moe] torch {info['torch']}, transformers {info['transformers']}, device "
        f"{info.get('gpu', args.device)}; {args.tokens} tokens after a {args.prompt_len}-token prompt; "
        f"plugins loaded {info['factors']} (what served each model's calls: its 'paths')")
    t0 = time.perf_counter()
    results = {"info": info, "models": {}}
    for name in names:
        t = time.perf_counter()
        results["models"][name] = run_model(name, args)
        results["models"][name]["seconds"] = time.perf_counter() - t
        gc.collect()                        # the model is gone with run_model's frame
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    results["seconds"] = time.perf_counter() - t0
    results["ok"] = all(m["ok"] for m in results["models"].values())
    log(f"[hf_moe] done in {results['seconds']:.1f} s: {'OK' if results['ok'] else 'MISMATCH'}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
        log(f"[hf_moe] wrote {args.json}")
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    exit_quietly_on_broken_pipe(main)   # Ctrl-C, out of memory, `| head`: one line, no traceback
