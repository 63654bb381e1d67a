"""graph_us before fe1d21b (one call per input set, no warm-up) against graph_us since (16 calls,
20 ms warm-up), same inputs, same process, 3 alternating rounds, ours and the gmm peer.

    python3 benchmarks/micro/graph_method_ab.py qwen3-30b-a3b:1 [model:T ...]   (writes $OUT/graph_method_ab.json)

Results: benchmarks/RESULTS.md, section "Sustained load; the table on fe1d21b"."""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _moe_setup import start  # noqa: E402
import bench_moe as b  # noqa: E402  (benchmarks/, on sys.path through _moe_setup)
from _timing import graph_us, torch  # noqa: E402
from ex_engine import moe_fused_gemm  # noqa: E402

cases, reg, gen = start(__doc__, "graph_method_ab")
out = []
cur = None
for m, T, s in cases:
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
    Path(os.environ.get("OUT", "."), "graph_method_ab.json").write_text(json.dumps(out, indent=1), encoding="utf-8")
