"""graph_us before fe1d21b (one call per input set, no warm-up) against graph_us since (16 calls,
20 ms warm-up), same inputs, same process, 3 alternating rounds, ours and the gmm peer:

    python3 benchmarks/micro/graph_method_ab.py qwen3-30b-a3b:1 [model:T ...]   (writes $OUT/graph_method_ab.json)

Results: benchmarks/RESULTS.md, section "Sustained load; the table on fe1d21b"."""
import argparse, sys, json, os
from pathlib import Path
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_moe as b
from _timing import graph_us, torch
from ex_engine import FactorRegistry, moe_fused_gemm
from ex_engine.moe_layer import load_models_or_exit
ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
ap.add_argument("cases", nargs="+", help="model:T pairs (models of moe_models.yaml)")
args = ap.parse_args()
if torch is None or not torch.cuda.is_available():
    sys.exit(f"{Path(__file__).name}: needs PyTorch and a CUDA GPU")
models = load_models_or_exit("graph_method_ab")
reg = FactorRegistry.load(None)
gen = torch.Generator(device="cuda").manual_seed(0)
bad = [c for c in args.cases if c.partition(":")[0] not in models or not c.partition(":")[2].isdigit()]
if bad:
    sys.exit(f"graph_method_ab: expected model:T cases, models one of {', '.join(sorted(models))}; got {bad}")
cases = [c.split(":") for c in args.cases]
out = []
cur = None
for m, T in cases:
    T = int(T); s = models[m]
    if cur != m:
        layer = None; torch.cuda.empty_cache(); layer = b.layer_weights(s, torch.bfloat16, gen); cur = m
    w13, w2 = layer
    sets = b.input_sets(s, T, 4, w13, w2, torch.bfloat16, gen)
    ours = [lambda a=a: moe_fused_gemm(*a, registry=reg) for a in sets]
    gmm = [lambda a=a: b.gmm_pipeline(*a) for a in sets]
    r = {"model": m, "T": T, "old_ours": [], "new_ours": [], "old_gmm": [], "new_gmm": []}
    for rnd in range(3):
        for name, fns in (("ours", ours), ("gmm", gmm)):
            r["old_" + name].append(graph_us(fns, calls=len(fns), warm_ms=0))
            r["new_" + name].append(graph_us(fns))
    med = lambda v: sorted(v)[len(v) // 2]
    print(f"{m:<22}{T:>6}  ours old {med(r['old_ours']):8.1f} new {med(r['new_ours']):8.1f}   gmm old {med(r['old_gmm']):8.1f} new {med(r['new_gmm']):8.1f}", flush=True)
    out.append(r)
    Path(os.environ.get("OUT", "."), "graph_method_ab.json").write_text(json.dumps(out, indent=1))
